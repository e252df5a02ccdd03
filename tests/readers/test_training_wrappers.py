"""Training wrappers and the state around the model (issue 14, items 1-2), made by the real
producers: torch.save of PyTorch Lightning and Stable Diffusion style checkpoints with real OmegaConf
hyper-parameters and a callback object. Every tensor written is compared bit for bit with torch.load."""
import collections
import json
import os
import typing

import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures import lightning
from tests.fixtures.attacks import Reduce
from tests.fixtures.models import training_state
from tests.helpers import assert_refused, assert_same, cli, load_output, run


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("wrappers")
    return {"lightning": (d / "lightning.ckpt", lightning.lightning(d / "lightning.ckpt")),
            "sd": (d / "sd.ckpt", lightning.stable_diffusion(d / "sd.ckpt"))}


def manifest(out):
    return json.loads((out / "manifest.json").read_text())


@pytest.mark.parametrize("kind", ["lightning", "sd"])
def test_a_training_wrapper_converts_in_one_command_under_the_bare_names(ckpts, tmp_path, kind):
    src, state = ckpts[kind]
    out = tmp_path / "out"
    r = run("convert", src, out)          # no --allow-global: OmegaConf and the callback are left out
    assert r.exit_code == 0, r.stderr
    got = load_output(out)
    assert sorted(got) == sorted(state)
    for name, tensor in state.items():
        assert_same(got[name], tensor, name)
    source = manifest(out)["source"]
    assert source["state_dict"] == "state_dict"
    assert "left out" in r.stdout and "inert placeholders" in r.stdout
    if kind == "lightning":
        assert {d["name"] for d in source["dropped"]} == {"callbacks", "optimizer_states", "hyper_parameters"}
        assert {p["global"] for p in source["placeholders"]} >= {"omegaconf.dictconfig.DictConfig",
                                                                  "omegaconf.listconfig.ListConfig"}
        extras = manifest(out)["extras"]
        assert extras["epoch"] == 3 and extras["global_step"] == 100 and extras["hparams_name"] == "kwargs"
    else:
        assert source["placeholders"] == [{"global": "tests.fixtures.lightning.ModelCheckpoint", "count": 1}]
    assert run("verify", out, "--against", src).exit_code == 0


def test_everything_kept_names_every_class_in_one_line(ckpts, tmp_path):
    src, _ = ckpts["lightning"]
    out = tmp_path / "out"
    r = cli("convert", src, out, "--state-dict", "none")
    assert_refused(r, out, "omegaconf.dictconfig.DictConfig", "omegaconf.listconfig.ListConfig",
                   "omegaconf.nodes.AnyNode", "first at pickle offset", "--allow-global 'omegaconf.*'")


def test_everything_kept_with_a_module_pattern(ckpts, tmp_path):
    src, state = ckpts["lightning"]
    out = tmp_path / "out"
    r = run("convert", src, out, "--state-dict", "none", "--allow-global", "omegaconf.*")
    assert r.exit_code == 0, r.stderr
    raw = torch.load(src, weights_only=False)
    got = load_output(out)
    for name, tensor in state.items():
        assert_same(got["state_dict." + name], tensor, name)
    assert_same(got["optimizer_states.0.state.0.exp_avg"], raw["optimizer_states"][0]["state"][0]["exp_avg"])
    hp = manifest(out)["extras"]["hyper_parameters"]
    assert hp["__class__"] == "omegaconf.dictconfig.DictConfig"
    text = json.dumps(hp)
    assert '"__ref__": "hyper_parameters' in text          # nodes point back to their parents
    assert '"typing.Any"' in text and '"_val": 3' in text
    r = run("verify", out, "--against", src, "--allow-global", "omegaconf.*")
    assert r.exit_code == 0, r.stdout


