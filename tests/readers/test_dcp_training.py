"""Training states saved through DCP by the real stacks (tests/fixtures/training_dcp.py: FSDP1,
Lightning's Trainer and Fabric with the sharded FSDP strategy, torchtitan, Accelerate; committed under
tests/fixtures/data/training_dcp/,
remade by `make test-training`, which points CKPTCONV_TRAINING_DCP_FIXTURES at fresh ones) convert in
one command with no flags to what each stack's own consolidation gives, bit for bit, and say which
entry they took and what they left out; --state-dict picks another or keeps everything."""
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures.training_dcp import KINDS, COMMITTED, source
from tests.helpers import assert_same, load_output, run

ROOT = Path(os.environ.get("CKPTCONV_TRAINING_DCP_FIXTURES") or COMMITTED)


def src_of(kind):
    return source(kind, ROOT) if os.environ.get("CKPTCONV_TRAINING_DCP_FIXTURES") else ROOT / kind


CHOSEN = {"fsdp1": ("model", ["optim"]), "lightning": ("model", ["optimizer_0", "callbacks"]),
          "lightning_two": ("model", ["optimizer_0", "optimizer_1"]), "fabric": ("model", ["optimizer"]),
          "torchtitan": (".", ["optimizer"]), "accelerate": ("model", [])}


@pytest.mark.parametrize("kind", KINDS)
def test_converts_to_what_the_stacks_consolidation_gives(kind, tmp_path):
    out = tmp_path / "out"
    r = run("convert", src_of(kind), out)
    assert r.exit_code == 0, r.stderr
    want = load_file(ROOT / f"{kind}.reference.safetensors")
    got = load_output(out)
    assert sorted(got) == sorted(want) and len(got) == 8
    for name, t in want.items():
        assert_same(got[name], t, name)
    source_facts = json.loads((out / "manifest.json").read_text())["source"]
    chosen, dropped = CHOSEN[kind]
    assert source_facts["state_dict"] == chosen
    assert [d["name"] for d in source_facts.get("dropped", [])] == dropped
    said = r.stdout + r.stderr
    assert "training checkpoint: model weights " in said and "picked by --state-dict auto" in said
    assert "also holds" not in said   # (Lightning's meta.pt is the checkpoint's, not a torch file beside it)
    # verify --against reads the source the way convert did
    v = run("verify", out, "--against", src_of(kind))
    assert v.exit_code == 0, v.stdout + v.stderr


@pytest.mark.parametrize("kind", ["fsdp1", "torchtitan"])
def test_state_dict_none_keeps_the_training_state_and_a_key_picks_another(kind, tmp_path):
    every = tmp_path / "all"
    assert run("convert", src_of(kind), every, "--state-dict", "none", "--quiet").exit_code == 0
    names = set(load_output(every))
    assert len(names) == 32 and any(".exp_avg_sq" in n for n in names)
    opt = "optim" if kind == "fsdp1" else "optimizer"
    moments = tmp_path / "opt"
    r = run("convert", src_of(kind), moments, "--state-dict", opt, "--quiet")
    assert r.exit_code == 0, r.stderr
    assert set(load_output(moments)) == {n[len(opt) + 1:] for n in names if n.startswith(opt + ".")}
    r = run("convert", src_of(kind), tmp_path / "x", "--state-dict", "nothere")
    assert r.exit_code == 2 and "--state-dict 'nothere'" in r.stderr and "nothing" not in r.stdout


def test_inspect_says_which_entry_it_took(tmp_path):
    r = run("inspect", src_of("torchtitan"))
    assert r.exit_code == 0, r.stderr
    assert "model weights at the top level: 8 tensors; optimizer state under optimizer: 24 tensors" in r.stdout
    assert "converts the top-level tensors under their own names" in r.stdout
    r = run("inspect", src_of("fsdp1"), "--json")
    layout = json.loads(r.stdout)["layout"]
    assert layout["state_dict"] == "model" and {p["key"]: p["tensors"] for p in layout["parts"]} == {"model": 8, "optim": 24}


def test_only_selects_among_the_names_written(tmp_path):
    out = tmp_path / "out"
    assert run("convert", src_of("lightning"), out, "--only", "model.layers.", "--quiet").exit_code == 0
    assert sorted(load_output(out)) == ["model.layers.0.bias", "model.layers.0.weight", "model.layers.1.bias",
                                        "model.layers.1.weight"]


# What Lightning 2.6.6 writes beside the DCP items in meta.pt (strategies/fsdp.py save_checkpoint: the
# rest of dump_checkpoint for the Trainer, the user's non-module, non-optimizer state for Fabric), with
# the values the runs of tests/fixtures/lightning_dcp.py give them (max_steps=2; lr 1e-3; StepLR(1)).
META_EXTRAS = {
    "lightning": {"epoch": 1, "global_step": 2, "pytorch-lightning_version": "2.6.6", "hparams_name": "kwargs",
                  "hyper_parameters.lr": 0.001, "hyper_parameters.two": False, "lr_schedulers.0.last_epoch": 2,
                  "lr_schedulers.0.step_size": 1, "loops.fit_loop.epoch_progress.total.completed": 1},
    "lightning_two": {"epoch": 1, "global_step": 2, "pytorch-lightning_version": "2.6.6",
                      "hyper_parameters.two": True, "lr_schedulers.0.last_epoch": 1,
                      "loops.fit_loop.epoch_loop.manual_optimization.optim_step_progress.total.completed": 2},
    "fabric": {"step": 2, "hparams.lr": 0.001, "hparams.name": "tiny", "scheduler.last_epoch": 1,
               "scheduler.step_size": 1},
}


