"""The DCP reader's checks of what `.metadata` says (readers/dcp.py reads with them): record types,
field types, shapes, storage entries, and that the chunks tile each tensor exactly (the coverage
grid); and the limits every loop, allocation and decompression of the reader is bounded by
(docs/dcp.md, "Limits"). Registers nothing: dcp.py is the reader.
"""
import bisect
import math

import numpy as np

from .. import dtypes
from ..errors import BadInput
from ..io.zstd import ZSTD_MAX_RATIO
from ..limits import MAX_NDIM, shape_problem
from ..tensor import TensorSource
from .pickle.unpickler import InertObject, Marker

ZSTD = "stream.zstd/1"

# --- Limits (docs/dcp.md, "Limits") ------------------------------------------------------------
# A zstd tensor chunk inflates to a torch.save archive of the chunk: its data (the chunk's declared
# sizes x itemsize: DCP clones a view before saving, so the storage is exactly the chunk) plus the
# archive around it - data.pkl, version records, a 40-byte serialization id, 64-byte alignment
# padding, local headers and the central directory: 1.5-1.6 KB as torch 2.13 writes it, a few KB
# for 32-dimensional chunks with 19-digit sizes. Inflating further than this is refused.
ARCHIVE_ALLOWANCE = 64 << 10
# BYTE_IO items declare no size. All zstd-compressed ones of a checkpoint together may inflate to
# this much (real ones are pickled step counters, param groups and RNG states: kilobytes).
ZSTD_BYTES_LIMIT = 256 << 20
# A chunk that declares more data than ZSTD_MAX_RATIO (io/zstd.py: the most a zstd stream can
# inflate per byte) times its stream is refused before anything is read or planned; the decoder's
# window is at most io/zstd.py's ZSTD_MAX_WINDOW.
_PIECE = 1 << 20                # decompressed bytes read and written at a time
MAPPED_INFLATED = 16            # inflated chunks kept mapped (more are re-mapped, never re-inflated)
# The chunk-coverage grid (cut points of all chunk boundaries, per axis) may have this many cells
# per chunk, or GRID_MIN_CELLS, whichever is more: a regular layout has exactly one cell per chunk.
GRID_CELLS_PER_CHUNK = 16
GRID_MIN_CELLS = 1 << 16


# --- Checking what .metadata says --------------------------------------------------------------

