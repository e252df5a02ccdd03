"""A zarr chunk's bytes decoded, as Orbax and tensorstore store them (readers/orbax_zarr.py makes
an array of them): `ZarrChunk` is one chunk of the grid, its source made by its codec chain — not
stored: the fill value; uncompressed: a zero-copy view of its file (strided for a transpose or
order F, byte-swapped for big-endian); zstd: `Inflating`, inflated as rows are asked for, front to
back, never past the chunk's declared byte size (io/zstd.py's Stream), then transposed if stored so;
and `shard_index`, a sharding_indexed shard's index read and checked (its crc32c, every inner
chunk inside the shard's data, no two sharing bytes). Registers nothing: orbax.py is the reader.
"""
import math
import struct

import numpy as np

from ..errors import BadInput
from ..io import zstd
from ..io.crc32c import crc32c
from ..storage import files as storage
from ..tensor import MappedView, Strided, TensorSource, constant

_PIECE = 1 << 20                # compressed bytes fed to a decompressor at a time (remote objects)
_SKIP = 4 << 20                 # decompressed bytes skipped at a time


class ZarrChunk:
    """One chunk of the grid: its place (`offsets`, `sizes`: clipped to the array) and where its
    bytes are (`file`, `offset`, `length`; None: not stored, the fill value)."""

    def __init__(self, name, meta, chunk_shape, codecs, offsets, sizes, file, offset, length, what):
        self.name, self.meta, self.chunk_shape, self.codecs = name, meta, chunk_shape, codecs
        self.offsets, self.sizes, self.file, self.offset, self.length, self.what = \
            offsets, sizes, file, offset, length, what
        self.numel = math.prod(sizes)
        self.nbytes = math.prod(chunk_shape) * meta.dtype.itemsize   # what the stored chunk decodes to
        self._source = None

    @property
    def transformed(self) -> bool:
        """Not a view of its file: compressed, or not stored (the fill value)."""
        return self.file is None or self.codecs.zstd

    def source(self) -> TensorSource:
        if self._source is None:
            self._source = self._make()
        return self._source

    def _make(self):
        dt = self.meta.dtype
        if self.file is None:
            return constant(self.name, dt, self.sizes, self.meta.fill)
        stored = tuple(self.chunk_shape[p] for p in self.codecs.perm) if self.codecs.perm else self.chunk_shape
        if self.codecs.zstd:
            edge = self.sizes[0] if self.sizes and not self.codecs.perm and self.sizes[0] != self.chunk_shape[0] else None
            src = Inflating(self.name, dt, stored, self.file, self.offset, self.length, self.codecs, self.what, edge)
            if self.codecs.perm:
                src = _Transposed(src, self.codecs.perm)
        else:
            data = self.length - (4 if self.codecs.crc32c else 0)
            if data != self.nbytes:
                raise BadInput(f"{self.file.path}: {self.what} holds {data} bytes; its array's chunk "
                               f"{list(self.chunk_shape)} of {dt.code} is {self.nbytes} bytes")
            if self.codecs.perm or (self.codecs.big_endian and dt.itemsize > 1):
                strides = _c_strides(stored)
                if self.codecs.perm:
                    inverse = [0] * len(stored)
                    for j, p in enumerate(self.codecs.perm):
                        inverse[p] = j
                    strides = tuple(strides[inverse[i]] for i in range(len(stored)))
                src = MappedView(self.name, dt, self.chunk_shape, self.file, self.offset,
                                 Strided(strides, self.codecs.big_endian, (self.offset, self.nbytes)))
            else:
                src = MappedView(self.name, dt, self.chunk_shape, self.file, self.offset)
        for axis, (n, full) in enumerate(zip(self.sizes, self.chunk_shape)):
            if n != full:   # an edge chunk: stored whole, the array's part of it read
                src = src.sliced(axis, 0, n)
        return src

    def release(self):
        if self._source is not None:
            self._source.release()


def _c_strides(shape):
    out, n = [], 1
    for k in reversed(shape):
        out.append(n)
        n *= k
    return tuple(reversed(out))


class _Transposed(TensorSource):
    """A compressed chunk stored transposed (zarr v2 order F, zarr v3 transpose): inflated whole
    (its declared bytes), then viewed in the array's axis order."""

    def __init__(self, base, perm):
        self.base, self.perm = base, perm
        inverse = [0] * len(perm)
        for j, p in enumerate(perm):
            inverse[p] = j
        self.inverse = tuple(inverse)
        self.name, self.dtype, self.shape = base.name, base.dtype, tuple(base.shape[i] for i in inverse)

    def _region(self, index):
        return self.base.region().transpose(self.inverse)[index]

    def release(self):
        self.base.release()



