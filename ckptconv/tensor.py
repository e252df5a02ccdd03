"""Lazy tensor sources (the checkpoint they make up: checkpoint.py).

A source knows its name, dtype and shape, and hands out any hyper-rectangle of its logical values
(`region`) without touching the rest: a view of a mapped file, a slice of another source, a
concatenation, a cast. Writers stream a source in bounded blocks (`iter_blocks`) or, when its bytes
are one contiguous range of a file (`file_span`), hash and copy that range without gathering it.
"""
import hashlib
import itertools
import math
from typing import NamedTuple

import numpy as np

from .dtypes import DType
from .errors import BadInput


def _full(shape):
    return tuple(slice(0, n) for n in shape)


def _normalize(index, shape):
    """Turn `index` into one (start, stop) pair per axis, each inside the shape."""
    index = tuple(index) + _full(shape[len(index):])
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError("regions take unit-step slices only")
        out.append(slice(start, max(start, stop)))
    return tuple(out)


class TensorSource:
    """Base class: subclasses implement `_region` and may implement `file_span` and `release`."""

    __slots__ = ()   # (subclasses without their own __slots__ still get a __dict__)

    name: str
    dtype: DType
    shape: tuple

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def region(self, index=()) -> np.ndarray:
        """Logical values of a hyper-rectangle (unit-step slices), little-endian, in `dtype`."""
        arr = self._region(_normalize(index, self.shape))
        if arr.dtype != self.dtype.numpy:
            arr = arr.astype(self.dtype.numpy)  # byte swap of a big-endian source
        return arr

    def _region(self, index) -> np.ndarray:
        raise NotImplementedError

    def file_span(self):
        """(MappedFile, offset) when the logical bytes are one contiguous little-endian file range."""
        return None

    def prefetch(self):
        """Have the disk start reading this source's bytes (one contiguous file range) before they
        are needed; a no-op for anything else."""
        span = self.file_span()
        if span is not None:
            span[0].will_need(span[1], self.nbytes)

    def release(self):
        """Advise away mapped pages this source touched (bounded RSS); a no-op by default."""

    def renamed(self, name: str) -> "TensorSource":
        return Renamed(self, name)

    def sliced(self, axis: int, start: int, stop: int) -> "TensorSource":
        return Slice(self, axis, start, stop)


class ArraySource(TensorSource):
    """A tensor backed by a numpy view (usually of a mapped file, possibly strided or big-endian).

    `span` is (MappedFile, offset, length): the bytes the view reaches into, so they can be released;
    `contiguous` says the view is exactly that range in row-major order.
    """

    def __init__(self, name, dtype: DType, shape, array_fn, span=None, contiguous=False):
        self.name, self.dtype, self.shape = name, dtype, tuple(int(n) for n in shape)
        self._array_fn = array_fn
        self._span = span
        self._contiguous = contiguous

    def array(self) -> np.ndarray:
        return self._array_fn()

    def _region(self, index):
        return self.array()[index]

    def file_span(self):
        if self._span is not None and self._contiguous:
            return self._span[0], self._span[1]
        return None

    def release(self):
        if self._span is not None:
            mapped, offset, length = self._span
            mapped.release(offset, length)


class Strided(NamedTuple):
    """How a MappedView that is not its own row-major little-endian bytes reads them: strides in
    elements, byte order, and the bytes it may reach (to release), when known."""

    stride: tuple
    big_endian: bool = False
    held: tuple | None = None   # (offset, length)


class MappedView(TensorSource):
    """A tensor at `start` in a mapped file: row-major (`strided` None) or as `strided` says, its
    array made only when read. A record of a few fields, no closure: a checkpoint of a million small
    tensors must not hold a million functions and views (nor a field per tensor that only strided
    ones use)."""

    __slots__ = ("name", "dtype", "shape", "mapped", "start", "strided")

    def __init__(self, name, dtype: DType, shape, mapped, start: int, strided: Strided | None = None):
        self.name, self.dtype, self.shape, self.mapped, self.start = name, dtype, tuple(shape), mapped, start
        self.strided = strided

    def array(self) -> np.ndarray:
        item, n = self.dtype.itemsize, math.prod(self.shape)
        if not n:
            return np.empty(self.shape, self.dtype.numpy)
        if self.mapped.remote:
            self.mapped.need(*self._reach())
        if self.strided is None:
            return np.frombuffer(self.mapped.view, dtype=self.dtype.numpy, count=n, offset=self.start).reshape(self.shape)
        stride, big_endian, _ = self.strided
        np_dtype = self.dtype.numpy.newbyteorder(">") if big_endian and item > 1 else self.dtype.numpy
        reach = (sum((k - 1) * s for k, s in zip(self.shape, stride)) + 1) * item
        flat = np.frombuffer(self.mapped.view, dtype=np.uint8, count=reach, offset=self.start)
        return np.lib.stride_tricks.as_strided(flat.view(np_dtype), self.shape, tuple(s * item for s in stride),
                                               writeable=False)

    def _reach(self, index=None) -> tuple:
        """(offset, length) of the bytes the tensor (or the region `index` of it, row-major) reaches."""
        item = self.dtype.itemsize
        if self.strided is not None:
            held = self.strided.held
            if held:
                return held
            reach = (sum((k - 1) * s for k, s in zip(self.shape, self.strided.stride)) + 1) * item
            return self.start, reach
        if index is None or any(s.stop <= s.start for s in index):
            return self.start, math.prod(self.shape) * item
        first = last = 0
        for s, n in zip(index, self.shape):   # row-major: the region lies between its first and last element
            first, last = first * n + s.start, last * n + s.stop - 1
        return self.start + first * item, (last - first + 1) * item

    def _region(self, index):
        if self.mapped.remote and self.strided is None:
            self.mapped.need(*self._reach(index))
            return self._unfetched_array()[index]
        return self.array()[index]

    def _unfetched_array(self) -> np.ndarray:
        return np.frombuffer(self.mapped.view, dtype=self.dtype.numpy, count=math.prod(self.shape),
                             offset=self.start).reshape(self.shape)

    def file_span(self):
        return (self.mapped, self.start) if self.strided is None else None

    def release(self):
        held = self.strided and self.strided.held
        offset, length = held if held else (self.start, self.nbytes)
        self.mapped.release(offset, length)


