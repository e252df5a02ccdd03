"""The stand-ins the allowlisting VM (vm.py) resolves globals to: what a pickle may build, written by
us. A `StandIn` is called (REDUCE) or instantiated (NEWOBJ) only by the VM, with arguments the pickle
built; it copies at most what it is given (charged to the pickle's budget) and calls nothing of the
file's. Records of classes (`InertObject`) are data: their class is a name, never imported. The
plain containers every format may meet in non-tensor state (`BENIGN`) are emulated here.
"""
from dataclasses import dataclass

from ...errors import printable


PAYLOAD_MIN = 64 * 1024  # payloads this large stay views of the mapped file


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
    namespace = False   # as a `MODULE.*` pattern: a namespace of its own, whose names are never Python's

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

    def named(self, qualname) -> "InertClass":
        """The class a `MODULE.*` pattern gives for one global it matches."""
        return InertClass(qualname)

    def call(self, args, ctx):
        return InertObject(self.qualname, _args(ctx, args, self.qualname))

    def new(self, args, kwargs, ctx):
        return InertObject(self.qualname, _args(ctx, args, self.qualname), _kwargs(ctx, kwargs, self.qualname))


def _args(ctx, args, qualname) -> list:
    """Constructor arguments are a tuple (a string would become one record field per character),
    copied into the record: charged, as one memoized tuple may be passed to any number of calls."""
    if not isinstance(args, tuple):
        raise ctx.bad(f"{qualname} called with a {type(args).__name__} instead of a tuple of arguments")
    ctx.copying(len(args))
    return list(args)


def _kwargs(ctx, kwargs, qualname) -> dict:
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ctx.bad(f"{qualname} instantiated with keyword arguments in a {type(kwargs).__name__}")
    ctx.copying(len(kwargs or ()))
    return dict(kwargs or {})


class InertObject:
    """An instance of a class, as data: its qualified name, constructor arguments, the items a dict
    or list subclass was filled with (SETITEMS, APPENDS: `items`, a dict or a list) and the state
    BUILD gave it. Nothing of the class is ever imported or called (docs/security.md)."""

    def __init__(self, qualname, args=None, state=None, placeholder=None):
        self.qualname, self.args, self.state = qualname, args or [], state or {}
        self.items = None                # a dict or list subclass's own items
        self.placeholder = placeholder   # the Placeholder that built it: a class on no allowlist

    def build(self, state, ctx):
        """BUILD (setstate): a dict of attributes (or Python's (dict, slots) pair) is merged into the
        state, copied and charged; any other state is kept as `__state__`."""
        if isinstance(state, tuple) and len(state) == 2 and all(s is None or isinstance(s, dict) for s in state):
            parts = [s for s in state if s]
        elif isinstance(state, dict):
            parts = [state]
        else:
            self.state["__state__"] = state
            return
        for part in parts:
            ctx.copying(len(part))
            self.state.update(part)   # (a dict's stored hashes: no key is hashed again)

    def mapping(self, ctx, opname) -> dict:
        """The items of a dict subclass (SETITEM, SETITEMS, or copyreg._reconstructor with base dict)."""
        if self.items is None:
            self.items = {}
        if not isinstance(self.items, dict):
            raise ctx.unsafe(f"{opname} on a {printable(self.qualname, 200)} that holds list items")
        return self.items

    def sequence(self, ctx, opname) -> list:
        """The items of a list subclass (APPEND, APPENDS, or copyreg._reconstructor with base list)."""
        if self.items is None:
            self.items = []
        if not isinstance(self.items, list):
            raise ctx.unsafe(f"{opname} on a {printable(self.qualname, 200)} that holds dict items")
        return self.items

    @property
    def unread(self) -> bool:
        """Built by a global of a module the format reads itself (`Allowlist.owned`): a tensor kind
        ckptconv does not read, never walked into nor written as a record."""
        return self.placeholder is not None and self.placeholder.owned


class StateDict(dict):
    """collections.OrderedDict as a plain dict; BUILD attributes (torch's `_metadata`) are kept aside."""

    attrs = None

    def build(self, state, ctx):
        if not isinstance(state, dict):
            raise ctx.bad("OrderedDict state is not a dict")
        self.attrs = state


def _ordered_dict(ctx, items=()):
    d = StateDict()
    ctx.copying(len(_items(ctx, items, "OrderedDict")))
    for kv in items:
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
    ctx.copying(len(text))
    return text.encode("latin1")


def _bytearray(ctx, data=b"", encoding=None):
    if isinstance(data, str):
        data = _encode(ctx, data, encoding or "")
    if not isinstance(data, (bytes, bytearray)):
        raise ctx.unsafe(f"builtins.bytearray of a {type(data).__name__}")
    ctx.copying(len(data))
    return bytearray(data)


def _set(ctx, items=()):
    return set(ctx.hashing(_items(ctx, items, "set")))


def _frozenset(ctx, items=()):
    return ctx.frozenset(_items(ctx, items, "frozenset"))


