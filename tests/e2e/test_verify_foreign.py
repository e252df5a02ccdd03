"""verify for anyone's output (issue 14, item 5): safetensors written by transformers' save_pretrained
(or any other tool), with or without an index, checked against their source tensor by tensor; what
could not be checked without ckptconv's manifest is said, and a transposed tensor is caught."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import run


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import transformers
    d = tmp_path_factory.mktemp("foreign")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(d / "one")                                   # model.safetensors, no index
    model.save_pretrained(d / "sharded", max_shard_size="20KB")        # shards and an index
    torch.save(model.state_dict(), d / "source.bin")
    return d


@pytest.mark.parametrize("form", ["one", "sharded"])
def test_save_pretrained_output_verifies_against_its_source(saved, form):
    out = saved / form
    assert (out / "model.safetensors.index.json").exists() == (form == "sharded")
    r = run("verify", out, "--json")
    report = json.loads(r.stdout)
    assert r.exit_code == 0 and report["ok"] and report["tensor_count"] > 10
    assert report["schema"] == "ckptconv.verify/2" and report["problems"] == []
    assert any("no file or tensor digests are recorded" in n for n in report["notes"])
    r = run("verify", out, "--against", saved / "source.bin")
    assert r.exit_code == 0 and "matches the source" in r.stdout and "note:" in r.stdout, r.stdout


def test_a_single_foreign_file_verifies_and_a_transposed_tensor_is_caught(saved, tmp_path):
    tensors = load_file(saved / "one" / "model.safetensors")
    good = tmp_path / "good.safetensors"
    save_file(tensors, good, metadata={"format": "pt"})
    assert run("verify", good, "--against", saved / "source.bin").exit_code == 0
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].T.contiguous()
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, bad, metadata={"format": "pt"})
    r = run("verify", bad, "--against", saved / "source.bin")
    assert r.exit_code == 1 and name in r.stdout and "the source has" in r.stdout, r.stdout
    r = run("verify", bad, "--against", saved / "source.bin", "--json")
    problems = json.loads(r.stdout)["problems"]
    assert r.exit_code == 1 and len(problems) == 1
    assert problems[0]["kind"] == "source" and problems[0]["tensor"] == name and problems[0]["file"] == str(bad)
    assert "the source has" in problems[0]["detail"] and problems[0]["message"].startswith(f"{bad}: tensor ")


def test_a_tampered_foreign_index_is_reported(saved, tmp_path):
    import shutil
    out = tmp_path / "sharded"
    shutil.copytree(saved / "sharded", out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name] = "model-00009-of-00009.safetensors"
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    r = run("verify", out)
    assert r.exit_code == 1 and name in r.stdout
    problems = json.loads(run("verify", out, "--json").stdout)["problems"]
    assert {(p["kind"], p["tensor"]) for p in problems} == {("misplaced", name), ("missing", None)}, problems


def test_a_directory_with_nothing_to_verify_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    r = run("verify", tmp_path)
    assert r.exit_code == 2


def test_a_note_about_the_source_does_not_make_an_output_foreign(tmp_path):
    """verify --against a training checkpoint notes the part of it compared; the output is still
    ckptconv's: its digests were checked ("hashed"), and --device places it on the devices."""
    import subprocess
    import sys
    from tests.fixtures import lightning
    from tests.helpers import ROOT
    lightning.stable_diffusion(tmp_path / "sd.ckpt")
    assert run("convert", tmp_path / "sd.ckpt", tmp_path / "sd.safetensors", "--quiet").exit_code == 0
    r = run("verify", tmp_path / "sd.safetensors", "--against", tmp_path / "sd.ckpt", "-v")
    assert r.exit_code == 0 and "note: " in r.stdout and "hashed, matches the source" in r.stdout, r.stdout
    assert "against the recorded digests" in r.stdout and "none recorded" not in r.stdout, r.stdout
    r = subprocess.run([sys.executable, "-m", "ckptconv.cli", "verify", tmp_path / "sd.safetensors", "--against",
                        tmp_path / "sd.ckpt", "--device", "cpu", "--json"], capture_output=True, text=True, cwd=ROOT)
    report = json.loads(r.stdout)
    assert r.returncode == 0 and report["device"] is not None, r.stdout + r.stderr
    assert report["device"]["ranks"] == 1 and not any("nothing was placed" in n for n in report["notes"])
