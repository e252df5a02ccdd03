"""The import graph keeps its layers (docs/architecture.md): no cycles, nothing imports a layer above
its own, and only the command line and the Python API import the commands. Read from the source with `ast`, so lazy
imports inside functions count too."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ckptconv"

# lowest first; a module may import its own layer and those below
LAYERS = [
    ["errors", "limits", "sizes", "dtypes", "safejson", "safetoml", "signals", "progress", "rowview", "_mapguard", "_sha256x"],
    ["io", "storage"],                          # bytes in and out: files, and objects in a store
    ["tensor", "checkpoint", "transforms"],
    ["formats"],
    ["tp", "readers.pickle", "readers.ziparchive"],
    ["readers"],
    ["run.share"],                              # the balancer: what layouts share work by
    ["layouts"],
    ["recipe", "requests"],
    ["run"],                                    # the job runner drives layouts
    ["jobs"],
    ["cli", "cli_options", "api", ""],   # "": the package itself (ckptconv/__init__.py exports the API)
]


def _name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _layer(module: str) -> int:
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if module == p or module.startswith(p + "."):
                if best is None or len(p) > best[1]:
                    best = (rank, len(p))
    assert best is not None, f"ckptconv.{module} belongs to no layer: add it to LAYERS"
    return best[0]


def _imports(path: Path) -> set:
    me = _name(path)
    package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("ckptconv"):
                target = node.module[len("ckptconv."):] if node.module != "ckptconv" else ""
            else:
                continue
            for alias in node.names:  # `from . import x` may name a module
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if (PACKAGE / sub.replace(".", "/")).with_suffix(".py").exists()
                          or (PACKAGE / sub.replace(".", "/")).is_dir() else target)
        elif isinstance(node, ast.Import):
            found.update(a.name[len("ckptconv."):] for a in node.names if a.name.startswith("ckptconv."))
    return {f for f in found if f and f != me}


def _graph() -> dict:
    return {_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def test_nothing_imports_a_layer_above_its_own():
    wrong = [(m, i) for m, deps in _graph().items() for i in deps if _layer(i) > _layer(m)]
    assert not wrong, wrong


def test_only_the_command_line_and_the_api_import_the_jobs():
    def job(name):   # jobs.verify.against -> "verify"; None outside jobs/
        parts = name.split(".")
        return parts[1] if parts[0] == "jobs" and len(parts) > 1 else None

    # a job's modules import only their own job (verify's job.py its against.py), never another's
    wrong = [(m, i) for m, deps in _graph().items() for i in deps
             if job(i) is not None and job(i) != job(m) and m not in ("cli", "cli_options", "api")]
    assert not wrong, wrong


def test_no_import_cycles():
    graph = _graph()
    state = {}

    def visit(m, path):
        state[m] = "open"
        for d in graph.get(m, ()):
            if d == m or d.startswith(m + "."):
                continue  # a package and its own modules (readers/__init__ lists its readers)
            assert state.get(d) != "open", " -> ".join(path + [d])
            if d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [m])