def _reconstructor(ctx, cls, base, state=None):
    """copyreg._reconstructor: protocol 0/1 spelling of `object.__new__(cls)`, inert classes only;
    with base `dict` or `list` (a subclass of one), the record holds a copy of `state` as its items."""
    if not isinstance(cls, (InertClass, Placeholder)):
        raise ctx.unsafe(f"copyreg._reconstructor of {getattr(cls, 'qualname', type(cls).__name__)}")
    kind = _BASES.get(base.qualname) if isinstance(base, Function) else None
    if kind is None and not (isinstance(base, Marker) and base.value is object):
        raise ctx.unsafe(f"copyreg._reconstructor of {cls.qualname} on the base "
                         f"{printable(getattr(base, 'qualname', type(base).__name__), 200)}")
    obj = cls.new((), {}, ctx)
    if kind is dict:
        if not isinstance(state, dict):
            raise ctx.bad(f"copyreg._reconstructor of the dict subclass {cls.qualname} with a {type(state).__name__}")
        ctx.copying(len(state))
        obj.mapping(ctx, "copyreg._reconstructor").update(state)
    elif kind is list:
        if not isinstance(state, list):
            raise ctx.bad(f"copyreg._reconstructor of the list subclass {cls.qualname} with a {type(state).__name__}")
        ctx.copying(len(state))
        obj.sequence(ctx, "copyreg._reconstructor").extend(state)
    return obj


_BASES = {"builtins.dict": dict, "builtins.list": list}   # the bases a record may be built on, beside object


class Placeholder(StandIn):
    """A global on no allowlist, as an inert class: instances are records naming it; never called.
    `owned`: in a module the format reads itself (its records refuse to be written)."""

    def __init__(self, qualname, unlisted, owned=False):
        self.qualname, self.unlisted, self.owned = qualname, unlisted, owned

    def call(self, args, ctx):
        return InertObject(self.qualname, _args(ctx, args, self.qualname), placeholder=self)

    def new(self, args, kwargs, ctx):
        return InertObject(self.qualname, _args(ctx, args, self.qualname), _kwargs(ctx, kwargs, self.qualname), self)


_NOTHING = object()


def _container(kind):
    """Python 2's `__builtin__.list`, `dict`, ... (and builtins' own) called on plain data: the same
    container, built here; nothing is called. Arguments must be plain containers or scalars."""
    def build(ctx, items=_NOTHING, *rest):
        if items is _NOTHING:
            return ctx.tuple([]) if kind is tuple else ctx.frozenset([]) if kind is frozenset else kind()
        if rest or isinstance(items, (StandIn, InertObject)):
            raise ctx.unsafe(f"builtins.{kind.__name__} of {type(items).__name__}")
        if kind in (list, tuple, set, frozenset, dict) and not isinstance(items, (list, tuple, set, frozenset, dict)):
            raise ctx.unsafe(f"builtins.{kind.__name__} of a {type(items).__name__}")
        if isinstance(items, (list, tuple, set, frozenset, dict, str, bytes)):
            ctx.copying(len(items))
        if kind is dict:
            return dict(zip(ctx.hashing(list(items)), items.values())) if isinstance(items, dict) else \
                _ordered_dict(ctx, items)
        if kind is tuple:
            return ctx.tuple(list(items))
        if kind is frozenset:
            return ctx.frozenset(_items(ctx, items, "frozenset"))
        if kind is set:
            return set(ctx.hashing(_items(ctx, items, "set")))
        if kind is list:
            return list(items)
        if not isinstance(items, (int, float, str, bytes, bool)):
            raise ctx.unsafe(f"builtins.{kind.__name__} of a {type(items).__name__}")
        if kind is bytes and not isinstance(items, (bytes, str)):
            raise ctx.unsafe(f"builtins.bytes of a {type(items).__name__}")
        return kind(items.encode("latin1") if kind is bytes and isinstance(items, str) else items)
    return build


def _defaultdict(ctx, factory=None, *rest):
    """collections.defaultdict(factory): a plain dict (its factory is never called)."""
    return {}


_PY2 = {"list": list, "dict": dict, "tuple": tuple, "set": set, "frozenset": frozenset, "int": int, "long": int,
        "float": float, "str": str, "unicode": str, "bytes": bytes, "bool": bool}


# Globals every format may meet in non-tensor state; each format adds its own on top.
BENIGN = {
    **{(b, n): Function(f"builtins.{kind.__name__}", _container(kind)) for n, kind in _PY2.items()
       for b in ("__builtin__", "builtins") if n not in ("long", "unicode") or b == "__builtin__"},
    ("collections", "defaultdict"): Function("collections.defaultdict", _defaultdict),
    ("typing", "Any"): Marker("typing.Any"),
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
    # In-memory files (torchtitan's older train state keeps its loss lists in one): their pickled state
    # is (contents, position, attributes), kept on an inert record as data; nothing of io runs.
    **{(m, n): InertClass(f"_io.{n}") for m in ("_io", "io") for n in ("BytesIO", "StringIO")},
}
