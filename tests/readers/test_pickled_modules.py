"""torch.save(model): a whole pickled nn.Module converts to what model.state_dict() gives, checked by
torch itself (the same names in the same order, the same bits, load_state_dict(strict=True))."""
import json

import torch
from safetensors.torch import load_file

from tests.helpers import assert_same, run


class Net(torch.nn.Module):
    """Parameters, persistent and non-persistent buffers, an LSTM (its _flat_weights repeat its
    parameters), a child that is None, a module shared under two names, a Sequential."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.lstm = torch.nn.LSTM(8, 16, 2)
        self.register_buffer("hidden", torch.ones(3), persistent=False)
        self.register_buffer("kept", torch.arange(3.0))
        self.register_parameter("nothing", None)
        self.fc = torch.nn.Linear(16, 2)
        self.head = torch.nn.Sequential(torch.nn.Linear(2, 3, bias=False), torch.nn.ReLU(), None)
        self.shared = self.fc
        self.ratio = 0.5


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return Net()


def convert(src, out):
    r = run("convert", src, out)
    assert r.exit_code == 0, r.stderr
    return r


def test_a_pickled_module_converts_to_its_state_dict(tmp_path):
    model = _module()
    torch.save(model, tmp_path / "model.pt")
    r = convert(tmp_path / "model.pt", tmp_path / "out")
    got = load_file(tmp_path / "out" / "model.safetensors")
    want = model.state_dict()
    assert list(got) == list(want)   # names and order as torch's state_dict()
    assert "hidden" not in got and not any("_flat_weights" in k or "_modules" in k for k in got)
    for name, t in want.items():
        assert_same(got[name], t, name)
    fresh = _module()
    fresh.load_state_dict(got, strict=True)
    assert f"pickled module {Net.__module__}.Net (the whole file): read as its state_dict(), {len(want)} entries" \
        in r.stdout
    source = json.loads((tmp_path / "out" / "manifest.json").read_text())["source"]
    assert source["modules"] == [{"name": "", "class": f"{Net.__module__}.Net", "entries": len(want)}]


def test_an_lstm_is_written_once(tmp_path):
    torch.manual_seed(1)
    lstm = torch.nn.LSTM(32, 64, 2)
    torch.save(lstm, tmp_path / "lstm.pt")
    convert(tmp_path / "lstm.pt", tmp_path / "out")
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert list(got) == list(lstm.state_dict())
    weights = sum(t.numel() * t.element_size() for t in lstm.state_dict().values())
    written = (tmp_path / "out" / "model.safetensors").stat().st_size
    assert weights < written < weights + 4096   # each tensor once (before: twice, with _flat_weights)


def test_a_module_inside_a_training_checkpoint_is_unwrapped(tmp_path):
    model = _module()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.save({"model": model, "optimizer": optim.state_dict(), "epoch": 4}, tmp_path / "ckpt.pt")
    r = run("inspect", tmp_path / "ckpt.pt")
    assert r.exit_code == 0, r.stderr
    assert "pickled module" in r.stdout and "under 'model'" in r.stdout
    convert(tmp_path / "ckpt.pt", tmp_path / "out")
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert list(got) == list(model.state_dict())


def test_a_module_that_contains_itself_is_refused(tmp_path):
    model = torch.nn.Linear(2, 2)
    model._modules["again"] = model   # (torch's own state_dict() would recurse without end)
    torch.save(model, tmp_path / "loop.pt")
    r = run("convert", tmp_path / "loop.pt", tmp_path / "out")
    assert r.exit_code == 2
    assert "contains itself" in r.stderr and "loop.pt" in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_module_shared_by_many_parents_is_bounded(tmp_path):
    """A chain of modules each holding the next twice names 2**40 entries from a few KB: refused."""
    leaf = torch.nn.Linear(1, 1)
    for _ in range(40):
        parent = torch.nn.Module()
        parent.a, parent.b = leaf, leaf
        leaf = parent
    torch.save(leaf, tmp_path / "wide.pt")
    r = run("inspect", tmp_path / "wide.pt")
    assert r.exit_code == 2 and "expands far beyond" in r.stderr
