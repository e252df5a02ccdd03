"""The Orbax reader's zarr arrays (readers/orbax.py reads with them): zarr v2 `.zarray` and zarr v3
`zarr.json` metadata, the chunk grid and chunk keys, the codecs Orbax and tensorstore write (zarr v2:
compressor zstd or none, order C/F; zarr v3: bytes, transpose, zstd, crc32c, sharding_indexed), and
each array as one lazy source assembled from its chunks (dcp_chunks' tiling helpers). Registers
nothing: orbax.py is the reader.

An array's values come from a store: `keys()`, `get(key) -> Value | None` (a Value: the storage
file holding the bytes and where, or the bytes inline) — `DirStore` here (one directory per array,
Orbax's use_ocdbt=False), or readers/ocdbt.OcdbtStore (OCDBT). An uncompressed chunk is a zero-copy
view of its file; a zstd chunk is inflated as rows are asked for, front to back, never past its
declared byte size; a chunk the store does not hold is the array's fill value (zarr's rule, and
tensorstore's).
"""
import math
import struct
from typing import NamedTuple

import numpy as np

from .. import dtypes, safejson
from ..errors import BadInput, UsageError
from ..io.mapped import MemoryFile
from ..limits import MAX_NDIM, shape_problem
from ..storage import files as storage
from ..tensor import MappedView, Strided, TensorSource, constant
from .dcp_chunks import _Reading, _global
from .dcp_metadata import ZSTD_MAX_RATIO, ZSTD_MAX_WINDOW, Grid
from .ocdbt import crc32c

# --- Limits (docs/security.md, "Orbax") ---------------------------------------------------------
MAX_META_BYTES = 1 << 20        # one array's .zarray / zarr.json
MAX_CHUNKS = 1 << 20            # chunks of one array's grid (present or not), and of a whole checkpoint
FILL_ALLOWANCE = 1 << 30        # bytes of chunks not stored (the fill value), beyond what stored chunks hold
_PIECE = 1 << 20                # compressed bytes fed to a decompressor at a time (remote objects)
ABSENT_CHUNKS = 1 << 16         # chunks not stored, beyond 16 per value the checkpoint holds (Counter)
_SKIP = 4 << 20                 # decompressed bytes skipped at a time

