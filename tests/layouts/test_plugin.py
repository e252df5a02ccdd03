"""An output layout is one package: the commands reach layouts only through the registry
(layouts/__init__.py), so a layout registered there is written by reshard, listed by --target, found
and checked by verify, and replayed by verify --against, with nothing else changed."""
import ast
import json
from pathlib import Path

import pytest

import ckptconv
from ckptconv import layouts
from ckptconv.layouts.base import LAYOUTS
from ckptconv.layouts.mesh import MeshDirectory
from ckptconv.layouts.mesh.check import check_only_ranks
from tests.helpers import split_all_rules

PACKAGE = Path(ckptconv.__file__).parent
OWN = {"sharded", "single", "mesh", "vllm", "foreign", "diffusers"}   # the layouts' own modules and packages


def _imported(path: Path) -> set:
    """Modules of ckptconv a module imports, as dotted names below the package."""
    me = path.relative_to(PACKAGE).with_suffix("").parts
    package = list(me[:-1]) if me[-1] != "__init__" else list(me[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            found.update({target} | {f"{target}.{a.name}" for a in node.names})
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ckptconv."):
            found.update({node.module[9:]} | {f"{node.module[9:]}.{a.name}" for a in node.names})
    return found


def test_nothing_but_the_layouts_names_a_layout_module():
    """Commands, the runner, the recipe, cli and api import the registry's functions and the shared
    modules (base, files, report, scan), never one layout's module."""
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        if path.is_relative_to(PACKAGE / "layouts"):
            continue
        for name in _imported(path):
            parts = name.split(".")
            if parts[0] == "layouts" and len(parts) > 1 and parts[1] in OWN:
                wrong.append((str(path.relative_to(PACKAGE)), name))
    assert not wrong, wrong


def test_every_layout_is_registered_and_detected_in_its_order():
    assert {"sharded", "single", "mesh", "vllm", "foreign", "diffusers"} <= set(LAYOUTS)
    assert list(layouts.target_choices()) == ["mesh", "vllm"]
    orders = [cls.order for cls in LAYOUTS.values()]
    assert len(set(orders)) == len(orders)   # (no two tried at the same step)


class Toy(MeshDirectory):
    """An engine's layout of rank directories that records its own target and checks its top level."""

    name, order, target, records_target = "toy", 99, "the toy engine's rank directories", True
    checked = []

    @classmethod
    def engine(cls, ckpt, spec):
        return {"engine": "toy", "tensors": len(ckpt.tensors)}, None

    @classmethod
    def accepts_target(cls, record):
        return isinstance(record, dict) and record.get("engine") == "toy" and type(record.get("tensors")) is int

    @classmethod
    def to_target(cls, tensors, record):
        return [t.renamed("toy." + t.name) for t in tensors]

    @classmethod
    def check_top(cls, path, parts, entries, sums, report):
        cls.checked.append(Path(path).name)
        check_only_ranks(path, sums, report)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(LAYOUTS, "toy", Toy)
    Toy.checked.clear()
    return Toy


def test_a_registered_layout_is_written_checked_and_replayed(toy, tmp_path):
    torch = pytest.importorskip("torch")
    src = tmp_path / "m.pt"
    torch.save({"a.weight": torch.arange(24, dtype=torch.float32).reshape(6, 4),
                "b.bias": torch.arange(6, dtype=torch.int64)}, src)
    assert "toy" in layouts.target_choices()
    out = tmp_path / "out"
    ckptconv.reshard(src, out, 2, rules=split_all_rules(tmp_path), target="toy")
    mesh = json.loads((out / "mesh.json").read_text())
    assert mesh["source"]["target"] == {"engine": "toy", "tensors": 2}
    assert sorted(mesh["tensors"]) == ["toy.a.weight", "toy.b.bias"]
    report = ckptconv.verify(out, against=src)
    assert report.ok, [str(p) for p in report.problems]
    assert Toy.checked == ["out"]   # (its own check of the top level)
    (out / "stray.txt").write_text("x")
    assert not ckptconv.verify(out).ok


def test_an_unregistered_target_is_refused_where_an_output_records_it(toy, tmp_path):
    torch = pytest.importorskip("torch")
    src = tmp_path / "m.pt"
    torch.save({"a.weight": torch.arange(8, dtype=torch.float32).reshape(4, 2)}, src)
    out = tmp_path / "out"
    ckptconv.reshard(src, out, 2, rules=split_all_rules(tmp_path), target="toy")
    del LAYOUTS["toy"]   # (what a reader of this output without the toy layout sees)
    report = ckptconv.verify(out, against=src)
    assert not report.ok and any("source.target" in str(p) for p in report.problems), \
        [str(p) for p in report.problems]
