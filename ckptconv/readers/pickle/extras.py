"""Turning what a pickle built into JSON-able extras: containers, records named by their class,
bytes by their size and digest, shared or self-referencing state as references, every unit of it
charged to the pickle's work budget.
"""
import hashlib
import json
import math

from ...errors import BadInput, brief, printable
from ...limits import MAX_DEPTH, Budget

from .standins import InertObject, Payload, StandIn
from .policy import record_parts, unread_in



# ---------------------------------------------------------------------------------------------
# Turning what a pickle built into JSON-able extras.


class Ref:
    """A second way to reach a container already recorded under `path` (shared or self-referencing
    state): written as {"__ref__": path} instead of a copy, so sharing never multiplies the output."""

    def __init__(self, path: str):
        self.path = path


def key_text(key) -> str:
    """A dict key as a name part: scalars as str(), a class used as a key (Lightning 1.x keys its
    `callbacks` by the callback's class) as its qualified name, an instance of a class `<pkg.Name>`,
    anything else as a short, deterministic repr. A key holding something ckptconv does not read
    (a record a global of the format's own modules built) is refused."""
    if isinstance(key, str):
        return key
    if isinstance(key, (InertObject, tuple, frozenset)):
        unread = unread_in(key)
        if unread is not None:
            raise unread.unlisted.refusal()
    if isinstance(key, StandIn):
        return key.qualname
    if isinstance(key, InertObject):
        return f"<{key.qualname}>"
    if isinstance(key, int) and key.bit_length() > 1024:
        return hex(key)  # str() of a 40,000-digit number is refused by Python itself
    if key is None or isinstance(key, (bool, int, float)):
        return str(key)
    return brief(key, 100)


def extras_json(extras: dict, budget: Budget) -> dict:
    """Plain JSON values for the manifest, one walk over all extras: tuples and sets become lists,
    bytes a size and digest, inert objects a record; a mutable container met a second time (shared,
    or a cycle) becomes {"__ref__": the name it was first written under}. The budget is charged
    about one unit per byte written (text by its length, however often the pickle refers to it),
    so the manifest stays proportional to the pickle; nesting deeper than MAX_DEPTH is refused."""
    walk = _Extras(budget)
    return {name: walk.value(value, (None, name), 0) for name, value in extras.items()}


def recorded_digest(value, budget: Budget) -> str:
    """What a file records (a run's arguments, DeepSpeed's ds_config), in 16 hex digits of the
    SHA-256 of its extras JSON with sorted keys: compared across a source's files
    (readers.one_save) without keeping it, and charged to the budget as extras are."""
    text = json.dumps(extras_json({"": value}, budget)[""], sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _Extras:
    """One walk over extras. Paths are (parent, key) pairs, spelled out only when written (a
    reference) or reported: building every dotted name up front costs its length per value."""

    _RECORD = 100   # units for a record written in place of bytes or a reference

    def __init__(self, budget: Budget):
        self.budget, self.seen, self.digests = budget, {}, {}

    def spend(self, units):
        self.budget.spend(units, "non-tensor state")

    @staticmethod
    def text(path) -> str:
        parts = []
        while path is not None:
            path, key = path
            parts.append(key)
        return ".".join(reversed(parts))

    def value(self, value, path, depth):
        self.spend(1)
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int):
            if value.bit_length() <= 1024:
                return value
            self.spend(value.bit_length() >> 2)   # (its hex digits, written again at every reference)
            return {"__int__": hex(value)}
        if isinstance(value, float):
            return value if math.isfinite(value) else {"__float__": str(value)}   # (never the text "nan")
        if isinstance(value, str):
            self.spend(len(value))
            return value  # (text UTF-8 cannot spell is written as its JSON escape: writer.write_json)
        if isinstance(value, (bytes, bytearray, Payload)):
            return self.bytes_record(value)
        if isinstance(value, Ref):
            self.spend(len(value.path))
            return {"__ref__": value.path}
        if isinstance(value, InertObject) and value.unread:
            raise value.placeholder.unlisted.refusal()
        if isinstance(value, StandIn):   # a class (or function) used as a value, never called
            self.spend(len(value.qualname))
            return {"__global__": value.qualname}
        if not isinstance(value, (dict, list, tuple, set, frozenset, InertObject)):
            jsonable = getattr(value, "to_jsonable", None)
            self.spend(self._RECORD)
            return jsonable() if jsonable is not None else f"<{type(value).__name__}>"
        if depth >= MAX_DEPTH:
            raise BadInput(f"{self.budget.path}: non-tensor state {self.text(path)!r} is nested more than "
                           f"{MAX_DEPTH} deep")
        if isinstance(value, InertObject) or (isinstance(value, (dict, list, set)) and value):  # mutable: may be shared
            first = self.seen.get(id(value))
            if first is not None:
                ref = self.text(first[1])
                self.spend(len(ref))
                return {"__ref__": ref}
            self.seen[id(value)] = (value, path)
        if isinstance(value, dict):
            return {key: self.value(v, (path, key), depth + 1) for key, v in self.keyed(value.items())}
        if isinstance(value, (list, tuple)):
            return [self.value(v, (path, str(i)), depth + 1) for i, v in enumerate(value)]
        if isinstance(value, (set, frozenset)):
            # members are hashable (tuples, frozensets, scalars, records): no path names them, so they are
            # written out whole, in an order that does not depend on hashing
            inner = _Extras(self.budget)
            inner.digests = self.digests
            members = [inner.value(v, path, depth + 1) for v in value]
            return sorted(members, key=lambda m: json.dumps(m, sort_keys=True))
        out = {"__class__": value.qualname}
        self.spend(len(value.qualname))
        for key, v in self.keyed(record_parts(value)):
            if key in out:
                raise BadInput(f"{self.budget.path}: non-tensor state {printable(self.text(path), 200)!r}, a "
                               f"{printable(value.qualname, 200)} record, has two parts named "
                               f"{printable(key, 100)!r}")
            out[key] = self.value(v, (path, key), depth + 1)
        return out

    def keyed(self, items):
        for k, v in items:
            key = key_text(k)
            self.spend(len(key))
            yield key, v

    def bytes_record(self, value) -> dict:
        """{"__bytes__": size, "sha256"}: each bytes object is hashed once, however often it is reached."""
        self.spend(self._RECORD)
        raw = value.view if isinstance(value, Payload) else value
        digest = self.digests.get(id(value))
        if digest is None:
            self.spend(len(raw) >> 10)
            digest = self.digests[id(value)] = (value, hashlib.sha256(raw).hexdigest())
        return {"__bytes__": len(raw), "sha256": digest[1]}
