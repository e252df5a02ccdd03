"""Grok-1, DeepSpeed ZeRO and Megatron checkpoints in a bucket (moto's S3 API on 127.0.0.1) read as
the same files on a local disk do: convert and `reshard --tp 2` write byte-identical outputs (every
file, manifest.json too: it records the source by name), `plan` counts the bytes that cross the
network, the merges fetch ranges of the rank files (never the Adam moments beside the partitions),
a Grok-1 shard is parsed from its opcodes alone, and hostile inputs are refused with the line they
get locally. A `--distributed` device check refuses a URL in one line."""
import os
import shutil

import pytest
import torch

from ckptconv.readers import grok
from tests.fixtures import grok as gf
from tests.fixtures.attacks import Reduce, attacks
from tests.helpers import DATA, run
from tests.storage.test_bucket_sources import same_tree, upload


@pytest.fixture(scope="module")
def grok_dir(tmp_path_factory):
    """A Grok-1-style directory of two hosts (every leaf joined on the axis its rules shard)."""
    d = tmp_path_factory.mktemp("grok") / "grok1"
    gf.write_dir(d, gf.make_params(1, seed=5), hosts=2, axes=grok.model_axis)
    return d


def source(name, grok_dir):
    return grok_dir if name == "grok" else DATA / name


def both(s3, local, tmp_path, command, *args):
    """`command` of `local` and of its copy in the bucket (under the same name) into tmp_path/local and
    tmp_path/remote; the two outputs, after both succeeded."""
    url = upload(s3, local, f"runs/{local.name}")
    r = run(command, url, tmp_path / "remote", "--quiet", "--endpoint-url", s3.endpoint, *args)
    assert r.exit_code == 0, r.stderr
    r = run(command, local, tmp_path / "local", "--quiet", *args)
    assert r.exit_code == 0, r.stderr
    return tmp_path / "remote", tmp_path / "local"


@pytest.mark.parametrize("name, args", [
    ("grok", ()),
    ("grok", ("--layout", "mixtral")),   # dequantized, transposed, split into experts: regions, not spans
    pytest.param("deepspeed/z2-fp32-mlp", ()),
    pytest.param("deepspeed/z3-bf16-frozen-tied", ("--max-shard-size", "4KB")),
    pytest.param("deepspeed/z1-bf16-pipe-tied", ()),   # (a pipeline: layer files and two stages)
    pytest.param("megatron/legacy-moe-tp2-pp1-ep2", ()),
    pytest.param("megatron/dist-tied-tp2-pp2", ("--to", "hf")),
])
def test_converted_from_a_bucket_as_locally(s3, grok_dir, tmp_path, name, args):
    same_tree(*both(s3, source(name, grok_dir), tmp_path, "convert", *args))


@pytest.mark.parametrize("name, args", [
    ("grok", ("--heads", 4, "--kv-heads", 2, "--head-dim", 32)),
    pytest.param("deepspeed/z3-bf16-llama-tied", ()),
    pytest.param("megatron/legacy-untied-tp2-pp2", ()),
])
def test_resharded_from_a_bucket_as_locally(s3, grok_dir, tmp_path, name, args):
    same_tree(*both(s3, source(name, grok_dir), tmp_path, "reshard", "--tp", 2, *args))


def test_plan_counts_what_crosses_the_network(s3, grok_dir, tmp_path):
    """Of what each process reads and writes, plan counts what a SRC or an --out in a bucket makes
    cross the network, and times it at --network-gbps."""
    import json
    from ckptconv.jobs.plan import PER_TENSOR_SECONDS
    url = upload(s3, grok_dir, f"plans/{grok_dir.name}")

    def plan(src, *args):
        r = run("plan", src, "--hosts", 2, "--max-shard-size", "20KB", "--json", "--endpoint-url", s3.endpoint, *args)
        assert r.exit_code == 0, r.stderr
        return json.loads(r.stdout)
    local, remote = plan(grok_dir), plan(url, "--network-gbps", 0.001)
    both_out = plan(url, "--network-gbps", 0.001, "--out", s3.url("out"))
    assert remote["units"] == local["units"] == both_out["units"] and remote["network_gbps"] == 0.001
    for lp, rp, bp in zip(local["processes"], remote["processes"], both_out["processes"]):
        assert lp["network_bytes_read"] == lp["network_bytes_written"] == 0
        assert rp["network_bytes_read"] == rp["bytes_read"] > 0 and rp["network_bytes_written"] == 0
        assert bp["network_bytes_read"] == bp["bytes_read"] and bp["network_bytes_written"] == bp["bytes_written"]
        # at 1 MB/s the network sets the time: what it carries, read (and written), over its speed
        tensors = rp["seconds"] - rp["bytes_read"] / 1e6
        assert tensors == pytest.approx(lp["tensors_written"] * PER_TENSOR_SECONDS["convert"])
        assert bp["seconds"] - (bp["bytes_read"] + bp["bytes_written"]) / 1e6 == pytest.approx(tensors)
    r = run("plan", url, "--out", s3.url("out"), "--network-gbps", 0.001, "--endpoint-url", s3.endpoint)
    assert "network 0.001 GB/s" in r.stdout and "over the network, writes" in r.stdout, r.stdout


