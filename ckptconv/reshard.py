"""reshard: per-rank tensor-parallel (and expert-parallel) output for a target mesh.

Planning is pure data: for every tensor, the rule that matched, the split axis and, per rank, the
intervals of the global tensor along that axis that make up the rank's piece (`plan`). Execution
hands each rank's writer lazy slices of the source (`rank_pieces`), so only what a rank needs is
read, and a source that is itself sliced (a previous reshard, DCP chunks) is read the same way.
Layout of the output, mesh.json and `ranges`: DESIGN.md.
"""
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import sha256
from .cluster import assign, on_cluster, run_guarded
from .errors import BadInput, UsageError
from .output import atomic_output, temp_path
from .progress import byte_progress
from .readers import ReadOptions, open_checkpoint, readers
from .rules import RuleSet, choose, read_config, recorded
from .tensor import Computed, Concat, as_bytes, sha256_of
from .hashing import CHUNK, Pipeline, sha256_file
from .sha256sums import NAME as SUMS, write_sums
from .writer import OutputStream, check_space, copy_files, finish, plan_shards, write_json, write_tensor

MESH_FORMAT = "ckptconv.mesh/1"


@dataclass
class TensorPlan:
    name: str
    shape: tuple
    dtype: object
    rule: str
    axis: int | None
    ranges: list           # per rank: list of (start, stop) along axis; [] = absent; None axis = whole
    even: bool             # ranges are the r-th of N equal blocks (not recorded in mesh.json)
    padded: int | None = None  # --pad-vocab: the axis is zero-padded to this size before splitting

    def piece_shape(self, rank):
        if self.axis is None:
            return self.shape
        n = sum(b - a for a, b in self.ranges[rank])
        return self.shape[:self.axis] + (n,) + self.shape[self.axis + 1:]

    def piece_bytes(self, rank) -> int:
        if self.axis is not None and not self.ranges[rank]:
            return 0
        return math.prod(self.piece_shape(rank)) * self.dtype.itemsize


def rule_axis(rule, layout: str, ndim: int):
    if rule.axis is not None:
        if not -ndim <= rule.axis < ndim:
            raise UsageError(f"rule {rule.pattern!r}: axis {rule.axis} does not exist in a {ndim}-d tensor")
        return rule.axis % ndim
    kind = rule.kind
    if kind == "replicate" or ndim == 0:
        return None
    if kind in ("vocab", "expert"):
        return 0
    if ndim == 1:
        return None if kind == "row" else 0   # biases: column-parallel split, row-parallel replicate
    column, row = (ndim - 2, ndim - 1) if layout == "torch" else (ndim - 1, ndim - 2)
    return row if kind == "row" else column


def _even(name, n, tp, axis, what="size"):
    if n % tp:
        raise BadInput(f"tensor {name!r}: axis {axis} has {what} {n}, not divisible by tp={tp}")
    k = n // tp
    return [[(r * k, (r + 1) * k)] for r in range(tp)]