@pytest.mark.parametrize("kind", sorted(META_EXTRAS))
def test_lightnings_other_state_lands_in_the_extras_and_its_tensors_are_left_out(kind, tmp_path):
    """Lightning's consolidation merges meta.pt into the checkpoint's top level; so does convert: its
    entries without tensors are the extras, `callbacks` (ModelCheckpoint's `kth_value` is a tensor) is
    left out and said so (the Trainer's run with a ModelCheckpoint); nothing of the optimizers is in
    the extras."""
    out = tmp_path / "out"
    r = run("convert", src_of(kind), out)
    assert r.exit_code == 0, r.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    extras = manifest["extras"]
    assert {k: extras.get(k) for k in META_EXTRAS[kind]} == META_EXTRAS[kind]
    assert not any(k.startswith(("optimizer", "callbacks", "model.")) for k in extras)
    assert "meta.pt" in manifest["source"]["files"]
    if kind == "lightning":   # (the other run has no ModelCheckpoint: enable_checkpointing=False)
        assert "Lightning training state under callbacks: 1 tensor" in r.stdout + r.stderr


def test_inspect_names_each_numbered_optimizer(tmp_path):
    r = run("inspect", src_of("lightning_two"))
    assert r.exit_code == 0, r.stderr
    assert ("model weights under model: 8 tensors; optimizer state under optimizer_0: 15 tensors; optimizer state "
            "under optimizer_1: 3 tensors\n") in r.stdout


def test_state_dict_none_writes_meta_pts_tensors_too(tmp_path):
    """`--state-dict none` keeps everything Lightning's consolidation holds: the DCP items under their
    FQNs and meta.pt's tensors under their flattened names."""
    out = tmp_path / "all"
    r = run("convert", src_of("lightning"), out, "--state-dict", "none", "--quiet")
    assert r.exit_code == 0, r.stderr
    names = set(load_output(out))
    assert len(names) == 33 and "model.model.embed.weight" in names and "optimizer_0.state.model.embed.weight.exp_avg" \
        in names
    assert [n for n in names if n.startswith("callbacks.")] == \
        [n for n in names if n.startswith("callbacks.ModelCheckpoint{") and n.endswith("}.kth_value")]
    r = run("convert", src_of("lightning_two"), tmp_path / "opt1", "--state-dict", "optimizer_1", "--quiet")
    assert r.exit_code == 0, r.stderr
    assert sorted(load_output(tmp_path / "opt1")) == [f"state.model.{n}.momentum_buffer"
                                                       for n in ("head.weight", "norm.bias", "norm.weight")]


def test_a_plain_or_ambiguous_state_is_written_whole(tmp_path):
    """A model state dict saved on its own (one path part per name), or a state whose other entries
    are not recognisable training state, is written under its own names, as before."""
    import torch.distributed.checkpoint as dcp
    plain, mixed = tmp_path / "plain", tmp_path / "mixed"
    sd = {"model.embed.weight": torch.ones(2, 2), "lm_head.weight": torch.zeros(2)}
    dcp.save(sd, checkpoint_id=str(plain), no_dist=True)
    dcp.save({"model": {"w": torch.ones(2)}, "optim": {"state": {"w": {"exp_avg": torch.ones(2)}}},
              "extra": {"t": torch.zeros(1)}}, checkpoint_id=str(mixed), no_dist=True)
    for d, names in ((plain, {"model.embed.weight", "lm_head.weight"}),
                     (mixed, {"model.w", "optim.state.w.exp_avg", "extra.t"})):
        out = tmp_path / f"{d.name}-out"
        assert run("convert", d, out, "--quiet").exit_code == 0
        assert set(load_output(out)) == names


@pytest.mark.parametrize("lie", ["other-name", "longer", "not-a-path", "not-a-dict"])
def test_planner_data_that_does_not_spell_its_names_unwraps_nothing(tmp_path, lie):
    """planner_data is the planner's own: paths that do not spell their FQN (another name, or more parts
    than it has), or are not paths, leave every name as the file gives it (nothing renamed or dropped)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    src = tmp_path / "src"
    dcp.save({"model": {"w": torch.ones(2)}, "optim": {"state": {"w": {"exp_avg": torch.ones(2)}}}},
             checkpoint_id=str(src), no_dist=True)
    md = FileSystemReader(str(src)).read_metadata()
    fqn = "model.w"
    md.planner_data = {"other-name": {**md.planner_data, fqn: ("model", "x")},
                       "longer": {**md.planner_data, fqn: ("model", "w") + ("",) * 70},   # more parts than the FQN
                       "not-a-path": {**md.planner_data, fqn: "model.w"},
                       "not-a-dict": ["model.w"]}[lie]
    import pickle
    (src / ".metadata").write_bytes(pickle.dumps(md))
    out = tmp_path / "out"
    r = run("convert", src, out, "--quiet")
    assert r.exit_code == 0, r.stderr
    assert set(load_output(out)) == {"model.w", "optim.state.w.exp_avg"}
    r = run("convert", src, tmp_path / "o2", "--state-dict", "model")
    assert r.exit_code == 2 and "records no state-dict paths" in r.stderr
