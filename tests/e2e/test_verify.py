"""verify: good outputs pass; each tamper is caught and named; device placement on 8 CPU devices."""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from ckptconv.formats.safetensors import parse_header
from ckptconv.io.mapped import MappedFile
from tests.helpers import ROOT, output_files, run


@pytest.fixture(scope="module")
def outputs(hf_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("verify")
    assert run("convert", hf_llama["dir"], d / "conv", "--max-shard-size", "60KB", "--quiet").exit_code == 0
    assert run("reshard", hf_llama["dir"], d / "tp8", "--tp", "8", "--quiet").exit_code == 0
    return d


@pytest.fixture
def copy(outputs, tmp_path):
    def make(name):
        shutil.copytree(outputs / name, tmp_path / name)
        return tmp_path / name
    return make


def problems(*args):
    r = run("verify", *args)
    return r.exit_code, r.stdout


def locate(out, name):
    """(shard path, absolute begin, end) of a tensor in an output dir."""
    path = out / output_files(out)[name]
    m = MappedFile(path)
    e = next(e for e in parse_header(m.view, m.size, path).entries if e.name == name)
    return path, e.begin, e.end


def resign(out):
    """Recompute manifest and SHA256SUMS after an edit, as a careful forger would."""
    manifest = json.loads((out / "manifest.json").read_text())
    for name, info in manifest["tensors"].items():
        path, b, e = locate(out, name)
        info["sha256"] = hashlib.sha256(path.read_bytes()[b:e]).hexdigest()
    for f, info in manifest["files"].items():
        data = (out / f).read_bytes()
        info.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    files = sorted(p.name for p in out.iterdir() if p.name != "SHA256SUMS")
    (out / "SHA256SUMS").write_text("".join(f"{hashlib.sha256((out / f).read_bytes()).hexdigest()}  {f}\n"
                                            for f in files))


def test_good_outputs_pass(outputs, hf_llama):
    code, out = problems(outputs / "conv", "--against", hf_llama["dir"])
    assert code == 0, out
    assert "OK" in out and "matches the source" in out
    code, out = problems(outputs / "tp8", "--against", hf_llama["dir"])
    assert code == 0, out


def test_flipped_byte_names_the_tensor(copy):
    out = copy("conv")
    name = "model.layers.1.mlp.up_proj.weight"
    path, b, e = locate(out, name)
    data = bytearray(path.read_bytes())
    data[(b + e) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    code, text = problems(out)
    assert code == 1
    assert any(name in line and "sha256 differs" in line and path.name in line for line in text.splitlines()), text


def test_truncated_and_missing_shards(copy):
    out = copy("conv")
    shards = sorted(out.glob("model-*.safetensors"))
    shards[0].write_bytes(shards[0].read_bytes()[:-100])
    shards[1].unlink()
    code, text = problems(out)
    assert code == 1
    assert f"{shards[1]}: shard is missing" in text
    assert str(shards[0]) in text and ("bytes" in text)


def test_index_disagreements(copy):
    out = copy("conv")
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    gone = "model.norm.weight"
    index["weight_map"].pop(gone)
    index["weight_map"]["model.ghost.weight"] = "model-00001-of-00006.safetensors"
    index_path.write_text(json.dumps(index))
    code, text = problems(out)
    assert code == 1
    assert f"tensor {gone!r} is in the shard but missing from the index" in text
    assert "tensor 'model.ghost.weight' is listed in the index" in text and "is in no shard" in text


def test_edited_manifest_digest(copy):
    out = copy("conv")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["tensors"]["lm_head.weight"]["sha256"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest))
    code, text = problems(out)
    assert code == 1
    assert "'lm_head.weight': sha256 differs from the manifest" in text
    assert "manifest.json: sha256 differs from SHA256SUMS" in text


def test_rank_pieces_swapped(copy):
    out = copy("tp8")
    os.rename(out / "rank-00001", out / "tmp")
    os.rename(out / "rank-00002", out / "rank-00001")
    os.rename(out / "tmp", out / "rank-00002")
    code, text = problems(out)
    assert code == 1
    assert "'model.layers.0.mlp.gate_proj.weight': the global tensor reassembled" in text


def test_replicated_piece_differs(copy):
    out = copy("tp8")
    rank = out / "rank-00003"
    path, b, e = locate(rank, "model.norm.weight")
    data = bytearray(path.read_bytes())
    data[b] ^= 0x80
    path.write_bytes(bytes(data))
    resign(rank)
    code, text = problems(out)
    assert code == 1
    assert "replicated tensor 'model.norm.weight' differs between ranks" in text


def test_shared_kv_interval_differs(copy):
    out = copy("tp8")  # 2 kv heads over 8 ranks: ranks 0-3 share head 0
    rank = out / "rank-00001"
    path, b, e = locate(rank, "model.layers.0.self_attn.k_proj.weight")
    data = bytearray(path.read_bytes())
    data[b + 4] ^= 0x40
    path.write_bytes(bytes(data))
    resign(rank)
    code, text = problems(out)
    assert code == 1 and "interval 0..8 of axis 0 differs between ranks [0, 1, 2, 3]" in text


def test_transposed_square_tensor_caught_against_source(copy, hf_llama):
    out = copy("conv")
    name = "model.layers.0.self_attn.q_proj.weight"  # 64 x 64
    path, b, e = locate(out, name)
    data = bytearray(path.read_bytes())
    w = np.frombuffer(bytes(data[b:e]), np.float32).reshape(64, 64)
    data[b:e] = np.ascontiguousarray(w.T).tobytes()
    path.write_bytes(bytes(data))
    resign(out)
    assert problems(out)[0] == 0  # self-consistent ...
    code, text = problems(out, "--against", hf_llama["dir"])
    assert code == 1 and f"tensor {name!r} differs from the source at index (0, 1)" in text


def test_not_an_output_is_exit_2(tmp_path):
    r = run("verify", tmp_path)
    assert r.exit_code == 2 and "not a ckptconv output" in r.stderr


def test_device_load_on_8_cpu_devices(outputs, hf_llama):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "ckptconv.cli", "verify", outputs / "tp8", "--device", "cpu", "--json",
                        "--against", hf_llama["dir"]], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] and report["device"]["ranks"] == 8 and report["device"]["devices"] == 8
    assert report["device"]["global_arrays"] and report["device"]["bytes"] > 0


