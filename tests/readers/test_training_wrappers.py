"""Training wrappers and the state around the model (issue 14, items 1-2), made by the real
producers: torch.save of PyTorch Lightning and Stable Diffusion style checkpoints with real OmegaConf
hyper-parameters and a callback object. Every tensor written is compared bit for bit with torch.load."""
import collections
import hashlib
import io
import json
import os
import typing

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures import lightning, values
from tests.fixtures.attacks import Reduce
from tests.fixtures.models import training_state
from tests.helpers import assert_refused, assert_same, cli, load_output, run


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("wrappers")
    return {"lightning": (d / "lightning.ckpt", lightning.lightning(d / "lightning.ckpt")),
            "sd": (d / "sd.ckpt", lightning.stable_diffusion(d / "sd.ckpt")),
            "sd1": (d / "sd1.ckpt", lightning.stable_diffusion_v1(d / "sd1.ckpt")),
            "admet": (d / "admet.ckpt", lightning.admet_ai(d / "admet.ckpt"))}


def manifest(out):
    return json.loads((out / "manifest.json").read_text())


PLACEHOLDERS = {"lightning": {"omegaconf.base.ContainerMetadata", "omegaconf.base.Metadata",
                              "omegaconf.dictconfig.DictConfig", "omegaconf.listconfig.ListConfig",
                              "omegaconf.nodes.AnyNode"},
                "sd": {"tests.fixtures.lightning.ModelCheckpoint"}, "sd1": {"tests.fixtures.lightning.ModelCheckpoint"},
                "admet": {"tests.fixtures.lightning.AttributeDict"}}
DROPPED = {"lightning": {"callbacks", "optimizer_states"}, "sd": {"callbacks"}, "sd1": set(),
           "admet": {"optimizer_states"}}


@pytest.mark.parametrize("kind", sorted(PLACEHOLDERS))
def test_a_training_wrapper_converts_in_one_command_under_the_bare_names(ckpts, tmp_path, kind):
    """Issue 30, failures 1-2: classes on no allowlist anywhere in the state (OmegaConf nodes, a callback
    object, SD 1.x's callbacks keyed by the ModelCheckpoint class itself, Lightning's AttributeDict) are
    recorded as inert data; none stops the run, and the summary lists each with its count."""
    src, state = ckpts[kind]
    out = tmp_path / "out"
    r = run("convert", src, out)          # no --allow-global
    assert r.exit_code == 0, r.stderr
    got = load_output(out)
    assert sorted(got) == sorted(state)
    for name, tensor in state.items():
        assert_same(got[name], tensor, name)
    source, extras = manifest(out)["source"], manifest(out)["extras"]
    assert source["state_dict"] == "state_dict"
    assert {d["name"] for d in source.get("dropped", [])} == DROPPED[kind]
    assert {p["global"] for p in source["placeholders"]} == PLACEHOLDERS[kind]
    assert "classes on no allowlist, recorded as inert data (never imported or called): " in r.stdout
    assert all(f"{p['global']} (x{p['count']})" in r.stdout for p in source["placeholders"])
    raw = torch.load(src, weights_only=False)
    if kind == "lightning":
        assert extras["epoch"] == 3 and extras["global_step"] == 100 and extras["hparams_name"] == "kwargs"
        assert extras["hyper_parameters"]["__class__"] == "omegaconf.dictconfig.DictConfig"
    elif kind == "sd1":   # the class used as a key names the entry; its plain state follows
        key = "callbacks.tests.fixtures.lightning.ModelCheckpoint"
        assert {k: v for k, v in extras.items() if k.startswith(key)} == {
            f"{key}.{k}": v for k, v in raw["callbacks"][lightning.ModelCheckpoint].items()}
        assert extras["pytorch-lightning_version"] == "1.4.2"
    elif kind == "admet":   # a dict subclass keeps its items, each as torch.load gives it
        hp = extras["hyper_parameters"]
        assert hp.pop("__class__") == "tests.fixtures.lightning.AttributeDict"
        assert hp.pop("scheduler") == {"__class__": "tests.fixtures.lightning.AttributeDict", "warmup": 2}
        assert hp == {k: v for k, v in raw["hyper_parameters"].items() if k != "scheduler"}
    assert run("verify", out, "--against", src).exit_code == 0


def test_everything_kept_records_every_class_with_or_without_allow_global(ckpts, tmp_path):
    """The whole wrapper kept: OmegaConf's classes are records in the extras (nodes that point back to
    their parents as references); `--allow-global 'omegaconf.*'` vouches for them, which gives the same
    output and lists them no more as placeholders."""
    src, state = ckpts["lightning"]
    raw = torch.load(src, weights_only=False)
    outputs = {}
    for extra in ([], ["--allow-global", "omegaconf.*"]):
        out = tmp_path / f"out{len(extra)}"
        r = run("convert", src, out, "--state-dict", "none", *extra)
        assert r.exit_code == 0, r.stderr
        got = load_output(out)
        for name, tensor in state.items():
            assert_same(got["state_dict." + name], tensor, name)
        assert_same(got["optimizer_states.0.state.0.exp_avg"], raw["optimizer_states"][0]["state"][0]["exp_avg"])
        outputs[bool(extra)] = manifest(out)
        r = run("verify", out, "--against", src, *extra)
        assert r.exit_code == 0, r.stdout
    hp = outputs[False]["extras"]["hyper_parameters"]
    assert hp["__class__"] == "omegaconf.dictconfig.DictConfig"
    text = json.dumps(hp)
    assert '"__ref__": "hyper_parameters' in text          # nodes point back to their parents
    assert '"typing.Any"' in text and '"_val": 3' in text
    assert outputs[True]["extras"] == outputs[False]["extras"]
    assert "placeholders" not in outputs[True]["source"]
    assert {p["global"] for p in outputs[False]["source"]["placeholders"]} == PLACEHOLDERS["lightning"]


