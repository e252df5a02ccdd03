"""Lazy tensor sources and the checkpoint they make up.

A source knows its name, dtype and shape, and hands out any hyper-rectangle of its logical values
(`region`) without touching the rest: a view of a mapped file, a slice of another source, a
concatenation, a cast. Writers stream a source in bounded blocks (`iter_blocks`) or, when its bytes
are one contiguous range of a file (`file_span`), hash and copy that range without gathering it.
"""
import hashlib
import itertools
import math
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .dtypes import DType
from .errors import BadInput, UsageError, encodable
from .io.output import Inputs
from .limits import shape_problem
from .storage import files as storage


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


@dataclass(kw_only=True)
class SourceFacts:
    """What a reader says about the source it read: the manifest's "source" (the commands add what
    the run did: the recipe, the selection), each fact typed, written out in one place (to_json)."""

    format: str
    path: str
    files: list | int | None = None    # the files read, relative to path (Grok-1: how many)
    state_dict: str | None = None      # the entry of a training checkpoint written ("none": everything)
    dropped: list = field(default_factory=list)        # {"name", "reason"}: state left out, and why
    placeholders: list = field(default_factory=list)   # {"global", "count"}: classes recorded as inert data
    skipped: list = field(default_factory=list)        # {"name", ...}: tensors --skip-unsupported left out
    modules: list = field(default_factory=list)        # {"name", "class", "entries"}: pickled nn.Modules read
                                                       # as their state_dict() (readers/torch_modules.py)
    unindexed: list = field(default_factory=list)      # .safetensors files beside an index that lists none
    damaged: list = field(default_factory=list)        # files cut short where only unread entries lie
                                                       # (readers/damage.py: {"file", "has", "needs", ...})
    layout: str | None = None          # a reader's layout of its format (Grok-1 "mixtral", Megatron "legacy")
    dequantize: str | None = None      # Grok-1 --dequantize
    to: str | None = None              # Megatron --to
    more: dict = field(default_factory=dict)   # the reader's own facts (tp, pp, tag, zero_stage, rules ...)

    _OPTIONAL = ("files", "state_dict", "layout", "dequantize", "to")
    _LISTS = ("dropped", "placeholders", "skipped", "unindexed", "modules", "damaged")

    def to_json(self) -> dict:
        """The facts as the manifest records them: a fact not established is not written."""
        out = {"format": self.format, "path": self.path}
        out.update({k: getattr(self, k) for k in self._OPTIONAL if getattr(self, k) is not None})
        out.update({k: getattr(self, k) for k in self._LISTS if getattr(self, k)})
        out.update(self.more)
        return out


@dataclass
class Part:
    """One part of a source made of others (a diffusers pipeline's component folder): its name (the
    folder's), its weights as the reader that recognises them reads them (`ckpt`; None: a part without
    weights, carried whole), the files carried from it ((name, path), checked by readers.carried) and
    those not carried ({"name", "reason"}), the stem and variant its weight files are named by (`stem`
    and `variant`: `diffusion_pytorch_model`, `fp16`), and what the source says of it (`facts`)."""

    name: str
    ckpt: "Checkpoint | None" = None
    files: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    stem: str | None = None
    variant: str | None = None
    facts: dict = field(default_factory=dict)


