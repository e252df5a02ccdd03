"""Reader for TorchScript archives (torch.jit.save, torch.jit.trace + save): the module's parameters
and buffers by attribute path (`encoder.0.weight`), as `torch.jit.load(f).state_dict()` names them.

The archive is a torch zip whose data.pkl pickles the module tree as `__torch__.*` objects; it runs
through the allowlisting unpickler with the TorchScript stand-ins, so each module is a record of its
attributes and each tensor a view of its stored entry. Which attributes are parameters and which
buffers is declared only in the class's TorchScript source (`__parameters__ = ["weight", "bias", ]`
in `code/__torch__/....py`): those two lines are matched as text and nothing else of the source is
looked at; it is never compiled or run, and `constants.pkl` is never read. Tensor attributes that are
neither (a plain `self.t = torch.ones(2)`) are not in the state dict: they are left out and listed;
other attributes become extras. See docs/convert.md#torchscript.
"""
import re
from pathlib import Path

from . import ReadOptions, wanted
from .base import Reader, register
from . import ziparchive
from .pickle import unpickler
from .pickle.torch_globals import TORCH_OWNED, TorchTensor, TorchTensorUnsupported, flatten, torch_globals
from .pickle.torchscript_globals import SCRIPT_MODULE, ScriptObject, script_globals
from .torch_pickle import archive_prefix, justified, load_zip
from ..errors import BadInput, printable
from ..storage import files as storage
from ..limits import MAX_DEPTH, Budget
from ..checkpoint import Checkpoint, SourceFacts

NAME = "torchscript"
BOOKKEEPING = ("training", "_is_full_backward_hook")   # every nn.Module's, not model state
MAX_SOURCE = 16 << 20   # the most one class's source entry may inflate to
_DECLARED = re.compile(r'^  (__parameters__|__buffers__) = \[((?:"[^"\\\n]*", )*)\]$', re.M)
_CLASS = re.compile(r"^class (\w+)(?:\((\w*)\))?:$", re.M)
CUSTOM_CLASSES = SCRIPT_MODULE + ".torch.classes"   # C++ classes (torch.classes.*): no TorchScript source


def _zip(path: Path):
    """`path` opened (storage.open_file), if it is a regular file that starts as a zip archive does;
    else None."""
    try:
        m = storage.open_file(path) if path.is_file() else None
    except (OSError, BadInput):
        return None
    return m if m is not None and ziparchive.is_zip(m) else None


def _scripted(names, prefix: str) -> bool:
    return any(n.startswith(prefix + "code/") for n in names)


def _entries(path: Path):
    """The archive's entries and the folder of its data.pkl, if `path` is a TorchScript archive (a
    torch zip with `code/` beside data.pkl); else None. A damaged archive is BadInput, saying how."""
    m = _zip(path)
    if m is None:
        return None
    entries = ziparchive.read_entries(m)
    prefix = archive_prefix(m, entries)
    return (m, entries, prefix) if _scripted(entries, prefix) else None


def detect(path: Path) -> bool:
    """A torch zip archive with `code/` beside its data.pkl, told by the names alone (ziparchive.names)."""
    m = _zip(path)
    if m is None:
        return False
    try:
        names = list(ziparchive.names(m))
        return _scripted(names, archive_prefix(m, names))
    except BadInput:
        return False


def load(path: Path, options: ReadOptions) -> Checkpoint:
    found = _entries(path)
    if found is None:
        raise BadInput(f"{path}: not a TorchScript archive (a torch zip archive with code/ beside data.pkl)")
    m, entries, prefix = found
    allow = unpickler.allowing({**torch_globals(), **script_globals()}, options.allow_globals,
                               (*TORCH_OWNED, "torch.jit._pickle"))
    budget, unlisted = Budget(path), unpickler.Unlisted(path)
    root = load_zip(m, allow, budget=budget, unlisted=unlisted, entries=entries)
    tree = _ModuleTree(m, entries, prefix, budget)
    if not isinstance(root, ScriptObject):
        raise BadInput(f"{path}: its data.pkl holds a {type(root).__name__}, not a TorchScript module")
    if not tree.is_module(root):
        raise BadInput(f"{path}: its data.pkl holds a TorchScript {root.qualname}, which is not a module")
    tree.visit(root, "", 0, set())
    tensors = [t.source(name) for name, t in tree.tensors]
    justified(m, tensors)
    tensors = [t for t in tensors if wanted(t.name, options.only)]
    extras = unpickler.extras_json({k: v for k, v in tree.extras.items() if wanted(k, options.only)}, budget)
    source = SourceFacts(format=NAME, path=str(path), files=[path.name], skipped=tree.skipped, dropped=tree.dropped,
                         placeholders=unlisted.listing(), more={"module": root.qualname})
    first = tree.skipped[0] if tree.skipped else None
    return Checkpoint(tensors, extras, source, [], [m], unsupported=first and (
        f"{path}: tensor {first['name']!r} has dtype {first['reason']}, which safetensors cannot store",
        "--skip-unsupported leaves it out"))


