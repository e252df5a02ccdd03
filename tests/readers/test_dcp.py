"""PyTorch Distributed Checkpoints made by real torch (1 and 2 processes, FSDP2, SAFETENSORS, zstd)
convert bit-exactly to what torch's own dcp_to_torch_save gives; bad metadata and data are refused."""
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.fixtures.attacks import Reduce
from tests.helpers import DATA, ROOT, assert_same, load_output, run


@pytest.fixture(scope="session")
def dcp_dirs(tmp_path_factory):
    """The saves tests/fixtures/dcp.py made with torch 2.13 (committed: `make dcp-fixtures` makes them
    again; making them here took 30-45 s of make test). CKPTCONV_DCP_FRESH=1 makes them now, with the
    torch installed here."""
    if not os.environ.get("CKPTCONV_DCP_FRESH"):
        return DATA / "dcp"
    root = tmp_path_factory.mktemp("dcp")
    r = subprocess.run([sys.executable, "-m", "tests.fixtures.dcp", str(root)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return root


def flat(obj, prefix=""):
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict)) for v in obj):
        for i, v in enumerate(obj):
            out.update(flat(v, f"{prefix}.{i}"))
    else:
        out[prefix] = obj
    return out


def reference(dcp_dirs, name, key=None):
    state = torch.load(dcp_dirs / f"{name}.pt", weights_only=False)
    return flat(state[key] if key else state)


@pytest.mark.parametrize("name, ref, flags, key", [
    ("single", "single", (), None), ("zstd", "zstd", (), None), ("safetensors", "single", (), None),
    ("dtensor", "dtensor", (), None),
    # an FSDP2 {model, optim} save: the model's entry under its own names (--state-dict auto), or everything
    ("fsdp2", "fsdp2", (), "model"), ("fsdp2", "fsdp2", ("--state-dict", "none"), None)])
def test_converts_bit_exact(dcp_dirs, tmp_path, name, ref, flags, key):
    r = run("convert", dcp_dirs / name, tmp_path / "out", "--quiet", *flags)
    assert r.exit_code == 0, r.stderr
    got = load_output(tmp_path / "out")
    want = reference(dcp_dirs, ref, key)
    tensors = {k: v for k, v in want.items() if isinstance(v, torch.Tensor)}
    assert set(got) == set(tensors)
    for k, v in tensors.items():
        assert_same(got[k], v.contiguous(), k)
    extras = json.loads((tmp_path / "out" / "manifest.json").read_text())["extras"]
    for k, v in want.items():
        if not isinstance(v, torch.Tensor):
            assert extras[k] == (list(v) if isinstance(v, tuple) else v), k


def test_dtensor_chunks_assembled(dcp_dirs, tmp_path):
    out = tmp_path / "out"
    assert run("convert", dcp_dirs / "dtensor", out, "--quiet").exit_code == 0
    got = load_output(out)
    assert got["uneven"].tolist() == torch.arange(35, dtype=torch.int32).reshape(5, 7).tolist()
    assert json.loads((out / "manifest.json").read_text())["extras"]["meta.epoch"] == 2


def test_reshard_straight_from_dcp_chunks(dcp_dirs, tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\npattern = "cols"\naxis = 1\n[[rule]]\npattern = "rows"\nkind = "column"\n')
    out = tmp_path / "tp2"
    r = run("reshard", dcp_dirs / "dtensor", out, "--tp", 2, "--rules", rules, "--allow-replicate", "uneven", "--quiet")
    assert r.exit_code == 0, r.stderr
    want = reference(dcp_dirs, "dtensor")
    from safetensors.torch import load_file
    rank1 = load_file(out / "rank-00001" / "model.safetensors")
    assert torch.equal(rank1["cols"], want["cols"][:, 4:]) and torch.equal(rank1["rows"], want["rows"][3:])
    assert run("verify", out, "--against", dcp_dirs / "dtensor").exit_code == 0


def test_only_skips_unread_items(dcp_dirs, tmp_path):
    src = tmp_path / "single"
    shutil.copytree(dcp_dirs / "single", src)
    md = pickle.loads((src / ".metadata").read_bytes())
    info = next(v for k, v in md.storage_data.items() if k.fqn == "optim.state.0.exp_avg")
    data = bytearray((src / info.relative_path).read_bytes())
    data[info.offset:info.offset + info.length] = b"\0" * info.length  # destroy an optimizer chunk
    (src / info.relative_path).write_bytes(bytes(data))
    r = run("convert", src, tmp_path / "model", "--only", "model", "--quiet")
    assert r.exit_code == 0, r.stderr
    assert set(load_output(tmp_path / "model")) == {"model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias"}
    r = run("convert", src, tmp_path / "all")
    assert r.exit_code == 2 and "optim.state.0.exp_avg" in r.stderr and not (tmp_path / "all").exists()


def test_malicious_metadata_refused(dcp_dirs, tmp_path):
    canary = tmp_path / "canary"
    src = tmp_path / "evil"
    shutil.copytree(dcp_dirs / "single", src)
    (src / ".metadata").write_bytes(pickle.dumps(Reduce(os.system, (f"touch {canary}",))))
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 2 and "'posix.system' is not on the allowlist" in r.stderr and ".metadata" in r.stderr
    assert not canary.exists() and not (tmp_path / "out").exists()


def test_malicious_bytes_item_refused_unless_excluded(tmp_path):
    canary = tmp_path / "canary"
    dcp.save({"w": torch.ones(4), "evil": Reduce(os.system, (f"touch {canary}",))}, checkpoint_id=tmp_path / "src")
    r = run("convert", tmp_path / "src", tmp_path / "out")
    assert r.exit_code == 2 and "'posix.system'" in r.stderr and not canary.exists()
    r = run("convert", tmp_path / "src", tmp_path / "out", "--only", "w", "--quiet")
    assert r.exit_code == 0 and not canary.exists()


def test_truncated_distcp_and_chunk_past_end(dcp_dirs, tmp_path):
    src = tmp_path / "trunc"
    shutil.copytree(dcp_dirs / "single", src)
    data = (src / "__0_0.distcp").read_bytes()
    (src / "__0_0.distcp").write_bytes(data[:len(data) // 2])
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 2 and "__0_0.distcp" in r.stderr and not (tmp_path / "out").exists()

    src = tmp_path / "past"
    shutil.copytree(dcp_dirs / "single", src)
    md = pickle.loads((src / ".metadata").read_bytes())
    key = next(k for k in md.storage_data if k.fqn == "model.0.weight")
    md.storage_data[key].offset = 10**9
    (src / ".metadata").write_bytes(pickle.dumps(md))
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 2 and "model.0.weight" in r.stderr and "truncated or corrupt" in r.stderr


def test_chunks_that_do_not_cover_the_tensor(dcp_dirs, tmp_path):
    src = tmp_path / "gap"
    shutil.copytree(dcp_dirs / "dtensor", src)
    md = pickle.loads((src / ".metadata").read_bytes())
    md.state_dict_metadata["rows"].chunks.pop()
    (src / ".metadata").write_bytes(pickle.dumps(md))
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 2 and "'rows'" in r.stderr and "do not cover" in r.stderr
