"""Orbax checkpoints written by the real Orbax 0.12.8 (jax 0.10.2, flax 0.12.8, 8 host CPU devices;
committed under tests/fixtures/data/orbax/, made by tests/fixtures/orbax.py) convert to exactly what
Orbax's own restore gives from the same files (`VARIANT.reference.safetensors`, the whole tree under
its dotted PyTree paths): OCDBT and per-array zarr v2/v3, compressed and not, arrays sharded over a
2x4 mesh and replicated; CheckpointManager steps and items; a training state's params by default.
`make test-orbax` remakes every variant with a fresh Orbax and runs tests/orbax/ against them."""
import json
import os
from pathlib import Path

import pytest

from ckptconv.readers import open_checkpoint
from ckptconv.readers.base import ReadOptions
from tests.helpers import DATA, assert_same, load_output, run

FIXTURES = Path(os.environ.get("CKPTCONV_ORBAX_FIXTURES") or DATA / "orbax")
FLAX = ["flax-ocdbt", "flax-zarr2", "flax-zarr3", "flax-ocdbt-zarr3", "flax-raw", "flax-2proc", "flax-2proc-zarr",
        "zarr2-layouts", "zarr3-layouts"]


def reference(name):
    from safetensors.torch import load_file
    return load_file(FIXTURES / f"{name}.reference.safetensors")


def check(out: Path, want: dict, prefix: str = "params."):
    got = load_output(out)
    expected = {k[len(prefix):]: v for k, v in want.items() if k.startswith(prefix)}
    assert sorted(got) == sorted(expected)
    for k, v in got.items():
        assert_same(v, expected[k], k)
    return json.loads((out / "manifest.json").read_text()) if (out / "manifest.json").exists() else None


@pytest.mark.parametrize("name", FLAX)
def test_a_flax_models_params_are_orbaxs_restore_bit_for_bit(name, tmp_path):
    r = run("convert", FIXTURES / name, tmp_path / "out", "--quiet")
    assert r.exit_code == 0, r.stderr
    manifest = check(tmp_path / "out", reference(name))
    src = manifest["source"]
    assert src["format"] == "orbax" and src["state_dict"] == "params"
    assert src["layout_kind"] == ("ocdbt" if "ocdbt" in name or name == "flax-2proc" else "zarr")


@pytest.mark.parametrize("name", ["flax-zarr2", "flax-ocdbt"])
def test_state_dict_none_keeps_the_whole_tree_under_its_paths(name, tmp_path):
    r = run("convert", FIXTURES / name, tmp_path / "out", "--quiet", "--state-dict", "none")
    assert r.exit_code == 0, r.stderr
    check(tmp_path / "out", reference(name), prefix="")


def test_uncompressed_chunks_are_views_of_their_files():
    ckpt = open_checkpoint(FIXTURES / "flax-raw")
    by = {t.name: t for t in ckpt.tensors}
    # down.kernel is sharded on its first axis only: its chunks tile axis 0, each a mapped view
    assert type(by["down.kernel"]).__name__ == "_Tiles"
    assert all(p.file_span() is not None for p in by["down.kernel"].parts)
    assert type(by["up.kernel"]).__name__ == "ChunkedTensor"   # a 2x4 grid of views


@pytest.mark.parametrize("root", ["manager", "manager-zarr"])
def test_a_manager_reads_its_latest_complete_step_and_params(root, tmp_path):
    r = run("convert", FIXTURES / root, tmp_path / "out", "--quiet")
    assert r.exit_code == 0, r.stderr
    manifest = check(tmp_path / "out", reference(f"{root}.step2"))
    src = manifest["source"]
    assert src["step"] == 2 and src["item"] == ("state" if root == "manager-zarr" else "default")
    assert {d["name"] for d in src["dropped"]} == {"opt_state", "step"}
    assert [s["name"] for s in src["incomplete_steps"]] == ["4", "3.orbax-checkpoint-tmp-1700000000"]


@pytest.mark.parametrize("root", ["manager", "manager-zarr"])
def test_step_picks_an_older_step(root, tmp_path):
    r = run("convert", FIXTURES / root, tmp_path / "out", "--quiet", "--step", "1")
    assert r.exit_code == 0, r.stderr
    assert check(tmp_path / "out", reference(f"{root}.step1"))["source"]["step"] == 1


@pytest.mark.parametrize("step,why", [("3", "orbax-checkpoint-tmp"), ("4", "_CHECKPOINT_METADATA")])
def test_an_incomplete_step_is_refused_when_asked(step, why, tmp_path):
    r = run("convert", FIXTURES / "manager", tmp_path / "out", "--step", step)
    assert r.exit_code == 2
    assert "incomplete Orbax checkpoint" in r.stderr and why in r.stderr
    assert not (tmp_path / "out").exists()


def test_an_incomplete_step_given_as_src_is_refused(tmp_path):
    r = run("convert", FIXTURES / "manager" / "4", tmp_path / "out")
    assert r.exit_code == 2 and "incomplete" in r.stderr


def test_a_step_and_its_item_read_like_the_root(tmp_path):
    for i, src in enumerate([FIXTURES / "manager-zarr" / "2", FIXTURES / "manager-zarr" / "2" / "state"]):
        r = run("convert", src, tmp_path / f"out{i}", "--quiet")
        assert r.exit_code == 0, r.stderr
        check(tmp_path / f"out{i}", reference("manager-zarr.step2"))


