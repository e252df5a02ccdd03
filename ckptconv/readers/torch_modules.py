"""`torch.save(model)`: a whole pickled `nn.Module`, read as the state dict `model.state_dict()` gives.

A module pickles as a record of its class (never imported: an `InertObject`) whose attributes include
`_parameters`, `_buffers` and `_modules`, three dicts. torch's `Module.state_dict()` writes, for each
module from the outermost in: its parameters (those not None), then its buffers (not None, and not
named in `_non_persistent_buffers_set`), under the module's dotted prefix, then each child module (not
None) under `PREFIX.NAME.` (docs/convert.md#pickled-modules). Everything else a module holds (its
hyper-parameters, an LSTM's `_flat_weights` list that repeats its parameters, hooks) is not in a state
dict and is left out. A module shared by two parents appears under both names, as in torch (tied
weights: one tensor, two names). A module's own `get_extra_state` or state-dict hooks are code of the
file's classes, which never runs: what they would add is not written.

`as_state_dicts` replaces every such record it reaches through containers and other records by that
state dict (a `StateDict`), so the training-wrapper survey, `--state-dict` and the flattening see a
state dict where the file held a module. Every object it walks is charged to the pickle's budget.
"""
from dataclasses import dataclass

from ..errors import BadInput, printable
from ..limits import MAX_DEPTH, Budget
from . import wrappers
from .pickle import unpickler
from .pickle.numpy_globals import NumpyArray
from .pickle.torch_globals import TorchTensor, TorchTensorUnsupported

_PARTS = ("_parameters", "_buffers", "_modules")
_WALKED = (dict, list, tuple, unpickler.InertObject)   # what may hold a module


@dataclass(frozen=True)
class PickledModule:
    """A module found in a pickle: where (its dotted path; "" for the whole file), its class, and how
    many entries its state dict has."""

    name: str
    cls: str
    entries: int
    left_out: tuple = ()   # attributes (dotted, inside the module) holding tensors its state dict does not

    def to_json(self) -> dict:
        return {"name": self.name, "class": self.cls, "entries": self.entries}


def is_module(value) -> bool:
    """A record of an `nn.Module`: its three dicts are there (whatever its class is called)."""
    if not isinstance(value, unpickler.InertObject) or value.unread:
        return False
    return all(isinstance(value.state.get(k), dict) for k in _PARTS)


def as_state_dicts(obj, path, budget: Budget) -> tuple:
    """(`obj` with every module record it reaches replaced by its state dict, [PickledModule] of the
    outermost ones). Containers are changed in place (a tuple is rebuilt); a container reached again
    gets the same replacement."""
    walk = _Walk(path, budget)
    return walk.value(obj, None, 0), walk.found


class _Walk:
    """One walk of what a pickle built. Where a value sits is a (parent, key) pair, spelled out only
    for a module found: a dict of a million numbers costs a look at each, not a name each."""

    def __init__(self, path, budget: Budget):
        self.path, self.budget = path, budget
        self.found, self.done = [], {}   # done: id -> the value that replaces it (itself if none)

    def value(self, v, where, depth: int):
        if isinstance(v, (TorchTensor, TorchTensorUnsupported, NumpyArray)) or not isinstance(v, _WALKED):
            return v
        if id(v) in self.done:
            return self.done[id(v)]
        if depth >= MAX_DEPTH:
            raise BadInput(f"{self.path}: containers nested more than {MAX_DEPTH} deep")
        self.done[id(v)] = v   # (a cycle back to a container being walked meets it unchanged)
        if is_module(v):
            made = _StateDict(self.path, self.budget)
            out = made.of(v)
            self.found.append(PickledModule(_spelled(where), v.qualname[:1000], len(out), made.left_out()))
        else:
            out = self._inside(v, where, depth)
        self.done[id(v)] = out
        return out

    def _inside(self, v, where, depth):
        """`v` with its parts replaced; only containers that hold something to replace are touched."""
        self.budget.spend(1 + (len(v) if isinstance(v, (dict, list, tuple)) else 0), "its non-tensor state")
        if isinstance(v, unpickler.InertObject):
            if v.unread:
                return v
            v.args[:] = self._replaced(v.args, where, depth)
            if v.items is not None:
                v.items = self._inside(v.items, where, depth)
            self._dict(v.state, where, depth)
            return v
        if isinstance(v, dict):
            self._dict(v, where, depth)
            return v
        parts = self._replaced(v, where, depth)
        if isinstance(v, list):
            v[:] = parts
            return v
        return tuple(parts) if any(a is not b for a, b in zip(parts, v)) else v

    def _dict(self, d: dict, where, depth):
        if not any(isinstance(item, _WALKED) for item in d.values()):   # (a table of numbers or text)
            return
        changed = {}
        for k, item in d.items():
            new = self.value(item, (where, k), depth + 1)
            if new is not item:
                changed[k] = new
        d.update(changed)   # (the same keys: the order stays)

    def _replaced(self, items, where, depth) -> list:
        if not any(isinstance(item, _WALKED) for item in items):   # (a row of numbers: nothing to replace)
            return list(items)
        return [self.value(item, (where, i), depth + 1) for i, item in enumerate(items)]