class Renamed(TensorSource):
    __slots__ = ("base", "name", "dtype", "shape")

    def __init__(self, base: TensorSource, name: str):
        self.base, self.name, self.dtype, self.shape = base, name, base.dtype, base.shape

    def _region(self, index):
        return self.base.region(index)

    def file_span(self):
        return self.base.file_span()

    def release(self):
        self.base.release()


class Slice(TensorSource):
    """Rows [start, stop) of `base` along `axis`; still lazy. Slotted: reshard holds one per tensor
    per rank until the run ends."""

    __slots__ = ("base", "axis", "start", "stop", "name", "dtype", "shape")

    def __init__(self, base: TensorSource, axis: int, start: int, stop: int, name=None):
        if not 0 <= start <= stop <= base.shape[axis]:
            raise ValueError(f"slice {start}:{stop} out of range for axis {axis} of {base.shape}")
        self.base, self.axis, self.start, self.stop = base, axis, start, stop
        self.name, self.dtype = name or base.name, base.dtype
        self.shape = base.shape[:axis] + (stop - start,) + base.shape[axis + 1:]

    def _region(self, index):
        s = index[self.axis]
        index = index[:self.axis] + (slice(s.start + self.start, s.stop + self.start),) + index[self.axis + 1:]
        return self.base.region(index)

    def file_span(self):
        span = self.base.file_span()
        if span is None or any(n != 1 for n in self.base.shape[:self.axis]):
            return None
        row = math.prod(self.base.shape[self.axis + 1:]) * self.dtype.itemsize
        return span[0], span[1] + self.start * row

    def release(self):
        self.base.release()


class Concat(TensorSource):
    """Several sources joined along `axis` (rank pieces, host slices, chunk rows)."""

    def __init__(self, name, parts, axis: int):
        first = parts[0]
        for p in parts:
            if p.dtype != first.dtype or p.shape[:axis] + p.shape[axis + 1:] != first.shape[:axis] + first.shape[axis + 1:]:
                raise BadInput(f"tensor {name!r}: parts {first.shape}/{first.dtype.code} and "
                               f"{p.shape}/{p.dtype.code} cannot be joined on axis {axis}")
        self.name, self.parts, self.axis, self.dtype = name, list(parts), axis, first.dtype
        self.shape = first.shape[:axis] + (sum(p.shape[axis] for p in parts),) + first.shape[axis + 1:]

    def _region(self, index):
        want = index[self.axis]
        pieces, at = [], 0
        for p in self.parts:
            lo, hi = max(want.start, at), min(want.stop, at + p.shape[self.axis])
            if lo < hi:
                sub = index[:self.axis] + (slice(lo - at, hi - at),) + index[self.axis + 1:]
                pieces.append(p.region(sub))
            at += p.shape[self.axis]
        if not pieces:  # an empty region
            return np.empty(tuple(s.stop - s.start for s in index), self.dtype.numpy)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=self.axis)

    def sliced(self, axis: int, start: int, stop: int) -> TensorSource:
        """A slice along the join axis that falls inside one part is a slice of that part (keeps its
        file span, so a tp 8 -> 4 reshard still copies contiguous ranges)."""
        if axis == self.axis:
            at = 0
            for p in self.parts:
                n = p.shape[axis]
                if at <= start and stop <= at + n:
                    return p.sliced(axis, start - at, stop - at).renamed(self.name)
                at += n
        return Slice(self, axis, start, stop)

    def release(self):
        for p in self.parts:
            p.release()


