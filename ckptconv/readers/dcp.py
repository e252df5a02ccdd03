"""Reader for PyTorch Distributed Checkpoints (`.metadata` + `__R_N.distcp`), without torch.

`.metadata` is a pickled `Metadata` dataclass; it runs through the allowlisting unpickler with
inert stand-ins for DCP's classes. For each fully qualified name it gives the global shape, dtype and
chunks (offsets, sizes), and for each chunk where its bytes are: a torch.save zip at (offset, length)
of a .distcp file (read with the torch reader, strides kept), a tensor in the safetensors blob of the
SAFETENSORS variant, possibly behind a `stream.zstd/1` transform. Every tensor is one lazy source of
its global shape whose regions are filled from the chunks that overlap them (docs/dcp.md); BYTE_IO
items become extras. Items outside `--only` are never read.

Everything `.metadata` says is checked before it is used (record types, field types, shapes, that the
chunks tile each tensor exactly, that items' byte ranges lie in their files and do not share bytes),
and every loop, allocation and decompression is bounded by bytes that are present or by sizes they
justify: see the limits below and docs/dcp.md.
"""
import bisect
import hashlib
import itertools
import math
import mmap
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np

from .base import Reader, register
from .. import dtypes, safejson
from .pickle import unpickler
from ..errors import BadInput, OutputError, UnsafePickle, UsageError
from ..limits import MAX_NDIM, Budget, shape_problem
from ..io.mapped import MappedFile, MemoryFile
from ..io.outfile import pwrite_all
from ..formats.safetensors import parse_header
from ..tensor import Checkpoint, SourceFacts, Concat, TensorSource
from .pickle.torch_globals import TORCH_OWNED, TorchTensor, flatten, torch_globals
from .pickle.unpickler import Function, InertClass, InertObject, Marker
from . import ReadOptions, confined, model_files, source_root, wanted
from .safetensors import file_tensors
from .torch_pickle import load_zip

NAME = "dcp"