def _heads(name, n, heads, head_dim, tp, axis, base=0, shared=False):
    """Whole heads per rank; `shared` (kv) heads fewer than ranks each go to tp/heads ranks."""
    hd = head_dim or (n // heads if heads and n % heads == 0 else None)
    if not heads or not hd or heads * hd != n:
        raise BadInput(f"tensor {name!r}: axis {axis} has size {n}, which is not {heads} heads x {head_dim}")
    if heads >= tp:
        if heads % tp:
            raise BadInput(f"tensor {name!r}: {heads} heads cannot be split evenly over tp={tp}")
        k = heads // tp
        return [[(base + r * k * hd, base + (r + 1) * k * hd)] for r in range(tp)]
    if not shared:
        raise BadInput(f"tensor {name!r}: {heads} query heads cannot be split over tp={tp} ranks")
    if tp % heads:
        raise BadInput(f"tensor {name!r}: {heads} heads cannot be shared evenly by tp={tp} ranks")
    return [[(base + (r * heads // tp) * hd, base + (r * heads // tp + 1) * hd)] for r in range(tp)]


def split(name, shape, rule, layout, tp):
    """(axis, per-rank intervals) for one tensor under one rule, for tp ranks."""
    axis = rule_axis(rule, layout, len(shape)) if rule else None
    if axis is None:
        return None, None
    n = shape[axis]
    kind = rule.kind
    if kind == "qkv":
        q, kv, hd = rule.heads, rule.kv_heads, rule.head_dim
        if (q + 2 * kv) * hd != n:
            raise BadInput(f"tensor {name!r}: axis {axis} has size {n}, not ({q} + 2 x {kv}) heads x {hd}")
        qs = _heads(name, q * hd, q, hd, tp, axis)
        ks = _heads(name, kv * hd, kv, hd, tp, axis, base=q * hd, shared=True)
        vs = _heads(name, kv * hd, kv, hd, tp, axis, base=(q + kv) * hd, shared=True)
        return axis, [qs[r] + ks[r] + vs[r] for r in range(tp)]
    if kind == "gate_up":
        if n % 2:
            raise BadInput(f"tensor {name!r}: gate_up axis {axis} has odd size {n}")
        half = n // 2
        gates, ups = _even(name, half, tp, axis, "half size"), _even(name, half, tp, axis, "half size")
        return axis, [gates[r] + [(a + half, b + half) for a, b in ups[r]] for r in range(tp)]
    if kind == "column" and rule.heads:
        return axis, _heads(name, n, rule.heads, rule.head_dim, tp, axis)
    if kind == "column" and rule.kv_heads:
        return axis, _heads(name, n, rule.kv_heads, rule.head_dim, tp, axis, shared=True)
    return axis, _even(name, n, tp, axis)


def plan(tensors, rules: RuleSet, tp: int, ep: int = 1, pad_vocab: bool = False) -> list:
    """The whole layout as data: one TensorPlan per tensor, ranks = ep groups x tp (rank = g * tp + t).
    Quantization scales (`X.scales` beside `X.weight`) follow their weight's plan."""
    if tp < 1 or ep < 1:
        raise UsageError("--tp and --ep must be at least 1")
    names = {t.name for t in tensors}
    experts_named = sorted({int(m.group(1)) for t in tensors if (m := re.search(r"\.experts\.(\d+)\.", t.name))})
    by_name = {t.name: _tensor_plan(t, rules, tp, ep, experts_named, pad_vocab)
               for t in tensors if _weight_of(t.name, names) is None}
    for t in tensors:
        weight = _weight_of(t.name, names)
        if weight is not None:
            by_name[t.name] = _scales_plan(t, by_name[weight])
    return [by_name[t.name] for t in tensors]


def _weight_of(name, names):
    base = name[:-len(".scales")] + ".weight" if name.endswith(".scales") else None
    return base if base in names else None


def _tensor_plan(t, rules, tp, ep, experts_named, pad_vocab=False):
    rule = rules.match(t.name)
    ranks = tp * ep
    if pad_vocab and rule is not None and rule.kind == "vocab" and t.shape and t.shape[0] % tp:
        padded = -(-t.shape[0] // tp) * tp  # the one documented exception: zero rows up to a multiple of tp
        k = padded // tp
        ranges = [[(r % tp * k, (r % tp + 1) * k)] for r in range(ranks)]
        return TensorPlan(t.name, t.shape, t.dtype, f"vocab (padded to {padded})", 0, ranges, ep == 1, padded)
    if rule is None or (rule.kind == "replicate"):
        why = "replicate" if rule else "replicate (no rule matched)"
        return TensorPlan(t.name, t.shape, t.dtype, why, None, [None] * ranks, False)
    if ep > 1 and rule.experts:  # stacked experts: whole experts per expert group, same on its tp ranks
        n = t.shape[0]
        if n % ep:
            raise BadInput(f"tensor {t.name!r}: {n} experts cannot be split over ep={ep}")
        k = n // ep
        ranges = [[(g * k, (g + 1) * k)] for g in range(ep) for _ in range(tp)]
        return TensorPlan(t.name, t.shape, t.dtype, f"expert groups (ep={ep})", 0, ranges, False)
    axis, per_tp = split(t.name, t.shape, rule, rules.layout, tp)
    if axis is None:
        return TensorPlan(t.name, t.shape, t.dtype, rule.describe() + " -> replicate", None, [None] * ranks, False)
    m = re.search(r"\.experts\.(\d+)\.", t.name)
    if ep > 1 and m:  # one tensor per expert: only its expert group holds it
        per_group = math.ceil(len(experts_named) / ep)
        group = experts_named.index(int(m.group(1))) // per_group
        ranges = [per_tp[r % tp] if r // tp == group else [] for r in range(ranks)]
    else:
        ranges = [per_tp[r % tp] for r in range(ranks)]
    n = t.shape[axis]
    even = ep == 1 and all(ranges[r] == [(r * n // tp, (r + 1) * n // tp)] for r in range(tp))
    return TensorPlan(t.name, t.shape, t.dtype, rule.describe(), axis, ranges, even)


def _scales_plan(t, w: TensorPlan) -> TensorPlan:
    """Scales of a quantized weight follow it: same intervals along N (or experts), group intervals
    along a grouped K axis, replicated when there is one group."""
    if w.axis is None or len(t.shape) != len(w.shape):
        return TensorPlan(t.name, t.shape, t.dtype, "scales of a replicated weight", None, [None] * len(w.ranges),
                          False)
    ws, ss = w.shape[w.axis], t.shape[w.axis]
    if ss == ws:
        return TensorPlan(t.name, t.shape, t.dtype, "scales with their weight", w.axis, w.ranges, w.even)
    if ss == 1:
        return TensorPlan(t.name, t.shape, t.dtype, "scales (one group): replicate", None, [None] * len(w.ranges),
                          False)
    if ws % ss:
        raise BadInput(f"tensor {t.name!r}: {ss} scale groups do not divide axis {w.axis} of size {ws}")
    rows = ws // ss
    ranges = []
    for rank in w.ranges:
        if any(a % rows or b % rows for a, b in rank):
            raise BadInput(f"tensor {w.name!r}: a quantization group of {rows} rows along axis {w.axis} would "
                           "straddle two ranks; reshard a dequantized copy (--dequantize) instead")
        ranges.append([(a // rows, b // rows) for a, b in rank])
    n = ss // len(w.ranges) if w.even else 0
    even = w.even and all(ranges[r] == [(r * n, (r + 1) * n)] for r in range(len(ranges)))
    return TensorPlan(t.name, t.shape, t.dtype, f"scales by group ({ss} groups)", w.axis, ranges, even)


def rank_pieces(sources: dict, plans, rank) -> list:
    """Rank `rank`'s pieces as lazy sources: slices of the global tensors, joined in range order."""
    out = []
    for p in plans:
        src = sources[p.name] if p.padded is None else zero_padded(sources[p.name], p.axis, p.padded)
        if p.axis is None:
            out.append(src)
            continue
        if not p.ranges[rank]:
            continue
        parts = [src.sliced(p.axis, a, b) for a, b in p.ranges[rank]]
        out.append(parts[0].renamed(p.name) if len(parts) == 1 else Concat(p.name, parts, p.axis))
    return out


def _streams_in_order(p: TensorPlan) -> bool:
    """Pieces written rank by rank give the global bytes in order (so the global digest is a tap)."""
    return p.axis is not None and p.even and p.padded is None and all(n == 1 for n in p.shape[:p.axis])


def zero_padded(src, axis, size) -> Computed:
    """`src` with zero rows appended along `axis` up to `size` (--pad-vocab)."""
    n = src.shape[axis]
    shape = src.shape[:axis] + (size,) + src.shape[axis + 1:]

    def compute(index):
        out = np.zeros(tuple(s.stop - s.start for s in index), src.dtype.numpy)
        start, stop = index[axis].start, min(index[axis].stop, n)
        if start < stop:  # the part of the region that lies inside the real tensor
            dest, real = [slice(None)] * len(index), list(index)
            dest[axis], real[axis] = slice(0, stop - start), slice(start, stop)
            out[tuple(dest)] = src.region(tuple(real))
        return out

    return Computed(src.name, src.dtype, shape, compute, (src,))


def reshard(src, out, tp, ep=1, preset=None, rules_file=None, heads=None, read=None, fmt=None,
            max_shard_size=5 * 10**9, overwrite=False, dry_run=False, quiet=False, fsync=False, cluster=None,
            pad_vocab=False, direct=True):
    started = time.perf_counter()
    ckpt = open_checkpoint(src, fmt, read or ReadOptions())
    names = [t.name for t in ckpt.tensors]
    if preset is None and rules_file is None and ckpt.source.get("rules"):
        rules = recorded(ckpt.source["rules"])  # a resharded source: the preset it recorded
    else:
        rules = choose(names, read_config(ckpt.model_files), preset, rules_file, heads or {})
    plans = plan(ckpt.tensors, rules, tp, ep, pad_vocab)
    if not any(p.axis is not None for p in plans):
        raise UsageError(f"{src}: the {rules.name} rules split no tensor of this checkpoint; an output in which "
                         "nothing is split would be a mistake (check --preset/--rules)")
    summary = plan_summary(plans, rules, tp, ep)
    if dry_run:
        return summary
    if not getattr(readers()[ckpt.source["format"]], "DATA", True):
        raise UsageError(f"{src}: a shapes-only description holds no data; use --dry-run or `ckptconv plan`")
    sources = {t.name: t for t in ckpt.tensors}
    ranks = tp * ep
    total = sum(p.piece_bytes(r) for p in plans for r in range(ranks))

    def write(tmp, my_ranks, progress=None, taps=None):
        """Write the rank directories `my_ranks`; returns rank 0's piece digests if it is among them."""
        check_space(tmp, sum(p.piece_bytes(r) for p in plans for r in my_ranks), ckpt.model_files, len(my_ranks))
        streams = write_ranks(tmp, my_ranks, plans, sources, max_shard_size, progress, fsync, taps, direct)
        for rank, stream in streams.items():
            source = {**ckpt.source, "resharded": {"tp": tp, "ep": ep, "rank": rank},
                      **({"skipped_files": ckpt.skipped_files} if ckpt.skipped_files else {})}
            copy_files(stream.out_dir, ckpt.model_files, stream.written)
            finish(stream.out_dir, stream.shards, stream.written, source, ckpt.extras)
        return {n: v["sha256"] for n, v in streams[0].written.tensors.items()} if 0 in streams else None

    if cluster is not None:
        _reshard_on_cluster(cluster, out, overwrite, plans, rules, tp, ep, ckpt, sources, write, ckpt.inputs(src))
    else:
        taps = {p.name: sha256.new() for p in plans if _streams_in_order(p) or _scatters(p)}
        with atomic_output(out, overwrite, inputs=ckpt.inputs(src)) as tmp, \
                byte_progress(total, "reshard", quiet) as progress:
            rank0 = write(tmp, list(range(ranks)), progress, taps)
            mesh = mesh_json(plans, rules, tp, ep, ckpt.source, global_digests(plans, sources, taps, rank0))
            write_json(tmp, "mesh.json", mesh)
            write_top_sums(tmp)
            ckpt.check_unchanged()
    seconds = time.perf_counter() - started
    summary.update({"out": str(out), "seconds": round(seconds, 3), "bytes_written": total,
                    "gb_per_s": round(total / seconds / 1e9, 3) if seconds else None})
    return summary


def _scatters(p: TensorPlan) -> bool:
    """Split on a later axis, with rows small enough to read whole: read each block of rows once and
    hand every rank its columns (instead of every rank gathering its columns from the whole tensor)."""
    if p.axis is None or _streams_in_order(p) or p.axis == 0 or not math.prod(p.shape):
        return False
    return math.prod(p.shape[1:]) * p.dtype.itemsize <= CHUNK


def write_ranks(tmp, ranks, plans, sources, max_shard_size, progress=None, fsync=False, taps=None,
                direct=True) -> dict:
    """Every rank directory's shards written side by side, tensor by tensor: a tensor split on a later
    axis is read once for all ranks; the others are sliced per rank. Returns {rank: finished OutputStream}."""
    taps = taps or {}
    pieces = {r: {t.name: t for t in rank_pieces(sources, plans, r)} for r in ranks}
    pipeline = Pipeline()
    streams = {}
    try:
        for r in ranks:
            rank_dir = Path(tmp) / f"rank-{r:05d}"
            rank_dir.mkdir()
            streams[r] = OutputStream(rank_dir, plan_shards(list(pieces[r].values()), max_shard_size), pipeline, fsync,
                                      direct=direct)
        for p in plans:
            holders = [r for r in ranks if p.name in pieces[r]]
            if _scatters(p):
                _scatter(p, sources[p.name], holders, pieces, streams, pipeline, progress, taps.get(p.name))
                continue
            for r in holders:
                f, file_h = streams[r].file_for(p.name)
                piece = pieces[r][p.name]
                streams[r].record(piece, write_tensor(f, file_h, piece, pipeline, progress, taps.get(p.name)))
        for stream in streams.values():
            stream.finish()
        return streams
    except BaseException:
        for stream in streams.values():
            stream.abandon()
        raise
    finally:
        pipeline.close()


def _scatter(p, src, holders, pieces, streams, pipeline, progress, global_h):
    rows = max(1, CHUNK // (math.prod(p.shape[1:]) * p.dtype.itemsize))
    digests = {r: sha256.new() for r in holders}
    lead = (slice(None),) * p.axis
    try:
        for a in range(0, p.shape[0], rows):
            block = np.ascontiguousarray(src.region((slice(a, min(a + rows, p.shape[0])),)))
            pending = pipeline.hashes.feed(as_bytes(block), tap=global_h)
            for r in holders:
                parts = [block[lead + (slice(lo, hi),)] for lo, hi in p.ranges[r]]
                f, file_h = streams[r].file_for(p.name)
                fill_at, nbytes = _gather(parts, p.axis)
                pipeline.push_range(f, file_h, digests[r], fill_at, 0, nbytes, progress=progress)
            for f in pending:
                f.result()
            src.release()
    except (ValueError, IndexError) as e:
        raise BadInput(f"tensor {p.name!r}: cannot read its data: {e}") from None
    for r in holders:
        streams[r].record(pieces[r][p.name], pipeline.hashes.digest("tensor", digests[r]))


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


def _reshard_on_cluster(cluster, out, overwrite, plans, rules, tp, ep, ckpt, sources, write, inputs):
    """Rank directories are split among processes by bytes, and so are the global digests of split
    tensors; process 0 writes mesh.json from everyone's digests and publishes."""
    ranks = tp * ep
    owner = assign([sum(p.piece_bytes(r) for p in plans) for r in range(ranks)], cluster.num_processes)
    split = [p for p in plans if p.axis is not None]
    digest_owner = assign([math.prod(p.shape) * p.dtype.itemsize for p in split], cluster.num_processes)
    tmp = temp_path(Path(out))

    def work():
        rank0 = write(tmp, [r for r in range(ranks) if owner[r] == cluster.process_id])
        mine = [p for p, o in zip(split, digest_owner) if o == cluster.process_id]
        glob = global_digests(mine, sources, {}, {})
        ckpt.check_unchanged()
        return {"rank0": rank0, "global": glob}

    def publish(tmp_dir):
        results = run_guarded(cluster, "ranks", work)
        rank0 = next(r["rank0"] for r in results if r["rank0"] is not None)
        digests = {p.name: rank0[p.name] for p in plans if p.axis is None}
        for r in results:
            digests.update(r["global"])
        write_json(tmp_dir, "mesh.json", mesh_json(plans, rules, tp, ep, ckpt.source, digests))
        write_top_sums(tmp_dir)

    on_cluster(cluster, out, overwrite, publish, lambda: run_guarded(cluster, "ranks", work), inputs)


def write_top_sums(out_dir):
    """OUT/SHA256SUMS over mesh.json and every other top-level regular file (the rank directories
    carry their own), so nothing in a reshard output is unhashed."""
    digests = {}
    with os.scandir(out_dir) as it:
        for entry in it:
            if entry.name != SUMS and entry.is_file(follow_symlinks=False):
                digests[entry.name] = sha256_file(entry.path)
    write_sums(out_dir, digests)


def global_digests(plans, sources, taps, rank0) -> dict:
    """Each global tensor's SHA-256: rank 0's piece when replicated, the tap when pieces streamed in
    order, else one bounded streaming pass over the source tensor."""
    out = {}
    for p in plans:
        if p.axis is None:
            out[p.name] = rank0[p.name]
        elif p.name in taps:
            out[p.name] = taps[p.name].hexdigest()
        else:
            out[p.name] = sha256_of(sources[p.name])
    return out


def mesh_json(plans, rules, tp, ep, source, digests) -> dict:
    tensors = {}
    for p in plans:
        entry = {"shape": list(p.shape), "dtype": p.dtype.code, "axis": p.axis, "rule": p.rule,
                 "sha256": digests[p.name]}
        if p.axis is not None and not p.even:
            entry["ranges"] = [[list(iv) for iv in r] for r in p.ranges]
        if p.padded is not None:
            entry["padded_shape"] = list(p.shape[:p.axis] + (p.padded,) + p.shape[p.axis + 1:])
        tensors[p.name] = entry
    return {"format": MESH_FORMAT, "tp": tp, "ep": ep, "ranks": tp * ep,
            "rank_order": "rank = expert_group * tp + tp_rank", "rules": rules.to_json(),
            "source": {k: v for k, v in source.items() if k != "rules"}, "tensors": tensors}


def plan_summary(plans, rules, tp, ep) -> dict:
    ranks = tp * ep
    rows = [{"name": p.name, "rule": p.rule, "axis": p.axis, "shape": list(p.shape), "dtype": p.dtype.code,
             "bytes_per_rank": [p.piece_bytes(r) for r in range(ranks)], **({"ranges": p.ranges}
                                                                           if p.axis is not None and not p.even else {})}
            for p in plans]
    return {"preset": rules.name, "layout": rules.layout, "params": rules.params, "tp": tp, "ep": ep,
            "ranks": ranks, "tensors": rows,
            "split": sum(p.axis is not None for p in plans),
            "replicated": [p.name for p in plans if p.axis is None],
            "bytes_per_rank": [sum(p.piece_bytes(r) for p in plans) for r in range(ranks)],
            "source_bytes": sum(math.prod(p.shape) * p.dtype.itemsize for p in plans)}
