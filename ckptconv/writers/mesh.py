"""A reshard output (docs/output.md, "Reshard outputs"): one complete sharded directory per rank,
`rank-XXXXX/`, holding exactly that rank's pieces, and mesh.json with the global digests.

The layout (which rank holds which intervals of which tensor) is decided before, as pure data
(tp/layout.py's TensorPlans); the units of this writer are rank directories. The ranks a process owns
are written side by side, tensor by tensor: a tensor split on a later axis is read once for all
ranks and scattered (each rank gathers its columns of each block); the others are sliced per rank,
so only what a rank needs is read. A process that writes every rank also gets the global digests
as taps of the bytes it streams; the rest are one bounded pass over the source, split among the
processes by bytes.
"""
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..io import sha256
from ..errors import BadInput, brief
from ..formats import mesh as fmt
from ..io.hashing import CHUNK, SMALL, Digests, Pipeline
from ..tensor import Concat, as_bytes, sha256_of, zero_padded
from ..tp.layout import RankPieces, holds
from .base import Content, ResultError, RunFacts, WriteOptions, Writer, assign, from_hex, is_digest, register
from .files import (InlineTap, OutputStream, check_space, copy_files, finish_dir, plan_shards, write_json,
                    write_tensor)


@dataclass
class RankDir:
    rank: int
    name: str
    size: int


@dataclass
class MeshResult:
    """What a mesh writer wrote of its share: each of its ranks' shard files in order, [name, sha256];
    the global digests it computed, a bit per tensor of the layout saying which (`global_at`, packed)
    and 32 bytes for each bit set, in layout order (`global_digests`: no object per tensor); and, in
    vLLM's layout, the top-level links it made to those shards, name -> sha256."""

    global_digests: bytes       # (or a memoryview of them)
    global_at: bytes
    shards: dict                # rank -> [[name, sha256], ...]
    linked: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """As it crosses processes (cluster.py): bytes as hex, ranks as JSON keys."""
        return {"global": self.global_digests.hex(), "global_at": self.global_at.hex(),
                "shards": {str(rank): files for rank, files in self.shards.items()}, "linked": self.linked}

    @classmethod
    def from_json(cls, data) -> "MeshResult":
        """A result that crossed from another process, read, not trusted: ResultError when a part is
        not of its type (whether it fits the share and the layout is MeshWriter.accepts)."""
        if not (isinstance(data, dict) and isinstance(data.get("shards"), dict) and isinstance(data.get("global"), str)
                and isinstance(data.get("global_at"), str) and isinstance(data.get("linked", {}), dict)):
            raise ResultError("not {global, global_at, shards}")
        shards = {}
        for rank, files in data["shards"].items():
            if not (rank.isascii() and rank.isdigit() and len(rank) <= 9 and str(int(rank)) == rank):
                raise ResultError(f"{brief(rank, 40)} is not a rank")
            if not (isinstance(files, list) and all(isinstance(f, list) and len(f) == 2 and isinstance(f[0], str)
                                                    and is_digest(f[1]) for f in files)):
                raise ResultError(f"rank {rank}: its shards are not [name, sha256] pairs")
            shards[int(rank)] = files
        linked = data.get("linked", {})
        if not all(is_digest(d) for d in linked.values()):
            raise ResultError("its links are not name: sha256")
        return cls(from_hex(data["global"], "its global digests"), from_hex(data["global_at"], "its global digests"),
                   shards, linked)


def rank_piece(src, p, rank):
    """Rank `rank`'s piece of plan `p` of the global tensor `src`, as a lazy source: a slice of it,
    its intervals joined in range order (made as it is written: tp/layout.RankPieces)."""
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


