"""Stand-ins for the torch globals in torch.save pickles: storages, tensor rebuilds, dtypes, Size.

Shared by the torch zip reader, the legacy reader and DCP chunk files. A rebuilt tensor is a
`TorchTensor` record (storage, offset, size, stride); readers turn it into a lazy `MappedView`.
Storage bytes are located by the reader's `persistent_load`, which returns a `Storage`.
"""
import math
from dataclasses import dataclass


from ... import dtypes
from ...errors import BadInput, brief
from ...limits import MAX_DEPTH, Budget, shape_problem
from .numpy_globals import NUMPY_OWNED, NumpyArray, numpy_globals, numpy_source
from ...tensor import MappedView, Strided
from . import unpickler
from .unpickler import BENIGN, Function, Marker, StandIn


@dataclass
class Unsupported:
    """A torch dtype or tensor kind safetensors cannot store (complex, quantized, sparse)."""

    what: str
    itemsize: int = 1


@dataclass
class StorageType:
    """`torch.FloatStorage`-style classes (dtype known) or `torch.storage.UntypedStorage` (dtype None)."""

    dtype: object  # DType, Unsupported, or None for untyped


@dataclass(slots=True)
class Storage:
    """A storage's bytes in a mapped file: `offset`, `nbytes`; `dtype` as the storage type says."""

    key: str
    dtype: object
    mapped: object
    offset: int
    nbytes: int
    big_endian: bool = False


class TorchTensor(MappedView):
    """What `_rebuild_tensor_v2/_v3` builds: a strided view of a storage, validated against it, and
    kept as the view it describes (where in the mapped file, row-major or strided), without the
    storage: a million-tensor file does not hold a million storage records (each with its key) past
    its load. It is its own source under the first name it is flattened to."""

    __slots__ = ()   # (a million of them: a field here is 8 MB, and 16 where it crosses an allocation class)
    pending = None   # where its storage is not placed yet (an _Unplaced one): (storage, element offset)

    def __new__(cls, ctx, storage, *args, **kwargs):
        return super().__new__(_Unplaced if isinstance(storage, Storage) and storage.offset < 0 else cls)

    def __init__(self, ctx, storage, storage_offset, size, stride, dtype=None):
        if not isinstance(storage, Storage):
            raise ctx.unsafe("tensor rebuilt from something that is not a storage")
        dt = dtype if dtype is not None else storage.dtype
        if dt is None:
            raise ctx.bad(f"tensor over the untyped storage {storage.key!r} names no dtype")
        if not isinstance(dt, (dtypes.DType, Unsupported)):
            raise ctx.bad(f"tensor dtype {brief(dt)} is not a torch dtype")
        if not isinstance(size, (tuple, list)) or not isinstance(stride, (tuple, list)):
            raise ctx.bad("tensor size and stride must be sequences of integers")
        size, stride = tuple(size), tuple(stride)
        if not all(type(v) is int for v in size + stride + (storage_offset,)):
            raise ctx.bad("tensor size, stride and offset must be integers")
        problem = shape_problem(size, dt.itemsize)
        if problem or len(size) != len(stride) or any(v < 0 for v in stride) or storage_offset < 0:
            raise ctx.bad(problem and f"tensor {problem}" or
                          f"tensor size {size} / stride {stride} / offset {storage_offset} are invalid")
        if isinstance(dt, dtypes.DType) and math.prod(size):
            last = storage_offset + sum((n - 1) * s for n, s in zip(size, stride))
            if (last + 1) * dt.itemsize > storage.nbytes:
                raise ctx.bad(f"tensor of size {size}, stride {stride}, offset {storage_offset} reaches element "
                              f"{last}, beyond its storage {storage.key!r} of {storage.nbytes} bytes")
        size = ctx.shapes.setdefault(size, size)   # (a million-tensor optimizer state has a few hundred shapes)
        placed = storage.offset >= 0
        start = storage.offset + storage_offset * dt.itemsize if placed else -1
        strided = None if not storage.big_endian and _is_row_major(size, stride) else \
            Strided(stride, storage.big_endian, (storage.offset, storage.nbytes) if placed else None)
        super().__init__(None, dt, size, storage.mapped, start, strided)
        if not placed:
            self.pending = (storage, storage_offset)

    @property
    def unsupported(self):
        return self.dtype.what if isinstance(self.dtype, Unsupported) else None

    def source(self, name) -> MappedView:
        """The tensor under `name`: this record the first time, a copy under a second name (one
        tensor saved under two keys, tied weights)."""
        if self.pending is not None:   # its storage is placed by now (the whole file was read)
            storage, offset = self.pending
            self.start, self.pending = storage.offset + offset * self.dtype.itemsize, None
            if self.strided is not None:
                self.strided = self.strided._replace(held=(storage.offset, storage.nbytes))
        if self.name is None:
            self.name = name
            return self
        return MappedView(name, self.dtype, self.shape, self.mapped, self.start, self.strided)