def test_item_and_state_dict_pick_other_parts(tmp_path):
    r = run("convert", FIXTURES / "manager-zarr", tmp_path / "out", "--quiet", "--item", "state",
            "--state-dict", "opt_state")
    assert r.exit_code == 0, r.stderr
    check(tmp_path / "out", reference("manager-zarr.step2"), prefix="opt_state.")
    r = run("convert", FIXTURES / "manager-zarr", tmp_path / "out2", "--item", "nope")
    assert r.exit_code != 0 and "no item 'nope'" in r.stderr and "state" in r.stderr


def test_inspect_says_which_step_item_and_key_it_read():
    r = run("inspect", FIXTURES / "manager")
    assert r.exit_code == 0, r.stderr
    assert "read: step 2, item default, OCDBT, state dict params" in r.stdout
    assert "optimizer state under opt_state" in r.stdout and "model weights under params" in r.stdout
    r = run("inspect", FIXTURES / "manager", "--json")
    found = json.loads(r.stdout)
    assert found["format"] == "orbax" and found["source"]["step"] == 2


def test_detection_finds_items_steps_and_roots():
    from ckptconv.readers import readers
    detect = readers()["orbax"].detect
    for p in ["flax-ocdbt", "flax-zarr2", "manager", "manager/1", "manager/1/default", "manager-zarr"]:
        assert detect(FIXTURES / p), p
    assert not detect(FIXTURES / "flax-zarr2" / "params.up.kernel")
    assert not detect(DATA)


def test_reshard_tp2_with_rules(tmp_path):
    rules = tmp_path / "rules.toml"   # Flax kernels are [in, out]: the JAX layout
    rules.write_text('layout = "jax"\n[[rule]]\npattern = "up\\\\.kernel"\naxis = 1\n'
                     '[[rule]]\npattern = "down\\\\.kernel"\naxis = 0\n'
                     '[[rule]]\npattern = "embed\\\\.embedding"\naxis = 0\n')
    for name in ("flax-zarr3", "flax-ocdbt"):
        out = tmp_path / name
        r = run("reshard", FIXTURES / name, out, "--tp", "2", "--rules", rules, "--quiet")
        assert r.exit_code == 0, r.stderr
        mesh = json.loads((out / "mesh.json").read_text())
        assert mesh["tp"] == 2
        r = run("verify", out, "--against", FIXTURES / name)
        assert r.exit_code == 0, r.stdout + r.stderr


def test_only_reads_the_arrays_asked_for(tmp_path):
    ckpt = open_checkpoint(FIXTURES / "flax-zarr2", options=ReadOptions(only=["up."]))
    assert sorted(t.name for t in ckpt.tensors) == ["up.bias", "up.kernel"]


def test_leaves_that_are_not_arrays_are_extras_or_left_out(tmp_path):
    r = run("convert", FIXTURES / "mixed", tmp_path / "out", "--quiet", "--state-dict", "none")
    assert r.exit_code == 0, r.stderr
    manifest = check(tmp_path / "out", reference("mixed"), prefix="")
    assert manifest["extras"] == {"name": "hello"}
    assert {d["name"] for d in manifest["source"]["dropped"]} == {"none", "empty"}
    ckpt = open_checkpoint(FIXTURES / "mixed", options=ReadOptions(state_dict="none"))
    assert ckpt.extras == {"name": "hello"}


@pytest.mark.parametrize("name", ["manager", "flax-2proc-zarr"])
def test_two_workers_write_what_one_does(name, tmp_path):
    from tests.e2e.test_distributed import same_tree
    r = run("convert", FIXTURES / name, tmp_path / "two", "--max-shard-size", "1KB", "--quiet", "--workers", 2)
    assert r.exit_code == 0, r.stderr
    r = run("convert", FIXTURES / name, tmp_path / "one", "--max-shard-size", "1KB", "--quiet", "--workers", 1)
    assert r.exit_code == 0, r.stderr
    same_tree(tmp_path / "two", tmp_path / "one")
    check(tmp_path / "one", reference(f"{name}.step2" if name == "manager" else name))


def test_a_step_without_its_commit_marker_is_skipped_and_refused(tmp_path):
    import shutil
    src = tmp_path / "manager-zarr"
    shutil.copytree(FIXTURES / "manager-zarr", src)
    (src / "2" / "commit_success.txt").unlink()   # its siblings have theirs: the write of 2 did not commit
    r = run("convert", src, tmp_path / "out", "--quiet")
    assert r.exit_code == 0, r.stderr
    manifest = check(tmp_path / "out", reference("manager-zarr.step1"))
    assert manifest["source"]["step"] == 1
    assert {"name": "2", "reason": "it has no commit_success.txt, which Orbax writes when a save is committed"} \
        in manifest["source"]["incomplete_steps"]
    r = run("convert", src, tmp_path / "out2", "--step", "2")
    assert r.exit_code == 2 and "commit_success.txt" in r.stderr


def test_an_item_under_orbaxs_temporary_name_is_not_read(tmp_path):
    import shutil
    src = tmp_path / "manager-zarr"
    shutil.copytree(FIXTURES / "manager-zarr", src)
    shutil.copytree(src / "2" / "state", src / "2" / "params.orbax-checkpoint-tmp-17")   # (a preferred name)
    r = run("convert", src, tmp_path / "out", "--quiet")
    assert r.exit_code == 0, r.stderr
    assert check(tmp_path / "out", reference("manager-zarr.step2"))["source"]["item"] == "state"
