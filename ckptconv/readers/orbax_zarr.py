"""The Orbax reader's zarr arrays (readers/orbax.py reads with them): each array as one lazy source
assembled from its chunks, read from a store: the chunk grid and chunk keys, each chunk looked up
(under sharding_indexed, in its shard's index), the bounds on chunks and on the fill value of those
not stored, and the global tensor over them (dcp_chunks' tiling helpers). The array's metadata is
readers/zarr_meta.py's, each chunk's decoding readers/zarr_codecs.py's. Registers nothing: orbax.py
is the reader.

An array's values come from a store: `get(key) -> Value | None` (readers/ocdbt.Value: the storage
file holding the bytes and where, or the bytes inline), `where(key)`, `count_under(prefix, limit)`,
`files` — `DirStore` here (one directory per array, Orbax's use_ocdbt=False), or readers/ocdbt's
OcdbtStore (OCDBT, as readers/orbax.py presents it). A chunk the store does not hold is the array's
fill value (zarr's rule, and tensorstore's).
"""
import math

import numpy as np

from ..errors import BadInput
from ..io.mapped import MemoryFile
from ..storage import files as storage
from ..tensor import TensorSource
from .dcp_chunks import global_tensor
from .dcp_metadata import Grid
from .ocdbt import Value
from .zarr_codecs import ZarrChunk, shard_index
from .zarr_meta import ArrayMeta

# --- Limits (docs/security.md, "Orbax") ---------------------------------------------------------
MAX_CHUNKS = 1 << 20            # chunks of one array's grid (present or not), and of a whole checkpoint
FILL_ALLOWANCE = 1 << 30        # bytes of chunks not stored (the fill value), beyond what stored chunks hold
ABSENT_CHUNKS = 1 << 16         # chunks not stored, beyond 16 per value the checkpoint holds (Counter)


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


def _file_of(store, key, value: Value):
    """(file, offset): an inline value as a file of its own."""
    if value.inline is not None:
        return MemoryFile(bytes(value.inline), f"{store.where(key)}"), 0
    value.file.check(value.offset, value.length, f"value of {key!r}")
    return value.file, value.offset


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
        return global_tensor(name, dt, shape, [], None)
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
                chunks.append(ZarrChunk(name, meta, unit, codecs, offsets, sizes, None, 0, 0, cwhat))
                continue
            f, at = _file_of(store, key, value)
            chunks.append(ZarrChunk(name, meta, unit, codecs, offsets, sizes, f, at, value.length, cwhat))
            continue
        per = tuple(c // s for c, s in zip(meta.chunks, unit))
        outer = tuple(i // p for i, p in zip(idx, per))
        if outer not in shards:
            key = f"{array}/{meta.key(outer)}"
            value = store.get(key)
            shards[outer] = None if value is None else \
                (_file_of(store, key, value), shard_index(store, key, value, meta, meta.codecs.shard, what), value)
        held = shards[outer]
        inner = tuple(i % p for i, p in zip(idx, per))
        if held is None or inner not in held[1]:
            chunks.append(ZarrChunk(name, meta, unit, codecs, offsets, sizes, None, 0, 0, cwhat))
            continue
        (f, at), index, _ = held
        off, nb = index[inner]
        chunks.append(ZarrChunk(name, meta, unit, codecs, offsets, sizes, f, at + off, nb, cwhat))
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
    return global_tensor(name, dt, shape, chunks, Grid(cuts, owner))
