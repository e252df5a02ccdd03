"""Which reader reads a path: the documented priority (docs/formats.md#detection), and what the
summary says when a directory holds weights in two formats."""
import json
import re

import torch
from safetensors.torch import save_file

from ckptconv.readers import open_checkpoint, reader_for, readers
from tests.helpers import ROOT, assert_same, load_output, run


def test_the_detection_order_is_the_documented_one():
    table = re.findall(r"^\| (\d+) \| `(\w+)` \|", (ROOT / "docs" / "formats.md").read_text(), re.M)
    assert [(r.priority, r.name) for r in readers().values()] == [(int(p), n) for p, n in table]
    assert list(readers())[:9] == ["diffusers", "mesh", "megatron", "dcp", "orbax", "safetensors", "torchscript",
                                   "deepspeed", "torch"]


def test_a_directory_saved_both_ways_reads_the_safetensors_and_says_so(tmp_path):
    d = tmp_path / "both"
    d.mkdir()
    torch.save({"a": torch.zeros(2)}, d / "pytorch_model.bin")           # different values on purpose
    save_file({"a": torch.ones(2)}, d / "model.safetensors", metadata={"format": "pt"})
    reader, also = reader_for(d)
    assert reader.name == "safetensors" and also == ["torch"]
    r = run("convert", d, tmp_path / "out", "--quiet")
    assert r.exit_code == 0
    assert "read the safetensors weights" in r.stdout and "--from torch" in r.stdout
    assert_same(load_output(tmp_path / "out")["a"], torch.ones(2))
    r = run("convert", d, tmp_path / "json", "--quiet", "--json")
    assert json.loads(r.stdout)["also"] == ["torch"]
    assert open_checkpoint(d, "torch").tensors[0].name == "a"           # --from reads the other
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "SHA256SUMS", "manifest.json", "model.safetensors"]


def test_one_format_alone_says_nothing_more(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    torch.save({"a": torch.zeros(2)}, d / "pytorch_model.bin")
    reader, also = reader_for(d)
    assert reader.name == "torch" and also == []
    r = run("convert", d, tmp_path / "out", "--quiet")
    assert r.exit_code == 0 and "also holds" not in r.stdout


def test_a_directory_of_pth_tar_files_is_a_torch_checkpoint(tmp_path):
    """Issue 30, failure 6: the PyTorch ImageNet example's `checkpoint.pth.tar` (a torch.save zip
    whatever its name) converts as a file and, alone, in its directory; beside `model_best.pth.tar`
    ckptconv does not guess which one is the model."""
    d = tmp_path / "run"
    d.mkdir()
    state = {"fc.weight": torch.arange(6.0).reshape(2, 3), "fc.bias": torch.ones(2)}
    torch.save({"epoch": 90, "arch": "resnet18", "state_dict": state, "best_acc1": 69.7,
                "optimizer": {"state": {0: {"momentum_buffer": torch.zeros(2, 3)}}, "param_groups": []}},
               d / "checkpoint.pth.tar")
    (d / "config.json").write_text("{}")
    r = run("convert", d, tmp_path / "out", "--quiet")
    assert r.exit_code == 0, r.stderr
    got = load_output(tmp_path / "out")
    assert sorted(got) == sorted(state) and all(assert_same(got[k], v) is None for k, v in state.items())
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "SHA256SUMS", "config.json", "manifest.json", "model.safetensors"]
    torch.save({"state_dict": state}, d / "model_best.pth.tar")
    r = run("convert", d, tmp_path / "two", "--quiet")
    assert r.exit_code == 2 and "2 torch files and no index (checkpoint.pth.tar, model_best.pth.tar)" in r.stderr


def test_finding_nothing_names_what_was_looked_for(tmp_path):
    """One short line: what SRC looked like and where the list of formats is (issue 38)."""
    d = tmp_path / "notes"
    d.mkdir()
    (d / "weights.tar").write_bytes(b"not a checkpoint")
    r = run("inspect", d)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1
    line = r.stderr
    assert "not a checkpoint ckptconv reads: a directory of 1 entry (weights.tar), none named like a weights file" \
        in line and "`ckptconv inspect --formats`" in line
    listed = run("inspect", "--formats").stdout
    for reader in readers().values():
        assert f"{reader.name}: {reader.description}" in listed and reader.looks_for in listed
    assert "*.pth.tar" in listed and "mesh.json" in listed and ".metadata" in listed


def test_a_variants_index_is_read_and_never_carried(tmp_path):
    """Hugging Face names a variant's index `STEM.safetensors.index.VARIANT.json` (diffusers' and
    transformers' `_add_variant`): a directory holding one reads it (safetensors and .bin); beside the
    index without a variant, that one is read; either way it is weights, never a model file carried."""
    from huggingface_hub import save_torch_state_dict
    tensors = {f"w{i}": torch.full((64,), float(i)) for i in range(4)}

    def variant(d, kind):
        d.mkdir()
        save_torch_state_dict(tensors, d, filename_pattern="model.fp16{suffix}." + kind, max_shard_size=300,
                              safe_serialization=kind == "safetensors")
        (d / f"model.fp16.{kind}.index.json").rename(d / f"model.{kind}.index.fp16.json")

    for kind, reader in (("safetensors", "safetensors"), ("bin", "torch")):
        d = tmp_path / kind
        variant(d, kind)
        (d / "config.json").write_text("{}")
        ckpt = open_checkpoint(d)
        assert ckpt.format == reader and sorted(t.name for t in ckpt.tensors) == sorted(tensors), kind
        assert [rel for rel, _ in ckpt.model_files] == ["config.json"]
    d = tmp_path / "both"
    variant(d, "safetensors")
    save_torch_state_dict({"a": torch.ones(2), "b": torch.ones(2)}, d, max_shard_size=8)
    assert (d / "model.safetensors.index.json").is_file()
    assert sorted(t.name for t in open_checkpoint(d).tensors) == ["a", "b"]
