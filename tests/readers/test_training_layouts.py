"""Model weights found for the user (issue 30, failure 4): training checkpoints in the layouts real
projects write with torch.save — torchfcpe (`model`), SevenNet (`model_state_dict` beside
`optimizer_state_dict`), chgnet (`model` -> `state_dict` beside `optimizer`), DeepSpeed's
`mp_rank_00_model_states.pt` (`module`) — each with a real model's state dict and a real optimizer's
state (values set by hand: tests/fixtures/values.py). What convert writes is compared bit for bit
with what torch.load gives under the key found."""
import json

import numpy as np
import pytest
import torch

from tests.fixtures import values
from tests.helpers import DATA, assert_same, load_output, run


def _model_and_optimizer(seed):
    rng = np.random.default_rng(seed)
    model = values.set_weights(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3),
                                                   torch.nn.Linear(3, 2)), rng)
    opt = values.adam_state(torch.optim.Adam(model.parameters(), lr=1e-3), rng)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=10)


def torchfcpe(path):
    model, _, _ = _model_and_optimizer(0)
    torch.save({"model": model.state_dict(), "config_dict": {"model": {"type": "CFNaiveMelPE", "out_dims": 360},
                                                             "mel": {"sr": 16000, "num_mels": 128}}}, path)
    return "model"


def sevenn(path):
    model, opt, sched = _model_and_optimizer(1)
    torch.save({"model_state_dict": model.state_dict(), "optimizer_state_dict": opt.state_dict(),
                "scheduler_state_dict": sched.state_dict(), "config": {"cutoff": 5.0, "channel": 32},
                "epoch": 600, "time": "2024-01-01 00:00", "hash": "0" * 32}, path)
    return "model_state_dict"


