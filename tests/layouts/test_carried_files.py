"""Files carried into OUT besides a source directory's model files (docs/convert.md, "Files
carried"): a single weights file carries the config beside it that its name pairs it with
(`adapter_config.json` beside `adapter_model.bin`, `config.json` beside `pytorch_model.bin`,
`model.safetensors`, `diffusion_pytorch_model.bin` and their indexes), and `--with FILE` writes any
other named file; neither ever replaces a file of OUT."""
import json
import os

import numpy as np
import pytest
import torch

from tests.fixtures import values
from tests.helpers import assert_refused, cli, run, split_all_rules


def weights(d, name, config=None, config_text='{"model_type": "test"}'):
    """A small state dict saved as `d/name` (torch.save), and `config` beside it."""
    d.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    torch.save({"w": values.floats(rng, 4, 2), "b": values.floats(rng, 4)}, d / name)
    if config:
        (d / config).write_text(config_text)
    return d / name


def names(out):
    return sorted(p.name for p in out.iterdir())


def refused(r, out, *fragments):
    """Exit 2, one `ckptconv: error:` line holding every fragment, and nothing at OUT or beside it."""
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptconv: error: "), r.stderr
    assert all(f in lines[0] for f in fragments), (fragments, lines[0])
    assert not out.exists() and not any(p.name.startswith(f".{out.name}.ckptconv") for p in out.parent.iterdir())


@pytest.mark.parametrize("file,config,stem", [
    ("adapter_model.bin", "adapter_config.json", "adapter_model"),
    ("pytorch_model.bin", "config.json", "model"),
    ("diffusion_pytorch_model.bin", "config.json", "diffusion_pytorch_model"),
    ("diffusion_pytorch_model.fp16.bin", "config.json", "diffusion_pytorch_model"),
])
def test_a_single_file_carries_the_config_its_name_pairs_it_with(tmp_path, file, config, stem):
    src = weights(tmp_path / "src", file, config)
    (tmp_path / "src" / "README.md").write_text("not paired with anything")
    out = tmp_path / "out"
    assert run("convert", src, out, "--quiet").exit_code == 0
    assert names(out) == sorted(["SHA256SUMS", "manifest.json", f"{stem}.safetensors", config])
    assert (out / config).read_bytes() == (src.parent / config).read_bytes()
    assert run("verify", out, "--against", src).exit_code == 0
    # one .safetensors file carries nothing; --no-copy-extras carries nothing either
    assert run("convert", src, tmp_path / "one.safetensors", "--quiet").exit_code == 0
    assert run("convert", src, tmp_path / "bare", "--no-copy-extras", "--quiet").exit_code == 0
    assert names(tmp_path / "bare") == sorted(["SHA256SUMS", "manifest.json", f"{stem}.safetensors"])
    assert run("verify", tmp_path / "bare", "--against", src).exit_code == 0


@pytest.mark.parametrize("file,config", [("weights.pt", "config.json"), ("pytorch_model.bin", "adapter_config.json"),
                                         ("adapter_model.bin", "config.json"),
                                         ("pytorch_model-00001-of-00002.bin", "config.json")])
def test_a_config_the_name_does_not_pair_is_not_carried(tmp_path, file, config):
    src = weights(tmp_path / "src", file, config)
    assert run("convert", src, tmp_path / "out", "--quiet").exit_code == 0
    assert config not in names(tmp_path / "out")
    assert run("verify", tmp_path / "out", "--against", src).exit_code == 0


def test_an_index_carries_its_config_too(tmp_path):
    d = tmp_path / "src"
    weights(d, "pytorch_model-00001-of-00001.bin", "config.json")
    (d / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"w": "pytorch_model-00001-of-00001.bin", "b": "pytorch_model-00001-of-00001.bin"}}))
    assert run("convert", d / "pytorch_model.bin.index.json", tmp_path / "out", "--quiet").exit_code == 0
    assert "config.json" in names(tmp_path / "out")


def test_the_output_may_be_beside_the_file_and_its_config(tmp_path, monkeypatch):
    """The issue's command, run where the adapter is: OUT beside SRC, whose config is carried, is not
    inside a directory the reader of SRC reads (a later read of the file does not look at OUT)."""
    weights(tmp_path, "adapter_model.bin", "adapter_config.json")
    monkeypatch.chdir(tmp_path)
    assert run("convert", "adapter_model.bin", "lora", "--quiet").exit_code == 0
    assert names(tmp_path / "lora") == ["SHA256SUMS", "adapter_config.json", "adapter_model.safetensors",
                                        "manifest.json"]


def test_a_paired_config_leading_outside_is_skipped_and_listed(tmp_path):
    src = weights(tmp_path / "src", "pytorch_model.bin")
    (tmp_path / "elsewhere.json").write_text("{}")
    (tmp_path / "src" / "config.json").symlink_to(tmp_path / "elsewhere.json")
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 0 and "not carried into OUT: config.json (a symbolic link leading outside" in r.stdout
    assert "config.json" not in names(tmp_path / "out")
    assert run("verify", tmp_path / "out", "--against", src).exit_code == 0


