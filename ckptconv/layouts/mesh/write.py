"""Writing rank directories (the mesh layout's units): each rank's lazy piece of a global tensor, and
the three ways a tensor reaches its ranks (sliced per rank, pushed interval by interval in global
order, or read once in blocks of rows and scattered), and the result a process sends process 0."""
import math
from dataclasses import dataclass

import numpy as np

from ...errors import BadInput, brief
from ...io.hashing import CHUNK
from ...tensor import Concat, as_bytes, zero_padded
from ..base import ResultError, from_hex, is_digest
from ..files import write_tensor


@dataclass
class RankDir:
    rank: int
    name: str
    size: int


@dataclass
class MeshResult:
    """What a mesh layout wrote of its share: each of its ranks' shard files in order, [name, sha256];
    the global digests it computed, a bit per tensor of the layout saying which (`global_at`, packed)
    and 32 bytes for each bit set, in layout order (`global_digests`: no object per tensor)."""

    global_digests: bytes       # (or a memoryview of them)
    global_at: bytes
    shards: dict                # rank -> [[name, sha256], ...]

    def to_json(self) -> dict:
        """As it crosses processes (run/tasks.py: a task's answer): bytes as hex, ranks as JSON keys."""
        return {"global": self.global_digests.hex(), "global_at": self.global_at.hex(),
                "shards": {str(rank): files for rank, files in self.shards.items()}}

    @classmethod
    def from_json(cls, data) -> "MeshResult":
        """A result that crossed from another process, read, not trusted: ResultError when a part is
        not of its type (whether it fits the share and the layout is MeshDirectory.accepts)."""
        if not (isinstance(data, dict) and isinstance(data.get("shards"), dict) and isinstance(data.get("global"), str)
                and isinstance(data.get("global_at"), str)):
            raise ResultError("not {global, global_at, shards}")
        shards = {}
        for rank, files in data["shards"].items():
            if not (rank.isascii() and rank.isdigit() and len(rank) <= 9 and str(int(rank)) == rank):
                raise ResultError(f"{brief(rank, 40)} is not a rank")
            if not (isinstance(files, list) and all(isinstance(f, list) and len(f) == 2 and isinstance(f[0], str)
                                                    and is_digest(f[1]) for f in files)):
                raise ResultError(f"rank {rank}: its shards are not [name, sha256] pairs")
            shards[int(rank)] = files
        return cls(from_hex(data["global"], "its global digests"), from_hex(data["global_at"], "its global digests"),
                   shards)


def rank_piece(src, p, rank):
    """Rank `rank`'s piece of plan `p` of the global tensor `src`, as a lazy source: a slice of it,
    its intervals joined in range order (made as it is written: tp/intervals.RankPieces)."""
    src = src if p.padded is None else zero_padded(src, p.axis, p.padded)
    if p.axis is None:
        return src
    if p.outer is not None:   # this rank's expert group first, then its intervals of each expert
        src = src.sliced(p.outer[0], *p.outer[1][rank])
    parts = [src.sliced(p.axis, a, b) for a, b in p.ranges[rank]]
    if len(parts) > 1:
        return Concat(p.name, parts, p.axis)
    # (a slice keeps its source's name: no wrapper when that is the name)
    return parts[0] if parts[0].name == p.name else parts[0].renamed(p.name)


def _streams_in_order(p) -> bool:
    """Pieces written rank by rank give the global bytes in order (so the global digest is a tap)."""
    return p.axis is not None and p.even and p.padded is None and all(n == 1 for n in p.shape[:p.axis])


def _in_global_order(p) -> bool:
    """Split on the leading axis into intervals that are disjoint or identical (a kv head shared by
    several ranks) and cover it, each rank's in increasing order (fused qkv, gate_up): pushed interval
    by interval in global order, every piece is a run of contiguous slices of the source, and the
    global digest is a tap of the bytes written."""
    if p.axis is None or p.padded is not None or any(n != 1 for n in p.shape[:p.axis]) or _streams_in_order(p):
        return False
    if any(list(r) != sorted(r) for r in p.ranges):
        return False
    at = 0
    for a, b in sorted({tuple(iv) for r in p.ranges for iv in r}):
        if a != at:
            return False
        at = b
    return at == p.shape[p.axis]


def _scatters(p) -> bool:
    """Split on a later axis, with rows small enough to read whole: read each block of rows once and
    hand every rank its columns (instead of every rank gathering its columns from the whole tensor)."""
    if p.axis is None or p.outer is not None or _streams_in_order(p) or p.axis == 0 or not math.prod(p.shape):
        return False
    return math.prod(p.shape[1:]) * p.dtype.itemsize <= CHUNK


def _ordered(p, src, holders, pieces, streams, progress, global_h):
    """Every holder's piece pushed interval by interval in global order (see _in_global_order); an
    interval several ranks hold goes to each, and into the global digest once."""
    writers = {r: streams[r].tensor(pieces[r]) for r in holders}
    held = {r: {tuple(iv) for iv in p.ranges[r]} for r in holders}
    for a, b in sorted(set().union(*held.values())):
        part, tap = src.sliced(p.axis, a, b), global_h
        for r in holders:
            if (a, b) in held[r]:
                writers[r].tap, tap = tap, None
                write_tensor(writers[r], part, progress)
    for w in writers.values():
        w.close()


def _scatter(p, src, holders, pieces, streams, pipeline, progress, global_h):
    rows = max(1, CHUNK // (math.prod(p.shape[1:]) * p.dtype.itemsize))
    writers = {r: streams[r].tensor(pieces[r]) for r in holders}
    lead = (slice(None),) * p.axis
    try:
        for a in range(0, p.shape[0], rows):
            block = np.ascontiguousarray(src.region((slice(a, min(a + rows, p.shape[0])),)))
            pending = pipeline.hashes.feed(as_bytes(block), tap=global_h)
            for r in holders:
                fill_at, nbytes = _gather([block[lead + (slice(lo, hi),)] for lo, hi in p.ranges[r]], p.axis)
                writers[r].fill(fill_at, 0, nbytes, progress)
            for f in pending:
                f.result()
            src.release()
    except (ValueError, IndexError) as e:
        raise BadInput(f"tensor {p.name!r}: cannot read its data: {e}") from None
    for w in writers.values():
        w.close()


def _gather(parts, axis):
    """One rank's columns of a block as (`fill_at`, byte count): gathered straight into the staging
    buffer when it holds the whole piece, else gathered once and copied a byte range at a time."""
    shape = list(parts[0].shape)
    shape[axis] = sum(x.shape[axis] for x in parts)
    nbytes = math.prod(shape) * parts[0].itemsize
    whole = None

    def fill_at(view, offset):
        nonlocal whole
        if offset == 0 and len(view) == nbytes:
            np.concatenate(parts, axis=axis, out=np.frombuffer(view, parts[0].dtype).reshape(shape))
            return
        if whole is None:
            whole = as_bytes(np.concatenate(parts, axis=axis))
        view[:] = whole[offset:offset + len(view)]

    return fill_at, nbytes