_DCP_CLASSES = ["Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                "MetadataIndex", "TensorProperties", "StorageMeta"]
_MODULES = ["torch.distributed.checkpoint.metadata", "torch.distributed._shard.checkpoint.metadata"]
_PLANNER = "torch.distributed.checkpoint.planner"
ZSTD = "stream.zstd/1"
_ZIP = b"PK\x03\x04"

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
# The most a zstd stream can inflate per byte: one 4-byte RLE block (3-byte header, 1 byte) per
# 128 KiB block of output. A chunk that declares more data than this times its stream is refused
# before anything is read or planned.
ZSTD_MAX_RATIO = 32768
# The decoder's window, which a frame header chooses: libzstd's own default limit, made explicit.
ZSTD_MAX_WINDOW = 1 << 27
_PIECE = 1 << 20                # decompressed bytes read and written at a time
MAPPED_INFLATED = 16            # inflated chunks kept mapped (more are re-mapped, never re-inflated)
# The chunk-coverage grid (cut points of all chunk boundaries, per axis) may have this many cells
# per chunk, or GRID_MIN_CELLS, whichever is more: a regular layout has exactly one cell per chunk.
GRID_CELLS_PER_CHUNK = 16
GRID_MIN_CELLS = 1 << 16


def _posix_path(ctx, *parts):
    return "/".join(str(p) for p in parts)


def _enum(qualname):
    return Function(qualname, lambda ctx, value: f"{qualname}({value})")


def allowlist(extra=(), base=None) -> dict:
    """DCP's metadata classes (current and older module paths) as inert records, plus torch's (or
    `base`: a format's allowlist that extends torch's)."""
    allow = dict(base) if base is not None else torch_globals()
    for module in _MODULES:
        for cls in _DCP_CLASSES:
            allow[(module, cls)] = InertClass(cls)
        allow[(module, "_MEM_FORMAT_ENCODING")] = _enum("_MEM_FORMAT_ENCODING")
    for module in ("torch.distributed._shard.sharded_tensor.metadata",):
        allow[(module, "TensorProperties")] = InertClass("TensorProperties")
        allow[(module, "MEM_FORMAT_ENCODING")] = _enum("MEM_FORMAT_ENCODING")
    for module in ("torch.distributed.checkpoint.filesystem", "torch.distributed._shard.checkpoint.filesystem"):
        allow[(module, "_StorageInfo")] = InertClass("_StorageInfo")
    # the save plans a planner may keep in Metadata.planner_data (Megatron-Core's does, to save the same
    # structure again faster): records, never used here
    for cls in ("SavePlan", "WriteItem", "TensorWriteData"):
        allow[(_PLANNER, cls)] = InertClass(cls)
    allow[(_PLANNER, "WriteItemType")] = _enum("WriteItemType")
    allow[("pathlib", "PosixPath")] = Function("pathlib.PosixPath", _posix_path)
    allow[("pathlib", "WindowsPath")] = Function("pathlib.WindowsPath", _posix_path)
    return unpickler.allowing(allow, extra, (*TORCH_OWNED, *_MODULES, "torch.distributed._shard.sharded_tensor.metadata",
                                             "torch.distributed.checkpoint.filesystem",
                                             "torch.distributed._shard.checkpoint.filesystem", _PLANNER))


def detect(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


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


class Loc:
    """Where an item's bytes are: a checked `_StorageInfo` (file name, offset, length, transform)."""

    def __init__(self, info, what, where):
        _record(info, ("_StorageInfo",), f"the storage entry of {what}", where)
        where = f"{where}: {what}"
        rel = _field(info, "relative_path", where)
        if not isinstance(rel, str) or not rel or rel.startswith(".") or "/" in rel or "\0" in rel:
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


# --- Reading the bytes --------------------------------------------------------------------------

class _Inflated(MemoryFile):
    """A decompressed item: a read-only mapping of its extent of the reader's unlinked temporary
    file. Pages are the kernel's page cache (clean, file-backed); `release` drops them from our RSS."""

    def __init__(self, mm, path):
        super().__init__(mm, path)
        self._mm = mm

    def release(self, offset: int, length: int):
        start = offset - offset % mmap.PAGESIZE
        end = min(self.size, offset + length)
        if end > start:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)


class DCPReader:
    def __init__(self, path: Path, allow):
        self.path, self.allow, self.root = path, allow, source_root(path)
        self.files = {}
        self._blobs = {}                 # (file, offset) -> ({name: source}, DCP_SHARDING_INFO)
        self._members = {}               # (file, blob offset, name) -> offsets of the chunk it backs
        self._inflated = OrderedDict()   # id(chunk) -> source over its inflated bytes, most recent last
        self._spill = None               # the unlinked temporary file inflated items go to
        self._spill_end = 0
        self._bytes_left = ZSTD_BYTES_LIMIT

    def file(self, rel) -> MappedFile:
        if rel not in self.files:
            p = self.path / rel
            if not p.is_file():
                raise BadInput(f"{p}: .distcp file named by .metadata is missing")
            self.files[rel] = MappedFile(confined(p, self.root))
        return self.files[rel]

    def claim(self, bytes_locs, chunk_locs):
        """Every item's range must lie inside its file, and items must not share bytes: each one is
        parsed or inflated on its own, so shared bytes would multiply the work the file can cause.
        Untransformed chunks without a zip at their offset are members of a SAFETENSORS blob, which
        they all point at and which is parsed once: they are exempt."""
        by_file = {}
        for loc in itertools.chain(bytes_locs, chunk_locs):
            m = self.file(loc.rel)
            m.check(loc.offset, loc.length, loc.what)
            if loc.length and not loc.blob:
                by_file.setdefault(loc.rel, []).append(loc)
        for rel, group in by_file.items():
            group.sort(key=lambda loc: (loc.offset, loc.length))
            for a, b in zip(group, group[1:]):
                if b.offset < a.offset + a.length:
                    raise BadInput(f"{self.files[rel].path}: {a.what} and {b.what} share bytes "
                                   f"{b.offset}..{min(a.offset + a.length, b.offset + b.length)}; every item's "
                                   "bytes must be its own")

    def mark_blob_members(self, chunk_locs):
        for loc in chunk_locs:
            if not loc.zstd:
                m = self.file(loc.rel)
                m.check(loc.offset, loc.length, loc.what)
                loc.blob = bytes(m.view[loc.offset:loc.offset + 4]) != _ZIP

    # -- zstd

    def _spill_file(self):
        if self._spill is None:
            try:
                self._spill = tempfile.TemporaryFile(prefix="ckptconv-dcp-")
            except OSError as e:
                raise OutputError(f"{tempfile.gettempdir()}: cannot create a temporary file for inflated zstd "
                                  f"chunks: {e.strerror} (set TMPDIR)") from None
        return self._spill

    def inflate(self, loc: Loc, limit: int, too_big) -> MemoryFile:
        """The decompressed bytes of a zstd item: streamed into the temporary file (at most `limit`
        bytes; `too_big(limit)` is the error past it, found after reading limit + 1), then mapped.
        An item is inflated once; later calls map its extent again."""
        if loc.extent is None:
            loc.extent = self._inflate(loc, limit, too_big)
        start, size = loc.extent
        path = f"{self.file(loc.rel).path}[{loc.what}, inflated]"
        if not size:
            return MemoryFile(b"", path)
        try:
            mm = mmap.mmap(self._spill.fileno(), size, access=mmap.ACCESS_READ, offset=start)
        except OSError as e:
            raise OutputError(f"{path}: cannot map the inflated bytes: {e.strerror}") from None
        return _Inflated(mm, path)

    def _inflate(self, loc, limit, too_big):
        m = self.file(loc.rel)
        try:
            import zstandard
        except ImportError:
            raise UsageError(f"{m.path}: {loc.what} is zstd-compressed; install zstandard: "
                             "pip install 'ckptconv[zstd]'") from None
        spill = self._spill_file()
        start = -(-self._spill_end // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY
        size = 0
        dctx = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
        try:
            with dctx.stream_reader(m.view[loc.offset:loc.offset + loc.length], closefd=False) as stream:
                while True:
                    piece = stream.read(min(_PIECE, limit + 1 - size))
                    if not piece:
                        break
                    if size + len(piece) > limit:
                        raise too_big(limit)
                    pwrite_all(spill.fileno(), memoryview(piece), start + size)
                    size += len(piece)
        except zstandard.ZstdError as e:
            raise BadInput(f"{m.path}: {loc.what}: corrupt or unsupported zstd stream: {e}") from None
        except OSError as e:
            raise OutputError(f"{tempfile.gettempdir()}: cannot write inflated zstd data of {loc.what} to a "
                              f"temporary file: {e.strerror} (set TMPDIR to a larger disk)") from None
        self._spill_end = start + size
        return start, size

    def inflated_source(self, chunk: Chunk) -> TensorSource:
        """The source of a zstd chunk: inflated on first use (to at most its declared bytes plus the
        archive allowance), kept mapped while among the MAPPED_INFLATED most recently used."""
        key = id(chunk)
        src = self._inflated.get(key)
        if src is None:
            def too_big(limit):
                return BadInput(f"{self.file(chunk.loc.rel).path}: {chunk.loc.what}: zstd stream inflates beyond its "
                                f"declared {chunk.nbytes} bytes (+{ARCHIVE_ALLOWANCE} for the torch.save archive "
                                "around them)")
            m = self.inflate(chunk.loc, chunk.nbytes + ARCHIVE_ALLOWANCE, too_big)
            src = self._parse_chunk(chunk, m, 0, m.size, cache_blob=False)
            self._inflated[key] = src
            while len(self._inflated) > MAPPED_INFLATED:
                self._inflated.popitem(last=False)[1].release()
        self._inflated.move_to_end(key)
        return src

    def release_inflated(self, chunk: Chunk):
        src = self._inflated.get(id(chunk))
        if src is not None:
            src.release()

    def item_bytes(self, loc: Loc):
        """(mapped, offset, length) of a bytes item, inflated into the temporary file if it is zstd."""
        m = self.file(loc.rel)
        if not loc.zstd:
            return m, loc.offset, loc.length

        def too_big(limit):
            return BadInput(f"{m.path}: {loc.what}: zstd stream inflates beyond what zstd bytes items may take in all "
                            f"({ZSTD_BYTES_LIMIT} bytes, {limit} of them left)")
        inflated = self.inflate(loc, self._bytes_left, too_big)
        self._bytes_left -= inflated.size
        return inflated, 0, inflated.size

    # -- chunks

    def chunk_source(self, chunk: Chunk) -> TensorSource:
        return self._parse_chunk(chunk, self.file(chunk.loc.rel), chunk.loc.offset, chunk.loc.length, cache_blob=True)

    def _parse_chunk(self, chunk, m, offset, length, cache_blob):
        what = chunk.loc.what
        try:
            src = self._chunk(chunk, m, offset, length, cache_blob)
        except BadInput as e:
            if what in str(e):
                raise
            raise BadInput(f"{m.path}: {what} (bytes {offset}..{offset + length}): "
                           f"{str(e).removeprefix(m.path + ': ')}") from None
        if src.shape != chunk.sizes:
            raise BadInput(f"{m.path}: {what} holds shape {list(src.shape)}, .metadata says {list(chunk.sizes)}")
        if src.dtype != chunk.dtype:
            raise BadInput(f"{self.path / '.metadata'}: tensor {chunk.fqn!r}: chunk holds {src.dtype.code}, "
                           f".metadata says {chunk.dtype.code}")
        return src

    def _chunk(self, chunk, m, offset, length, cache_blob):
        if bytes(m.view[offset:offset + 4]) == _ZIP:
            obj = load_zip(m, self.allow, offset, length)
            if not isinstance(obj, TorchTensor):
                raise BadInput(f"{m.path}: chunk of {chunk.fqn!r} at offset {offset} is not a tensor")
            src = obj.source(chunk.fqn) if not obj.unsupported else None
            if src is None:
                raise BadInput(f"{m.path}: chunk of {chunk.fqn!r} has dtype {obj.unsupported}")
            return src
        sources, info = self._blob(m, offset) if cache_blob else self._parse_blob(m, offset)
        src = sources.get(chunk.fqn)
        mine = info.get(chunk.fqn, {})
        if not isinstance(mine, dict):
            raise BadInput(f"{m.path}: DCP_SHARDING_INFO of {chunk.fqn!r} in the safetensors blob at offset {offset} "
                           "is not an object")
        saved = mine.get("saved_offsets")
        if src is None or (saved is not None and (not isinstance(saved, list) or tuple(saved) != chunk.offsets)):
            raise BadInput(f"{m.path}: chunk of {chunk.fqn!r} at {list(chunk.offsets)} is not in the safetensors blob "
                           f"at offset {offset}")
        # a blob holds one tensor per name: a second chunk naming it would repeat its bytes
        first = self._members.setdefault((m.path, offset, chunk.fqn), chunk.offsets)
        if first != chunk.offsets:
            raise BadInput(f"{m.path}: chunks of {chunk.fqn!r} at {list(first)} and {list(chunk.offsets)} both name "
                           f"its one tensor in the safetensors blob at offset {offset}")
        return src

    def _blob(self, m, offset):
        """SAFETENSORS variant: the rank's tensors are one safetensors blob; parsed once per blob."""
        key = (m.path, offset)
        if key not in self._blobs:
            self._blobs[key] = self._parse_blob(m, offset)
        return self._blobs[key]

    def _parse_blob(self, m, offset):
        if offset + 8 > m.size:
            raise BadInput(f"{m.path}: item at offset {offset} is neither a torch zip nor safetensors")
        blob = MemoryFile(m.view[offset:], m.path)  # the blob seen as a file of its own
        sources = {s.name: s for s in file_tensors(blob)}  # refuses a header with any problem
        header = parse_header(blob.view, blob.size, m.path)
        info = safejson.loads(header.metadata.get("DCP_SHARDING_INFO", "{}") or "{}", m.path,
                              f"DCP_SHARDING_INFO of the safetensors blob at offset {offset}")
        if not isinstance(info, dict):
            raise BadInput(f"{m.path}: DCP_SHARDING_INFO of the safetensors blob at offset {offset} is not an object")
        return sources, info


class ChunkedTensor(TensorSource):
    """A global tensor whose regions are filled from the chunks that overlap them (found through the
    coverage grid, so a region costs what it overlaps, not the number of chunks)."""

    def __init__(self, name, dtype, shape, chunks, grid: Grid = None):
        self.name, self.dtype, self.shape, self.chunks, self.grid = name, dtype, tuple(shape), chunks, grid
        self._touched = {}  # chunks read since the last release

    def _region(self, index):
        out = np.empty(tuple(s.stop - s.start for s in index), self.dtype.numpy)
        if self.grid is None or not out.size:
            return out
        for i in self.grid.overlapping(index):
            c = self.chunks[i]
            lo = [max(s.start, o) for s, o in zip(index, c.offsets)]
            hi = [min(s.stop, o + n) for s, o, n in zip(index, c.offsets, c.sizes)]
            local = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, c.offsets))
            dest = tuple(slice(a - s.start, b - s.start) for a, b, s in zip(lo, hi, index))
            out[dest] = c.source().region(local)
            self._touched[i] = c
        return out

    def release(self):
        for c in self._touched.values():
            c.release()
        self._touched.clear()


