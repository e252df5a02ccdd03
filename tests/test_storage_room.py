"""Readers and layouts reach files only through the storage interface (ckptconv/storage/files.py,
docs/storage.md; layouts write through an output's Target, storage/targets.py): a call that opens,
maps, stats or lists a path directly would work on a local disk and silently not on a bucket. This
test fails on any such call in their code."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ckptconv"
PACKAGES = ("readers", "layouts")

# calls that reach a file system by name: os.X / os.path.X / mmap / open / pathlib
FORBIDDEN_OS = {"open", "listdir", "scandir", "stat", "lstat", "walk", "readlink", "fdopen"}
FORBIDDEN_OS_PATH = {"isdir", "isfile", "exists", "lexists", "getsize", "realpath", "islink", "abspath", "samefile",
                     "getmtime"}
FORBIDDEN_NAMES = {"open", "MappedFile", "Path"}


def violations(path: Path) -> list:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == "mmap" for a in node.names):
            found.append((node.lineno, "import mmap"))
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in FORBIDDEN_NAMES:
            found.append((node.lineno, f"{f.id}()"))
        elif isinstance(f, ast.Attribute):
            base = f.value
            if isinstance(base, ast.Name) and base.id == "os" and f.attr in FORBIDDEN_OS:
                found.append((node.lineno, f"os.{f.attr}()"))
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id == "os" \
                    and base.attr == "path" and f.attr in FORBIDDEN_OS_PATH:
                found.append((node.lineno, f"os.path.{f.attr}()"))
            elif isinstance(base, ast.Name) and base.id == "safejson" and f.attr in ("read", "load_file", "open_regular"):
                found.append((node.lineno, f"safejson.{f.attr}()"))
            elif f.attr in ("read_text", "read_bytes", "write_text", "write_bytes") and \
                    not (isinstance(base, ast.Name) and base.id == "storage"):   # (the interface's own)
                found.append((node.lineno, f".{f.attr}()"))
            elif f.attr in ("iterdir", "glob", "is_dir", "is_file", "exists", "stat", "resolve") and \
                    isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "Path":
                found.append((node.lineno, f"Path(...).{f.attr}()"))
    return found


def test_readers_and_layouts_reach_files_only_through_storage():
    bad = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, what in violations(path):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {what}")
    assert not bad, "use ckptconv.storage.files instead of:\n" + "\n".join(bad)


def test_the_check_finds_a_direct_call(tmp_path):
    p = tmp_path / "x.py"
    p.write_text("import os, mmap\nos.listdir('d')\nopen('f')\nos.path.isdir('d')\nPath('x').iterdir()\n")
    assert sorted(w for _, w in violations(p)) == sorted(["import mmap", "os.listdir()", "open()", "os.path.isdir()",
                                                          "Path()", "Path(...).iterdir()"])
