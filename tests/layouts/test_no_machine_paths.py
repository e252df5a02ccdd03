"""No machine paths in outputs (docs/output.md, "No machine paths"): an output records SRC by its base
name and its input files by their names inside SRC, so the same bytes converted from any folder, from
any working directory, with absolute or relative paths, give byte-identical outputs, and no absolute
path of the machine appears in any file written into OUT."""
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import run
from tests.layouts.test_pinned_outputs import llama_bin

# (command, extra options, OUT's name): a sharded directory, one file, a reshard, vLLM's layout
JOBS = [("convert", (), "conv"), ("convert", ("--max-shard-size", "30KB"), "sharded"),
        ("convert", (), "one.safetensors"), ("reshard", ("--tp", "2"), "tp2"),
        ("reshard", ("--tp", "2", "--target", "vllm"), "vllm")]


def digests(out: Path) -> dict:
    if out.is_file():
        return {"(the file)": hashlib.sha256(out.read_bytes()).hexdigest()}
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


def contents(out: Path):
    return [out.read_bytes()] if out.is_file() else [p.read_bytes() for p in out.rglob("*") if p.is_file()]


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """One Llama-shaped source directory, copied to two unrelated absolute places."""
    root = tmp_path_factory.mktemp("paths")
    (root / "first").mkdir()
    llama_bin(root / "first" / "llama")
    (root / "second" / "a" / "b").mkdir(parents=True)
    shutil.copytree(root / "first" / "llama", root / "second" / "a" / "b" / "llama")
    return root, [root / "first" / "llama", root / "second" / "a" / "b" / "llama"]


@pytest.mark.parametrize("command,extra,name", JOBS)
def test_the_same_bytes_give_the_same_output_from_any_folder(copies, tmp_path, monkeypatch, command, extra, name):
    root, sources = copies
    got = []
    for i, src in enumerate(sources):
        outs = tmp_path / f"outs-{i}"
        outs.mkdir()
        ways = [(tmp_path, [src, outs / f"abs-{name}"]),                         # absolute, from elsewhere
                (src.parent, ["llama", os.path.relpath(outs / f"rel-{name}", src.parent)]),   # relative
                (src, [".", os.path.relpath(outs / f"dot-{name}", src)])]         # SRC is the working dir
        for cwd, (s, o) in ways:
            monkeypatch.chdir(cwd)
            r = run(command, s, o, *extra, "--quiet")
            assert r.exit_code == 0, (cwd, s, o, r.stderr)
            out = (cwd / o).resolve()
            got.append(digests(out))
            for data in contents(out):
                for where in (str(root), str(tmp_path), str(src), os.getcwd()):
                    assert where.encode() not in data, (out, where)
            assert not [p for p in ([out] if out.is_file() else out.rglob("*")) if p.name.startswith(".")]
    assert all(g == got[0] for g in got), [sorted(g.items())[:3] for g in got]


def test_the_manifest_names_the_source_and_its_files_inside_it(copies, tmp_path):
    _, (src, _) = copies
    out = tmp_path / "out"
    assert run("convert", src, out, "--quiet").exit_code == 0
    source = json.loads((out / "manifest.json").read_text())["source"]
    assert source["path"] == "llama"
    assert source["files"] == ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
    assert run("verify", out, "--against", src).exit_code == 0