@register("mesh")
class MeshWriter(Writer):
    Result = MeshResult

    def __init__(self, options: WriteOptions, content: Content, out, layout, rules, tp: int, ep: int, sources: list):
        super().__init__(options, content, out)
        self.layout, self.rules, self.tp, self.ep, self.sources = layout, rules, tp, ep, sources   # (in layout order)
        self.ranks = tp * ep

    def plan(self, tensors=None) -> list:
        return [RankDir(r, fmt.rank_dir(r), sum(p.piece_bytes(r) for p in self.layout)) for r in range(self.ranks)]

    def job(self) -> dict:
        return {**super().job(), "--tp": self.tp, "--ep": self.ep, "rules": self.rules.to_json()}

    def accepts(self, result: MeshResult, units, tmp) -> str | None:
        """(see Writer.accepts) Its rank directories are exactly its share, each written; its global
        digests a bit per tensor of the layout and 32 bytes for each bit set."""
        if set(result.shards) != {u.rank for u in units}:
            return f"it names ranks {sorted(result.shards)[:4]}, not its share {[u.rank for u in units][:4]}"
        if any(not os.path.isdir(os.path.join(tmp, u.name)) or os.path.islink(os.path.join(tmp, u.name)) for u in units):
            return "a rank directory of its share is not there"
        if len(result.global_at) != -(-len(self.layout) // 8):
            return "its global digests do not fit the layout"
        at = np.unpackbits(np.frombuffer(result.global_at, np.uint8), count=len(self.layout))
        if len(result.global_digests) != 32 * int(at.sum()):
            return "its global digests do not fit the layout"
        return None

    def write(self, units, tmp, progress=None, share=(0, 1)):
        mine = [u.rank for u in units]
        check_space(tmp, sum(u.size for u in units) + len(units) * self.content.added_bytes(), self.content.model_files,
                    len(units))
        streams, taps, tapped = self._write_ranks(tmp, mine, progress, every_rank=len(mine) == self.ranks)
        for rank, stream in streams.items():
            source = {**self.content.source, "resharded": {"tp": self.tp, "ep": self.ep, "rank": rank},
                      **self.content.skipped()}
            copy_files(stream.out_dir, self.content.model_files, stream.written, self.content.edited, self.content.added)
            finish_dir(stream.out_dir, stream.shards, stream.written, source, self.content.extras,
                       self.content.manifest, stem=self.options.stem)
        shards = {rank: [[s.name, stream.written.files[s.name]["sha256"]] for s in stream.shards]
                  for rank, stream in streams.items()}
        have, found = self._global_digests(streams, taps, tapped, share)
        # (only the rows this process has, and a bit per tensor saying which: what crosses to process 0)
        rows = found if have.all() else found[have]
        return MeshResult(memoryview(rows).cast("B"), np.packbits(have).tobytes(), shards)

    def _global_digests(self, streams, taps: Digests, tapped: bytearray, share) -> tuple:
        """(which tensors, their global digests): a bool per tensor of the layout and a 32-byte row
        per tensor (no object per tensor). A split tensor's comes from its tap where this process
        streamed it whole (`tapped[i]`; the taps in layout order), else from its share (by bytes) of
        one bounded pass over the source each; a whole one's is rank 0's."""
        have = np.frombuffer(tapped, np.uint8).astype(bool)
        found = np.zeros((len(self.layout), 32), np.uint8)
        found[have] = np.frombuffer(taps.packed(), np.uint8).reshape(-1, 32)
        ours = None   # one process: every split tensor without a tap
        if share[1] > 1:
            split = [i for i, p in enumerate(self.layout) if p.axis is not None]
            owner = assign([math.prod(self.layout[i].shape) * self.layout[i].dtype.itemsize for i in split], share[1])
            ours = {i for i, o in zip(split, owner) if o == share[0]}
        for i, p in enumerate(self.layout):
            if p.axis is not None and not tapped[i] and (ours is None or i in ours):
                found[i], have[i] = np.frombuffer(bytes.fromhex(sha256_of(self.sources[i])), np.uint8), True
        if 0 in streams:   # rank 0's digests, shard by shard, are of the tensors it holds in layout order
            n = len(self.layout)
            held = np.flatnonzero(np.fromiter((holds(p, 0) for p in self.layout), bool, n))
            whole = np.fromiter((p.axis is None for p in self.layout), bool, n)
            at = 0
            for shard in streams[0].shards:
                rows = np.frombuffer(streams[0].written.digests[shard.name], np.uint8).reshape(-1, 32)
                index, at = held[at:at + len(rows)], at + len(rows)
                found[index[whole[index]]], have[index[whole[index]]] = rows[whole[index]], True
        return have, found

    def finish(self, tmp, results) -> RunFacts:
        n = len(self.layout)
        digests, have = np.zeros((n, 32), np.uint8), np.zeros(n, bool)
        for r in results:
            at = np.unpackbits(np.frombuffer(r.global_at, np.uint8), count=n).astype(bool)
            rows = np.frombuffer(r.global_digests, np.uint8).reshape(-1, 32)
            if len(results) == 1 and at.all():   # (one process: its rows are the table, not copied)
                digests = rows
            else:
                digests[at] = rows
            have |= at
        if not have.all():
            raise AssertionError("a tensor's global digest was computed by no process")
        write_json(tmp, fmt.MESH, fmt.document(self.layout, self.rules, self.tp, self.ep, self.content.source,
                                               memoryview(digests).cast("B")))
        fmt.write_top_sums(tmp, self.known_digests(results))
        return RunFacts()

    def known_digests(self, results) -> dict:
        """Top-level files whose digests the run already has (none here; the vLLM layout's links)."""
        return {}

    def _write_ranks(self, tmp, ranks, progress, every_rank: bool) -> tuple:
        """Every rank directory's shards written side by side, tensor by tensor. Returns ({rank: stream},
        the global digests of the tensors whose global bytes went by in order, when `every_rank` (this
        process writes them all), in layout order, and which those are: a byte per layout index)."""
        pipeline = Pipeline()
        streams = {}
        try:
            for r in ranks:
                rank_dir = Path(tmp) / fmt.rank_dir(r)
                rank_dir.mkdir()
                streams[r] = OutputStream(rank_dir, plan_shards(RankPieces.of(self.layout, r),
                                                                self.options.max_shard_size, self.options.stem),
                                          pipeline, self.options.fsync, direct=self.options.direct)
            taps, tapped = Digests(), bytearray(len(self.layout))
            for i, (p, src) in enumerate(zip(self.layout, self.sources)):
                holders = [r for r in ranks if holds(p, r)]
                pieces = {r: rank_piece(src, p, r) for r in holders}
                scatters, ordered = _scatters(p), _in_global_order(p)
                tap = sha256.new() if every_rank and (scatters or ordered or _streams_in_order(p)) else None
                if scatters:
                    _scatter(p, src, holders, pieces, streams, pipeline, progress, tap)
                elif ordered:
                    _ordered(p, src, holders, pieces, streams, progress, tap)
                else:
                    if tap is not None and math.prod(p.shape) * p.dtype.itemsize <= SMALL:
                        tap = InlineTap()   # every piece is small: digested in this thread, as they are
                    for r in holders:
                        streams[r].add(pieces[r], progress, tap)
                if tap is not None:   # (the taps in layout order: tapped says whose they are)
                    tapped[i] = 1
                if isinstance(tap, InlineTap):
                    taps.append_done(tap.digest())
                elif tap is not None:   # (a state per tensor only while it is written)
                    taps.append(pipeline.hashes.digest("tap", tap))
            for stream in streams.values():
                stream.finish()
            return streams, taps, tapped
        except BaseException:
            for stream in streams.values():
                stream.abandon()
            raise
        finally:
            pipeline.close()


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
