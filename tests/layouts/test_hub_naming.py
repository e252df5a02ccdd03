"""Output names are huggingface_hub's (docs/output.md): a model that fits one shard is one file,
`STEM.safetensors`, with no index; several shards are `STEM-0000k-of-0000n.safetensors` with
`STEM.safetensors.index.json`. Compared with what huggingface_hub itself names and writes for the
same tensor sizes. ckptconv's older outputs (`-00001-of-00001` and an index, even for one shard)
still verify."""
import json
import shutil

import numpy as np
import pytest
import torch

from tests.fixtures import values
from tests.helpers import DATA, load_output, run, split_all_rules

# (tensor sizes in bytes, --max-shard-size): one shard, several, one exactly at the limit
CASES = [((3, 3, 3), 6), ((4, 4), 100), ((1,) * 12, 5), ((8,), 8), ((5, 1, 2, 3), 6)]


def state_dict(sizes) -> dict:
    rng = np.random.default_rng(1)
    return {f"t{i}": torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)) for i, n in enumerate(sizes)}


def listing(d) -> list:
    return sorted(p.name for p in d.iterdir() if p.name.endswith((".safetensors", ".safetensors.index.json")))


@pytest.mark.parametrize("stem", ["model", "adapter_model"])
@pytest.mark.parametrize("sizes,limit", CASES)
def test_names_are_huggingface_hubs(tmp_path, sizes, limit, stem):
    from huggingface_hub import save_torch_state_dict, split_torch_state_dict_into_shards
    sd = state_dict(sizes)
    pattern = stem + "{suffix}.safetensors"
    split = split_torch_state_dict_into_shards(sd, filename_pattern=pattern, max_shard_size=limit)
    (tmp_path / "hub").mkdir()
    save_torch_state_dict(sd, tmp_path / "hub", filename_pattern=pattern, max_shard_size=limit)
    torch.save(sd, tmp_path / "sd.pt")
    r = run("convert", tmp_path / "sd.pt", tmp_path / "ours", "--max-shard-size", f"{limit}B", "--name", stem,
            "--quiet")
    assert r.exit_code == 0, r.stderr
    ours = tmp_path / "ours"
    assert listing(ours) == listing(tmp_path / "hub") == sorted(
        [*split.filename_to_tensors] + ([f"{stem}.safetensors.index.json"] if split.is_sharded else []))
    manifest = json.loads((ours / "manifest.json").read_text())
    assert {n: t["file"] for n, t in manifest["tensors"].items()} == split.tensor_to_filename
    if split.is_sharded:
        index = json.loads((ours / f"{stem}.safetensors.index.json").read_text())
        theirs = json.loads((tmp_path / "hub" / f"{stem}.safetensors.index.json").read_text())
        assert index["weight_map"] == theirs["weight_map"]
        assert index["metadata"]["total_size"] == theirs["metadata"]["total_size"]
    assert run("verify", ours, "--against", tmp_path / "sd.pt").exit_code == 0