class Inflating(TensorSource):
    """A zstd-compressed chunk (row-major), inflated front to back as its rows are asked for: one
    decompressor kept per chunk while it is being read, the last rows asked kept (the next block may
    ask them again along another axis), never more than the chunk's declared bytes (a stream that
    inflates further is refused, as is one that ends short)."""

    def __init__(self, name, dtype, shape, file, offset, length, codecs, what, needed=None):
        self.needed = needed   # rows the array uses (an edge chunk's): past them, the stream is only checked
        self.name, self.dtype, self.shape = name, dtype, tuple(shape)
        self.file, self.offset, self.what = file, offset, what
        self.length = length - (4 if codecs.crc32c else 0)
        self.big = codecs.big_endian and dtype.itemsize > 1
        if self.nbytes > zstd.ZSTD_MAX_RATIO * max(self.length, 1):
            raise BadInput(f"{file.path}: {what} declares {self.nbytes} bytes, more than its zstd stream of "
                           f"{self.length} bytes can inflate to")
        self._reader, self._pos, self._kept = None, 0, None   # (first row, rows, array)

    def _start(self):
        window = min(zstd.ZSTD_MAX_WINDOW, max(1 << 20, 1 << max(self.nbytes - 1, 1).bit_length()))
        self._frame, self._gen = zstd.FrameEnd(), self._pieces()
        self._reader = zstd.Stream(zstd.Pieces(self._gen), f"{self.file.path}: {self.what}", self.nbytes,
                                   self._too_big, window)
        self._pos = 0

    def _too_big(self, limit):
        return BadInput(f"{self.file.path}: {self.what}: zstd stream inflates past its declared {limit} bytes; refused")

    def _pieces(self):
        """The compressed bytes front to back (files.pieces: views of a local mapping, an object's
        bytes a bounded window ahead), each piece's pages let go once the next is asked for: a mapped
        file's pages would otherwise stay resident, the whole checkpoint's by the end."""
        at = self.offset
        for piece in storage.pieces(self.file, self.offset, self.length, _PIECE):
            self._frame.feed(piece, f"{self.file.path}: {self.what}")
            yield piece
            self.file.release(at, len(piece))
            at += len(piece)

    def _read(self, n: int) -> bytes:
        parts, got = [], 0
        while got < n:
            piece = self._reader.read(n - got)
            if not piece:
                raise BadInput(f"{self.file.path}: {self.what}: zstd stream ends after {self._pos + got} of its "
                               f"declared {self.nbytes} bytes (truncated or corrupt)")
            parts.append(piece)
            got += len(piece)
        if self._pos + got == self.nbytes:
            self._reader.read(1)   # one byte more is refused (_too_big)
        self._pos += got
        if self._pos == self.nbytes:
            for _ in self._gen:   # the rest of the stream, walked (not inflated): one frame, ending where it does
                pass
            if self._frame.end != self.length:
                raise BadInput(f"{self.file.path}: {self.what}: {self.length - (self._frame.end or 0)} bytes follow its "
                               "zstd frame (a chunk is one frame, as tensorstore writes and reads it); refused")
            self._reader = None   # read to its end: the decompressor goes, and its pages
            self.file.release(self.offset, self.length)
        return b"".join(parts) if len(parts) != 1 else parts[0]

    def _region(self, index):
        if not self.shape:
            lo, hi, row = 0, 1, self.nbytes
        else:
            lo, hi = index[0].start, index[0].stop
            row = self.nbytes // self.shape[0] if self.shape[0] else 0
        if hi <= lo or not row:
            return np.empty(tuple(s.stop - s.start for s in index), self.dtype.numpy)
        kept = self._kept
        if kept is None or not (kept[0] <= lo and hi <= kept[0] + kept[1]):
            if self._reader is None or lo * row < self._pos:
                self._start()
            while self._pos < lo * row:
                self._read(min(_SKIP, lo * row - self._pos))
            np_dtype = self.dtype.numpy.newbyteorder(">") if self.big else self.dtype.numpy
            data = np.frombuffer(self._read((hi - lo) * row), np_dtype).reshape((hi - lo,) + self.shape[1:]
                                                                               if self.shape else ())
            kept = self._kept = (lo, hi - lo, data.astype(self.dtype.numpy) if self.big else data)
            if self.needed is not None and hi >= self.needed:
                while self._reader is not None:   # an edge chunk: the rows past the array's end are
                    self._read(min(_SKIP, self.nbytes - self._pos))   # stored too; its stream must hold them
        out = kept[2][lo - kept[0]:hi - kept[0]] if self.shape else kept[2]
        return out[(slice(None),) + tuple(index[1:])] if self.shape else out

    def release(self):
        if self._reader is None:   # read to its end (or never begun): nothing more is kept
            self._kept = None


def shard_index(store, key, value, meta, shard, what):
    """{inner grid index (within the shard): (offset, nbytes) relative to the value} of a shard."""
    per = tuple(c // s if s else 1 for c, s in zip(meta.chunks, shard.chunk_shape))
    n = math.prod(per)
    size = 16 * n + (4 if shard.index_crc32c else 0)
    where = store.where(key)
    if value.length < size:
        raise BadInput(f"{where}: shard of {value.length} bytes cannot hold its index of {n} chunks ({size} bytes)")
    at = value.length - size if shard.index_at_end else 0
    if value.inline is not None:
        raw = bytes(value.inline[at:at + size])
    else:
        value.file.check(value.offset, value.length, f"shard {key!r}")
        raw = bytes(storage.buffer(value.file, value.offset + at, size))
    if shard.index_crc32c and struct.unpack("<I", raw[-4:])[0] != crc32c(raw[:-4]):
        raise BadInput(f"{where}: the shard index's crc32c does not match (corrupt)")
    entries = np.frombuffer(raw, "<u8", count=2 * n).reshape(n, 2)
    data_lo, data_hi = (0, at) if shard.index_at_end else (size, value.length)
    out, spans = {}, []
    for flat, (off, nb) in enumerate(entries.tolist()):
        if off == 2**64 - 1 and nb == 2**64 - 1:
            continue
        if off < data_lo or nb > data_hi - off:
            raise BadInput(f"{where}: {what}: inner chunk {flat} at bytes {off}..{off + nb} lies outside the "
                           f"shard's data ({data_lo}..{data_hi})")
        out[np.unravel_index(flat, per) if per else ()] = (off, nb)
        spans.append((off, nb))
    spans.sort()
    for (a, na), (b, _) in zip(spans, spans[1:]):
        if b < a + na:
            raise BadInput(f"{where}: {what}: two inner chunks share bytes {b}..{a + na}; each chunk's bytes "
                           "must be its own")
    return {tuple(int(i) for i in k): v for k, v in out.items()}