class _Tiles(Concat):
    """Chunks that tile one axis, joined along it: a region finds its first part by bisection and
    `release` advises away only the parts read since the last one (both per block, with thousands
    of parts)."""

    def __init__(self, name, parts, axis):
        super().__init__(name, parts, axis)
        self._ends = list(itertools.accumulate(p.shape[axis] for p in self.parts))
        self._touched = {}

    def _region(self, index):
        want, axis = index[self.axis], self.axis
        pieces = []
        i = bisect.bisect_right(self._ends, want.start)
        while i < len(self.parts) and self._ends[i] - self.parts[i].shape[axis] < want.stop:
            p, at = self.parts[i], self._ends[i] - self.parts[i].shape[axis]
            lo, hi = max(want.start, at), min(want.stop, self._ends[i])
            pieces.append(p.region(index[:axis] + (slice(lo - at, hi - at),) + index[axis + 1:]))
            self._touched[i] = p
            i += 1
        if not pieces:  # an empty region
            return np.empty(tuple(s.stop - s.start for s in index), self.dtype.numpy)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=axis)

    def release(self):
        for p in self._touched.values():
            p.release()
        self._touched.clear()


def _tile_axis(shape, chunks):
    """The axis along which the chunks tile the tensor whole (each full in every other axis), if any."""
    for axis in range(len(shape)):
        if all(all(c.offsets[k] == 0 and c.sizes[k] == shape[k] for k in range(len(shape)) if k != axis)
               for c in chunks):
            return axis
    return None