def test_device_global_arrays_equal_source(outputs, hf_llama, tmp_path):
    """Independently of verify: the tp=8 pieces placed one per device form global arrays equal to the source."""
    code = f"""
import json, numpy as np, jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors.numpy import load_file
from pathlib import Path
out = Path({str(outputs / 'tp8')!r})
mesh = json.loads((out / "mesh.json").read_text())
devs = jax.devices("cpu"); assert len(devs) == 8
jm = Mesh(np.array(devs), ("tp",))
ranks = [{{}} for _ in range(8)]
for r in range(8):
    for f in (out / f"rank-{{r:05d}}").glob("*.safetensors"):
        ranks[r].update(load_file(f))
name = "model.layers.1.mlp.down_proj.weight"
e = mesh["tensors"][name]
spec = [None, None]; spec[e["axis"]] = "tp"
arrays = [jax.device_put(ranks[r][name], devs[r]) for r in range(8)]
g = jax.make_array_from_single_device_arrays(tuple(e["shape"]), NamedSharding(jm, PartitionSpec(*spec)), arrays)
assert g.sharding.shard_shape(g.shape)[e["axis"]] == e["shape"][e["axis"]] // 8
np.save({str(tmp_path / "g.npy")!r}, np.asarray(g))
"""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    got = np.load(tmp_path / "g.npy")
    assert np.array_equal(got, hf_llama["state"]["model.layers.1.mlp.down_proj.weight"].numpy())