def _spelled(where) -> str:
    """The dotted name of a (parent, key) place; "" for the top."""
    parts = []
    while where is not None:
        where, key = where
        parts.append(unpickler.key_text(key) if not isinstance(key, int) else str(key))
    return ".".join(reversed(parts))


class _StateDict:
    """One module's state dict, as `Module.state_dict()` lays it out."""

    def __init__(self, path, budget: Budget):
        self.path, self.budget = path, budget
        self.out, self.open = unpickler.StateDict(), set()   # open: modules on the current path
        self.held = []   # (attribute's dotted name, ids of the tensors it reaches): what else modules hold

    def of(self, module) -> dict:
        self._add(module, "", 0)
        return self.out

    def _add(self, module, prefix: str, depth: int):
        if id(module) in self.open:
            raise BadInput(f"{self.path}: module {printable(prefix[:-1] or module.qualname, 200)!r} contains itself; "
                           "refused")
        if depth >= MAX_DEPTH:
            raise BadInput(f"{self.path}: modules nested more than {MAX_DEPTH} deep")
        self.open.add(id(module))
        params, buffers, children = (module.state[k] for k in _PARTS)
        self.budget.spend(1 + len(params) + len(buffers) + len(children), "its modules")
        hidden = _names(module.state.get("_non_persistent_buffers_set"))
        for k, v in params.items():
            if v is not None:
                self._put(prefix + unpickler.key_text(k), v)
        for k, v in buffers.items():
            if v is not None and unpickler.key_text(k) not in hidden:
                self._put(prefix + unpickler.key_text(k), v)
        for k, child in children.items():
            if child is None:
                continue
            name = prefix + unpickler.key_text(k)
            if is_module(child):
                self._add(child, name + ".", depth + 1)
            else:   # (not a module record: kept whole under its name, flattened like any value)
                self._put(name, child)
        for k, v in module.state.items():
            if k not in _PARTS:
                found = self._tensors_in(v)
                if found:
                    self.held.append((prefix + unpickler.key_text(k), found))
        self.open.discard(id(module))

    def _tensors_in(self, value) -> list:
        """The ids of the tensors `value` reaches (not through another module: each is looked at where
        its own state dict is made), and of the kinds of tensor ckptconv does not read (a quantized
        tensor's packed form)."""
        reached = wrappers.tensors_reached(value, self.budget, "its modules", unread=True, stop=is_module)
        return [id(t) for t in reached]

    def left_out(self) -> tuple:
        """The attributes holding a tensor the state dict does not (a class that writes its own state
        dict, a quantized module's packed weights, a cache kept as a plain attribute)."""
        placed = {id(v) for v in self.out.values()}
        return tuple(name for name, ids in self.held if any(i not in placed for i in ids))

    def _put(self, name: str, value):
        self.budget.spend(len(name), "naming its tensors")
        if name in self.out:
            raise BadInput(f"{self.path}: two entries of a pickled module's state dict are named "
                           f"{printable(name, 200)!r}")
        self.out[name] = value


def _names(value) -> set:
    """`_non_persistent_buffers_set`: the buffer names a set (or its record) holds."""
    if isinstance(value, unpickler.InertObject):
        value = value.items if value.items is not None else value.args[0] if value.args else ()
    if isinstance(value, (set, frozenset, list, tuple)):
        return {unpickler.key_text(v) for v in value if isinstance(v, str)}
    return set()