_V2_DTYPES = {"bfloat16": "BF16", "<f8": "F64", "<f4": "F32", "<f2": "F16", "<i8": "I64", "<i4": "I32",
              "<i2": "I16", "|i1": "I8", "<u8": "U64", "<u4": "U32", "<u2": "U16", "|u1": "U8", "|b1": "BOOL",
              "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_V3_DTYPES = {"bfloat16": "BF16", "float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64",
              "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16",
              "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


class Value(NamedTuple):
    """Where a store's value is (readers/ocdbt.py's Value has the same fields)."""

    file: object
    offset: int
    length: int
    inline: bytes | None


class DirStore:
    """A directory as a store: keys are relative paths ("params.up.kernel/.zarray",
    "params.up.kernel/0.1"); a value is its whole file, opened when asked for, confined to the
    checkpoint (`confine`: readers.confined with the source's root)."""

    def __init__(self, root, confine):
        self.root, self.confine, self.files = root, confine, []

    def get(self, key: str):
        path = storage.join(self.root, *key.split("/"))
        if not storage.is_file(path):
            return None
        f = storage.open_file(self.confine(storage.place(path)))
        self.files.append(f)
        return Value(f, 0, f.size, None)

    def where(self, key: str) -> str:
        return storage.join(self.root, key)

    def count_under(self, prefix: str, limit: int) -> int:
        """How many files lie under `prefix` (a directory), counted as far as `limit`: every name looked
        at counts, so empty directories bound the walk too; never a probe per chunk."""
        found, seen, todo = 0, 0, [storage.join(self.root, *prefix.strip("/").split("/"))]
        while todo and seen < limit:
            d = todo.pop()
            if not storage.is_dir(d):
                continue
            for e in storage.entries(d):
                seen += 1
                if e.is_dir:
                    todo.append(storage.join(d, e.name))
                else:
                    found += 1
        return limit if seen >= limit else min(found, limit)


def value_bytes(store, value: Value):
    if value.inline is not None:
        return value.inline
    return storage.buffer(value.file, value.offset, value.length)


def _file_of(store, key, value: Value):
    """(file, offset): an inline value as a file of its own."""
    if value.inline is not None:
        return MemoryFile(bytes(value.inline), f"{store.where(key)}"), 0
    value.file.check(value.offset, value.length, f"value of {key!r}")
    return value.file, value.offset


# --- Metadata ------------------------------------------------------------------------------------

class Codecs(NamedTuple):
    perm: tuple | None        # the stored array is the chunk transposed by perm (zarr v3 transpose; v2 order F)
    big_endian: bool
    zstd: bool
    crc32c: bool              # a 4-byte checksum after the (compressed) bytes
    shard: "Shard | None" = None


class Shard(NamedTuple):
    """zarr v3 sharding_indexed: each stored key holds a grid of inner chunks and their index."""

    chunk_shape: tuple
    inner: Codecs
    index_crc32c: bool
    index_at_end: bool


class ArrayMeta(NamedTuple):
    shape: tuple
    chunks: tuple             # the stored key's chunk shape (a shard's, under sharding_indexed)
    dtype: object             # dtypes.DType
    fill: object              # numpy scalar of the dtype
    codecs: Codecs
    key: object               # grid index tuple -> key relative to the array's directory


def _where(store, key):
    return store.where(key)


def read_meta(store, array: str) -> ArrayMeta | None:
    """The metadata of the array stored under `array/` (zarr v2 or v3), checked; None if neither file
    is there."""
    for name, parse in ((".zarray", _v2), ("zarr.json", _v3)):
        key = f"{array}/{name}"
        value = store.get(key)
        if value is None:
            continue
        where = _where(store, key)
        if value.length > MAX_META_BYTES:
            raise BadInput(f"{where}: {value.length} bytes of array metadata, more than the {MAX_META_BYTES} accepted")
        doc = safejson.loads(bytes(value_bytes(store, value)), where, "zarr array metadata")
        if not isinstance(doc, dict):
            raise BadInput(f"{where}: zarr array metadata is not a JSON object")
        return parse(doc, where)
    return None


def _ints(value, what, where, rank=None):
    if not isinstance(value, list) or len(value) > MAX_NDIM or \
            not all(type(v) is int and v >= 0 for v in value):
        raise BadInput(f"{where}: {what} must be a list of at most {MAX_NDIM} non-negative integers")
    if rank is not None and len(value) != rank:
        raise BadInput(f"{where}: {what} has {len(value)} entries for an array of {rank} dimensions")
    return tuple(value)


def _fill(value, dt, where):
    """zarr's fill_value as a numpy scalar: null (tensorstore: zero), a number, "NaN"/"Infinity"/
    "-Infinity", or (zarr v3) "0x..." the raw bits."""
    np_dtype = dt.numpy
    if value is None:
        return np.zeros((), np_dtype)
    if isinstance(value, (bool, int, float)):
        if dt.is_float:
            try:
                number = float(value)
            except OverflowError:
                raise BadInput(f"{where}: fill_value {str(value)[:40]}… does not fit {dt.code}") from None
            with np.errstate(over="ignore"):
                return np.array(number).astype(np_dtype)
        if dt.code == "BOOL":
            return np.array(bool(value))
        if isinstance(value, int) and np.iinfo(np_dtype).min <= value <= np.iinfo(np_dtype).max:
            return np.array(value, np_dtype)
        raise BadInput(f"{where}: fill_value {str(value)[:40]} does not fit {dt.code}")
    if isinstance(value, str) and dt.is_float and value in ("NaN", "Infinity", "-Infinity"):
        return np.array(float({"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}[value])).astype(np_dtype)
    if isinstance(value, str) and value.startswith("0x") and len(value) == 2 + 2 * dt.itemsize:
        try:
            bits = int(value, 16)
        except ValueError:
            bits = None
        if bits is not None:
            return np.frombuffer(bits.to_bytes(dt.itemsize, "little"), np_dtype).reshape(())
    raise BadInput(f"{where}: fill_value {str(value)[:60]!r} is not one for {dt.code}")


def _v2(doc, where) -> ArrayMeta:
    if doc.get("zarr_format") != 2:
        raise BadInput(f"{where}: zarr_format must be 2 in a .zarray")
    shape = _ints(doc.get("shape"), "shape", where)
    chunks = _ints(doc.get("chunks"), "chunks", where, len(shape))
    raw = doc.get("dtype")
    if not isinstance(raw, str) or raw.replace(">", "<") not in _V2_DTYPES:
        raise BadInput(f"{where}: dtype {str(raw)[:60]!r} is not one ckptconv reads (known: {', '.join(_V2_DTYPES)})")
    big = raw.startswith(">")
    dt = dtypes.from_code(_V2_DTYPES[raw.replace(">", "<")])
    order = doc.get("order", "C")
    if order not in ("C", "F"):
        raise BadInput(f"{where}: order {str(order)[:20]!r} must be C or F")
    if doc.get("filters") not in (None, []):
        raise BadInput(f"{where}: zarr filters are not supported (found {str(doc.get('filters'))[:80]})")
    comp = doc.get("compressor")
    if comp is not None and not (isinstance(comp, dict) and comp.get("id") == "zstd"):
        shown = comp.get("id") if isinstance(comp, dict) else comp
        raise BadInput(f"{where}: compressor {str(shown)[:40]!r} is not supported (zstd or none)")
    sep = doc.get("dimension_separator", ".")
    if sep not in (".", "/"):
        raise BadInput(f"{where}: dimension_separator {str(sep)[:10]!r} must be '.' or '/'")
    perm = tuple(reversed(range(len(shape)))) if order == "F" and len(shape) > 1 else None
    codecs = Codecs(perm, big, comp is not None, False)
    _check_shapes(shape, chunks, dt, where)
    return ArrayMeta(shape, chunks, dt, _fill(doc.get("fill_value"), dt, where), codecs,
                     lambda idx: sep.join(str(i) for i in idx) if idx else "0")


def _named(codec, where):
    if not isinstance(codec, dict) or not isinstance(codec.get("name"), str):
        raise BadInput(f"{where}: a codec must be an object with a name")
    conf = codec.get("configuration", {})
    if not isinstance(conf, dict):
        raise BadInput(f"{where}: codec {codec['name'][:40]!r}: configuration must be an object")
    return codec["name"], conf


def _codecs(chain, rank, where, inner=False) -> Codecs:
    """A zarr v3 codec chain: [transpose], bytes | sharding_indexed, [zstd], [crc32c]."""
    if not isinstance(chain, list) or not chain or len(chain) > 8:
        raise BadInput(f"{where}: codecs must be a list of 1 to 8 codecs")
    perm, big, zstd, crc, shard, stage = None, False, False, False, None, 0
    for codec in chain:
        name, conf = _named(codec, where)
        if name == "transpose" and stage == 0 and perm is None:
            order = conf.get("order")
            if not isinstance(order, list) or sorted(order) != list(range(rank)) or \
                    not all(type(v) is int for v in order):
                raise BadInput(f"{where}: transpose order {str(order)[:60]} is not a permutation of {rank} axes")
            perm = tuple(order) if order != list(range(rank)) else None
        elif name == "bytes" and stage == 0:
            endian = conf.get("endian", "little")
            if endian not in ("little", "big"):
                raise BadInput(f"{where}: bytes codec endian {str(endian)[:20]!r}")
            big, stage = endian == "big", 1
        elif name == "sharding_indexed" and stage == 0 and not inner and perm is None:
            cs = _ints(conf.get("chunk_shape"), "sharding_indexed chunk_shape", where, rank)
            sub = _codecs(conf.get("codecs"), rank, where, inner=True)
            index = conf.get("index_codecs", [{"name": "bytes", "configuration": {"endian": "little"}},
                                              {"name": "crc32c"}])
            names = [_named(c, where) for c in index] if isinstance(index, list) else None
            if names is None or [n for n, _ in names] not in (["bytes"], ["bytes", "crc32c"]) or \
                    names[0][1].get("endian", "little") != "little":
                raise BadInput(f"{where}: sharding_indexed index_codecs must be bytes (little) [+ crc32c]")
            at = conf.get("index_location", "end")
            if at not in ("start", "end"):
                raise BadInput(f"{where}: sharding_indexed index_location {str(at)[:20]!r}")
            shard, stage = Shard(cs, sub, len(names) == 2, at == "end"), 1
        elif name == "zstd" and stage == 1 and not zstd and not crc:
            zstd = True
        elif name == "crc32c" and stage == 1 and not crc:
            crc = True
        else:
            raise BadInput(f"{where}: codec {name[:40]!r} is not supported here (known: transpose, bytes, "
                           "sharding_indexed, zstd, crc32c, in that order)")
    if stage == 0:
        raise BadInput(f"{where}: the codecs have no bytes or sharding_indexed codec")
    return Codecs(perm, big, zstd, crc, shard)


def _v3(doc, where) -> ArrayMeta:
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "array":
        raise BadInput(f"{where}: zarr.json must be a zarr_format 3 array")
    shape = _ints(doc.get("shape"), "shape", where)
    raw = doc.get("data_type")
    if not isinstance(raw, str) or raw not in _V3_DTYPES:
        raise BadInput(f"{where}: data_type {str(raw)[:60]!r} is not one ckptconv reads")
    dt = dtypes.from_code(_V3_DTYPES[raw])
    grid = doc.get("chunk_grid")
    if not isinstance(grid, dict) or grid.get("name") != "regular" or not isinstance(grid.get("configuration"), dict):
        raise BadInput(f"{where}: chunk_grid must be regular")
    chunks = _ints(grid["configuration"].get("chunk_shape"), "chunk_shape", where, len(shape))
    if doc.get("storage_transformers") not in (None, []):
        raise BadInput(f"{where}: storage_transformers are not supported")
    enc = doc.get("chunk_key_encoding", {"name": "default"})
    name, conf = _named(enc, where)
    sep = conf.get("separator", "/" if name == "default" else ".")
    if name not in ("default", "v2") or sep not in (".", "/"):
        raise BadInput(f"{where}: chunk_key_encoding {name[:20]!r} separator {str(sep)[:4]!r} is not supported")
    codecs = _codecs(doc.get("codecs"), len(shape), where)
    if codecs.shard is not None:
        _check_shapes(chunks, codecs.shard.chunk_shape, dt, where)
        if any(c % s for c, s in zip(chunks, codecs.shard.chunk_shape) if s) or \
                any(s == 0 and c for c, s in zip(chunks, codecs.shard.chunk_shape)):
            raise BadInput(f"{where}: shard shape {list(chunks)} is not a multiple of its chunk shape "
                           f"{list(codecs.shard.chunk_shape)}")
    _check_shapes(shape, chunks, dt, where)
    if name == "default":
        def key(idx):
            return sep.join(["c", *(str(i) for i in idx)])
    else:
        def key(idx):
            return sep.join(str(i) for i in idx) if idx else "0"
    return ArrayMeta(shape, chunks, dt, _fill(doc.get("fill_value"), dt, where), codecs, key)


def _check_shapes(shape, chunks, dt, where):
    for what, s in (("shape", shape), ("chunk shape", chunks)):
        problem = shape_problem(s, dt.itemsize)
        if problem:
            raise BadInput(f"{where}: {what}: {problem}")
    if any(c == 0 and n for n, c in zip(shape, chunks)):
        raise BadInput(f"{where}: chunk shape {list(chunks)} has a zero size for a non-empty axis of {list(shape)}")


# --- Chunks --------------------------------------------------------------------------------------

class _Chunk:
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


class _FrameEnd:
    """Where a zstd frame ends, from its frame header and block headers as its bytes stream by (RFC
    8878, 3.1.1): blocks are skipped by their sizes, nothing is inflated; a second frame after the
    first is then seen as bytes past `end`."""

    def __init__(self):
        self.at, self.want, self.head = 0, 5, bytearray()   # the header being read: where, how long, its bytes
        self.stage, self.checksum, self.end, self.seen = "frame", False, None, 0

    def feed(self, piece, where: str):
        start = self.seen
        self.seen += len(piece)
        while self.end is None:
            lo = self.at + len(self.head)
            if lo >= self.seen:
                return
            take = min(self.want - len(self.head), self.seen - lo)
            self.head += piece[lo - start:lo - start + take]
            if len(self.head) < self.want:
                return
            self._parse(where)

    def _parse(self, where: str):
        head = bytes(self.head)
        if self.stage == "frame":
            if head[:4] != b"\x28\xb5\x2f\xfd":
                raise BadInput(f"{where}: not a zstd frame (its magic is {head[:4].hex()})")
            fhd = head[4]
            single = fhd >> 5 & 1
            self.checksum = bool(fhd >> 2 & 1)
            self.want = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3] + (single, 2, 4, 8)[fhd >> 6]
            self.stage = "header"
            if len(head) < self.want:
                return
        if self.stage == "header":
            self.stage, self.at, self.want, self.head = "block", self.want, 3, bytearray()
            return
        bits = int.from_bytes(head, "little")
        kind, size = bits >> 1 & 3, bits >> 3
        if kind == 3:
            raise BadInput(f"{where}: a zstd block of the reserved type at byte {self.at}; corrupt stream")
        self.at += 3 + (1 if kind == 1 else size)
        self.head = bytearray()
        if bits & 1:
            self.end = self.at + (4 if self.checksum else 0)


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
        if self.nbytes > ZSTD_MAX_RATIO * max(self.length, 1):
            raise BadInput(f"{file.path}: {what} declares {self.nbytes} bytes, more than its zstd stream of "
                           f"{self.length} bytes can inflate to")
        self._reader, self._pos, self._kept = None, 0, None   # (first row, rows, array)

    def _start(self):
        try:
            import zstandard
        except ImportError:
            raise UsageError(f"{self.file.path}: {self.what} is zstd-compressed; install zstandard: "
                             "pip install 'ckptconv[zstd]'") from None
        window = min(ZSTD_MAX_WINDOW, max(1 << 20, 1 << max(self.nbytes - 1, 1).bit_length()))
        dctx = zstandard.ZstdDecompressor(max_window_size=window)
        self._frame, self._gen = _FrameEnd(), self._pieces()
        self._reader = dctx.stream_reader(_Reading(self._gen), read_across_frames=False)
        self._pos = 0

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
        import zstandard
        parts, got = [], 0
        try:
            while got < n:
                piece = self._reader.read(n - got)
                if not piece:
                    raise BadInput(f"{self.file.path}: {self.what}: zstd stream ends after {self._pos + got} of its "
                                   f"declared {self.nbytes} bytes (truncated or corrupt)")
                parts.append(piece)
                got += len(piece)
            if self._pos + got == self.nbytes and self._reader.read(1):
                raise BadInput(f"{self.file.path}: {self.what}: zstd stream inflates past its declared "
                               f"{self.nbytes} bytes; refused")
        except zstandard.ZstdError as e:
            raise BadInput(f"{self.file.path}: {self.what}: corrupt or unsupported zstd stream: {e}") from None
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


# --- One array -------------------------------------------------------------------------------------

class Counter:
    """Chunks made so far for one checkpoint (MAX_CHUNKS in all), and the bytes of those stored and of
    those not (the fill value: at most FILL_ALLOWANCE more than the stored ones hold — Orbax stores
    every chunk, store_array_data_equal_to_fill_value; a few bytes of metadata must not make ckptconv
    write terabytes of fill)."""

    def __init__(self, every_chunk: bool = False):
        self.chunks = self.stored = self.missing = 0
        self.values = self.absent = 0   # values held under the arrays so far, chunks of theirs not stored
        self.every_chunk = every_chunk   # _METADATA's store_array_data_equal_to_fill_value: a missing chunk is damage


def _shard_index(store, key, value, meta, shard, what):
    """{inner grid index (within the shard): (offset, nbytes) relative to the value} of a shard."""
    per = tuple(c // s if s else 1 for c, s in zip(meta.chunks, shard.chunk_shape))
    n = math.prod(per)
    size = 16 * n + (4 if shard.index_crc32c else 0)
    where = _where(store, key)
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


def _chunk_bounds(store, array, what, shape, unit, grid, count, itemsize, counter):
    """Refuse, before a chunk is looked up, an array whose grid the values present cannot justify: at
    most as many chunks are stored as the store holds values under the array. Where Orbax stored every
    chunk (store_array_data_equal_to_fill_value), fewer values than chunks is damage; else the chunks
    not stored are at most ABSENT_CHUNKS plus 16 per value the checkpoint holds (each is a record
    here, so memory follows the bytes present), and their fill value at most FILL_ALLOWANCE more than
    the stored chunks can hold (each not held at least the smallest, corner, chunk)."""
    present = store.count_under(f"{array}/", count)
    if counter.every_chunk:
        if present < count:
            raise BadInput(f"{store.where(array)}: {what} has {count} chunks but at most {present} are stored; Orbax "
                           "stored every chunk of this checkpoint (store_array_data_equal_to_fill_value) and its "
                           "restore refuses a missing one too (truncated or damaged copy?)")
        return
    counter.values += present
    counter.absent += count - present
    smallest = math.prod(n - (g - 1) * c for n, c, g in zip(shape, unit, grid)) * itemsize
    least = counter.missing + (count - present) * smallest
    most_stored = counter.stored + present * math.prod(unit) * itemsize
    if least > FILL_ALLOWANCE + most_stored:
        raise BadInput(f"{store.where(array)}: {what}: the chunks not stored would be at least {least} bytes of fill "
                       f"value in the checkpoint so far, more than the {FILL_ALLOWANCE} accepted beyond the at most "
                       f"{most_stored} bytes of chunks stored")
    if counter.absent > ABSENT_CHUNKS + 16 * counter.values:
        raise BadInput(f"{store.where(array)}: {what}: {counter.absent} chunks not stored in the checkpoint so far, more "
                       f"than the {ABSENT_CHUNKS} + 16 per stored value ({counter.values}) accepted")


def array_source(store, array: str, name: str, meta: ArrayMeta, counter: Counter) -> TensorSource:
    """The lazy source of the array stored under `array/`, named `name`."""
    what = f"array {array!r}"
    shape, dt = meta.shape, meta.dtype
    codecs = meta.codecs.shard.inner if meta.codecs.shard is not None else meta.codecs
    unit = meta.codecs.shard.chunk_shape if meta.codecs.shard is not None else meta.chunks
    if not math.prod(shape):
        return _global(name, dt, shape, [], None)
    grid = tuple(-(-n // c) for n, c in zip(shape, unit))
    count = math.prod(grid)
    counter.chunks += count
    if count > MAX_CHUNKS or counter.chunks > MAX_CHUNKS:
        raise BadInput(f"{store.where(array)}: {what}'s chunk grid {list(grid)} makes {count} chunks "
                       f"({counter.chunks} in the checkpoint so far), more than the {MAX_CHUNKS} accepted")
    if meta.codecs.shard is None:
        _chunk_bounds(store, array, what, shape, unit, grid, count, dt.itemsize, counter)
    chunks = []
    shards = {}
    for idx in np.ndindex(*grid) if grid else [()]:
        offsets = tuple(i * c for i, c in zip(idx, unit))
        sizes = tuple(min(c, n - o) for c, n, o in zip(unit, shape, offsets))
        cwhat = f"chunk {list(idx)} of {array!r}"
        if meta.codecs.shard is None:
            key = f"{array}/{meta.key(idx)}"
            value = store.get(key)
            if value is None:
                chunks.append(_Chunk(name, meta, unit, codecs, offsets, sizes, None, 0, 0, cwhat))
                continue
            f, at = _file_of(store, key, value)
            chunks.append(_Chunk(name, meta, unit, codecs, offsets, sizes, f, at, value.length, cwhat))
            continue
        per = tuple(c // s for c, s in zip(meta.chunks, unit))
        outer = tuple(i // p for i, p in zip(idx, per))
        if outer not in shards:
            key = f"{array}/{meta.key(outer)}"
            value = store.get(key)
            shards[outer] = None if value is None else \
                (_file_of(store, key, value), _shard_index(store, key, value, meta, meta.codecs.shard, what), value)
        held = shards[outer]
        inner = tuple(i % p for i, p in zip(idx, per))
        if held is None or inner not in held[1]:
            chunks.append(_Chunk(name, meta, unit, codecs, offsets, sizes, None, 0, 0, cwhat))
            continue
        (f, at), index, _ = held
        off, nb = index[inner]
        chunks.append(_Chunk(name, meta, unit, codecs, offsets, sizes, f, at + off, nb, cwhat))
    for c in chunks:
        if c.file is None and counter.every_chunk:
            raise BadInput(f"{store.where(array)}: {c.what} is missing; Orbax stored every chunk of this checkpoint "
                           "(store_array_data_equal_to_fill_value) and its restore refuses it too (truncated or "
                           "damaged copy?)")
        if c.file is None:
            counter.missing += c.numel * dt.itemsize
        else:
            counter.stored += c.nbytes
    if counter.missing > FILL_ALLOWANCE + counter.stored:
        raise BadInput(f"{store.where(array)}: {what}: the chunks not stored would be {counter.missing} bytes of fill "
                       f"value in the checkpoint so far, more than the {FILL_ALLOWANCE} accepted beyond the "
                       f"{counter.stored} bytes of chunks stored")
    cuts = [sorted({0, n, *range(0, n, c)}) for n, c in zip(shape, unit)]
    owner = np.arange(count, dtype=np.int64 if count >= 2**31 else np.int32).reshape(grid)
    for c in chunks:
        if not c.transformed:
            c.source()   # sizes checked now, before anything is planned
    return _global(name, dt, shape, chunks, Grid(cuts, owner))