class _ModuleTree:
    """One walk of the module tree in state-dict order: a module's parameters, then its buffers, then
    its submodules, each by its attribute path. Every attribute visited is charged to the pickle's
    budget, so a submodule shared many times over cannot multiply the work beyond the file's size."""

    def __init__(self, m, entries, prefix, budget):
        self.m, self.entries, self.prefix, self.budget = m, entries, prefix, budget
        self.tensors, self.extras, self.dropped, self.skipped = [], {}, [], []
        self.declared = {}   # qualname -> (is a module, parameters, buffers)

    def visit(self, obj: ScriptObject, prefix: str, depth: int, above: set):
        """Depth first, in state-dict order; `above` holds the modules on the path here (a module that
        contains itself would never end)."""
        if depth >= MAX_DEPTH:
            raise BadInput(f"{self.m.path}: TorchScript modules nested more than {MAX_DEPTH} deep")
        if id(obj) in above:
            raise BadInput(f"{self.m.path}: TorchScript module {prefix.rstrip('.')!r} contains itself")
        state = obj.state
        if not isinstance(state, dict):
            raise BadInput(f"{self.m.path}: TorchScript module {obj.qualname} has no attribute dict")
        self.budget.spend(1 + len(state), "the TorchScript module tree")
        _, params, buffers, declared = self.classes(obj.qualname)
        for key in params + buffers:
            if key not in state:
                raise BadInput(f"{self.m.path}: {obj.qualname} declares {key!r} a parameter or buffer, but the "
                               f"module {prefix.rstrip('.') or '(root)'} has no such attribute")
            self.tensor(state[key], prefix + key)
        for key, value in state.items():
            key = unpickler.key_text(key)
            if key in declared or key in BOOKKEEPING:
                continue
            if isinstance(value, ScriptObject) and self.is_module(value):
                self.visit(value, f"{prefix}{key}.", depth + 1, above | {id(obj)})
            else:
                self.attribute(value, prefix + key)

    def tensor(self, value, name):
        if value is None:   # an optional parameter left unset (Linear(bias=False)): not in the state dict
            return
        if isinstance(value, (TorchTensor, TorchTensorUnsupported)) and value.unsupported:
            self.skipped.append({"name": name, "reason": value.unsupported})   # (readers/__init__ refuses them)
            return
        if not isinstance(value, TorchTensor):
            raise BadInput(f"{self.m.path}: parameter or buffer {name!r} is a {type(value).__name__}, not a tensor")
        self.tensors.append((name, value))

    def attribute(self, value, name):
        """Neither parameter, buffer nor submodule: its non-tensor parts are extras; tensors and
        TorchScript objects in it are not part of the state dict, and are listed as left out."""
        if isinstance(value, ScriptObject):
            self.dropped.append({"name": name, "reason": f"TorchScript object of class {value.qualname}"})
            return
        tensors, extras, skipped = flatten(value, self.m.path, prefix=name, budget=self.budget)
        self.extras.update(extras)
        if tensors or skipped:
            self.dropped.append({"name": name, "reason": "a tensor attribute, not a parameter or buffer"})

    def is_module(self, obj: ScriptObject) -> bool:
        return self.classes(obj.qualname)[0]

    def classes(self, qualname: str) -> tuple:
        """(is an nn.Module, its parameter names, its buffer names), from the declaration lines of its
        class in the archive's TorchScript source. Each source entry is read and scanned once."""
        module, _, cls = qualname.rpartition(".")
        if not module or not module.startswith(SCRIPT_MODULE) or not cls.isidentifier():
            raise BadInput(f"{self.m.path}: TorchScript class name {printable(qualname, 200)!r} is malformed")
        if module == CUSTOM_CLASSES or module.startswith(CUSTOM_CLASSES + "."):
            raise BadInput(f"{self.m.path}: {qualname} is a TorchScript custom C++ class (such as a quantized "
                           "model's packed parameters), whose state only its C++ code can read; not supported")
        name = f"{self.prefix}code/{module.replace('.', '/')}.py"
        if name not in self.declared:
            entry = self.entries.get(name)
            if entry is None:
                raise BadInput(f"{self.m.path}: the source of TorchScript class {qualname} ({name}) is missing")
            text = bytes(ziparchive.read_small(self.m, entry, MAX_SOURCE)).decode("utf-8", "replace")
            self.declared[name] = _classes(text, f"{self.m.path}: {name}")
        found = self.declared[name].get(cls)
        if found is None:
            raise BadInput(f"{self.m.path}: {name} does not define TorchScript class {cls}")
        return found


def _classes(text: str, where: str) -> dict:
    """{class: (is an nn.Module, parameter names, buffer names)} of one TorchScript source file, in one
    pass: each top-level `class` line, and the declaration lines in its body."""
    heads = list(_CLASS.finditer(text))
    out = {}
    for i, head in enumerate(heads):
        body = text[head.end():heads[i + 1].start() if i + 1 < len(heads) else len(text)]
        end = re.search(r"^\S", body, re.M)   # the class ends where the next top-level statement starts
        body = body[:end.start()] if end else body
        found = {}
        for kind, names in _DECLARED.findall(body):
            if kind in found:
                raise BadInput(f"{where}: class {head.group(1)} declares {kind} twice")
            found[kind] = re.findall(r'"([^"]*)"', names)
        is_module = head.group(2) == "Module"
        if is_module and set(found) != {"__parameters__", "__buffers__"}:
            raise BadInput(f"{where}: TorchScript module {head.group(1)} does not declare its parameters and buffers "
                           "in the form torch.jit.save writes")
        params, buffers = found.get("__parameters__", []), found.get("__buffers__", [])
        names = params + buffers
        if len(set(names)) != len(names) or "" in names:
            raise BadInput(f"{where}: class {head.group(1)} declares a parameter or buffer name twice, or an empty one")
        out[head.group(1)] = (is_module, tuple(params), tuple(buffers), frozenset(names))
    return out


READER = register(Reader(NAME, "TorchScript archives (torch.jit.save): parameters and buffers by attribute path",
                         detect, load, priority=35, parses_pickles=True, suffixes=(".pt", ".pth"), fuzz=(("input.pt", None),),
                         looks_for="a torch.jit.save zip (code/ beside data.pkl)"))