def test_an_older_output_without_the_paired_config_still_verifies_with_a_note(tmp_path):
    """An output written before a file's paired config was carried: the config beside the source
    now is no problem, only a note."""
    src = weights(tmp_path / "src", "pytorch_model.bin")
    assert run("convert", src, tmp_path / "out", "--quiet").exit_code == 0
    (tmp_path / "src" / "config.json").write_text("{}")
    r = run("verify", tmp_path / "out", "--against", src)
    assert r.exit_code == 0 and "does not hold config.json, the config beside the source file" in r.stdout + r.stderr


def test_with_writes_named_files_into_out(tmp_path):
    src = weights(tmp_path / "src", "pytorch_model.bin", "config.json")
    (tmp_path / "gen.json").write_text('{"max_length": 8}')
    (tmp_path / "tokenizer.json").write_text("{}")
    out = tmp_path / "out"
    r = run("convert", src, out, "--with", tmp_path / "gen.json", "--with", tmp_path / "tokenizer.json", "--quiet")
    assert r.exit_code == 0, r.stderr
    assert names(out) == ["SHA256SUMS", "config.json", "gen.json", "manifest.json", "model.safetensors",
                          "tokenizer.json"]
    assert (out / "gen.json").read_text() == '{"max_length": 8}'
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["with"] == ["gen.json", "tokenizer.json"] and "gen.json" in manifest["files"]
    assert run("verify", out, "--against", src).exit_code == 0
    # with --no-copy-extras, a file of the source's names may come from elsewhere
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"model_type": "mine"}')
    assert run("convert", src, tmp_path / "own", "--no-copy-extras", "--with", tmp_path / "other" / "config.json",
               "--quiet").exit_code == 0
    assert (tmp_path / "own" / "config.json").read_text() == '{"model_type": "mine"}'
    assert run("verify", tmp_path / "own", "--against", src).exit_code == 0


def test_reshard_writes_with_files_into_every_rank(tmp_path):
    rng = np.random.default_rng(1)
    src = tmp_path / "m.pt"
    torch.save({"a": values.floats(rng, 4, 2)}, src)
    (tmp_path / "notes.txt").write_text("x")
    r = run("reshard", src, tmp_path / "tp2", "--tp", 2, "--rules", split_all_rules(tmp_path), "--with",
            tmp_path / "notes.txt", "--quiet")
    assert r.exit_code == 0, r.stderr
    for rank in ("rank-00000", "rank-00001"):
        assert (tmp_path / "tp2" / rank / "notes.txt").read_text() == "x"
    assert run("verify", tmp_path / "tp2", "--against", src).exit_code == 0


@pytest.mark.parametrize("name,why", [
    ("manifest.json", "an output's own file name"), ("SHA256SUMS", "an output's own file name"),
    ("mesh.json", "an output's own file name"), ("rank-00000", "an output's own file name"),
    ("model.safetensors", "a weights file's"), ("x.safetensors.index.json", "a weights file's"),
    ("extra.bin", "a weights file's"), (".hidden", "an output's own file name"),
    ("config.json", "the name of a model file carried from the source"),
])
def test_with_never_replaces_a_file_of_out(tmp_path, name, why):
    src = weights(tmp_path / "src", "pytorch_model.bin", "config.json")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / name).write_text("{}")
    out = tmp_path / "out"
    refused(run("convert", src, out, "--with", tmp_path / "elsewhere" / name), out, "--with", name, why)


def test_with_files_that_cannot_be_carried_are_refused(tmp_path):
    src = weights(tmp_path / "src", "pytorch_model.bin")
    out = tmp_path / "out"
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "a.json").write_text("{}")
    refused(run("convert", src, out, "--with", tmp_path / "a.json", "--with", tmp_path / "b" / "a.json"), out,
            "named by another --with")
    refused(run("convert", src, out, "--with", tmp_path / "missing.json"), out, "missing.json",
            "cannot open the --with file")
    refused(run("convert", src, out, "--with", tmp_path / "b"), out, "the --with file is not a regular file")
    (tmp_path / "big.json").write_text("x" * 100)
    refused(run("convert", src, out, "--with", tmp_path / "big.json", "--max-extra-size", "50B"), out,
            "big.json", "more than the 50 accepted")
    refused(run("convert", src, tmp_path / "one.safetensors", "--with", tmp_path / "a.json"),
            tmp_path / "one.safetensors", "--with writes files into an output directory")


def test_a_fifo_named_with_with_is_refused_without_blocking(tmp_path):
    src = weights(tmp_path / "src", "pytorch_model.bin")
    os.mkfifo(tmp_path / "pipe.json")
    r = cli("convert", src, tmp_path / "out", "--with", tmp_path / "pipe.json", timeout=60)
    assert_refused(r, tmp_path / "out", "pipe.json", "not a regular file")