@dataclass
class Checkpoint:
    """What a reader returns: ordered tensors, JSON-able extras, what it found out about the source."""

    tensors: list
    extras: dict = field(default_factory=dict)
    source: SourceFacts = None
    model_files: list = field(default_factory=list)  # (relative name, path) carried into OUT unchanged
    mapped: list = field(default_factory=list)       # MappedFiles to check for changes during a run
    manifest: dict = field(default_factory=dict)     # extra top-level manifest entries (quantization)
    skipped_files: list = field(default_factory=list)  # model files not carried: {"name", "reason"}
    format: str | None = None                        # the reader's name (set by readers.open_checkpoint)
    config: dict | None = None                       # a model config the source describes (shapes JSON)
    recorded_rules: dict | None = None               # partition rules a reshard output records (mesh.json)
    also: list = field(default_factory=list)         # other formats the same directory holds, not read
    layout: object = None                            # readers/wrappers.Layout: a training checkpoint's parts
    made: dict = field(default_factory=dict)         # model files the reader makes from what the source says,
                                                     # name -> bytes (a Megatron checkpoint's config.json)
    unsupported: tuple | None = None                 # (what, hint) of the first tensor in source.skipped: what
                                                     # refuses the source unless --skip-unsupported (readers/__init__)
    parts: list = field(default_factory=list)        # Part: a source made of others (a diffusers pipeline's
                                                     # components); `tensors` then lists theirs as PART/NAME
    output: str | None = None                        # the output layout such a source is written as (its name)
    root: object = None                              # the path it was read from, with its storage backend
                                                     # (storage/files.locate; set by readers.open_checkpoint)

    def __post_init__(self):
        """Every reader's tensors meet the same rules before anything is planned or written: distinct
        names that UTF-8 can spell (a safetensors header is UTF-8 JSON) and shapes consumers can load."""
        if self.source is None:
            self.source = SourceFacts(format="", path="checkpoint")
        where = self.source.path
        seen = set()
        for t in self.tensors:
            if not isinstance(t.name, str) or not encodable(t.name):
                raise BadInput(f"{where}: tensor name {t.name!r} is not valid Unicode text")
            if t.name in seen:
                raise BadInput(f"{where}: two tensors are named {t.name!r}")
            if t.name == "__metadata__":
                raise BadInput(f"{where}: a tensor is named '__metadata__', which the safetensors format reserves")
            seen.add(t.name)
            problem = shape_problem(t.shape, t.dtype.itemsize)
            if problem:
                raise BadInput(f"{where}: tensor {t.name!r}: {problem}")

    def inputs(self, src) -> list:
        """Every path this checkpoint reads: SRC, its mapped files and the model files it (and each of
        its parts) carries."""
        return [src] + [m.path for m in self.mapped] + [p for _, p in self.model_files] \
            + [p for part in self.parts for _, p in part.files]

    def reads(self, src) -> Inputs:
        """What a run over this checkpoint must not write into: its files, and the directories a
        reader of SRC reads from (SRC itself if a directory; SRC's if SRC is a file read with other
        weight files, an index or a DCP `.metadata`; none for a file read alone, whatever model file
        beside it is carried: a later read of the file does not look at what else is there)."""
        files = self.inputs(src)
        if storage.is_dir(src):
            roots = (src,)
        else:
            alone = storage.realpath(src)
            weights = [src] + [m.path for m in self.mapped]
            roots = (storage.parent(alone),) if any(storage.realpath(p) != alone for p in weights) else ()
        return Inputs(tuple(files), roots)

    def out_files(self) -> tuple:
        """(the model files for OUT as layouts take them: (name, path) carried, (name, None) made; the
        bytes of those made, {name: bytes})."""
        return self.model_files + [(name, None) for name in self.made], dict(self.made)

    def whole(self, src, what: str) -> "Checkpoint":
        """This checkpoint, for `what` (reshard, plan --tp), which takes one: UsageError for a source made
        of parts, naming the parts to give instead."""
        if self.parts:
            names = [os.path.join(str(src), p.name) for p in self.parts if p.ckpt is not None]
            raise UsageError(f"{src}: {what} takes one checkpoint, not a {self.format} source of several; give one of "
                             f"its components ({', '.join(names[:6])})")
        return self

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def check_unchanged(self):
        """Refuse to publish if an input file changed while we read it: replaced, resized or touched
        (`MappedFile.unchanged`), or pages of it gone under a mapping (the SIGBUS guard read zeros
        there) — also for mapped files a reader did not list in `mapped`."""
        from .io.mapped import changed_files
        changed = [m.path for m in self.mapped if not m.unchanged()] or changed_files()
        if changed:
            raise BadInput(f"{changed[0]}: changed while it was being read; nothing was written")
