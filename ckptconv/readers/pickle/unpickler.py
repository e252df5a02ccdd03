"""The one allowlisting unpickler: a pickle VM that builds data and never calls into the file.

`pickle.Unpickler.find_class` imports modules and calls whatever REDUCE names; this VM instead
resolves every global through an explicit allowlist to an inert stand-in that we wrote (a `StandIn`),
and REDUCE/NEWOBJ/BUILD only ever run those stand-ins. Anything else - an unknown global, an EXT
code, an out-of-band buffer, a call on a non-callable - stops the run with `UnsafePickle` naming the
file, the byte offset and what was asked for. Large BINBYTES/BINBYTES8/BYTEARRAY8 payloads are not
copied: they come back as `Payload` views of the caller's (memory-mapped) buffer, with their offset.
"""
import codecs
import hashlib
import json
import math
import struct
import sys
from dataclasses import dataclass

from ...errors import BadInput, UnsafePickle, brief, printable
from ...limits import MAX_DEPTH, Budget

PAYLOAD_MIN = 64 * 1024  # payloads this large stay views of the mapped file
_MODULUS = sys.hash_info.modulus  # 2**61 - 1 on 64-bit builds


@dataclass
class Payload:
    """A bytes payload left in place: `view` is a memoryview into the file, `offset` its position."""

    view: memoryview
    offset: int

    def __len__(self):
        return len(self.view)

    def tobytes(self) -> bytes:
        return self.view.tobytes()


def as_buffer(data):
    """bytes/bytearray/Payload -> something numpy.frombuffer accepts, without copying a Payload."""
    return data.view if isinstance(data, Payload) else data


class StandIn:
    """What an allowlisted global resolves to. Subclasses override the operations they permit."""

    qualname = "?"

    def call(self, args, ctx):
        raise ctx.unsafe(f"global {self.qualname!r} cannot be called")

    def new(self, args, kwargs, ctx):
        raise ctx.unsafe(f"global {self.qualname!r} cannot be instantiated")


class Function(StandIn):
    """A callable stand-in: REDUCE runs `fn(ctx, *args)`, our own code."""

    def __init__(self, qualname, fn):
        self.qualname, self.fn = qualname, fn

    def call(self, args, ctx):
        if not isinstance(args, tuple):
            raise ctx.bad(f"{self.qualname} called with {type(args).__name__} instead of a tuple")
        return self.fn(ctx, *args)


class Marker(StandIn):
    """A global that is only ever an argument (a dtype, a storage class): carries `value`."""

    def __init__(self, qualname, value=None):
        self.qualname, self.value = qualname, value


class InertClass(StandIn):
    """A benign class (argparse.Namespace, a user's --allow-global): instances are plain records."""

    def __init__(self, qualname):
        self.qualname = qualname

    def call(self, args, ctx):
        return InertObject(self.qualname, list(_args(ctx, args, self.qualname)))

    def new(self, args, kwargs, ctx):
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ctx.bad(f"{self.qualname} instantiated with keyword arguments in a {type(kwargs).__name__}")
        return InertObject(self.qualname, list(_args(ctx, args, self.qualname)), dict(kwargs or {}))


def _args(ctx, args, qualname):
    """Constructor arguments are a tuple (a string would become one record field per character)."""
    if not isinstance(args, tuple):
        raise ctx.bad(f"{qualname} called with a {type(args).__name__} instead of a tuple of arguments")
    return args


class InertObject:
    """An instance of an inert class: its constructor arguments and state, as data."""

    def __init__(self, qualname, args=None, state=None):
        self.qualname, self.args, self.state = qualname, args or [], state or {}

    def build(self, state, ctx):
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slots state)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.state.update(state)
        else:
            self.state["__state__"] = state


class StateDict(dict):
    """collections.OrderedDict as a plain dict; BUILD attributes (torch's `_metadata`) are kept aside."""

    attrs = None

    def build(self, state, ctx):
        if not isinstance(state, dict):
            raise ctx.bad("OrderedDict state is not a dict")
        self.attrs = state


