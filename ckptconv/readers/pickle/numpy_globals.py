"""Stand-ins for the numpy and ml_dtypes globals that pickled arrays use (torch extras, Grok-1 shards).

An array is rebuilt as a `NumpyArray`: a numpy view of the pickle's payload bytes, a view of the
mapped file when the payload is a large `Payload`. Object, string and void dtypes are refused.
"""
import re

import ml_dtypes
import numpy as np

from ... import dtypes
from ...errors import BadInput, brief
from ...limits import shape_problem
from ...tensor import ArraySource, MappedView, Strided, TensorSource
from .unpickler import Function, Marker, Payload, StandIn, as_buffer

_DTYPE_SPEC = re.compile(r"[<>|=]?(?:[fiu][1248]|b1|f2|\?)")
_ML_DTYPES = {name: np.dtype(getattr(ml_dtypes, name)) for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2")}


class NumpyDType:
    """A numpy dtype rebuilt from `numpy.dtype(spec, align, copy)` plus its BUILD state."""

    def __init__(self, dtype):
        self.dtype = dtype

    def build(self, state, ctx):
        if not isinstance(state, tuple) or len(state) < 2:
            raise ctx.bad("numpy dtype state is not a tuple")
        order = state[1]
        if len(state) >= 5 and (state[3] is not None or state[4] is not None):
            raise ctx.unsafe("structured numpy dtypes are not accepted")
        if order == ">":
            self.dtype = self.dtype.newbyteorder(">")
        elif order in ("<", "|", "="):
            self.dtype = self.dtype.newbyteorder("<") if self.dtype.itemsize > 1 else self.dtype
        else:
            raise ctx.bad(f"numpy dtype byte order {brief(order)}")

    def to_jsonable(self):
        return self.dtype.name


def _dtype(ctx, spec, align=False, copy=False):
    if isinstance(spec, Marker) and isinstance(spec.value, np.dtype):
        return NumpyDType(spec.value)
    if not isinstance(spec, str) or not _DTYPE_SPEC.fullmatch(spec):
        raise ctx.unsafe(f"numpy dtype {brief(spec)} is not a plain numeric dtype")
    dt = np.dtype(spec)
    try:
        dtypes.from_numpy(dt)
    except BadInput:
        raise ctx.unsafe(f"numpy dtype {brief(spec)} is not accepted") from None
    return NumpyDType(dt)


class NumpyArray:
    """An ndarray from a pickle. `payload` is set when its bytes are a view of the mapped file."""

    def __init__(self):
        self.array = None
        self.payload = None

    def build(self, state, ctx):
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise ctx.bad("ndarray state is not a 4- or 5-tuple")
        if len(state) == 5:
            state = state[1:]
        shape, dt, fortran, raw = state
        self._fill(ctx, raw, dt, shape, "F" if fortran else "C")

    def _fill(self, ctx, raw, dt, shape, order):
        if not isinstance(dt, NumpyDType):
            raise ctx.unsafe("ndarray with a dtype that is not a numpy dtype")
        if not isinstance(raw, (bytes, bytearray, Payload)):
            raise ctx.unsafe(f"ndarray data of type {type(raw).__name__} (object arrays are refused)")
        problem = shape_problem(shape, dt.dtype.itemsize) if isinstance(shape, tuple) else "shape is not a tuple"
        if problem:
            raise ctx.bad(f"ndarray {problem}")
        if order not in ("C", "F"):
            raise ctx.bad(f"ndarray order {brief(order)}")
        count = 1
        for n in shape:
            count *= n
        if count * dt.dtype.itemsize != len(raw):
            raise ctx.bad(f"ndarray of shape {shape} and dtype {dt.dtype.name} needs "
                          f"{count * dt.dtype.itemsize} bytes, the pickle holds {len(raw)}")
        self.array = np.frombuffer(as_buffer(raw), dtype=dt.dtype, count=count).reshape(shape, order=order)
        if isinstance(raw, Payload):
            self.payload = raw

    @property
    def fortran(self) -> bool:
        return self.array.ndim > 1 and not self.array.flags.c_contiguous


def _reconstruct(ctx, cls, shape, typecode):
    if not (isinstance(cls, Marker) and cls.value is np.ndarray):
        raise ctx.unsafe("numpy _reconstruct of a class other than numpy.ndarray")
    return NumpyArray()


def _frombuffer(ctx, buf, dt, shape, order="C"):
    arr = NumpyArray()
    arr._fill(ctx, buf, dt, tuple(shape), order)
    return arr


def _scalar(ctx, dt, raw=None):
    if not isinstance(dt, NumpyDType) or not isinstance(raw, (bytes, bytearray)) or len(raw) != dt.dtype.itemsize:
        raise ctx.unsafe("numpy scalar that is not a plain numeric value")
    value = np.frombuffer(raw, dtype=dt.dtype)[0]
    return float(value) if dt.dtype.kind == "V" or dt.dtype in _ML_DTYPES.values() else value.item()


# Modules whose globals build arrays and dtypes: read by ckptconv itself (unpickler.Allowlist.owned)
NUMPY_OWNED = ("numpy", "numpy.core.multiarray", "numpy._core.multiarray", "numpy.core.numeric", "numpy._core.numeric",
               "numpy.dtypes", "ml_dtypes")


def numpy_globals(numpy1=True, numpy2=True) -> dict:
    """The numpy/ml_dtypes allowlist entries, under the module spellings numpy 1.x and 2.x use."""
    out: dict[tuple, StandIn] = {
        ("numpy", "ndarray"): Marker("numpy.ndarray", np.ndarray),
        ("numpy", "dtype"): Function("numpy.dtype", _dtype),
    }
    cores = (["numpy.core"] if numpy1 else []) + (["numpy._core"] if numpy2 else [])
    for core in cores:
        out[(f"{core}.multiarray", "_reconstruct")] = Function(f"{core}.multiarray._reconstruct", _reconstruct)
        out[(f"{core}.multiarray", "scalar")] = Function(f"{core}.multiarray.scalar", _scalar)
        out[(f"{core}.numeric", "_frombuffer")] = Function(f"{core}.numeric._frombuffer", _frombuffer)
    for name, dt in _ML_DTYPES.items():
        out[("ml_dtypes", name)] = Marker(f"ml_dtypes.{name}", dt)
    return out


def numpy_source(name, arr: NumpyArray, mapped=None) -> TensorSource:
    """A source for a pickled ndarray: when its payload lies in the file `mapped` (a MappedFile or a
    storage RemoteFile), a MappedView of it (zero-copy, with a file span when it is row-major and
    little-endian; from an object store, a region fetches only the bytes it reaches); else the array."""
    a = arr.array
    if a is None:
        raise BadInput(f"tensor {name!r}: a numpy array whose pickle never set its state (no data)")
    dt = dtypes.from_numpy(a.dtype)
    if arr.payload is not None and mapped is not None:
        offset = arr.payload.offset
        if a.flags.c_contiguous and a.dtype.byteorder != ">":
            return MappedView(name, dt, a.shape, mapped, offset)
        stride = tuple(s // a.itemsize for s in a.strides)
        return MappedView(name, dt, a.shape, mapped, offset,
                          Strided(stride, a.dtype.byteorder == ">", (offset, len(arr.payload))))
    return ArraySource(name, dt, a.shape, lambda: a)