def test_reshard_rank_directories_are_named_alike(tmp_path):
    rng = np.random.default_rng(2)
    src = tmp_path / "l.pt"
    torch.save({"model.layers.0.mlp.up_proj.weight": values.floats(rng, 8, 4),
                "model.layers.0.mlp.down_proj.weight": values.floats(rng, 4, 8)}, src)
    llama = ("--preset", "llama", "--heads", "2", "--kv-heads", "2", "--head-dim", "2", "--quiet")
    assert run("reshard", src, tmp_path / "one", "--tp", "2", *llama).exit_code == 0
    assert run("reshard", src, tmp_path / "two", "--tp", "2", "--max-shard-size", "40B", *llama).exit_code == 0
    for rank in ("rank-00000", "rank-00001"):
        assert listing(tmp_path / "one" / rank) == ["model.safetensors"]
        assert listing(tmp_path / "two" / rank) == ["model-00001-of-00002.safetensors",
                                                    "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    for out in ("one", "two"):
        assert run("verify", tmp_path / out, "--against", src).exit_code == 0


def older_source(d):
    """The source tests/fixtures/data/older-output was converted from (by ckptconv before the Hub's
    naming: `convert older.pt older-output` in one directory)."""
    rng = np.random.default_rng(0)
    torch.save({"w": values.floats(rng, 4, 3), "b": values.floats(rng, 3)}, d / "older.pt")
    return d / "older.pt"


def test_older_outputs_with_one_numbered_shard_and_an_index_still_verify(tmp_path):
    out = tmp_path / "older-output"
    shutil.copytree(DATA / "older-output", out)
    assert sorted(p.name for p in out.iterdir()) == ["SHA256SUMS", "manifest.json",
                                                      "model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    src = older_source(tmp_path)
    r = run("verify", out, "--against", src, "--expect",
            "sha256:9a8b7ea35e01bb603e3b1793c038184ced66c9f77c23887deb0b9c4375e6310a")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert {k: v.tolist() for k, v in load_output(out).items()} == \
        {k: v.tolist() for k, v in torch.load(src, weights_only=True).items()}
    # its index is still checked: one that disagrees with the shard is found
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost"] = "model-00001-of-00001.safetensors"
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    r = run("verify", out)
    assert r.exit_code == 1 and "tensor 'ghost' is listed in the index" in r.stdout


def test_several_shards_without_their_index_do_not_verify(tmp_path):
    sd = state_dict((4, 4))
    torch.save(sd, tmp_path / "sd.pt")
    assert run("convert", tmp_path / "sd.pt", tmp_path / "out", "--max-shard-size", "4B", "--quiet").exit_code == 0
    (tmp_path / "out" / "model.safetensors.index.json").unlink()
    r = run("verify", tmp_path / "out")
    assert r.exit_code == 1 and f"{tmp_path / 'out' / 'model.safetensors.index.json'}: the index is missing" in r.stdout


@pytest.mark.parametrize("file,stem", [("adapter_model.bin", "adapter_model"),
                                       ("diffusion_pytorch_model.bin", "diffusion_pytorch_model"),
                                       ("diffusion_pytorch_model.fp16.safetensors", "diffusion_pytorch_model"),
                                       ("pytorch_model.bin", "model"), ("weights.ckpt", "model")])
def test_the_stem_defaults_from_the_source(tmp_path, file, stem):
    from safetensors.torch import save_file
    sd = state_dict((4, 4))
    d = tmp_path / "src"
    d.mkdir()
    save_file(sd, d / file) if file.endswith(".safetensors") else torch.save(sd, d / file)
    for src, out in ((d / file, "from-file"), (d, "from-dir")):
        assert run("convert", src, tmp_path / out, "--quiet").exit_code == 0
        assert listing(tmp_path / out) == [f"{stem}.safetensors"]
    assert run("convert", d / file, tmp_path / "sharded", "--max-shard-size", "4B", "--quiet").exit_code == 0
    assert listing(tmp_path / "sharded") == [f"{stem}-00001-of-00002.safetensors", f"{stem}-00002-of-00002.safetensors",
                                             f"{stem}.safetensors.index.json"]
    assert run("convert", d / file, tmp_path / "named", "--name", "model", "--quiet").exit_code == 0
    assert listing(tmp_path / "named") == ["model.safetensors"]
    # a diffusers component's own shards and index name the output after them too
    assert run("convert", tmp_path / "sharded", tmp_path / "again", "--quiet").exit_code == 0
    assert listing(tmp_path / "again") == [f"{stem}.safetensors"]
    r = run("plan", d / file, "--json")
    assert [u["name"] for u in json.loads(r.stdout)["units"]] == [f"{stem}.safetensors"]


def test_reshard_names_rank_files_after_the_source(tmp_path):
    rng = np.random.default_rng(3)
    d = tmp_path / "lora"
    d.mkdir()
    torch.save({"a.lora_A.weight": values.floats(rng, 4, 8), "a.lora_B.weight": values.floats(rng, 8, 4)},
               d / "adapter_model.bin")
    r = run("reshard", d / "adapter_model.bin", tmp_path / "tp2", "--tp", "2", "--rules", split_all_rules(tmp_path),
            "--quiet")
    assert r.exit_code == 0, r.stderr
    for rank in ("rank-00000", "rank-00001"):
        assert listing(tmp_path / "tp2" / rank) == ["adapter_model.safetensors"]
    # a reshard output read again keeps the stem of its rank files
    assert run("convert", tmp_path / "tp2", tmp_path / "merged", "--quiet").exit_code == 0
    assert listing(tmp_path / "merged") == ["adapter_model.safetensors"]