@pytest.mark.parametrize("protocol", [1, 2, 5])
def test_dict_and_list_subclasses_classes_and_states_are_records_in_every_protocol(tmp_path, protocol):
    """Issue 30's two lines (`class AttributeDict(dict)` beside a tensor) and their kin: a list
    subclass, a state that is not a dict (BUILD), an instance as a dict key, a class as a value."""
    src = tmp_path / "m.pt"
    t = torch.arange(6.0).reshape(2, 3)
    torch.save({"w": t, "hp": lightning.AttributeDict(a=1, b=[1, 2], c={"d": "e"}), "steps": lightning.Steps([3, 4]),
                "tracker": lightning.Tracker(), "by_object": {lightning.Tracker(0.25): "x"},
                "cls": lightning.ModelCheckpoint}, src, pickle_protocol=protocol)
    raw = torch.load(src, weights_only=False)
    out = tmp_path / "out"
    r = run("convert", src, out)
    assert r.exit_code == 0, r.stderr
    assert_same(load_output(out)["w"], t)
    extras = manifest(out)["extras"]
    q = "tests.fixtures.lightning."
    assert extras["hp"] == {"__class__": q + "AttributeDict", **raw["hp"]}
    assert extras["steps"] == {"__class__": q + "Steps", "__items__": list(raw["steps"])}
    assert extras["tracker"] == {"__class__": q + "Tracker", "__state__": [0.5, "/ckpts/best.ckpt"]}
    assert extras["by_object.<tests.fixtures.lightning.Tracker>"] == "x"
    assert extras["cls"] == {"__global__": q + "ModelCheckpoint"}
    assert {p["global"] for p in manifest(out)["source"]["placeholders"]} == {
        q + n for n in ("AttributeDict", "Steps", "Tracker", "ModelCheckpoint")}
    assert run("verify", out, "--against", src).exit_code == 0


def test_tensors_inside_records_are_written_not_lost(ckpts, tmp_path):
    """A record that holds tensors (a callback object's score) is walked as a dict of its parts: each
    tensor under its path, the class under NAME.__class__; a pickled nn.Module is its state dict
    (tests/readers/test_pickled_modules.py), unwrapped like one."""
    src, _ = ckpts["sd"]
    raw = torch.load(src, weights_only=False)
    out = tmp_path / "out"
    assert run("convert", src, out, "--state-dict", "none").exit_code == 0
    got, extras = load_output(out), manifest(out)["extras"]
    cb = "callbacks.ModelCheckpoint"
    assert_same(got[f"{cb}.best_model_score"], raw["callbacks"]["ModelCheckpoint"].best_model_score)
    assert_same(got[f"{cb}.best_k_models./ckpts/epoch=3.ckpt"], torch.tensor(0.25))
    assert extras[f"{cb}.__class__"] == "tests.fixtures.lightning.ModelCheckpoint" and extras[f"{cb}.save_top_k"] == 3
    net = values.set_weights(torch.nn.Linear(3, 2), np.random.default_rng(0))
    torch.save({"net": net, "epoch": 1}, tmp_path / "module.pt")
    assert run("convert", tmp_path / "module.pt", tmp_path / "m").exit_code == 0
    got = load_output(tmp_path / "m")
    assert sorted(got) == ["bias", "weight"]
    assert_same(got["weight"], net.weight.detach())
    assert manifest(tmp_path / "m")["source"]["modules"] == [
        {"name": "net", "class": "torch.nn.modules.linear.Linear", "entries": 2}]
    assert run("convert", tmp_path / "module.pt", tmp_path / "n", "--state-dict", "none").exit_code == 0
    assert sorted(load_output(tmp_path / "n")) == ["net.bias", "net.weight"]


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


def test_in_memory_files_are_inert_records_and_the_rest_of_io_is_refused(tmp_path):
    # torchtitan's older TrainState keeps its loss lists as io.BytesIO (a torch.save inside)
    losses = io.BytesIO()
    torch.save([1.5, 2.25], losses)
    src = tmp_path / "titan.pt"
    torch.save({"model": {"w": torch.ones(2)}, "train_state": {"step": 3, "global_avg_losses": losses,
                                                               "log": io.StringIO("x")}}, src)
    out = tmp_path / "out"
    r = run("convert", src, out)
    assert r.exit_code == 0, r.stderr
    extras = manifest(out)["extras"]
    held = extras["train_state.global_avg_losses"]
    assert held["__class__"] == "_io.BytesIO"
    assert held["__state__"][0] == {"__bytes__": len(losses.getvalue()),
                                    "sha256": hashlib.sha256(losses.getvalue()).hexdigest()}
    assert extras["train_state.log"]["__class__"] == "_io.StringIO"
    assert_same(load_file(out / "model.safetensors")["w"], torch.ones(2))
    # every other name of io still reaches the system: refused wherever it is, whatever --allow-global says
    for target in (io.open, io.FileIO):
        evil = tmp_path / "evil.pt"
        torch.save({"model": {"w": torch.ones(2)}, "x": Reduce(target, (str(tmp_path / "canary"), "w"))}, evil)
        assert_refused(cli("convert", evil, out), out, "is not on the allowlist", "can run code")
        assert not (tmp_path / "canary").exists()
    assert_refused(cli("convert", src, out, "--allow-global", "io.*"), out, "--allow-global 'io.*'", "can run code")


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
    assert_same(load_file(out / "model.safetensors")["w"], torch.ones(2))


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
