"""A reshard output (docs/output.md, "Reshard outputs"): one complete sharded directory per rank,
`rank-XXXXX/`, holding exactly that rank's pieces, and mesh.json with the global digests.

The layout (which rank holds which intervals of which tensor) is decided before, as pure data
(tp/intervals.py's TensorPlans); the units of this writer are rank directories. The ranks a process owns
are written side by side, tensor by tensor: a tensor split on a later axis is read once for all
ranks and scattered (each rank gathers its columns of each block); the others are sliced per rank,
so only what a rank needs is read. A process that writes every rank also gets the global digests
as taps of the bytes it streams; the rest are one bounded pass over the source, split among the
processes by bytes.
"""
import math

import numpy as np

from ...io import sha256
from ...formats import mesh as fmt
from ...io.hashing import SMALL, Digests, Pipeline
from ...tensor import sha256_of
from ...tp.intervals import RankPieces, holds
from ...run.share import Share, assign
from ..base import Content, Layout, MeshPlan, RunFacts, WriteOptions, register
from ..files import InlineTap, OutputStream, check_space, copy_files, finish_dir, plan_shards, write_json
from ...storage import files as storage
from ...storage.targets import as_target
from .check import check_only_ranks, check_units, verify_mesh, verify_mesh_tensors
from .write import (MeshResult, RankDir, _in_global_order, _ordered, _scatter, _scatters, _streams_in_order,
                    rank_piece)


@register("mesh")
class MeshDirectory(Layout):
    Result = MeshResult
    order = 20
    reader = "mesh"
    target = "rank directories rank-XXXXX/, each a sharded directory, and mesh.json (docs/output.md)"

    def __init__(self, options: WriteOptions, content: Content, out=None, mesh: MeshPlan = None):
        super().__init__(options, content, out, mesh)
        self.layout, self.rules, self.tp, self.ep = mesh.layout, mesh.rules, mesh.tp, mesh.ep
        self.sources = mesh.sources   # (in layout order)
        self.ranks = mesh.tp * mesh.ep

    # -- what an engine's layout of rank directories changes (vllm/); the plain one changes nothing ------

    @classmethod
    def engine(cls, ckpt, spec) -> tuple:
        """(what the output records of this layout's target, as the recipe applies it; the rules that
        split its tensors), or (None, None): the source's tensors, split by --preset/--rules."""
        return None, None

    @classmethod
    def to_target(cls, tensors, record) -> list:
        """The source's tensors as the target's global tensors (lazy)."""
        return tensors

    @classmethod
    def target_differences(cls, ckpt, record) -> list:
        """Lines for what `record` (a target an output records) says of the source `ckpt` that the
        source, read again, does not give (verify --against): nothing, for a layout without one."""
        return []

    @classmethod
    def top_parts(cls, path, ranks: int) -> dict | None:
        """{top-level file: (the rank shard it is, that shard's digest)} of what the layout puts beside
        the rank directories ({}: nothing; None: the ranks' manifests could not be read)."""
        return {}

    @classmethod
    def check_top(cls, path, parts: dict, entries: dict, sums: dict, report):
        """The top-level files SHA256SUMS lists besides mesh.json (the plain layout: none)."""
        check_only_ranks(path, sums, report)

    # -- reading an output back ----------------------------------------------------------------------

    @classmethod
    def detect(cls, path) -> bool:
        path = storage.place(path)
        return path.is_dir() and storage.exists(path / fmt.MESH)

    @classmethod
    def recorded_in(cls, path):
        """Every rank's manifest records the source alike (checked): rank 0's."""
        return storage.place(path) / fmt.rank_dir(0)

    @classmethod
    def check_units(cls, path) -> dict:
        """Its rank directories by bytes, its global tensors by bytes (those of a valid mesh.json)."""
        return check_units(storage.place(path))

    @classmethod
    def check(cls, path, report, progress=None, share=None):
        """Every rank directory on its own (shared out), then, with all of them intact, each global
        tensor as mesh.json describes it; the engine layout mesh.json names checks the top level."""
        share = share or Share()
        mesh = verify_mesh(storage.place(path), report, progress, share.mine, cls)
        share.merge("rank-dirs")
        if not report.problems and mesh is not None:
            verify_mesh_tensors(storage.place(path), mesh, report, share.mine)

    # -- writing -------------------------------------------------------------------------------------

    def plan(self, tensors=None) -> list:
        return [RankDir(r, fmt.rank_dir(r), sum(p.piece_bytes(r) for p in self.layout)) for r in range(self.ranks)]

    def job(self) -> dict:
        return {**super().job(), "--tp": self.tp, "--ep": self.ep, "rules": self.rules.to_json()}

    def accepts(self, result: MeshResult, units, tmp) -> str | None:
        """(see Layout.accepts) Its rank directories are exactly its share, each written; its global
        digests a bit per tensor of the layout and 32 bytes for each bit set."""
        if set(result.shards) != {u.rank for u in units}:
            return f"it names ranks {sorted(result.shards)[:4]}, not its share {[u.rank for u in units][:4]}"
        if any(not as_target(tmp).is_dir(u.name) for u in units):
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
        mesh = write_json(tmp, fmt.MESH, fmt.document(self.layout, self.rules, self.tp, self.ep, self.content.source,
                                                      memoryview(digests).cast("B")))
        fmt.write_top_sums(tmp, {fmt.MESH: mesh, **self.known_digests(results)})
        return RunFacts()

    def pointer(self, units) -> str:
        """mesh.json: what a consumer of rank directories reads first (written last in a store)."""
        return fmt.MESH

    def known_digests(self, results) -> dict:
        """Top-level files besides mesh.json whose digests the run has (none here; the vLLM layout's
        links and model files)."""
        return {}

    def _write_ranks(self, tmp, ranks, progress, every_rank: bool) -> tuple:
        """Every rank directory's shards written side by side, tensor by tensor. Returns ({rank: stream},
        the global digests of the tensors whose global bytes went by in order, when `every_rank` (this
        process writes them all), in layout order, and which those are: a byte per layout index)."""
        pipeline = Pipeline(taps=every_rank)
        streams, target = {}, as_target(tmp)
        target.side_by_side(len(ranks))   # (a store divides its upload memory among the ranks' files)
        try:
            for r in ranks:
                target.mkdir(fmt.rank_dir(r))
                streams[r] = OutputStream(target.sub(fmt.rank_dir(r)), plan_shards(RankPieces.of(self.layout, r),
                                                                self.options.max_shard_size, self.options.stem),
                                          pipeline, self.options.fsync, direct=self.options.direct)
            taps, tapped = Digests(), bytearray(len(self.layout))
            for i, (p, src) in enumerate(zip(self.layout, self.sources)):
                if every_rank and i + 1 < len(self.sources):   # (the next one read from the disk while this
                    self.sources[i + 1].prefetch()                # one is written; only by who reads all of it)
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


