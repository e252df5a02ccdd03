"""zarr array metadata, as Orbax and tensorstore write it (readers/orbax_zarr.py reads each array
with it): zarr v2 `.zarray` (dtype, order C/F, compressor zstd or none, dimension separator) and
zarr v3 `zarr.json` (data type, regular chunk grid, chunk key encoding, the codec chain:
[transpose], bytes | sharding_indexed, [zstd], [crc32c]), each parsed into one ArrayMeta and checked
before use: shapes and chunk shapes, dtypes, codecs, fill values (docs/security.md, "Orbax").
Registers nothing: orbax.py is the reader.
"""
from typing import NamedTuple

import numpy as np

from .. import dtypes, safejson
from ..errors import BadInput
from ..limits import MAX_NDIM, shape_problem

MAX_META_BYTES = 1 << 20        # one array's .zarray / zarr.json (docs/security.md, "Orbax")

_V2_DTYPES = {"bfloat16": "BF16", "<f8": "F64", "<f4": "F32", "<f2": "F16", "<i8": "I64", "<i4": "I32",
              "<i2": "I16", "|i1": "I8", "<u8": "U64", "<u4": "U32", "<u2": "U16", "|u1": "U8", "|b1": "BOOL",
              "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_V3_DTYPES = {"bfloat16": "BF16", "float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64",
              "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16",
              "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


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


def read_meta(store, array: str) -> ArrayMeta | None:
    """The metadata of the array stored under `array/` in `store` (readers/orbax_zarr.py's stores:
    `get(key) -> Value | None`, `where(key)`), zarr v2 or v3, checked; None if neither file is there."""
    for name, parse in ((".zarray", _v2), ("zarr.json", _v3)):
        key = f"{array}/{name}"
        value = store.get(key)
        if value is None:
            continue
        where = store.where(key)
        if value.length > MAX_META_BYTES:
            raise BadInput(f"{where}: {value.length} bytes of array metadata, more than the {MAX_META_BYTES} accepted")
        doc = safejson.loads(bytes(value.data()), where, "zarr array metadata")
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