def _found(value) -> str:
    """A value read from the file, shortly, for a message."""
    if value is None:
        return "None"
    if type(value) is int:
        return str(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    return f"a {type(value).__name__}"


def _record(obj, kinds, what, where):
    """`obj` must be an inert record of one of the DCP classes `kinds`."""
    if not isinstance(obj, InertObject) or obj.qualname not in kinds:
        found = f"a {obj.qualname} record" if isinstance(obj, InertObject) else _found(obj)
        raise BadInput(f"{where}: {what} must be a {' or '.join(kinds)}, found {found}")
    return obj


def _field(obj, name, where, default=KeyError):
    """A dataclass field of an inert record, from its BUILD state (how dataclasses pickle)."""
    if not isinstance(obj, InertObject):
        raise BadInput(f"{where}: expected a DCP record, found {_found(obj)}")
    if name in obj.state:
        return obj.state[name]
    if default is KeyError:
        raise BadInput(f"{where}: {obj.qualname} has no field {name!r}")
    return default


def _count(value, what, where) -> int:
    if type(value) is not int or value < 0:
        raise BadInput(f"{where}: {what} must be a non-negative integer, found {_found(value)}")
    return value


def _dims(value, what, where, rank=None) -> tuple:
    """A list of sizes or offsets: a tuple/list (torch.Size) of at most MAX_NDIM ints >= 0."""
    if not isinstance(value, (tuple, list)):
        raise BadInput(f"{where}: {what} must be a list of non-negative integers, found {_found(value)}")
    if len(value) > MAX_NDIM:
        raise BadInput(f"{where}: {what} has {len(value)} entries, more than the {MAX_NDIM} dimensions "
                       "numpy and safetensors load")
    if rank is not None and len(value) != rank:
        raise BadInput(f"{where}: {what} has {len(value)} entries for a tensor of {rank} dimensions")
    for v in value:
        if type(v) is not int or v < 0:
            raise BadInput(f"{where}: {what} must be a list of non-negative integers, found {_found(v)} in it")
    return tuple(value)


def _dtype(props, where):
    """TensorProperties state: a dict with `dtype`, or the (dtype, layout, …) tuple of its __getstate__."""
    _record(props, ("TensorProperties",), "TensorStorageMetadata.properties", where)
    state = props.state.get("__state__")
    dt = state[0] if isinstance(state, tuple) and state else _field(props, "dtype", where)
    if not isinstance(dt, Marker):
        raise BadInput(f"{where}: TensorProperties.dtype must be a torch dtype, found {_found(dt)}")
    if not isinstance(dt.value, dtypes.DType):
        what = getattr(dt.value, "what", None) or dt.qualname
        raise BadInput(f"{where}: dtype {what} cannot be stored in safetensors")
    return dt.value


def _file_name(rel) -> bool:
    """A _StorageInfo.relative_path that names a file in the checkpoint's directory (no other)."""
    return isinstance(rel, str) and bool(rel) and not rel.startswith(".") and "/" not in rel and "\0" not in rel


class Loc:
    """Where an item's bytes are: a checked `_StorageInfo` (file name, offset, length, transform)."""

    def __init__(self, info, what, where):
        _record(info, ("_StorageInfo",), f"the storage entry of {what}", where)
        where = f"{where}: {what}"
        rel = _field(info, "relative_path", where)
        if not _file_name(rel):
            shown = repr(rel[:200]) if isinstance(rel, str) else _found(rel)
            raise BadInput(f"{where}: _StorageInfo.relative_path {shown} is not a file name in the checkpoint")
        self.rel, self.what = rel, what
        self.offset = _count(_field(info, "offset", where), "_StorageInfo.offset", where)
        self.length = _count(_field(info, "length", where), "_StorageInfo.length", where)
        transforms = _field(info, "transform_descriptors", where, None)
        if transforms is None:
            transforms = []
        if not isinstance(transforms, (list, tuple)) or not all(isinstance(t, str) for t in transforms):
            raise BadInput(f"{where}: _StorageInfo.transform_descriptors must be a list of strings, "
                           f"found {_found(transforms)}")
        if list(transforms) not in ([], [ZSTD]):
            raise BadInput(f"{where}: unsupported transform {[t[:100] for t in transforms[:4]]!r} (known: {ZSTD})")
        self.zstd = bool(transforms)
        self.blob = False      # a member of a SAFETENSORS blob (several chunks share its start)
        self.head = None       # its first 4 bytes, once read (dcp_chunks.DCPReader.mark_blob_members)
        self.extent = None     # (start, size) in the reader's temporary file, once inflated


class Chunk:
    """One saved chunk of a tensor: its place in the global tensor and where its bytes are."""

    def __init__(self, reader, fqn, dtype, offsets, sizes, loc: Loc):
        self.reader, self.fqn, self.dtype, self.offsets, self.sizes, self.loc = reader, fqn, dtype, offsets, sizes, loc
        self.numel = math.prod(sizes)
        self.nbytes = self.numel * dtype.itemsize
        self._source = None

    @property
    def transformed(self) -> bool:
        return self.loc.zstd

    def source(self) -> TensorSource:
        if self.transformed:
            return self.reader.inflated_source(self)  # a few kept mapped; never inflated twice
        if self._source is None:
            self._source = self.reader.chunk_source(self)
        return self._source

    def release(self):
        if self.transformed:
            self.reader.release_inflated(self)
        elif self._source is not None:
            self._source.release()


def _read_tensor(reader, fqn, item, where_by_key, where):
    """Check a TensorStorageMetadata: dtype, shape, every chunk's record, place and storage entry."""
    dt = _dtype(_field(item, "properties", where), f"{where}: tensor {fqn!r}")
    shape = _dims(_field(item, "size", where), f"tensor {fqn!r}: TensorStorageMetadata.size", where)
    problem = shape_problem(shape, dt.itemsize)
    if problem:
        raise BadInput(f"{where}: tensor {fqn!r}: {problem}")
    raw = _field(item, "chunks", where)
    if not isinstance(raw, (list, tuple)):
        raise BadInput(f"{where}: tensor {fqn!r}: TensorStorageMetadata.chunks must be a list, found {_found(raw)}")
    chunks = []
    for i, c in enumerate(raw):
        what = f"tensor {fqn!r}: chunk {i}"
        _record(c, ("ChunkStorageMetadata",), what, where)
        offsets = _dims(_field(c, "offsets", where), f"{what}: ChunkStorageMetadata.offsets", where, len(shape))
        sizes = _dims(_field(c, "sizes", where), f"{what}: ChunkStorageMetadata.sizes", where, len(shape))
        if any(o + n > s for o, n, s in zip(offsets, sizes, shape)):
            raise BadInput(f"{where}: tensor {fqn!r}: chunk at {list(offsets)} of size {list(sizes)} lies outside "
                           f"{list(shape)}")
        info = where_by_key.get((fqn, offsets))
        if info is None:
            raise BadInput(f"{where}: tensor {fqn!r}: no storage entry for the chunk at {list(offsets)}")
        chunk = Chunk(reader, fqn, dt, offsets, sizes, Loc(info, f"chunk of {fqn!r} at {list(offsets)}", where))
        if chunk.transformed and chunk.nbytes > ZSTD_MAX_RATIO * chunk.loc.length:
            raise BadInput(f"{where}: {chunk.loc.what} declares {chunk.nbytes} bytes, more than its zstd stream of "
                           f"{chunk.loc.length} bytes can inflate to")
        chunks.append(chunk)
    return dt, shape, chunks


class Grid:
    """Where each chunk lies: the cut points of all chunk boundaries along each axis split the tensor
    into cells, and `owner` holds, for each cell, the index of the one chunk that covers it."""

    def __init__(self, cuts, owner):
        self.cuts, self.owner = cuts, owner

    def overlapping(self, index) -> list:
        """Indices of the chunks that overlap the region `index` (non-empty unit slices)."""
        cells = []
        for cuts, s in zip(self.cuts, index):
            cells.append(slice(bisect.bisect_right(cuts, s.start) - 1, bisect.bisect_left(cuts, s.stop)))
        return np.unique(self.owner[tuple(cells)]).tolist()


def _check_coverage(fqn, shape, chunks, where):
    """Chunks must lie inside the tensor (checked as they are read), not overlap, and cover it exactly.
    Returns the Grid of the non-empty chunks, or None when the tensor has no elements.

    O(N log N + cells): the grid is bounded by a budget proportional to the number of chunks; each
    chunk marks its cells after checking that none is marked yet, so no cell is marked twice and the
    first overlap stops the walk."""
    if not math.prod(shape):
        return None  # every chunk lies inside it, so every chunk is empty
    live = [i for i, c in enumerate(chunks) if c.numel]
    if not live:
        raise BadInput(f"{where}: tensor {fqn!r}: chunks do not cover the tensor (gaps in {list(shape)})")
    cuts = []
    for k, n in enumerate(shape):
        points = {0, n}
        for i in live:
            points.add(chunks[i].offsets[k])
            points.add(chunks[i].offsets[k] + chunks[i].sizes[k])
        cuts.append(sorted(points))
    budget = max(GRID_MIN_CELLS, GRID_CELLS_PER_CHUNK * len(live))
    cells = 1
    for axis_cuts in cuts:
        cells *= len(axis_cuts) - 1
        if cells > budget:
            raise BadInput(f"{where}: tensor {fqn!r}: its {len(live)} chunks do not form a grid (their boundaries cut "
                           f"the tensor into more than {budget} cells); such a layout is not supported")
    position = [{v: j for j, v in enumerate(axis_cuts)} for axis_cuts in cuts]
    owner = np.full(tuple(len(axis_cuts) - 1 for axis_cuts in cuts), -1, np.int32 if len(chunks) < 2**31 else np.int64)
    for i in live:
        c = chunks[i]
        cell = tuple(slice(pos[o], pos[o + n]) for pos, o, n in zip(position, c.offsets, c.sizes))
        taken = owner[cell]
        if (taken >= 0).any():
            other = chunks[int(np.asarray(taken)[np.asarray(taken) >= 0].flat[0])]
            raise BadInput(f"{where}: tensor {fqn!r}: chunks at {list(other.offsets)} and {list(c.offsets)} overlap")
        owner[cell] = i
    if (owner < 0).any():
        raise BadInput(f"{where}: tensor {fqn!r}: chunks do not cover the tensor (gaps in {list(shape)})")
    return Grid(cuts, owner)


def _storage_index(storage, where) -> dict:
    """Metadata.storage_data: {MetadataIndex(fqn, offset): _StorageInfo} as {(fqn, offsets): info}."""
    out = {}
    for key, info in storage.items():
        _record(key, ("MetadataIndex",), "a key of Metadata.storage_data", where)
        fqn = _field(key, "fqn", where)
        if not isinstance(fqn, str):
            raise BadInput(f"{where}: MetadataIndex.fqn must be a string, found {_found(fqn)}")
        offset = _field(key, "offset", where, None)
        if offset is not None:
            offset = _dims(offset, f"MetadataIndex.offset of {fqn!r}", where)
        if (fqn, offset) in out:
            raise BadInput(f"{where}: two storage entries for {fqn!r}" + (f" at {list(offset)}" if offset else ""))
        out[(fqn, offset)] = info
    return out


def unread_places(storage, read) -> list:
    """(file, fqn, start, stop) of every storage entry whose item is not in `read` (the fqns read), as
    `_storage_index` gives them: what readers/damage.py sets against the files' sizes. Only records
    that name a file of the checkpoint with an offset and a length are taken (those items are never
    read: nothing else of them is checked, nor refused)."""
    out = []
    for (fqn, _), info in storage.items():
        if fqn in read or not isinstance(info, InertObject):
            continue
        rel, offset, length = (info.state.get(k) for k in ("relative_path", "offset", "length"))
        if _file_name(rel) and type(offset) is int and type(length) is int and offset >= 0 and length >= 0:
            out.append((rel, fqn, offset, offset + length))
    return out