def _ordered_dict(ctx, items=()):
    d = StateDict()
    for kv in _items(ctx, items, "OrderedDict"):
        if not (isinstance(kv, (tuple, list)) and len(kv) == 2):
            raise ctx.bad("OrderedDict item is not a (key, value) pair")
        ctx.hashing((kv[0],))
        d[kv[0]] = kv[1]
    return d


def _items(ctx, items, what):
    if not isinstance(items, (list, tuple)):
        raise ctx.bad(f"{what} of a {type(items).__name__}, not a list or tuple")
    return items


def _encode(ctx, text, encoding="latin1"):
    """_codecs.encode, as protocol-2 pickles use it to spell bytes; latin-1 only."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise ctx.unsafe(f"_codecs.encode({type(text).__name__}, {encoding!r}) is not allowed")
    return text.encode("latin1")


def _bytearray(ctx, data=b"", encoding=None):
    if isinstance(data, str):
        data = _encode(ctx, data, encoding or "")
    if not isinstance(data, (bytes, bytearray)):
        raise ctx.unsafe(f"builtins.bytearray of a {type(data).__name__}")
    return bytearray(data)


def _set(ctx, items=()):
    return set(ctx.hashing(_items(ctx, items, "set")))


def _frozenset(ctx, items=()):
    return ctx.frozenset(_items(ctx, items, "frozenset"))


def _reconstructor(ctx, cls, base, state=None):
    """copyreg._reconstructor: protocol 0/1 spelling of `object.__new__(cls)`, inert classes only."""
    if not isinstance(cls, InertClass) or not isinstance(base, Marker) or base.value is not object:
        raise ctx.unsafe(f"copyreg._reconstructor of {getattr(cls, 'qualname', type(cls).__name__)}")
    return cls.new((), {}, ctx)


# Globals every format may meet in non-tensor state; each format adds its own on top.
BENIGN = {
    ("collections", "OrderedDict"): Function("collections.OrderedDict", _ordered_dict),
    ("_codecs", "encode"): Function("_codecs.encode", _encode),
    ("builtins", "set"): Function("builtins.set", _set),
    ("__builtin__", "set"): Function("builtins.set", _set),
    ("builtins", "frozenset"): Function("builtins.frozenset", _frozenset),
    ("__builtin__", "frozenset"): Function("builtins.frozenset", _frozenset),
    ("builtins", "bytearray"): Function("builtins.bytearray", _bytearray),
    ("__builtin__", "bytearray"): Function("builtins.bytearray", _bytearray),
    ("builtins", "object"): Marker("builtins.object", object),
    ("__builtin__", "object"): Marker("builtins.object", object),
    ("copyreg", "_reconstructor"): Function("copyreg._reconstructor", _reconstructor),
    ("copy_reg", "_reconstructor"): Function("copyreg._reconstructor", _reconstructor),
    ("argparse", "Namespace"): InertClass("argparse.Namespace"),
}


def allow_globals(names) -> dict:
    """`--allow-global MODULE.NAME`: accept these classes as inert records (never imported)."""
    out = {}
    for name in names or ():
        module, _, attr = name.rpartition(".")
        if not module or not attr:
            raise BadInput(f"--allow-global {name!r}: expected MODULE.NAME")
        out[(module, attr)] = InertClass(name)
    return out


class _Mark:
    pass


MARK = _Mark()


class Context:
    """What stand-ins see: where we are (for messages), the work budget, and the depth and expanded
    size of every tuple and frozenset built so far. Those two are immutable, so both numbers are exact
    when they are made; Python hashes tuples by recursing in C with no guard, and hashing or writing
    out a shared tuple costs its expanded size, so both are bounded before anything hashes them."""

    def __init__(self, path, base_offset, budget: Budget):
        self.path, self.base_offset, self.pos, self.budget = path, base_offset, 0, budget
        self._shape = {}   # id -> (object, depth, expanded size), for nested tuples and frozensets
        self._credited = 0
        self.payloads = 0  # bytes of the payloads left in the file (Payload), up to here

    def credit(self, pos: int):
        """The budget grows with the pickle bytes read so far, less the payloads left in place (a
        Grok file's tensor bytes, like a legacy file's storages after its pickle, justify nothing)."""
        if pos - self.payloads > self._credited:
            self.budget.add_bytes(pos - self.payloads - self._credited)
            self._credited = pos - self.payloads

    def bad(self, msg) -> BadInput:
        return BadInput(f"{self.path}: {msg} (pickle offset {self.base_offset + self.pos})")

    def unsafe(self, msg) -> UnsafePickle:
        return UnsafePickle(f"{self.path}: refused: {msg} (pickle offset {self.base_offset + self.pos}); "
                            "nothing was executed")

    def _size(self, x) -> tuple:
        """(depth, expanded size) of a value: recorded for nested tuples and frozensets, one level
        for flat ones (they hold no tuple), a leaf otherwise."""
        info = self._shape.get(id(x))
        if info is not None and info[0] is x:
            return info[1], info[2]
        return (1, len(x) + 1) if isinstance(x, (tuple, frozenset)) else (0, 1)

    def _made(self, obj, items, what):
        self.credit(self.pos)
        depth, size = 1, 1
        for x in items:
            d, n = self._size(x)
            depth, size = max(depth, d + 1), size + n
        if depth > MAX_DEPTH:
            raise self.bad(f"{what}s nested more than {MAX_DEPTH} deep")
        if size > self.budget.left:
            raise self.bad(f"a {what} that expands to {size} values (shared members), more than the pickle's "
                           f"{self.budget.nbytes} bytes justify")
        if depth > 1:
            self._shape[id(obj)] = (obj, depth, size)
        return obj

    def tuple(self, items) -> tuple:
        items = tuple(items)
        return self._made(items, items, "tuple")

    def frozenset(self, items) -> frozenset:
        self.hashing(items)
        return self._made(frozenset(items), items, "frozenset")

    def hashing(self, keys):
        """Charge for hashing `keys` (a tuple's hash walks all of it, every time) and refuse keys
        chosen to collide; returns them."""
        self.credit(self.pos)
        cost = 0
        for k in keys:
            cost += self._size(k)[1]
        self.budget.spend(cost, "hashing its keys")
        for k in keys:
            self._unsalted(k)
        return keys

    def _unsalted(self, key):
        """Python hashes numbers by their value modulo 2**61 - 1, with no random salt (strings and
        bytes have one): numbers an attacker picks to be equal modulo it would make every insertion
        into a dict or set scan all the others, quadratic in the file's size. Such numbers cannot be
        keys, nor parts of tuple keys (walked once each; their size was charged above)."""
        todo, seen = [key], set()
        while todo:
            x = todo.pop()
            if isinstance(x, (int, float)) and not isinstance(x, bool) and not -_MODULUS < x < _MODULUS:
                raise self.bad(f"a dict key or set member holds the number {brief(x, 40)}, beyond the 2**61 - 1 "
                               "that Python can hash without collisions")
            if type(x) is tuple and id(x) not in seen:
                seen.add(id(x))
                todo.extend(x)


def load(data, allowlist: dict, path, base_offset=0, persistent_load=None, budget: Budget = None):
    """Run the pickle in `data` (bytes or memoryview) and return the object it builds.

    `allowlist` maps (module, name) to StandIns; `persistent_load(pid, ctx)` resolves PERSID ids.
    `budget` (default: one sized by `data`) is charged here and by whoever walks the result next
    (`flatten`, `extras_json`), so the whole reading of one pickle stays bounded by its size.
    """
    return load_prefix(data, allowlist, path, base_offset, persistent_load, budget=budget)[0]


def load_prefix(data, allowlist: dict, path, base_offset=0, persistent_load=None, max_memo=10_000_000,
                budget: Budget = None):
    """Like `load` for a pickle followed by other bytes: returns (object, length of the pickle)."""
    mv = memoryview(data).cast("B")
    ctx = Context(path, base_offset, budget or Budget(path))
    try:
        obj, length = _run(mv, allowlist, ctx, persistent_load, max_memo)
        ctx.credit(length)
        return obj, length
    except (BadInput,):
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, RecursionError,
            UnicodeDecodeError, struct.error, MemoryError) as e:
        raise ctx.bad(f"malformed pickle: {type(e).__name__}: {printable(e, 200)}") from None


def _run(mv, allowlist, ctx, persistent_load, max_memo):
    n = len(mv)
    pos = 0
    stack, metastack, memo = [], [], {}

    def take(k):
        nonlocal pos
        if k < 0 or pos + k > n:
            raise ctx.bad(f"truncated pickle: needs {k} bytes, {n - pos} left")
        out = mv[pos:pos + k]
        pos += k
        return out

    def line():
        """A text opcode's argument, up to the newline (searched in growing windows: linear time)."""
        nonlocal pos
        k = 256
        while True:
            window = bytes(mv[pos:pos + k])
            end = window.find(b"\n")
            if end >= 0:
                pos += end + 1
                return window[:end]
            if pos + k >= n:
                raise ctx.bad("truncated pickle: unterminated line")
            k *= 4

    def u(fmt, k):
        return struct.unpack(fmt, take(k))[0]

    def pop_mark():
        nonlocal stack
        if not metastack:
            raise ctx.bad("MARK missing")
        items = stack
        stack = metastack.pop()
        return items

    def push_bytes(k, mutable=False):
        start = pos
        view = take(k)
        if k >= PAYLOAD_MIN:
            stack.append(Payload(view, ctx.base_offset + start))
            ctx.payloads += k
        else:
            stack.append(bytearray(view) if mutable else bytes(view))

    def resolve(module, name):
        if not isinstance(module, str) or not isinstance(name, str):
            raise ctx.unsafe("STACK_GLOBAL with non-string operands")
        standin = allowlist.get((module, name))
        if standin is None:
            raise ctx.unsafe(f"global '{module}.{name}' is not on the allowlist")
        return standin

    def memo_put(idx):
        if not stack:
            raise ctx.bad("PUT on an empty stack")
        if idx < 0 or (idx not in memo and len(memo) >= max_memo):
            raise ctx.bad(f"memo index {idx} out of range")
        memo[idx] = stack[-1]

    def memo_get(idx):
        if idx not in memo:
            raise ctx.bad(f"memo key {idx} was never stored")
        stack.append(memo[idx])

    def instantiate(cls, args, kwargs=None):
        if not isinstance(cls, StandIn):
            raise ctx.unsafe(f"instantiating a {type(cls).__name__}, which is not an allowlisted class")
        return cls.new(args, kwargs, ctx)

    while True:
        if pos >= n:
            raise ctx.bad("truncated pickle: no STOP opcode")
        ctx.pos = pos
        op = mv[pos]
        pos += 1
        if op == 0x80:  # PROTO
            if take(1)[0] > 5:
                raise ctx.bad("unsupported pickle protocol")
        elif op == 0x95:  # FRAME: a length hint; opcodes run on regardless
            if u("<Q", 8) > n - pos:
                raise ctx.bad("FRAME longer than the data")
        elif op == 0x2E:  # STOP
            if len(stack) != 1 or metastack:
                raise ctx.bad("STOP with an unbalanced stack")
            return stack[0], pos
        elif op == 0x28:  # MARK
            metastack.append(stack)
            stack = []
        elif op == 0x30:  # POP
            if stack:
                stack.pop()
            else:
                pop_mark()
        elif op == 0x31:  # POP_MARK
            pop_mark()
        elif op == 0x32:  # DUP
            stack.append(stack[-1])
        # --- scalars
        elif op == 0x4E:  # NONE
            stack.append(None)
        elif op == 0x88:
            stack.append(True)
        elif op == 0x89:
            stack.append(False)
        elif op == 0x4B:  # BININT1
            stack.append(take(1)[0])
        elif op == 0x4D:  # BININT2
            stack.append(u("<H", 2))
        elif op == 0x4A:  # BININT
            stack.append(u("<i", 4))
        elif op == 0x8A:  # LONG1
            stack.append(int.from_bytes(take(take(1)[0]), "little", signed=True))
        elif op == 0x8B:  # LONG4
            k = u("<i", 4)
            if k > 1 << 20:
                raise ctx.bad(f"LONG4 of {k} bytes")
            stack.append(int.from_bytes(take(k), "little", signed=True))
        elif op == 0x47:  # BINFLOAT
            stack.append(u(">d", 8))
        elif op == 0x49:  # INT (text): also spells True/False in protocol 0
            text = line()
            stack.append(True if text == b"01" else False if text == b"00" else int(text))
        elif op == 0x4C:  # LONG (text)
            stack.append(int(line().rstrip(b"L")))
        elif op == 0x46:  # FLOAT (text)
            stack.append(float(line()))
        # --- strings and bytes
        elif op == 0x58:  # BINUNICODE
            stack.append(str(take(u("<I", 4)), "utf-8", "surrogatepass"))
        elif op == 0x8C:  # SHORT_BINUNICODE
            stack.append(str(take(take(1)[0]), "utf-8", "surrogatepass"))
        elif op == 0x8D:  # BINUNICODE8
            stack.append(str(take(u("<Q", 8)), "utf-8", "surrogatepass"))
        elif op == 0x56:  # UNICODE (text)
            stack.append(line().decode("raw-unicode-escape"))
        elif op == 0x43:  # SHORT_BINBYTES
            push_bytes(take(1)[0])
        elif op == 0x42:  # BINBYTES
            push_bytes(u("<I", 4))
        elif op == 0x8E:  # BINBYTES8
            push_bytes(u("<Q", 8))
        elif op == 0x96:  # BYTEARRAY8
            push_bytes(u("<Q", 8), mutable=True)
        elif op == 0x55:  # SHORT_BINSTRING (py2 str)
            stack.append(str(take(take(1)[0]), "latin1"))
        elif op == 0x54:  # BINSTRING
            k = u("<i", 4)
            stack.append(str(take(k), "latin1"))
        elif op == 0x53:  # STRING (text, quoted)
            text = line()
            if len(text) < 2 or text[0] != text[-1] or text[:1] not in (b"'", b'"'):
                raise ctx.bad("STRING opcode argument is not quoted")
            stack.append(str(codecs.escape_decode(text[1:-1])[0], "latin1"))
        elif op in (0x97, 0x98):  # NEXT_BUFFER, READONLY_BUFFER
            raise ctx.unsafe("out-of-band buffers (NEXT_BUFFER/READONLY_BUFFER) are not accepted")
        # --- containers
        elif op == 0x29:
            stack.append(())
        elif op in (0x85, 0x86, 0x87):  # TUPLE1/2/3
            k = op - 0x84
            if len(stack) < k:
                _underflow(ctx)
            stack[-k:] = [ctx.tuple(stack[-k:])]
        elif op == 0x74:  # TUPLE
            items = pop_mark()
            stack.append(ctx.tuple(items))
        elif op == 0x5D:  # EMPTY_LIST
            stack.append([])
        elif op == 0x6C:  # LIST
            items = pop_mark()
            stack.append(items)
        elif op == 0x61:  # APPEND
            item = stack.pop()
            _as(stack[-1], list, ctx, "APPEND").append(item)
        elif op == 0x65:  # APPENDS
            items = pop_mark()
            _as(stack[-1], list, ctx, "APPENDS").extend(items)
        elif op == 0x7D:  # EMPTY_DICT
            stack.append({})
        elif op == 0x64:  # DICT
            items = pop_mark()
            stack.append(dict(zip(ctx.hashing(items[0::2]), items[1::2])))
        elif op == 0x73:  # SETITEM
            v = stack.pop()
            k = stack.pop()
            _as(stack[-1], dict, ctx, "SETITEM")[ctx.hashing((k,))[0]] = v
        elif op == 0x75:  # SETITEMS
            items = pop_mark()
            if len(items) % 2:
                raise ctx.bad("SETITEMS with an odd number of items")
            d = _as(stack[-1], dict, ctx, "SETITEMS")
            ctx.hashing(items[0::2])
            for i in range(0, len(items), 2):
                d[items[i]] = items[i + 1]
        elif op == 0x8F:  # EMPTY_SET
            stack.append(set())
        elif op == 0x90:  # ADDITEMS
            items = pop_mark()
            _as(stack[-1], set, ctx, "ADDITEMS").update(ctx.hashing(items))
        elif op == 0x91:  # FROZENSET
            items = pop_mark()
            stack.append(ctx.frozenset(items))
        # --- memo
        elif op == 0x70:  # PUT (text)
            memo_put(int(line()))
        elif op == 0x71:
            memo_put(take(1)[0])
        elif op == 0x72:
            memo_put(u("<I", 4))
        elif op == 0x94:  # MEMOIZE
            memo_put(len(memo))
        elif op == 0x67:  # GET (text)
            memo_get(int(line()))
        elif op == 0x68:
            memo_get(take(1)[0])
        elif op == 0x6A:
            memo_get(u("<I", 4))
        # --- globals and objects: only stand-ins ever run
        elif op == 0x63:  # GLOBAL
            module = line().decode("utf-8")
            name = line().decode("utf-8")
            stack.append(resolve(module, name))
        elif op == 0x93:  # STACK_GLOBAL
            name = stack.pop()
            module = stack.pop()
            stack.append(resolve(module, name))
        elif op in (0x82, 0x83, 0x84):  # EXT1/2/4
            raise ctx.unsafe("extension-registry opcode (EXT1/EXT2/EXT4) is not accepted")
        elif op == 0x52:  # REDUCE
            args = stack.pop()
            func = stack.pop()
            if not isinstance(func, StandIn):
                raise ctx.unsafe(f"REDUCE on a {type(func).__name__}, which is not an allowlisted callable")
            stack.append(func.call(args, ctx))
        elif op == 0x81:  # NEWOBJ
            args = stack.pop()
            cls = stack.pop()
            stack.append(instantiate(cls, args))
        elif op == 0x92:  # NEWOBJ_EX
            kwargs = stack.pop()
            args = stack.pop()
            cls = stack.pop()
            stack.append(instantiate(cls, args, kwargs))
        elif op == 0x6F:  # OBJ
            items = pop_mark()
            if not items:
                raise ctx.bad("OBJ without a class")
            stack.append(instantiate(items[0], tuple(items[1:])))
        elif op == 0x69:  # INST
            module = line().decode("utf-8")
            name = line().decode("utf-8")
            cls = resolve(module, name)
            items = pop_mark()
            stack.append(instantiate(cls, tuple(items)))
        elif op == 0x62:  # BUILD
            state = stack.pop()
            obj = stack[-1]
            build = getattr(type(obj), "build", None)
            if build is None or not callable(build) or isinstance(obj, StandIn):
                raise ctx.unsafe(f"BUILD (setstate) on a {type(obj).__name__} is not allowed")
            obj.build(state, ctx)
        elif op == 0x50:  # PERSID (text)
            pid = line().decode("ascii")
            stack.append(_persistent(persistent_load, pid, ctx))
        elif op == 0x51:  # BINPERSID
            stack.append(_persistent(persistent_load, stack.pop(), ctx))
        else:
            raise ctx.bad(f"unknown pickle opcode 0x{op:02x}")


def _underflow(ctx):
    raise ctx.bad("stack underflow")


def _as(obj, kind, ctx, opname):
    if type(obj) is not kind and not (kind is dict and isinstance(obj, StateDict)):
        raise ctx.unsafe(f"{opname} on a {type(obj).__name__}")
    return obj


def _persistent(hook, pid, ctx):
    if hook is None:
        raise ctx.unsafe(f"persistent id {brief(pid)} in a pickle that has no persistent objects")
    return hook(pid, ctx)


# ---------------------------------------------------------------------------------------------
# Turning what a pickle built into JSON-able extras.


class Ref:
    """A second way to reach a container already recorded under `path` (shared or self-referencing
    state): written as {"__ref__": path} instead of a copy, so sharing never multiplies the output."""

    def __init__(self, path: str):
        self.path = path


def key_text(key) -> str:
    """A dict key as a name part: scalars as str(), anything else as a short, deterministic repr."""
    if isinstance(key, str):
        return key
    if isinstance(key, int) and key.bit_length() > 1024:
        return hex(key)  # str() of a 40,000-digit number is refused by Python itself
    if key is None or isinstance(key, (bool, int, float)):
        return str(key)
    return brief(key, 100)


def extras_json(extras: dict, budget: Budget) -> dict:
    """Plain JSON values for the manifest, one walk over all extras: tuples and sets become lists,
    bytes a size and digest, inert objects a record; a mutable container met a second time (shared,
    or a cycle) becomes {"__ref__": the name it was first written under}. Work is charged to
    `budget`; nesting deeper than MAX_DEPTH is refused."""
    seen = {}
    return {name: _jsonable(value, name, 0, seen, budget) for name, value in extras.items()}


def to_jsonable(value, budget: Budget = None):
    """One value as extras_json writes it (its own walk)."""
    return _jsonable(value, "", 0, {}, budget or Budget("non-tensor state"))


def _jsonable(value, path, depth, seen, budget):
    budget.spend(1, "non-tensor state")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if value.bit_length() <= 1024 else {"__int__": hex(value)}
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        budget.spend(len(value) >> 6, "non-tensor state")
        return value  # (text UTF-8 cannot spell is written as its JSON escape: writer.write_json)
    if isinstance(value, (bytes, bytearray, Payload)):
        raw = value.view if isinstance(value, Payload) else value
        budget.spend(len(raw) >> 16, "non-tensor state")
        return {"__bytes__": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    if isinstance(value, Ref):
        return {"__ref__": value.path}
    if isinstance(value, StandIn):
        return {"__global__": value.qualname}
    if not isinstance(value, (dict, list, tuple, set, frozenset, InertObject)):
        jsonable = getattr(value, "to_jsonable", None)
        return jsonable() if jsonable is not None else f"<{type(value).__name__}>"
    if depth >= MAX_DEPTH:
        raise BadInput(f"{budget.path}: non-tensor state {path!r} is nested more than {MAX_DEPTH} deep")
    if isinstance(value, InertObject) or (isinstance(value, (dict, list, set)) and value):  # mutable: may be shared
        first = seen.get(id(value))
        if first is not None:
            return {"__ref__": first[1]}
        seen[id(value)] = (value, path)

    def inner(v, key):
        return _jsonable(v, f"{path}.{key}" if path else str(key), depth + 1, seen, budget)

    if isinstance(value, dict):
        return {key_text(k): inner(v, key_text(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [inner(v, i) for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        # members are hashable (tuples, frozensets, scalars, records): no path names them, so they are
        # written out whole, in an order that does not depend on hashing
        members = [_jsonable(v, path, depth + 1, {}, budget) for v in value]
        return sorted(members, key=lambda m: json.dumps(m, sort_keys=True))
    out = {"__class__": value.qualname}
    if value.args:
        out["args"] = inner(value.args, "args")
    out.update({key_text(k): inner(v, key_text(k)) for k, v in value.state.items()})
    return out
