"""DeepSpeed ZeRO checkpoints written by the real DeepSpeed 0.19.8 (2 processes on CPUs; committed
under tests/fixtures/data/deepspeed/, made by tests/fixtures/deepspeed.py) convert to exactly what
DeepSpeed's own get_fp32_state_dict_from_zero_checkpoint returns, through every command; only the
fp32 partitions of the optimizer-state files are read (measured). The whole matrix of stages, dtypes
and options runs in `make test-deepspeed` (tests/deepspeed/)."""
import ctypes
import json
import mmap
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import DATA, ROOT, assert_same, load_output, run

FIXTURES = DATA / "deepspeed"
COMMITTED = ["z1-fp32-mlp", "z2-fp32-mlp", "z3-bf16-frozen-tied", "z3-bf16-llama-tied", "z3-fp32-saves", "z2-bf16-saves"]
SAVED_TWICE = ["z3-fp32-saves", "z2-bf16-saves"]   # global_step1/ and global_step2/ of one run
PIPELINES = ["z1-fp32-pipeline", "z1-bf16-pipe-tied", "z1-bf16-pipe-dp2"]   # PipelineModule, two stages (dp2: of
#                                                                         two data-parallel ranks each)


def reference(name, root=FIXTURES):
    """get_fp32_state_dict_from_zero_checkpoint's output (tied names written twice) and its facts."""
    return load_file(root / f"{name}.reference.safetensors"), json.loads((root / f"{name}.reference.json").read_text())