def _global(fqn, dt, shape, chunks, grid):
    """One chunk: its own source; chunks tiling one axis: a join (keeps slices contiguous); else
    a region-filling tensor. Transformed chunks are always read lazily."""
    live = [c for c in chunks if c.numel]
    if grid is None or any(c.transformed for c in live):
        return ChunkedTensor(fqn, dt, shape, chunks, grid)
    if len(live) == 1:
        return live[0].source().renamed(fqn)
    axis = _tile_axis(shape, live)
    if axis is not None:
        ordered = sorted(live, key=lambda c: c.offsets[axis])
        return _Tiles(fqn, [c.source() for c in ordered], axis)
    return ChunkedTensor(fqn, dt, shape, chunks, grid)


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


def load(path: Path, options: ReadOptions) -> Checkpoint:
    return read(path, options, allowlist(options.allow_globals), lambda fqn: wanted(fqn, options.only))


def read(path: Path, options: ReadOptions, allow, keep) -> Checkpoint:
    """The items of the DCP checkpoint in `path` whose name `keep(fqn)` accepts (the others are checked
    as records, never read), unpickled with `allow` (DCP's records plus a format's own: the megatron
    reader's torch_dist directories)."""
    meta_path = path / ".metadata"
    meta = MappedFile(confined(meta_path, source_root(path)))
    md = _record(unpickler.load(meta.view, allow, meta_path), ("Metadata",), "the pickle", meta_path)
    sdm = _field(md, "state_dict_metadata", meta_path)
    storage = _field(md, "storage_data", meta_path)
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise BadInput(f"{meta_path}: Metadata.state_dict_metadata/storage_data are not dicts")
    where_by_key = _storage_index(storage, meta_path)
    reader = DCPReader(path, allow)

    # 1. Check every wanted item's records and layout before reading any bytes.
    items, chunked = [], []
    for fqn, item in sdm.items():
        if not isinstance(fqn, str):
            raise BadInput(f"{meta_path}: a key of Metadata.state_dict_metadata is not a string: {_found(fqn)}")
        if not keep(fqn):
            continue
        _record(item, ("TensorStorageMetadata", "BytesStorageMetadata"), f"item {fqn!r}", meta_path)
        if item.qualname == "BytesStorageMetadata":
            info = where_by_key.get((fqn, None))
            if info is None:
                raise BadInput(f"{meta_path}: no storage entry for bytes item {fqn!r}")
            items.append((fqn, Loc(info, f"bytes item {fqn!r}", meta_path)))
            continue
        dt, shape, chunks = _read_tensor(reader, fqn, item, where_by_key, meta_path)
        grid = _check_coverage(fqn, shape, chunks, meta_path)
        items.append((fqn, (dt, shape, chunks, grid)))
        chunked.extend(c for c in chunks if c.numel)

    # 2. Every range inside its file; no two items sharing bytes (SAFETENSORS blobs excepted).
    reader.mark_blob_members([c.loc for c in chunked])
    reader.claim([x for _, x in items if isinstance(x, Loc)], [c.loc for c in chunked])

    # 3. Read: bytes items now, tensor chunks lazily (untransformed ones validated now: headers only).
    tensors, extras = [], {}
    for fqn, x in items:
        if isinstance(x, Loc):
            _bytes_item(reader, fqn, x, tensors, extras, options)
            continue
        dt, shape, chunks, grid = x
        for c in chunks:
            if c.numel and not c.transformed:
                c.source()
        tensors.append(_global(fqn, dt, shape, chunks, grid))
    source = SourceFacts(format=NAME, path=str(path), files=sorted(p.name for p in path.glob("*.distcp")))
    return Checkpoint(tensors, extras, source, model_files(path), [meta] + list(reader.files.values()))