class _Unplaced(TorchTensor):
    """A tensor over a storage that a legacy file places after its pickle: where it starts is known
    once the whole file is read (`source`)."""

    __slots__ = ("pending",)


def _is_row_major(size, stride) -> bool:
    expect = 1
    for n, s in zip(reversed(size), reversed(stride)):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def _rebuild_v2(ctx, storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    return TorchTensor(ctx, storage, storage_offset, size, stride)


def _rebuild_v3(ctx, storage, storage_offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    if not isinstance(dtype, Marker) or not isinstance(dtype.value, (dtypes.DType, Unsupported)):
        raise ctx.unsafe(f"_rebuild_tensor_v3 with {getattr(dtype, 'qualname', brief(dtype))}, which is not a "
                         "torch dtype")
    return TorchTensor(ctx, storage, storage_offset, size, stride, dtype.value)


def _rebuild_parameter(ctx, data, requires_grad=False, hooks=None, state=None):
    return data


def _rebuild_from_type_v2(ctx, func, new_type, args, state=None):
    if not isinstance(func, Function) or not isinstance(new_type, Marker):
        raise ctx.unsafe("_rebuild_from_type_v2 with a function or type outside the allowlist")
    return func.call(tuple(args), ctx)


def _unsupported(kind):
    def rebuild(ctx, *args):
        return TorchTensorUnsupported(kind)
    return rebuild


@dataclass
class TorchTensorUnsupported:
    kind: str

    @property
    def unsupported(self):
        return self.kind


class _StrClass(StandIn):
    """A str subclass (TorchVersion): instances are the string itself."""

    def __init__(self, qualname):
        self.qualname = qualname

    def new(self, args, kwargs, ctx):
        if len(args) != 1 or not isinstance(args[0], str):
            raise ctx.bad(f"{self.qualname} of something other than one string")
        return args[0]

    call = lambda self, args, ctx: self.new(args, None, ctx)  # noqa: E731


def _as_str(ctx, *args):
    """torch.device("cuda", 0) and layouts: a short text. Only strings and small ints are taken
    (str() of anything else could be a huge or self-sharing structure)."""
    if len(args) > 2 or not all(a is None or isinstance(a, str) or (type(a) is int and abs(a) < 2**31)
                                for a in args):
        raise ctx.bad(f"torch.device/layout of {brief(args)}")
    return ":".join(str(a)[:256] for a in args if a is not None)


def _size(ctx, dims=()):
    if not isinstance(dims, (tuple, list)):
        raise ctx.bad(f"torch.Size of a {type(dims).__name__}")
    return ctx.tuple(dims)


# Modules whose globals build tensors, storages and their dtypes: read by ckptconv itself, so a user's
# --allow-global never makes one of them a record (unpickler.Allowlist.owned)
TORCH_OWNED = ("torch", "torch._utils", "torch._tensor", "torch.storage", "torch.nn.parameter", "torch.serialization",
               *NUMPY_OWNED)


def torch_globals() -> dict:
    """The allowlist for torch.save pickles (zip and legacy) and DCP chunk pickles."""
    out = dict(BENIGN)
    out.update(numpy_globals())
    for dt in dtypes.DTYPES:
        out[("torch", dt.torch)] = Marker(f"torch.{dt.torch}", dt)
        if dt.storage:
            out[("torch", dt.storage)] = Marker(f"torch.{dt.storage}", StorageType(dt))
    for name in dtypes.TORCH_UNSUPPORTED:
        out[("torch", name)] = Marker(f"torch.{name}", Unsupported(name))
    for name, (what, itemsize) in dtypes.TORCH_UNSUPPORTED_STORAGES.items():
        out[("torch", name)] = Marker(f"torch.{name}", StorageType(Unsupported(what, itemsize)))
    out[("torch.storage", "UntypedStorage")] = Marker("torch.storage.UntypedStorage", StorageType(None))
    out[("torch", "UntypedStorage")] = Marker("torch.UntypedStorage", StorageType(None))
    for module, name, fn in [
        ("torch._utils", "_rebuild_tensor", lambda ctx, st, off, size, stride: TorchTensor(ctx, st, off, size, stride)),
        ("torch._utils", "_rebuild_tensor_v2", _rebuild_v2),
        ("torch._utils", "_rebuild_tensor_v3", _rebuild_v3),
        ("torch._utils", "_rebuild_parameter", _rebuild_parameter),
        ("torch._utils", "_rebuild_parameter_with_state", _rebuild_parameter),
        ("torch._tensor", "_rebuild_from_type_v2", _rebuild_from_type_v2),
        ("torch._utils", "_rebuild_qtensor", _unsupported("quantized")),
        ("torch._utils", "_rebuild_sparse_tensor", _unsupported("sparse")),
        ("torch._utils", "_rebuild_nested_tensor", _unsupported("nested")),
        ("torch", "Size", _size),
        ("torch", "device", _as_str),
        ("torch.serialization", "_get_layout", _as_str),
    ]:
        out[(module, name)] = Function(f"{module}.{name}", fn)
    out[("torch.torch_version", "TorchVersion")] = _StrClass("torch.torch_version.TorchVersion")
    out[("torch.nn.parameter", "Parameter")] = Marker("torch.nn.parameter.Parameter")
    out[("torch", "Tensor")] = Marker("torch.Tensor")
    for layout in ("strided", "sparse_coo", "sparse_csr"):
        out[("torch", layout)] = Marker(f"torch.{layout}", f"torch.{layout}")
    return out


def storage_dtype(storage_type, ctx):
    """The dtype a persistent id's storage type names: DType, Unsupported, or None (untyped)."""
    if not isinstance(storage_type, Marker) or not isinstance(storage_type.value, StorageType):
        raise ctx.unsafe("persistent id with a storage type outside the allowlist")
    return storage_type.value.dtype


def flatten(obj, path, prefix="", budget: Budget = None):
    """Flatten nested containers with `.` (docs/output.md#names): tensors become sources, the rest extras.
    Returns (tensors, extras, skipped): skipped are the tensors safetensors cannot store, {"name",
    "reason"} (whether they refuse the source is `readers.open_checkpoint`'s to decide). A container reached a second time (shared, or a cycle) is
    walked again only if it holds tensors (each needs its name); otherwise it is recorded as a Ref to
    its first name. A record (an instance of a class, as data: unpickler.InertObject) that holds
    tensors is walked as a dict of its parts (`unpickler.record_parts`; its class under `NAME.__class__`),
    so a dict subclass of tensors loses none; one that holds none is one extras
    value. Every step is charged to `budget` (the pickle's), so shared structure cannot expand beyond
    what the file's size justifies."""
    walker = _Flattener(path, budget or Budget(path))
    walker.walk(obj, prefix, 0)
    return walker.tensors, walker.extras, walker.skipped


class _Flattener:
    """flatten's walk: what it found so far, and what it has seen (see flatten)."""

    def __init__(self, path, budget: Budget):
        self.path, self.budget = path, budget
        self.tensors, self.extras, self.skipped = {}, {}, []
        self.seen = {}   # id -> [container, first name, holds tensors (None while being walked), depth]
        self.aside = []  # [depth, reaches out] of each record being walked aside, innermost last

    def leaf(self, value, name) -> bool:
        path = self.path
        if isinstance(value, (TorchTensor, TorchTensorUnsupported)) and value.unsupported:
            self.skipped.append({"name": name, "reason": value.unsupported})   # (readers/__init__ refuses them)
        elif isinstance(value, TorchTensor):
            _add(self.tensors, path, name, value.source(name))
        elif isinstance(value, NumpyArray):
            if value.array is None:
                raise BadInput(f"{path}: tensor {name!r} is a numpy array whose pickle never set its state")
            _add(self.tensors, path, name, numpy_source(name, value))
        else:
            if name in self.extras or name in self.tensors:
                raise BadInput(f"{path}: two entries flatten to the name {name!r}")
            self.extras[name] = value
            return False
        return True

    def walk(self, value, name, depth) -> bool:
        """Whether `value`, under `name`, holds a tensor; its tensors and extras added."""
        self.budget.spend(1 + (len(value) if isinstance(value, (dict, list, tuple)) else 0), "its non-tensor state")
        record = isinstance(value, unpickler.InertObject) and not value.unread
        if not (record or isinstance(value, dict) or (isinstance(value, (list, tuple)) and any(
                _is_tensorlike(v) or isinstance(v, (dict, list, tuple, unpickler.InertObject)) for v in value))):
            return self.leaf(value, name or "tensor")
        if depth >= MAX_DEPTH:
            raise BadInput(f"{self.path}: containers nested more than {MAX_DEPTH} deep")
        entry = self.seen.get(id(value))
        if entry is not None and not entry[2]:
            return self._again(entry, name)
        if entry is None:
            self.seen[id(value)] = entry = [value, name, None, depth]
        if record:
            found = self._record(value, name, depth)
        else:
            found = self._items(value.items() if isinstance(value, dict) else enumerate(value), name, depth)
        entry[2] = entry[2] or found
        return found

    def _again(self, entry, name) -> bool:
        """A container reached a second time that holds no tensor: a Ref to its first name."""
        if entry[2] is None:   # a container being walked: records inside it reach out of themselves
            for a in reversed(self.aside):
                if a[0] <= entry[3]:
                    break
                a[1] = True
        return self.leaf(unpickler.Ref(entry[1]), name or "tensor")

    def _items(self, items, name, depth) -> bool:
        found = False
        for k, v in items:
            k = unpickler.key_text(k)
            self.budget.spend(len(name) + len(k), "naming its tensors")   # (a long key shared many times is paid each time)
            found = self.walk(v, f"{name}.{k}" if name else k, depth + 1) or found
        return found

    def _record(self, value, name, depth) -> bool:
        """A record, walked aside: kept as one value if it holds no tensor and reaches nothing outside
        it (written whole, it would write again what lies outside it), else as its parts."""
        outer, self.extras = self.extras, {}
        self.aside.append([depth, False])
        found = self._items(unpickler.record_parts(value), name, depth)
        inner, self.extras = self.extras, outer
        reaches_out = self.aside.pop()[1]
        if found or reaches_out:
            for key, v in [(f"{name}.__class__" if name else "__class__", value.qualname), *inner.items()]:
                self.leaf(v, key)
        else:
            self.leaf(value, name or "tensor")
        return found


def _is_tensorlike(v):
    return isinstance(v, (TorchTensor, TorchTensorUnsupported, NumpyArray))


def _add(tensors, path, name, source):
    if name in tensors:
        raise BadInput(f"{path}: two tensors flatten to the name {name!r}")
    tensors[name] = source