def check_output(out: Path, name, root=FIXTURES, cast=None):
    """OUT holds the reference's tensors, each tied name written once and recorded as an alias."""
    want, facts = reference(name, root)
    got = load_output(out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest.get("aliases", {}) == facts["shared"]
    assert sorted(got) == sorted(n for n in facts["names"] if n not in facts["shared"])
    for k, v in got.items():
        w = want[k].to(cast) if cast is not None and want[k].is_floating_point() else want[k]
        assert_same(v, w, k)
    return manifest


@pytest.mark.parametrize("name", COMMITTED)
def test_the_fp32_masters_are_deepspeeds_bit_for_bit(name, tmp_path):
    r = run("convert", FIXTURES / name, tmp_path / "out", "--quiet")
    assert r.exit_code == 0, r.stderr
    manifest = check_output(tmp_path / "out", name)
    src = manifest["source"]
    from ckptconv.readers import open_checkpoint   # in DeepSpeed's order: buffers, frozen, trained, tied
    assert [t.name for t in open_checkpoint(FIXTURES / name).tensors] == reference(name)[1]["names"]
    assert src["format"] == "deepspeed" and src["tag"] == "global_step2" and src["world_size"] == 2
    assert src["zero_stage"] == int(name[1]) and src["ds_version"] == "0.19.8"


def check_pipeline(src: Path, out: Path, name, root=FIXTURES):
    """A pipeline checkpoint's output: what a fresh engine's load_checkpoint gives (the fp32 masters,
    the buffers as saved: VARIANT.reference.safetensors), and cast to the dtype of each tensor of the
    loaded module's state dict, exactly that state dict (the layer files' weights: 16-bit in a bf16
    run, DeepSpeed's own rounding of the masters)."""
    manifest = check_output(out, name, root)
    got = load_output(out)
    module = load_file(root / f"{name}.module.safetensors")
    assert sorted(module) == sorted(got)
    for k, v in module.items():
        assert_same(got[k].to(v.dtype), v, k)
    src_facts = manifest["source"]
    assert src_facts["pipeline_stages"] == 2 and src_facts["zero_stage"] == 1 and src_facts["master_dtype"] == "F32"
    assert sum(f.split("/")[-1].startswith("layer_") for f in src_facts["files"]) >= 3
    r = run("verify", out, "--against", src)
    assert r.exit_code == 0 and "matches the source" in r.stdout, r.stdout + r.stderr
    return manifest


@pytest.mark.parametrize("name", PIPELINES)
def test_pipeline_checkpoints_are_what_deepspeeds_own_load_gives(name, tmp_path):
    """Names by global layer index (`1.weight`), a TiedLayerSpec's module once (`tied_modules.embed.
    weight`, held by both stages), buffers from the layer files; DeepSpeed's zero_to_fp32 cannot read
    these (recorded by the fixture script)."""
    for src in (FIXTURES / name, FIXTURES / name / "global_step2"):
        out = tmp_path / src.name
        r = run("convert", src, out, "--quiet")
        assert r.exit_code == 0, r.stderr
        check_pipeline(src, out, name)
    facts = reference(name)[1]
    assert "Error" in facts["zero_to_fp32"] and facts["tied_same_on_every_stage"]
    if "tied" in name:
        assert "tied_modules.embed.weight" in facts["names"] and "2.scale" in facts["names"]
        assert "torch.bfloat16" in facts["module_dtypes"]
        r = run("convert", FIXTURES / name, tmp_path / "bf16", "--dtype", "bf16", "--quiet")
        assert r.exit_code == 0, r.stderr   # the masters rounded as DeepSpeed rounds them into the model
        module = load_file(FIXTURES / f"{name}.module.safetensors")
        got = load_output(tmp_path / "bf16")
        assert all(torch.equal(got[k], v) for k, v in module.items() if v.dtype == torch.bfloat16)


def test_a_tag_directory_reads_the_same_and_carries_the_parents_model_files(tmp_path):
    src = FIXTURES / "z3-bf16-llama-tied"
    r = run("convert", src / "global_step2", tmp_path / "out", "--quiet")
    assert r.exit_code == 0, r.stderr
    check_output(tmp_path / "out", "z3-bf16-llama-tied")
    assert (tmp_path / "out" / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_tied_llama_loads_in_transformers_with_the_masters(tmp_path):
    from transformers import AutoModelForCausalLM
    assert run("convert", FIXTURES / "z3-bf16-llama-tied", tmp_path / "out", "--quiet").exit_code == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", torch_dtype=torch.float32)
    want, _ = reference("z3-bf16-llama-tied")
    sd = model.state_dict()
    for k, v in want.items():
        assert_same(sd[k], v, k)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_single_file_only_and_release_dtype(tmp_path):
    name = "z2-fp32-mlp"
    want, facts = reference(name)
    out = tmp_path / "one.safetensors"
    r = run("convert", FIXTURES / name, out, "--quiet")
    assert r.exit_code == 0, r.stderr
    got = load_file(out)
    assert set(got) == set(facts["names"])
    for k, v in got.items():
        assert_same(v, want[k], k)
    r = run("convert", FIXTURES / name, tmp_path / "fc1", "--only", "fc1.", "--quiet")
    assert r.exit_code == 0, r.stderr
    assert set(load_output(tmp_path / "fc1")) == {"fc1.weight", "fc1.bias"}
    r = run("convert", FIXTURES / "z3-bf16-frozen-tied", tmp_path / "bf16", "--dtype", "bf16", "--quiet")
    assert r.exit_code == 0, r.stderr   # round to nearest even, as torch casts; the int64 buffer kept
    check_output(tmp_path / "bf16", "z3-bf16-frozen-tied", cast=torch.bfloat16)
    assert load_output(tmp_path / "bf16")["seen"].dtype == torch.int64
    r = run("convert", FIXTURES / "z2-fp32-mlp", tmp_path / "f16", "--dtype", "f16", "--quiet")
    assert r.exit_code == 0, r.stderr
    check_output(tmp_path / "f16", "z2-fp32-mlp", cast=torch.float16)


def test_inspect_plan_and_verify_against_the_zero_directory(tmp_path):
    src = FIXTURES / "z3-bf16-frozen-tied"
    r = run("inspect", src, "--json")
    assert r.exit_code == 0, r.stderr
    assert "frozen.weight" in r.stdout and "deepspeed" in r.stdout
    r = run("plan", src, "--json")
    assert r.exit_code == 0, r.stderr
    assert run("convert", src, tmp_path / "out", "--quiet").exit_code == 0
    r = run("verify", tmp_path / "out", "--against", src)
    assert r.exit_code == 0 and "matches the source" in r.stdout, r.stdout + r.stderr
    # a master changed in the output is found
    r = run("verify", tmp_path / "out", "--against", FIXTURES / "z2-fp32-mlp")
    assert r.exit_code != 0


@pytest.mark.parametrize("name", SAVED_TWICE)
def test_each_save_of_a_run_reads_alone(name, tmp_path):
    """Both saves of one run (the files every rank records the same of: steps, samples, the
    optimizer's step, ds_config) convert, each to its own masters, and verify against its files."""
    got = {}
    for tag in ("global_step1", "global_step2"):
        src = FIXTURES / name / tag
        r = run("convert", src, tmp_path / tag, "--quiet")
        assert r.exit_code == 0, r.stderr
        assert run("verify", tmp_path / tag, "--against", src).exit_code == 0
        got[tag] = load_output(tmp_path / tag)
    check_output(tmp_path / "global_step2", name)
    assert any(not torch.equal(got["global_step1"][k], v) for k, v in got["global_step2"].items())


def test_reshard_and_vllm_target_straight_from_zero(tmp_path):
    src = FIXTURES / "z3-bf16-llama-tied" / "global_step2"   # config.json from the parent
    want, _ = reference("z3-bf16-llama-tied")
    r = run("reshard", src, tmp_path / "tp2", "--tp", 2, "--quiet")
    assert r.exit_code == 0, r.stderr
    ranks = [load_file(tmp_path / "tp2" / f"rank-0000{i}" / "model.safetensors") for i in range(2)]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert_same(torch.cat([ranks[0][q], ranks[1][q]]), want[q], q)
    assert run("verify", tmp_path / "tp2", "--against", src).exit_code == 0
    r = run("reshard", FIXTURES / "z3-bf16-llama-tied", tmp_path / "vllm", "--tp", 2, "--target", "vllm", "--quiet")
    assert r.exit_code == 0, r.stderr
    assert run("verify", tmp_path / "vllm", "--against", FIXTURES / "z3-bf16-llama-tied").exit_code == 0


def test_two_workers_write_what_one_does(tmp_path):
    from tests.e2e.test_distributed import same_tree
    src = FIXTURES / "z3-bf16-llama-tied"
    r = run("convert", src, tmp_path / "two", "--max-shard-size", "5KB", "--quiet", "--workers", 2)
    assert r.exit_code == 0, r.stderr
    assert run("convert", src, tmp_path / "one", "--max-shard-size", "5KB", "--quiet", "--workers", 1).exit_code == 0
    same_tree(tmp_path / "two", tmp_path / "one")


def test_a_checkpoint_beside_trainer_weights_is_listed_not_read(tmp_path):
    """A Trainer checkpoint-N/ that also holds model.safetensors is read as those weights (no pickle);
    --from deepspeed reads the fp32 masters."""
    src = tmp_path / "checkpoint-2"
    shutil.copytree(FIXTURES / "z2-fp32-mlp", src)
    from safetensors.torch import save_file
    save_file({"w": torch.ones(2)}, src / "model.safetensors")
    r = run("convert", src, tmp_path / "a", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["also"] == ["deepspeed"]
    r = run("convert", src, tmp_path / "b", "--from", "deepspeed", "--quiet")
    assert r.exit_code == 0, r.stderr
    check_output(tmp_path / "b", "z2-fp32-mlp")


# --- What is read ----------------------------------------------------------------------------------

def _resident(path: Path) -> np.ndarray:
    """Which pages of `path` are in the page cache (mincore of a mapping that touches none), one
    bool per page."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)   # (writable, for ctypes' from_buffer)
    try:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        anchor = ctypes.c_char.from_buffer(m)
        rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
        del anchor
        if rc != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return np.frombuffer(bytes(vec), np.uint8) & 1 == 1
    finally:
        m.close()


def _entries(path: Path) -> dict:
    """{entry name: (data offset, size)} of a torch zip."""
    out = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            f.seek(info.header_offset + 26)
            n, extra = np.frombuffer(f.read(4), "<u2")
            out[info.filename] = (info.header_offset + 30 + int(n) + int(extra), info.file_size)
    return out


def _drop_cache(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_only_the_fp32_partitions_are_read(tmp_path):
    """Of each rank's optimizer-state file, the Adam moments (two thirds of it) stay unread: after the
    run, the page cache holds the partitions' pages and hardly any of the moments' (mincore)."""
    from tests.fixtures import zero_layout
    params = [(f"layer{i}.weight", (512, 1024)) for i in range(4)]   # 8 MiB of masters, 16 of moments
    src = tmp_path / "zero"
    zero_layout.write(src, params, stage=3, keep=False)
    files = sorted((src / "global_step1").iterdir())
    for f in files:
        _drop_cache(f)
    if any(_resident(f).any() for f in files):
        pytest.skip("this file system keeps pages cached (cannot measure what is read)")
    r = subprocess.run([sys.executable, "-m", "ckptconv.cli", "convert", src, tmp_path / "out", "--quiet"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    read = moments = partitions = moment_bytes = 0
    for f in files:
        if not f.name.endswith("_optim_states.pt"):
            continue
        pages = _resident(f)
        read += int(pages.sum()) * mmap.PAGESIZE
        osd = _entries(f)
        by_size = sorted(((size, off) for name, (off, size) in osd.items() if "/data/" in name), reverse=True)
        # the three big storages: exp_avg, exp_avg_sq (written first) and the partition (last)
        big = sorted(by_size[:3], key=lambda x: x[1])
        for i, (size, off) in enumerate(big):
            held = int(pages[off // mmap.PAGESIZE:-(-(off + size) // mmap.PAGESIZE)].sum()) * mmap.PAGESIZE
            if i < 2:
                moments += held
                moment_bytes += size
            else:
                partitions += size
                # the partition was read whole (a few of its pages may be evicted again before they are
                # counted, on a machine short of memory: one CI run counted 95 % of them)
                assert held >= size * 0.9, (f.name, held, size)
    assert partitions == 8 << 20 and moment_bytes == 16 << 20
    print(f"read {read} bytes of the optimizer-state files: partitions {partitions}, moments {moments} of {moment_bytes}")
    assert moments <= moment_bytes // 16, (moments, moment_bytes)   # read-around of headers at most
    assert read <= partitions * 1.1 + (1 << 20), (read, partitions)