def chgnet(path):
    model, opt, sched = _model_and_optimizer(2)
    torch.save({"model": {"model_name": "CHGNet", "model_args": {"atom_fea_dim": 64}, "state_dict": model.state_dict()},
                "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "training_history": {"e": {"train": [0.5], "val": [0.25]}}, "trainer_args": {"epochs": 20}}, path)
    return "model.state_dict"


LAYOUTS = {"torchfcpe": torchfcpe, "sevenn": sevenn, "chgnet": chgnet}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("layouts")
    return {name: (d / f"{name}.pt", make(d / f"{name}.pt")) for name, make in LAYOUTS.items()}


def at(obj, key):
    for part in key.split("."):
        obj = obj[part]
    return obj


def manifest(out):
    return json.loads((out / "manifest.json").read_text())


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_auto_finds_the_model_weights_beside_the_training_state(ckpts, tmp_path, layout):
    src, key = ckpts[layout]
    weights = at(torch.load(src, weights_only=False), key)
    out = tmp_path / "out"
    r = run("convert", src, out)
    assert r.exit_code == 0, r.stderr
    got = load_output(out)
    assert sorted(got) == sorted(weights)                # bare names; the optimizer left out
    for name, tensor in weights.items():
        assert_same(got[name], tensor, name)
    assert f"training checkpoint: model weights under {key}: 6 tensors" in r.stdout
    assert f"wrote the tensors of '{key}' under their own names (picked by --state-dict auto" in r.stdout
    assert manifest(out)["source"]["state_dict"] == key
    if layout != "torchfcpe":
        assert "optimizer state under optim" in r.stdout and ": 18 tensors" in r.stdout
        assert "left out: optim" in r.stdout
    r = run("verify", out, "--against", src)             # replays the key auto chose
    assert r.exit_code == 0, r.stdout


def test_inspect_says_what_it_found_and_the_flag(ckpts):
    src, _ = ckpts["sevenn"]
    r = run("inspect", src)
    assert r.exit_code == 0, r.stderr
    assert ("training checkpoint: model weights under model_state_dict: 6 tensors; optimizer state under "
            "optimizer_state_dict: 18 tensors") in r.stdout
    assert "converts the tensors of 'model_state_dict' under their own names (picked by --state-dict auto; " \
           "--state-dict none keeps everything)" in r.stdout
    found = json.loads(run("inspect", src, "--json").stdout)
    assert found["layout"] == {"parts": [{"key": "model_state_dict", "kind": "model weights", "tensors": 6},
                                         {"key": "optimizer_state_dict", "kind": "optimizer state", "tensors": 18}],
                               "state_dict": "model_state_dict", "asked": "auto"}
    assert found["tensor_count"] == 6
    everything = json.loads(run("inspect", src, "--json", "--state-dict", "none").stdout)
    assert everything["tensor_count"] == 24 and everything["layout"]["state_dict"] is None
    assert [p["tensors"] for p in everything["layout"]["parts"]] == [6, 18]


def test_a_dotted_path_picks_a_nested_state_dict(ckpts, tmp_path):
    src, _ = ckpts["chgnet"]
    raw = torch.load(src, weights_only=False)
    r = run("convert", src, tmp_path / "nested", "--state-dict", "model.state_dict")
    assert r.exit_code == 0, r.stderr
    assert sorted(load_output(tmp_path / "nested")) == sorted(raw["model"]["state_dict"])
    extras = manifest(tmp_path / "nested")["extras"]
    assert extras["model.model_name"] == "CHGNet" and extras["training_history.e.val"] == [0.25]
    r = run("convert", src, tmp_path / "outer", "--state-dict", "model")
    assert r.exit_code == 0, r.stderr
    assert sorted(load_output(tmp_path / "outer")) == sorted("state_dict." + k for k in raw["model"]["state_dict"])
    r = run("convert", src, tmp_path / "x", "--state-dict", "model.weights")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1
    assert "--state-dict 'model.weights'" in r.stderr and "'model', 'optimizer'" in r.stderr
    assert not (tmp_path / "x").exists()


def test_deepspeeds_module_is_found(tmp_path):
    src = DATA / "deepspeed" / "z2-fp32-mlp" / "global_step2" / "mp_rank_00_model_states.pt"
    module = torch.load(src, weights_only=False)["module"]
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 0, r.stderr
    got = load_output(tmp_path / "out")
    assert sorted(got) == sorted(module)
    for name, tensor in module.items():
        assert_same(got[name], tensor, name)
    assert "model weights under module: 10 tensors" in r.stdout


def test_ambiguous_layouts_convert_everything_and_say_so(tmp_path):
    """Two candidates (a model and a second network), or one beside tensors nothing recognises: every
    tensor is written under its flattened name, as before, and the summary names the flags."""
    a, _, _ = _model_and_optimizer(3)
    b, _, _ = _model_and_optimizer(4)
    src = tmp_path / "gan.pt"
    torch.save({"model": a.state_dict(), "net": b.state_dict(), "step": 5}, src)
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 0, r.stderr
    assert len(load_output(tmp_path / "out")) == 12 and "state_dict" not in manifest(tmp_path / "out")["source"]
    assert ("wrote every tensor under its flattened name: no single part holds the model weights (model, net could "
            "each be the model); --state-dict model or --state-dict net writes one part") in r.stdout
    src = tmp_path / "disc.pt"
    torch.save({"model": a.state_dict(), "discriminator": b.state_dict()}, src)
    r = run("convert", src, tmp_path / "out2")
    assert r.exit_code == 0, r.stderr
    assert "other under discriminator: 6 tensors" in r.stdout and "(discriminator also holds tensors)" in r.stdout
    r = run("convert", src, tmp_path / "model", "--state-dict", "model")
    assert r.exit_code == 0 and sorted(load_output(tmp_path / "model")) == sorted(a.state_dict())
    assert "left out: discriminator (tensors outside the state dict)" in r.stdout


def test_numbered_training_state_is_training_state(tmp_path):
    """Lightning numbers its optimizers (`optimizer_0`, `optimizer_1`: strategies/fsdp.py); any known
    key of training state followed by `_N` is that state, however many there are, and the model beside
    it is found. A model key or an unknown key numbered so is not."""
    from ckptconv.readers import wrappers
    assert [wrappers.kind(k) for k in ("optimizer_0", "optimizer_12", "optim_7", "lr_scheduler_3", "scheduler_1")] \
        == ["optimizer state"] * 3 + ["scheduler state"] * 2
    assert [wrappers.kind(k) for k in ("model_0", "optimizer_", "optimizer_x", "weights_0", "_0")] == ["other"] * 5
    model, opt, sched = _model_and_optimizer(5)
    _, second, _ = _model_and_optimizer(6)
    src = tmp_path / "numbered.pt"
    torch.save({"model": model.state_dict(), "optimizer_0": opt.state_dict(), "optimizer_1": second.state_dict(),
                "lr_scheduler_0": sched.state_dict(), "epoch": 3}, src)
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 0, r.stderr
    got = load_output(tmp_path / "out")
    assert sorted(got) == sorted(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert_same(got[name], tensor, name)
    assert "optimizer state under optimizer_0: 18 tensors; optimizer state under optimizer_1: 18 tensors" in r.stdout
    assert [d["name"] for d in manifest(tmp_path / "out")["source"]["dropped"]] == ["optimizer_0", "optimizer_1"]
    assert manifest(tmp_path / "out")["extras"]["epoch"] == 3
    assert manifest(tmp_path / "out")["extras"]["lr_scheduler_0.step_size"] == 10