def test_fewer_devices_than_ranks(outputs):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "ckptconv.cli", "verify", outputs / "tp8", "--device", "cpu"],
                       capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 2 and "8 ranks but only 2 devices" in r.stderr
    r = subprocess.run([sys.executable, "-m", "ckptconv.cli", "verify", outputs / "tp8", "--device", "cpu",
                        "--allow-fewer-devices"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_tensor_size_is_checked_whichever_thread_digests_it(tmp_path, monkeypatch):
    """Small tensors are digested by verify's own thread and fed to the file's digest with their
    neighbours; larger ones go to the hash threads chunk by chunk. A flipped byte is named, each way."""
    import importlib
    import torch
    shards = importlib.import_module("ckptconv.layouts.shardcheck")   # (where _hash_shard reads them)
    monkeypatch.setattr(shards, "SMALL", 1024)
    monkeypatch.setattr(shards, "CHUNK", 4096)
    sizes = {"empty": 0, "one": 1, "small": 100, "at_small": 256, "above": 257, "chunks": 2500, "tail": 3}
    torch.save({k: torch.arange(n, dtype=torch.float32) for k, n in sizes.items()}, tmp_path / "m.pt")
    good = tmp_path / "good"
    assert run("convert", tmp_path / "m.pt", good, "--quiet").exit_code == 0
    assert problems(good)[0] == 0
    for name, n in sizes.items():
        if not n:
            continue
        out = tmp_path / name
        shutil.copytree(good, out)
        path, b, e = locate(out, name)
        data = bytearray(path.read_bytes())
        data[e - 1] ^= 0x80
        path.write_bytes(bytes(data))
        code, text = problems(out)
        named = [line for line in text.splitlines() if "sha256 differs from the manifest" in line]
        assert code == 1 and len(named) == 1 and repr(name) in named[0], text
        assert any("sha256 differs from manifest.json" in line and path.name in line for line in text.splitlines())


def test_a_run_of_small_tensors_does_not_stay_mapped(tmp_path, monkeypatch):
    """Small tensors are read by verify's own thread; their pages must go as the file's digest passes
    them, not at the end of the shard (a 1 GB shard of 64 KiB tensors held 1.1 GB)."""
    import hashlib
    import importlib
    import types
    import torch
    from ckptconv.io.mapped import MappedFile
    shards = importlib.import_module("ckptconv.layouts.shardcheck")   # (where _hash_shard reads them)
    monkeypatch.setattr(shards, "CHUNK", 4096)
    torch.save({f"w{i}": torch.full((100,), float(i)) for i in range(200)}, tmp_path / "m.pt")   # 400 B each
    assert run("convert", tmp_path / "m.pt", tmp_path / "out", "--quiet").exit_code == 0
    events = []
    release = MappedFile.release
    monkeypatch.setattr(MappedFile, "release", lambda self, o, n: events.append("release") or release(self, o, n))
    monkeypatch.setattr(shards, "hashlib", types.SimpleNamespace(
        sha256=lambda *a: (a and events.append("read")) or hashlib.sha256(*a)))   # (with bytes: a tensor)
    assert problems(tmp_path / "out")[0] == 0
    reads = [i for i, e in enumerate(events) if e == "read"]
    assert len(reads) >= 200
    between = events[reads[0]:reads[-1]].count("release")   # pages let go while tensors are still being read
    assert between >= 200 * 400 // 4096 // 2, events


def test_against_replays_the_options_the_reader_recorded(tmp_path):
    """After --dequantize bf16 (a Grok reader option) verify --against printed 26+ false lines: the
    source was read without it. The recorded reader options are replayed, unless given again."""
    from tests.fixtures import grok as gf
    src = gf.write_dir(tmp_path / "grok", gf.make_params(1, seed=4))
    out = tmp_path / "out"
    assert run("convert", src, out, "--dequantize", "bf16", "--quiet").exit_code == 0
    r = run("verify", out, "--against", src)
    assert r.exit_code == 0, r.stdout
    mixtral = tmp_path / "mixtral"
    assert run("convert", src, mixtral, "--layout", "mixtral", "--quiet").exit_code == 0
    assert run("verify", mixtral, "--against", src).exit_code == 0


def test_names_that_differ_by_a_prefix_are_said_so_first(tmp_path):
    import torch
    src = tmp_path / "m.pt"
    torch.save({f"model.layers.{i}.w": torch.full((2,), float(i)) for i in range(20)}, src)
    other = tmp_path / "other.pt"
    torch.save({f"layers.{i}.w": torch.full((2,), float(i)) for i in range(20)}, other)
    out = tmp_path / "out"
    assert run("convert", other, out, "--quiet").exit_code == 0
    r = run("verify", out, "--against", src)
    lines = [line for line in r.stdout.splitlines() if "tensor" in line or "prefix" in line]
    assert r.exit_code == 1 and "the source's names are the output's with the prefix 'model.' (20 of 20)" in lines[0]
    assert "--strip-prefix 'model.'" in lines[0] and "tensor 'layers.0.w'" in r.stdout   # (the details after it)


def test_a_piece_that_differs_on_its_device_is_a_problem_of_kind_device(outputs):
    """What reaches a device is read back and compared with the file's digest: a difference is one
    problem line of kind `device` (here the digest verify compares with is made wrong)."""
    code = """
import sys
from ckptconv.jobs.verify import device
real = device._rank_tensors
def wrong(d):
    found = real(d)
    name = sorted(found)[0]
    found[name] = (found[name][0], "0" * 64)
    return found
device._rank_tensors = wrong
from ckptconv.cli import main
main(["verify", sys.argv[1], "--device", "cpu", "--json"])
"""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", code, outputs / "tp8"], capture_output=True, text=True, env=env,
                       cwd=ROOT)
    problems = json.loads(r.stdout)["problems"]
    assert r.returncode == 1 and problems and {p["kind"] for p in problems} == {"device"}, r.stdout + r.stderr
    assert all("contents differ from the file" in p["message"] for p in problems)
