"""The single-file writer (OUT ending in .safetensors) and `--name STEM`, checked by the real
consumers: safetensors.load_file, torch.load of the source, and ckptconv verify [--against]."""
import json
import struct

import pytest
import torch

from tests.helpers import assert_same, run, run_subprocess


@pytest.fixture()
def pt(tmp_path):
    g = torch.Generator().manual_seed(1)
    sd = {"unet.conv.weight": torch.randn(8, 4, 3, 3, generator=g), "unet.conv.bias": torch.randn(8, generator=g),
          "text.pos": torch.arange(12, dtype=torch.int64).reshape(3, 4),
          "vae.scale": torch.randn(5, generator=g).to(torch.float16)}
    p = tmp_path / "model.ckpt"
    torch.save({"state_dict": sd, "epoch": 3}, p)
    return p, sd


def _header(path):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), 8 + n


def test_one_file_loads_in_safetensors_and_verifies(pt, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file
    src, sd = pt
    out = tmp_path / "model.safetensors"
    r = run("convert", src, out, "--quiet")
    assert r.exit_code == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt", "model.safetensors"]  # nothing left over
    loaded = load_file(out)
    assert sorted(loaded) == sorted(sd)   # the training wrapper's state dict, under its own names
    for k, v in sd.items():
        assert_same(loaded[k], v, k)
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt"
    facts = json.loads(meta["ckptconv.manifest"])
    assert facts["format"] == "ckptconv.manifest/1" and facts["extras"] == {"epoch": 3}
    assert set(facts["tensors"]) == set(loaded)
    assert run("verify", out).exit_code == 0
    r = run("verify", out, "--against", src)
    assert r.exit_code == 0 and "matches the source" in r.stdout, r.stdout


def test_cast_and_prefix_are_recorded_for_verify_against(pt, tmp_path):
    from safetensors.torch import load_file
    src, sd = pt
    out = tmp_path / "half.safetensors"
    assert run("convert", src, out, "--quiet", "--dtype", "bf16", "--state-dict", "none",
               "--strip-prefix", "state_dict").exit_code == 0   # no trailing dot: the dot goes too
    loaded = load_file(out)
    assert_same(loaded["unet.conv.weight"], sd["unet.conv.weight"].to(torch.bfloat16))
    assert_same(loaded["text.pos"], sd["text.pos"])
    r = run("verify", out, "--against", src)
    assert r.exit_code == 0, r.stdout


def test_tampered_file_is_caught(pt, tmp_path):
    src, _ = pt
    out = tmp_path / "m.safetensors"
    assert run("convert", src, out, "--quiet").exit_code == 0
    header, start = _header(out)
    begin = header["unet.conv.bias"]["data_offsets"][0]
    data = bytearray(out.read_bytes())
    data[start + begin] ^= 1
    out.write_bytes(bytes(data))
    r = run("verify", out)
    assert r.exit_code == 1
    assert "tensor 'unet.conv.bias': sha256 differs from the manifest" in r.stdout, r.stdout
    r = run("verify", out, "--against", src)
    assert r.exit_code == 1


def test_forged_metadata_is_reported(pt, tmp_path):
    src, _ = pt
    out = tmp_path / "m.safetensors"
    assert run("convert", src, out, "--quiet").exit_code == 0
    data = out.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    facts = json.loads(header["__metadata__"]["ckptconv.manifest"])
    del facts["tensors"]["text.pos"]
    facts["tensors"]["ghost"] = {"sha256": "0" * 64}
    header["__metadata__"]["ckptconv.manifest"] = json.dumps(facts)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    out.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])
    r = run("verify", out)
    assert r.exit_code == 1
    assert "tensor 'ghost' is in the manifest but not in the file" in r.stdout
    assert "tensor 'text.pos' is in the file but missing from the manifest" in r.stdout


def test_a_foreign_safetensors_file_is_checked_for_what_can_be_checked(tmp_path):
    from safetensors.torch import save_file
    out = tmp_path / "theirs.safetensors"
    save_file({"a": torch.zeros(2)}, out)
    r = run_subprocess("verify", out)
    assert r.returncode == 0 and "note:" in r.stdout and "no file or tensor digests are recorded" in r.stdout


def test_overwrite_and_resume_rules_for_one_file(pt, tmp_path):
    from safetensors.torch import save_file
    src, _ = pt
    out = tmp_path / "m.safetensors"
    assert run("convert", src, out, "--quiet").exit_code == 0
    r = run_subprocess("convert", src, out, "--quiet")
    assert r.returncode == 2 and "--overwrite" in r.stderr
    assert run("convert", src, out, "--quiet", "--overwrite", "--dtype", "f16").exit_code == 0
    assert run("verify", out, "--against", src).exit_code == 0
    theirs = tmp_path / "theirs.safetensors"
    save_file({"a": torch.zeros(2)}, theirs)
    r = run_subprocess("convert", src, theirs, "--quiet", "--overwrite")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert run_subprocess("convert", src, tmp_path / "r.safetensors", "--resume").returncode == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "model.ckpt",
                                                          "theirs.safetensors"]


def test_name_stem_names_the_files(pt, tmp_path):
    from safetensors.torch import load_file
    src, sd = pt
    out = tmp_path / "adapter"
    assert run("convert", src, out, "--quiet", "--name", "adapter_model", "--max-shard-size", "600B").exit_code == 0
    names = sorted(p.name for p in out.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    assert "adapter_model.safetensors.index.json" in names and len(shards) > 1
    assert all(n.startswith("adapter_model-0000") and f"-of-{len(shards):05d}" in n for n in shards)
    index = json.loads((out / "adapter_model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    loaded = {k: v for s in shards for k, v in load_file(out / s).items()}
    for k, v in sd.items():
        assert_same(loaded[k], v, k)
    assert run("verify", out, "--against", src).exit_code == 0
    # reading it back as a source finds the renamed index
    again = tmp_path / "again.safetensors"
    assert run("convert", out, again, "--quiet").exit_code == 0
    assert run("verify", again, "--against", src).exit_code == 0


@pytest.mark.parametrize("stem", ["", "../x", "a/b", ".hidden", "a\nb", "x" * 129, "é" * 65])
def test_bad_name_is_refused(pt, tmp_path, stem):
    src, _ = pt
    r = run_subprocess("convert", src, tmp_path / "out", "--name", stem)
    assert r.returncode == 2 and "--name" in r.stderr
    assert not (tmp_path / "out").exists()


def test_name_stem_in_every_rank_dir(tmp_path):
    g = torch.Generator().manual_seed(2)
    src = tmp_path / "l.pt"
    torch.save({"model.layers.0.mlp.up_proj.weight": torch.randn(8, 4, generator=g),
                "model.layers.0.mlp.down_proj.weight": torch.randn(4, 8, generator=g)}, src)
    out = tmp_path / "tp"
    r = run("reshard", src, out, "--tp", "2", "--preset", "llama", "--heads", "2", "--kv-heads", "2",
            "--head-dim", "2", "--name", "adapter_model", "--quiet")
    assert r.exit_code == 0, r.stderr
    for rank in ("rank-00000", "rank-00001"):
        assert sorted(p.name for p in (out / rank).iterdir()) == [
            "SHA256SUMS", "adapter_model.safetensors", "manifest.json"]
    assert run("verify", out, "--against", src).exit_code == 0