def test_the_merge_fetches_the_partitions_not_the_moments(s3, tmp_path, monkeypatch):
    """Of each rank's optimizer-state file only its zip directory, its pickle and its fp32 partition
    are fetched: the Adam moments (two thirds of the file) never are."""
    from ckptconv.storage import objects
    from tests.fixtures import zero_layout
    src = tmp_path / "zero"
    zero_layout.write(src, [(f"layer{i}.weight", (256, 512)) for i in range(4)], stage=3, keep=False)
    url = upload(s3, src, "ranges/zero")
    fetched = {}

    def tally(key, ranges):   # (ranges may be consumed lazily: counted as they are)
        for offset, n in ranges:
            fetched[key] = fetched.get(key, 0) + n
            yield offset, n
    real_read, real_stream = objects.SourceObject.read, objects.SourceObject.stream
    monkeypatch.setattr(objects.SourceObject, "read", lambda self, offset, n, *a, **k: (
        next(tally(self.location.key, [(offset, n)])), real_read(self, offset, n, *a, **k))[1])
    monkeypatch.setattr(objects.SourceObject, "stream", lambda self, ranges, *a, **k:
                        real_stream(self, tally(self.location.key, ranges), *a, **k))
    r = run("convert", url, tmp_path / "out", "--quiet", "--endpoint-url", s3.endpoint)
    assert r.exit_code == 0, r.stderr
    optim = sorted(p for p in (src / "global_step1").iterdir() if p.name.endswith("_optim_states.pt"))
    assert optim
    for p in optim:   # (a third of it: the partition; its directory, pickle and local headers: a few KiB)
        got = fetched[f"ranges/zero/global_step1/{p.name}"]
        assert got < 0.4 * p.stat().st_size, (p.name, got, p.stat().st_size)


def test_a_grok_shard_is_parsed_from_its_opcodes(s3, tmp_path, monkeypatch):
    """Reading a Grok-1 directory fetches each shard's opcodes, never its payloads: a few KiB per
    file, whatever the size of its arrays (each tensor fetches its own bytes when it is written)."""
    import numpy as np
    from ckptconv.readers import ReadOptions, open_checkpoint
    from ckptconv.storage import objects
    from ckptconv.storage.urls import StorageOptions
    params = gf.make_params(1, seed=6)
    params["language_model/in_out_embed/embeddings"] = np.ones((8192, 256), np.float32)   # 8 MiB
    gf.write_dir(tmp_path / "g", params)
    url = upload(s3, tmp_path / "g", "opcodes/g")
    fetched = []

    def tally(ranges):   # (ranges may be consumed lazily: counted as they are)
        for offset, n in ranges:
            fetched.append((offset, n))
            yield offset, n
    real_read, real_stream = objects.SourceObject.read, objects.SourceObject.stream
    monkeypatch.setattr(objects.SourceObject, "read", lambda self, offset, n, *a, **k: (
        fetched.append((offset, n)), real_read(self, offset, n, *a, **k))[1])
    monkeypatch.setattr(objects.SourceObject, "stream", lambda self, ranges, *a, **k:
                        real_stream(self, tally(ranges), *a, **k))
    ckpt = open_checkpoint(url, options=ReadOptions(storage=StorageOptions(endpoint_url=s3.endpoint)))
    shards = sorted((tmp_path / "g" / "ckpt-0").iterdir())
    assert len(ckpt.tensors) > len(shards) - 1 and sum(p.stat().st_size for p in shards) > 8 << 20
    assert sum(n for _, n in fetched) <= len(shards) * (32 << 10), sum(n for _, n in fetched)


# --- hostile inputs: the same exit status and line as locally -------------------------------------------------

def _grok_code(d):
    (d / "ckpt-0").mkdir(parents=True)
    (d / "ckpt-0" / "tensor00000_000").write_bytes(attacks(d / "canary")["os.system"])


def _grok_truncated(d):
    gf.write_dir(d, gf.make_params(1, seed=7))
    f = d / "ckpt-0" / "tensor00000_000"
    f.write_bytes(f.read_bytes()[:-300])


def _grok_index_missing(d):
    gf.write_dir(d, gf.make_params(1, seed=7))
    (d / "ckpt-0" / "tensor00003_000").unlink()


def _copy(name):
    def make(d):
        shutil.copytree(DATA / name, d)
    return make


def _deepspeed_latest_outside(d):
    _copy("deepspeed/z1-fp32-mlp")(d)
    (d / "latest").write_text("../elsewhere")


def _deepspeed_rank_0_missing(d):
    _copy("deepspeed/z2-fp32-mlp")(d)
    tag = d / "global_step2"
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").rename(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")


def _deepspeed_code(d):
    _copy("deepspeed/z2-fp32-mlp")(d)
    torch.save({"optimizer_state_dict": Reduce(os.system, (f"touch {d / 'canary'}",))},
               d / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")


def _deepspeed_truncated(d):
    _copy("deepspeed/z3-bf16-frozen-tied")(d)
    f = d / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[:3000])