def _bytes_item(reader, fqn, loc, tensors, extras, options):
    m, offset, length = reader.item_bytes(loc)
    budget = Budget(m.path)
    head = bytes(m.view[offset:offset + 4])
    if head == _ZIP:
        value = load_zip(m, reader.allow, offset, length, budget=budget)
    else:
        # Any pickle protocol (0 and 1 have no header) is run by the VM, which never executes
        # anything: a hostile global is refused; bytes that do not parse as a pickle are opaque.
        try:
            value = unpickler.load(m.view[offset:offset + length], reader.allow, m.path, offset, budget=budget)
        except UnsafePickle:
            raise
        except BadInput:
            raw = m.view[offset:offset + length]
            extras[fqn] = {"__opaque__": length, "sha256": hashlib.sha256(raw).hexdigest()}
            return
    t, e, _ = flatten(value, m.path, prefix=fqn, skip_unsupported=options.skip_unsupported, budget=budget)
    tensors.extend(t.values())
    extras.update(unpickler.extras_json(e, budget))


READER = register(Reader(NAME, "PyTorch Distributed Checkpoint directories (.metadata + *.distcp)",
                         detect, load, priority=20, parses_pickles=True, suffixes=(".distcp",),
                         fuzz=((".metadata", None), ("__0_0.distcp", None)),
                         looks_for="a directory holding .metadata"))