def test_another_key_unwrapped_on_request(tmp_path):
    src = tmp_path / "train.pt"
    torch.save(training_state(), src)
    raw = torch.load(src, weights_only=False)
    r = run("convert", src, tmp_path / "model", "--state-dict", "model")
    assert r.exit_code == 0, r.stderr
    got = load_output(tmp_path / "model")
    assert sorted(got) == sorted(raw["model"])           # bare names; the optimizer's tensors are left out
    assert {d["name"] for d in manifest(tmp_path / "model")["source"]["dropped"]} == {"optim", "nested"}
    r = run("convert", src, tmp_path / "all")             # auto: a dict of model and optim converts as before
    assert r.exit_code == 0 and "optim.state.0.exp_avg" in load_output(tmp_path / "all")
    r = cli("convert", src, tmp_path / "x", "--state-dict", "ema")
    assert_refused(r, tmp_path / "x", "--state-dict 'ema'", "'model'")


def test_only_and_strip_prefix_apply_after_unwrapping(ckpts, tmp_path):
    src, state = ckpts["lightning"]
    out = tmp_path / "out"
    assert run("convert", src, out, "--only", "model.0.", "--strip-prefix", "model").exit_code == 0
    assert sorted(load_output(out)) == ["0.bias", "0.weight"]
    assert manifest(out)["source"]["only"] == ["model.0."]
    r = run("verify", out, "--against", src)             # the recorded --only and prefix are applied
    assert r.exit_code == 0, r.stdout


@pytest.mark.parametrize("target", [os.system, exec, eval])
def test_code_entry_points_are_refused_even_in_state_that_is_dropped(tmp_path, target):
    canary = tmp_path / "canary"
    src = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "callbacks": Reduce(target, (f"touch {canary}",))}, src)
    out = tmp_path / "out"
    assert_refused(cli("convert", src, out), out, "is not on the allowlist", "can run code")
    # asking for them is itself refused (issue 28): no spelling of --allow-global admits them
    assert_refused(cli("convert", src, out, "--allow-global", "posix.*", "--allow-global", "builtins.*"), out,
                   "--allow-global 'posix.*'", "can run code")
    assert not canary.exists()


def test_python2_spellings_and_plain_containers_are_emulated(tmp_path):
    src = tmp_path / "py2.pt"
    dd = collections.defaultdict(list)
    dd["a"].append(1)
    torch.save({"w": torch.ones(2), "empty": b"", "bytes": b"\x00\x01", "dd": dd, "any": typing.Any,
                "big": 2**70, "set": {1, 2}, "fs": frozenset({"x"})}, src)   # protocol 2: __builtin__ names
    out = tmp_path / "out"
    r = run("convert", src, out)
    assert r.exit_code == 0, r.stderr
    extras = manifest(out)["extras"]
    assert extras["empty"]["__bytes__"] == 0 and extras["bytes"]["__bytes__"] == 2
    assert extras["dd.a"] == [1] and extras["any"] == {"__global__": "typing.Any"}
    assert extras["big"] == 2**70 and extras["set"] == [1, 2] and extras["fs"] == ["x"]
    assert_same(load_file(out / "model-00001-of-00001.safetensors")["w"], torch.ones(2))


def test_allow_global_patterns_are_checked(tmp_path):
    src = tmp_path / "s.pt"
    torch.save({"w": torch.ones(1)}, src)
    for bad in ("*", "omegaconf.*.x", "x"):
        r = cli("convert", src, tmp_path / "o", "--allow-global", bad)
        assert_refused(r, tmp_path / "o", "--allow-global")


@pytest.mark.parametrize("protocol", [1, 2])   # (protocol 0 spells storage ids as text: not read)
def test_old_protocols_build_placeholders_too(tmp_path, protocol):
    src = tmp_path / "old.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "callbacks": {"cb": lightning.ModelCheckpoint()}}, src,
               pickle_protocol=protocol)
    out = tmp_path / "out"
    r = run("convert", src, out)
    assert r.exit_code == 0, r.stderr
    assert manifest(out)["source"]["placeholders"][0]["global"] == "tests.fixtures.lightning.ModelCheckpoint"