def _megatron_tracker(d):
    _copy("megatron/legacy-untied-tp2-pp2")(d)
    (d / "latest_checkpointed_iteration.txt").write_text("../../etc")


def _megatron_truncated(d):
    _copy("megatron/legacy-untied-tp2-pp2")(d)
    f = d / "iter_0000001" / "mp_rank_00_001" / "model_optim_rng.pt"
    f.write_bytes(f.read_bytes()[:5000])


def _megatron_rank_missing(d):
    _copy("megatron/legacy-untied-tp2-pp2")(d)
    shutil.rmtree(d / "iter_0000001" / "mp_rank_01_001")


@pytest.mark.parametrize("make", [
    _grok_code, _grok_truncated, _grok_index_missing, _deepspeed_latest_outside, _deepspeed_rank_0_missing,
    _megatron_tracker,
    pytest.param(_deepspeed_code), pytest.param(_deepspeed_truncated),
    pytest.param(_megatron_truncated), pytest.param(_megatron_rank_missing),
], ids=lambda f: f.__name__.strip("_"))
def test_hostile_input_from_a_bucket_is_refused_as_locally(s3, tmp_path, make):
    src = tmp_path / "src"
    make(src)
    url = upload(s3, src, "hostile/src")
    here = run("convert", src, tmp_path / "out")
    there = run("convert", url, tmp_path / "out", "--endpoint-url", s3.endpoint)
    assert here.exit_code == there.exit_code == 2, (here.stderr, there.stderr)
    assert len(there.stderr.splitlines()) == 1 and there.stderr.startswith("ckptconv: error: "), there.stderr
    assert there.stderr == here.stderr.replace(str(src), url), (here.stderr, there.stderr)
    assert not (tmp_path / "out").exists() and not (src / "canary").exists()


# --- --distributed ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, what", [
    (("verify", "s3://bucket/out", "--device", "cpu"), "s3://bucket/out: PATH"),
    (("verify", "OUT", "--device", "cpu", "--against", "s3://bucket/ckpt"), "s3://bucket/ckpt: --against"),
])
def test_a_distributed_job_refuses_a_url_in_one_line(tmp_path, args, what):
    r = run(*args, "--coordinator", "127.0.0.1:9", "--num-processes", 2, "--process-id", 1, "--cluster-timeout", 1)
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert what in r.stderr and "--distributed job reads and writes local paths only" in r.stderr, r.stderr


# --- the opcode walk (readers/pickle/fetch.py), against the VM itself ----------------------------------------

class _Sparse:
    """A remote file's interface over `data`: its view holds zeros until `need` fetches a range."""

    remote = True

    def __init__(self, data: bytes):
        self.data, self.size, self.path = data, len(data), "sparse"
        self.buf = bytearray(len(data))
        self.view = memoryview(self.buf)
        self.fetched = 0

    def need(self, offset, length):
        assert 0 <= offset and offset + length <= self.size, (offset, length, self.size)
        self.buf[offset:offset + length] = self.data[offset:offset + length]
        self.fetched += length


def _outcome(data, allow):
    from ckptconv.errors import BadInput
    from ckptconv.readers.pickle import unpickler
    try:
        obj = unpickler.load(data, allow, "sparse")
    except BadInput as e:
        return "refused", str(e)
    arrays = [obj] if not isinstance(obj, grok.Quantized) else [obj.weight, obj.scales]
    return "read", [(a.array.shape, str(a.array.dtype), a.payload.offset if a.payload else a.array.tobytes()) for a in arrays]


def _pickles():
    import numpy as np
    params = gf.make_params(1, seed=8)
    big = params["language_model/in_out_embed/embeddings"]
    quant = params["transformer/decoder_layer_0/moe/linear/w"]
    out = {f"p{p}{'-np2' if n2 else ''}-{kind}": gf.dumps(v, p, n2) for p, n2 in ((2, False), (4, False), (4, True),
                                                                                  (5, False))
           for kind, v in (("array", big), ("quantized", quant))}
    out["fortran"] = gf.dumps(np.asfortranarray(big), 4)
    out.update({f"attack-{k}": v for k, v in attacks(__import__("pathlib").Path("/nonexistent")).items()})
    whole = out["p4-quantized"]
    out.update({f"cut-{n}": whole[:n] for n in (1, 40, 200, 70_000, len(whole) - 40, len(whole) - 1)})
    return out


PICKLES = _pickles()


@pytest.mark.parametrize("name", sorted(PICKLES))
def test_the_opcode_walk_fetches_what_the_vm_reads(name):
    """Every byte the unpickler reads is fetched before it runs (it reads the same as from the whole
    file, or refuses it with the same line), and a payload of 64 KiB or more is not fetched."""
    from ckptconv.readers.pickle.fetch import fetch_opcodes
    allow, data = grok.allowlist(), PICKLES[name]
    m = _Sparse(data)
    fetch_opcodes(m, step=1024)
    assert _outcome(m.view, allow) == _outcome(data, allow)
    if name.startswith(("p4", "p5")):
        assert m.fetched < 4096 + 2 * 1024, m.fetched   # (the payloads: 128 KiB and more)
