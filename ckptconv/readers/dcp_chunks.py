"""The DCP reader's bytes (readers/dcp.py reads with them): each chunk's torch.save zip or
SAFETENSORS blob member, zstd items inflated into an unlinked temporary file, and the global tensors
whose regions are filled from the chunks. Registers nothing: dcp.py is the reader.

Files are reached through storage/files.py. From an object store: the first bytes of every chunk
(zip or blob member?) in one batch per file, each chunk's zip metadata in a few ranged reads
(ziparchive.py), a zstd item fetched front to back as it is inflated, a SAFETENSORS blob's header
and then each tensor's bytes where it lies (`_Within`).
"""
import bisect
import contextlib
import itertools
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np

from .. import safejson
from ..errors import BadInput, OutputError
from ..io.mapped import MemoryFile
from ..io import zstd
from ..io.spill import SpillFile
from ..storage import files as storage
from ..formats.safetensors import file_header
from ..tensor import Concat, TensorSource
from .pickle.torch_globals import TorchTensor
from . import confined, inside, source_root
from .dcp_metadata import ARCHIVE_ALLOWANCE, MAPPED_INFLATED, ZSTD_BYTES_LIMIT, _PIECE, Chunk, Grid, Loc
from .safetensors import file_tensors
from .torch_pickle import load_zip

_ZIP = b"PK\x03\x04"


# --- Reading the bytes --------------------------------------------------------------------------

class DCPReader:
    def __init__(self, path: Path, allow):
        self.path, self.allow, self.root = path, allow, source_root(path)
        self.files = {}
        self._blobs = {}                 # (file, offset) -> ({name: source}, DCP_SHARDING_INFO)
        self._members = {}               # (file, blob offset, name) -> offsets of the chunk it backs
        self._inflated = OrderedDict()   # id(chunk) -> source over its inflated bytes, most recent last
        self._spill = SpillFile("ckptconv-dcp-", "inflated zstd chunks")   # where inflated items go
        self._bytes_left = ZSTD_BYTES_LIMIT

    def file(self, rel):
        if rel not in self.files:
            p = self.path / rel
            if not p.is_file():
                raise BadInput(f"{p}: .distcp file named by .metadata is missing")
            self.files[rel] = storage.open_file(confined(p, self.root))
        return self.files[rel]

    def size(self, rel):
        """The bytes file `rel` holds, or None when it is missing, without opening it (a file of
        unread entries only); a name leading outside the checkpoint is not looked at (-1)."""
        if rel in self.files:
            return self.files[rel].size
        p = self.path / rel
        if not inside(p, self.root):
            return -1
        return storage.size(p) if p.is_file() else None

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
        """Which untransformed chunks are members of a SAFETENSORS blob: those without a zip at their
        offset (the first bytes of a file's chunks read in one batch: files.read_ranges)."""
        by_file = {}
        for loc in chunk_locs:
            if not loc.zstd:
                m = self.file(loc.rel)
                m.check(loc.offset, loc.length, loc.what)
                by_file.setdefault(loc.rel, []).append(loc)
        for rel, locs in by_file.items():
            m = self.files[rel]
            heads = storage.read_ranges(m, ((loc.offset, min(4, m.size - loc.offset)) for loc in locs))
            with contextlib.closing(heads):
                for loc, head in zip(locs, heads):
                    loc.head = bytes(head)
                    loc.blob = loc.head != _ZIP

    # -- zstd

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
        return self._spill.map(start, size, path)

    def _inflate(self, loc, limit, too_big):
        m = self.file(loc.rel)
        source = m.view[loc.offset:loc.offset + loc.length] if not m.remote else \
            zstd.Pieces(storage.pieces(m, loc.offset, loc.length, _PIECE))
        stream = zstd.Stream(source, f"{m.path}: {loc.what}", limit, too_big)
        start, size = self._spill.begin(), 0
        try:
            with stream:
                while True:
                    piece = stream.read(min(_PIECE, limit + 1 - size))
                    if not piece:
                        break
                    self._spill.write(piece, start + size)
                    size += len(piece)
        except OSError as e:
            raise OutputError(f"{tempfile.gettempdir()}: cannot write inflated zstd data of {loc.what} to a "
                              f"temporary file: {e.strerror} (set TMPDIR to a larger disk)") from None
        self._spill.done(start, size)
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
        head = chunk.loc.head if cache_blob and chunk.loc.head is not None else bytes(storage.buffer(m, offset, 4))
        if head == _ZIP:
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
        blob = MemoryFile(m.view[offset:], m.path) if not m.remote else _Within(m, offset)   # seen as a file
        header = file_header(blob, m.path)   # (its metadata; file_tensors lets the header's bytes go)
        sources = {s.name: s for s in file_tensors(blob)}  # refuses a header with any problem
        info = safejson.loads(header.metadata.get("DCP_SHARDING_INFO", "{}") or "{}", m.path,
                              f"DCP_SHARDING_INFO of the safetensors blob at offset {offset}")
        if not isinstance(info, dict):
            raise BadInput(f"{m.path}: DCP_SHARDING_INFO of the safetensors blob at offset {offset} is not an object")
        return sources, info


class _Within:
    """The bytes of an object from `offset` on (a SAFETENSORS blob) as a file of its own: a
    RemoteFile's interface (storage/files.py), offsets shifted, so tensors over the blob fetch their
    own bytes (a local file's blob is a MemoryFile over its mapping)."""

    remote = True

    def __init__(self, m, offset: int):
        self._m, self._at = m, offset
        self.path, self.size, self.identity = m.path, m.size - offset, m.identity

    @property
    def view(self) -> memoryview:
        return self._m.view[self._at:]

    def need(self, offset: int, length: int):
        self._m.need(self._at + offset, length)

    def read(self, offset: int, length: int) -> bytes:
        self.check(offset, length, "a read")
        return self._m.read(self._at + offset, length)

    def check(self, offset: int, length: int, what: str):
        if offset < 0 or length < 0 or offset + length > self.size:
            raise BadInput(f"{self.path}: {what} needs bytes {self._at + offset}..{self._at + offset + length} "
                           f"but the object has {self._m.size} bytes (truncated or corrupt)")

    @contextlib.contextmanager
    def reader(self):
        with self._m.reader() as fill_at:
            yield lambda view, offset: fill_at(view, self._at + offset)

    def will_need(self, offset: int, length: int):
        self._m.will_need(self._at + offset, length)

    def populate(self, offset: int, length: int):
        self._m.populate(self._at + offset, length)

    def release(self, offset: int, length: int):
        self._m.release(self._at + offset, length)

    def advise(self, advice: int, offset: int = 0, length=None):
        pass

    def unchanged(self) -> bool:
        return self._m.unchanged()


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


def global_tensor(fqn, dt, shape, chunks, grid):
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