class Computed(TensorSource):
    """A tensor whose regions are computed from other sources (casts, dequantization, transposes)."""

    def __init__(self, name, dtype: DType, shape, compute, inputs=()):
        self.name, self.dtype, self.shape = name, dtype, tuple(shape)
        self._compute, self._inputs = compute, inputs

    def _region(self, index):
        return self._compute(index)

    def release(self):
        for s in self._inputs:
            s.release()


class Stacked(TensorSource):
    """Sources of one shape stacked on a new leading axis (per-expert weights as one [E, ...] tensor).
    A slice along a later axis is the stack of the parts' slices, so it keeps their file spans."""

    def __init__(self, name, parts):
        first = parts[0]
        for p in parts:
            if p.dtype != first.dtype or p.shape != first.shape:
                raise BadInput(f"tensor {name!r}: {first.name!r} is {first.shape}/{first.dtype.code} and "
                               f"{p.name!r} {p.shape}/{p.dtype.code}; they cannot be stacked")
        self.name, self.parts, self.dtype = name, list(parts), first.dtype
        self.shape = (len(parts),) + first.shape

    def _region(self, index):
        blocks = [self.parts[e].region(index[1:]) for e in range(index[0].start, index[0].stop)]
        if not blocks:
            return np.empty(tuple(s.stop - s.start for s in index), self.dtype.numpy)
        return np.stack(blocks)

    def sliced(self, axis: int, start: int, stop: int) -> TensorSource:
        if axis == 0:
            return Stacked(self.name, self.parts[start:stop]) if stop > start else Slice(self, axis, start, stop)
        return Stacked(self.name, [p.sliced(axis - 1, start, stop) for p in self.parts])

    def release(self):
        for p in self.parts:
            p.release()


def constant(name, dtype: DType, shape, value) -> TensorSource:
    """A tensor every element of which is `value` (an engine's scale buffers, 1.0)."""
    return Computed(name, dtype, shape, lambda index: np.full(tuple(s.stop - s.start for s in index), value,
                                                              dtype.numpy))


def zero_padded(src: TensorSource, axis: int, size: int) -> TensorSource:
    """`src` with zero rows appended along `axis` up to `size` (a vocabulary padded for its split)."""
    n = src.shape[axis]
    shape = src.shape[:axis] + (size,) + src.shape[axis + 1:]

    def compute(index):
        out = np.zeros(tuple(s.stop - s.start for s in index), src.dtype.numpy)
        start, stop = index[axis].start, min(index[axis].stop, n)
        if start < stop:  # the part of the region that lies inside the real tensor
            dest, real = [slice(None)] * len(index), list(index)
            dest[axis], real[axis] = slice(0, stop - start), slice(start, stop)
            out[tuple(dest)] = src.region(tuple(real))
        return out

    return Computed(src.name, src.dtype, shape, compute, (src,))


def cast(src: TensorSource, dtype: DType) -> TensorSource:
    """Cast a floating tensor (ml_dtypes rounds to nearest even), computed block by block."""
    if src.dtype == dtype:
        return src

    def compute(index):
        with np.errstate(over="ignore", invalid="ignore"):  # out of range becomes inf: the cast's meaning
            return src.region(index).astype(dtype.numpy)

    return Computed(src.name, dtype, src.shape, compute, (src,))


def fetch_ahead(tensors):
    """Name to the read-ahead window the object-store ranges these tensors will be copied from, in
    the order they will be (storage/files.py); local files are left to the kernel's read-ahead."""
    for t in tensors:
        span = t.file_span()
        if span is not None and span[0].remote:
            span[0].will_need(span[1], t.nbytes)


def iter_blocks(src: TensorSource, limit: int):
    """Yield C-contiguous arrays of at most ~`limit` bytes whose bytes, in order, are the tensor's."""
    shape, item = src.shape, src.dtype.itemsize
    if src.nbytes <= limit or not shape:
        yield np.ascontiguousarray(src.region())
        return
    # The first axis whose single index fits in the limit is the one we step along in blocks.
    axis = next(k for k in range(len(shape)) if math.prod(shape[k + 1:]) * item <= limit)
    inner = math.prod(shape[axis + 1:]) * item
    step = max(1, limit // max(inner, 1))
    for prefix in itertools.product(*(range(n) for n in shape[:axis])):
        head = tuple(slice(i, i + 1) for i in prefix)
        for a in range(0, shape[axis], step):
            yield np.ascontiguousarray(src.region(head + (slice(a, min(a + step, shape[axis])),)))


def sha256_of(src: TensorSource, limit: int = 16 << 20) -> str:
    """A tensor's logical SHA-256 in one bounded pass, its mapped pages advised away as it goes."""
    h = hashlib.sha256()
    for block in iter_blocks(src, limit):
        h.update(as_bytes(block))
        src.release()
    return h.hexdigest()


def as_bytes(block: np.ndarray) -> memoryview:
    """The raw bytes of a C-contiguous block (works for ml_dtypes too)."""
    return memoryview(block.reshape(-1).view(np.uint8))
