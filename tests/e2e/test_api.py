"""The Python API (docs/api.md): the commands as functions, typed results, one exception hierarchy."""
import dataclasses
import gc
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import ckptconv
from tests.helpers import assert_same


@pytest.fixture()
def ckpt(tmp_path):
    g = torch.Generator().manual_seed(4)
    sd = {"model.layers.0.mlp.up_proj.weight": torch.randn(8, 4, generator=g),
          "model.layers.0.mlp.down_proj.weight": torch.randn(4, 8, generator=g), "model.norm.weight": torch.ones(4)}
    path = tmp_path / "model.ckpt"
    torch.save({"state_dict": sd, "epoch": 2}, path)
    return path, sd


def test_version_and_exports():
    assert ckptconv.__version__ and ckptconv.__version__[0].isdigit()
    assert issubclass(ckptconv.UnsafePickle, ckptconv.BadInput) and issubclass(ckptconv.BadInput, ckptconv.CkptError)
    assert callable(ckptconv.convert) and callable(ckptconv.verify)


def test_convert_verify_inspect(ckpt, tmp_path):
    src, sd = ckpt
    out = tmp_path / "model.safetensors"
    result = ckptconv.convert(src, out, dtype="bf16")
    assert isinstance(result, ckptconv.ConvertResult)
    assert result.tensors == 3 and result.files == ["model.safetensors"] and result.state_dict == "state_dict"
    assert json.loads(json.dumps(result.to_json()))["format"] == "torch"
    loaded = load_file(out)
    for name, t in sd.items():
        assert_same(loaded[name], t.to(torch.bfloat16), name)
    report = ckptconv.verify(out, against=src)
    assert isinstance(report, ckptconv.Report) and report.ok and report.tensors == 3
    found = ckptconv.inspect(src)
    assert found.format == "torch" and [t["name"] for t in found.tensors] == list(sd)
    assert found.extras == {"epoch": 2} and found.dtypes == {"F32": sum(t.nbytes for t in sd.values())}
    # per-tensor rows are made when read (a million tensors are not held twice), and behave as a list
    rows = [{"name": n, "dtype": "F32", "shape": list(t.shape), "bytes": t.nbytes} for n, t in sd.items()]
    assert found.tensors == rows and found.tensors[1:] == rows[1:] and found.tensors[-1] == rows[-1]
    assert json.loads(json.dumps(dataclasses.asdict(found)))["tensors"] == rows
    # ... from plain facts: results kept do not keep the checkpoint mapped (or a descriptor open)
    gc.collect()
    fds = len(os.listdir("/proc/self/fd"))
    kept = [ckptconv.inspect(src) for _ in range(20)]
    gc.collect()   # (what the readers leave in cycles goes at the collector's pace)
    assert len(os.listdir("/proc/self/fd")) - fds < 5 and len(kept) == 20


def test_sharded_output_and_reshard(ckpt, tmp_path):
    src, sd = ckpt
    result = ckptconv.convert(src, tmp_path / "dir", max_shard_size=200, name="adapter_model")
    assert len(result.files) > 2 and all(f.startswith(("adapter_model", "manifest", "SHA256SUMS"))
                                         for f in result.files)
    plan = ckptconv.reshard(src, None, 2, preset="llama", heads=2, kv_heads=2, head_dim=2, dry_run=True)
    assert plan.ranks == 2 and plan.out is None and plan.split == 2 and plan.replicated == ["model.norm.weight"]
    done = ckptconv.reshard(src, tmp_path / "tp2", 2, preset="llama", heads=2, kv_heads=2, head_dim=2)
    assert done.bytes_written > 0 and (tmp_path / "tp2" / "mesh.json").is_file()
    assert ckptconv.verify(tmp_path / "tp2", against=src).ok


def test_failures_are_ckpt_errors(ckpt, tmp_path):
    src, _ = ckpt
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(ckptconv.BadInput):
        ckptconv.convert(bad, tmp_path / "o")
    ckptconv.convert(src, tmp_path / "o")
    with pytest.raises(ckptconv.OutputError):
        ckptconv.convert(src, tmp_path / "o")                 # exists: overwrite=True replaces it
    with pytest.raises(ckptconv.UsageError):
        ckptconv.convert(src, tmp_path / "p", state_dict="ema")
    (tmp_path / "o" / "model.safetensors").write_bytes(b"\0" * 8)
    report = ckptconv.verify(tmp_path / "o")
    assert not report.ok and all(isinstance(p, ckptconv.Problem) for p in report.problems)
    assert report.problems[0].file == str(tmp_path / "o" / "model.safetensors")
    assert str(report.problems[0]).startswith(report.problems[0].file + ": ")


def test_verbose_says_what_was_written_and_checked(ckpt, tmp_path):
    from tests.helpers import run
    src, _ = ckpt
    r = run("convert", src, tmp_path / "o", "-v")
    assert r.exit_code == 0 and "  model.safetensors  " in r.stdout
    (tmp_path / "o" / "stray.txt").write_text("x")
    r = run("verify", tmp_path / "o", "-v", "--against", src)
    assert r.exit_code == 1 and f"[unlisted] {tmp_path / 'o' / 'stray.txt'}: file is not listed" in r.stdout
    assert "checked: structure and metadata" in r.stdout and f"not compared with {src}" in r.stdout
    (tmp_path / "o" / "stray.txt").unlink()
    r = run("verify", tmp_path / "o", "-v", "--against", src)
    assert r.exit_code == 0 and f"every tensor against {src}, bit for bit" in r.stdout


@pytest.mark.parametrize("args, schema", [(["inspect"], "ckptconv.inspect/1"), (["plan"], "ckptconv.plan/1")])
def test_json_summaries_name_their_schema(ckpt, args, schema):
    from tests.helpers import run
    src, _ = ckpt
    r = run(*args, src, "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["schema"] == schema and doc["tensor_count"] == 3


def test_with_json_an_error_is_json_on_stdout_too(tmp_path):
    from tests.helpers import run_subprocess
    r = run_subprocess("convert", tmp_path / "missing.pt", tmp_path / "out", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 2 and doc == {"schema": "ckptconv.error/1", "ok": False, "exit_code": 2,
                                         "error": f"{tmp_path / 'missing.pt'}: no such file or directory"}
    assert r.stderr.count("\n") == 1


def test_inspect_and_convert_agree_on_max_extra_size(tmp_path):
    """`inspect --max-extra-size 1KB` listed a 5 KB config.json as carried while convert did not: the
    CLI's ReadOptions lost max_extra_size on its way through the API (issue 32)."""
    import json as jsonlib
    import torch
    from tests.helpers import run
    src = tmp_path / "model"
    src.mkdir()
    torch.save({"w": torch.ones(2)}, src / "pytorch_model.bin")
    (src / "config.json").write_text(jsonlib.dumps({"model_type": "x", "pad": "x" * 5000}))
    r = run("inspect", src, "--max-extra-size", "1KB", "--json")
    found = jsonlib.loads(r.stdout)
    assert "config.json" not in found["model_files"] and found["skipped_files"][0]["name"] == "config.json"
    assert ckptconv.inspect(src, max_extra_size="1KB").skipped_files[0]["name"] == "config.json"
    result = ckptconv.convert(src, tmp_path / "out", max_extra_size=1000)
    assert [s["name"] for s in result.skipped_files] == ["config.json"]
