"""How each tensor is split over a tensor-parallel (and expert-parallel) mesh, as pure data.

For every tensor: the rule that matched, the split axis and, per rank, the intervals of the global
tensor along that axis that make up the rank's piece (`plan`). A source that is itself sliced (a
previous reshard, DCP chunks) is planned the same way. The mesh format: docs/output.md.
"""
import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import BadInput, UsageError, brief
from ..rowview import RowView
from ..tensor import Concat
from ..formats.mesh import recorded_cut
from .rules import RuleSet


@dataclass(slots=True)
class TensorPlan:
    name: str
    shape: tuple
    dtype: object
    rule: str
    axis: int | None
    ranges: list           # per rank: list of (start, stop) along axis; [] = absent; None axis = whole
    even: bool             # ranges are the r-th of N equal blocks (not recorded in mesh.json)
    padded: int | None = None  # --pad-vocab: the axis is zero-padded to this size before splitting
    outer: tuple | None = None  # (axis, per rank (start, stop)): cut there first (experts by --ep), then `ranges`

    def piece_shape(self, rank):
        axis = self.axis
        if axis is None:
            return self.shape
        ranges = self.ranges[rank]
        n = ranges[0][1] - ranges[0][0] if len(ranges) == 1 else sum(b - a for a, b in ranges)
        if self.outer is None:
            return self.shape[:axis] + (n,) + self.shape[axis + 1:]
        shape = list(self.shape)
        shape[axis] = n
        a, b = self.outer[1][rank]
        shape[self.outer[0]] = b - a
        return tuple(shape)

    def piece_bytes(self, rank) -> int:
        if self.axis is not None and not self.ranges[rank]:
            return 0
        return math.prod(self.piece_shape(rank)) * self.dtype.itemsize


def holds(p: TensorPlan, rank: int) -> bool:
    """Whether rank `rank` has a piece of the tensor (a replicated one, or one of its intervals)."""
    return p.axis is None or bool(p.ranges[rank])


class Piece:
    """A rank's piece of a tensor, as its shard plan, header and manifest see it: its plan and rank,
    the rest worked out when read (most readers want only the name)."""

    __slots__ = ("plan", "rank")

    def __init__(self, plan: TensorPlan, rank: int):
        self.plan, self.rank = plan, rank

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def dtype(self):
        return self.plan.dtype

    @property
    def shape(self) -> tuple:
        return self.plan.piece_shape(self.rank)

    @property
    def nbytes(self) -> int:
        return self.plan.piece_bytes(self.rank)


class RankPieces(Sequence):
    """One rank's pieces in layout order, each made when asked for (a Piece, from its plan): a
    reshard of a million tensors does not hold a row per rank per tensor for the whole run. A slice
    is another view of the same plans (a shard's pieces), not a copy."""

    __slots__ = ("plans", "rank", "start", "stop")

    def __init__(self, plans: list, rank: int, start: int = 0, stop: int | None = None):
        self.plans, self.rank, self.start = plans, rank, start
        self.stop = len(plans) if stop is None else stop

    @classmethod
    def of(cls, layout: list, rank: int) -> "RankPieces":
        """Rank `rank`'s pieces of `layout` (the layout itself where the rank holds every tensor)."""
        return cls(layout if all(holds(p, rank) for p in layout) else [p for p in layout if holds(p, rank)], rank)

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, k):
        if isinstance(k, slice):
            start, stop, step = k.indices(len(self))
            if step != 1:
                raise ValueError("a rank's pieces are sliced one by one, in order (no step)")
            return RankPieces(self.plans, self.rank, self.start + start, self.start + max(start, stop))
        if not -len(self) <= k < len(self):
            raise IndexError(k)
        return Piece(self.plans[self.start + k % len(self)], self.rank)

    def __iter__(self):
        rank = self.rank
        for k in range(self.start, self.stop):
            yield Piece(self.plans[k], rank)


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
    return _blocks(n, tp)


@functools.lru_cache(maxsize=4096)
def _blocks(n, tp) -> list:
    """The tp equal blocks of n, one list shared by every tensor of that size (plans are never
    changed once made): a million small tensors do not each get their own."""
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


def joined(name, pieces: list, rule, layout: str, where=""):
    """The global tensor whose split by `rule` over len(pieces) ranks gives `pieces` (rank order): the
    inverse of `split`, from the same intervals. Each rank's piece is cut back into its intervals and
    the cuts are joined in place, lazily (slices of the pieces, no copy). Every piece must have the
    first one's shape; an interval that two ranks hold (kv heads shared by several ranks) is taken from
    the first. A replicated tensor (no axis) is the first piece. BadInput naming `where` otherwise."""
    first, tp = pieces[0], len(pieces)
    for r, p in enumerate(pieces):
        if p.shape != first.shape or p.dtype != first.dtype:
            raise BadInput(f"{where}tensor {name!r}: tp rank {r} holds {p.dtype.code}{list(p.shape)}, tp rank 0 "
                           f"{first.dtype.code}{list(first.shape)}")
    axis = rule_axis(rule, layout, len(first.shape)) if rule is not None and rule.kind != "replicate" else None
    if axis is None or tp == 1 or not math.prod(first.shape):
        return first if first.name == name else first.renamed(name)
    shape = first.shape[:axis] + (first.shape[axis] * tp,) + first.shape[axis + 1:]
    _, ranges = split(name, shape, rule, layout, tp)
    cuts = []
    for r, held in enumerate(ranges):
        piece, at = pieces[r], 0
        for a, b in held:
            whole = (at, at + b - a) == (0, piece.shape[axis])
            cuts.append((a, b, piece if whole else piece.sliced(axis, at, at + b - a)))
            at += b - a
        if at != piece.shape[axis]:
            raise BadInput(f"{where}tensor {name!r}: tp rank {r}'s piece has {piece.shape[axis]} along axis {axis}, "
                           f"the {rule.describe()} split gives it {at}")
    parts, end = [], 0
    for a, b, part in sorted(cuts, key=lambda c: c[0]):
        if b <= end:
            continue   # (held by an earlier rank too)
        parts.append(part)
        end = b
    if end != shape[axis]:
        raise BadInput(f"{where}tensor {name!r}: the ranks' pieces do not make up axis {axis} of {list(shape)}")
    return parts[0].renamed(name) if len(parts) == 1 else Concat(name, parts, axis)


_EXPERT = re.compile(r"\.experts\.([0-9]+)\.")   # (ASCII digits: \d takes every script's)


def expert_numbers(names, where="") -> dict:
    """{module prefix (up to `.experts.`): number of experts} for per-expert tensors (`….experts.N.…`),
    each prefix's experts numbered 0..E-1 and spelled canonically (`01` and `1` would be one
    expert): BadInput otherwise. The one check of expert numbering, for every mode that groups or
    stacks experts (reshard --ep, --target vllm)."""
    found = {}
    for name in names:
        m = _EXPERT.search(name)
        if m:
            if len(m.group(1)) > 9 or str(int(m.group(1))) != m.group(1):
                raise BadInput(f"{where}tensor {brief(name, 120)}: expert number {brief(m.group(1), 20)} is not written "
                               "canonically")
            found.setdefault(name[:m.start()], set()).add(int(m.group(1)))
    for prefix, numbers in found.items():
        if numbers != set(range(len(numbers))):
            shown = sorted(numbers)
            listed = ", ".join(map(str, shown[:8])) + (" …" if len(shown) > 8 else "")
            raise BadInput(f"{where}the experts of {prefix} are numbered {listed}, not 0..{len(numbers) - 1}: an "
                           "expert is missing or misnamed")
    return {prefix: len(numbers) for prefix, numbers in found.items()}


MAX_RANKS = 65536   # ranks of one mesh (tp x ep): a rank directory and intervals each


def plan(tensors, rules: RuleSet, tp: int, ep: int = 1, pad_vocab: bool = False) -> list:
    """The whole layout as data: one TensorPlan per tensor, ranks = ep groups x tp (rank = g * tp + t).
    Quantization scales (`X.scales` beside `X.weight`) follow their weight's plan."""
    if tp < 1 or ep < 1:
        raise UsageError("--tp and --ep must be at least 1")
    if tp * ep > MAX_RANKS:
        raise UsageError(f"--tp {tp} x --ep {ep}: more than the {MAX_RANKS} ranks one mesh may have")
    names = {t.name for t in tensors}
    experts_named = expert_numbers(names) if ep > 1 else {}
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
    if rule is None or rule.kind == "replicate" or not math.prod(t.shape):
        why = "replicate" if rule else "replicate (no rule matched)"
        why = why if math.prod(t.shape) else "empty: replicate"   # nothing to cut (no empty pieces)
        return TensorPlan(t.name, t.shape, t.dtype, why, None, [None] * ranks, False)
    if ep > 1 and rule.experts:  # stacked experts [E, ...]: whole experts per expert group ...
        n = t.shape[0]
        if n % ep:
            raise BadInput(f"tensor {t.name!r}: {n} experts cannot be split over ep={ep}")
        k = n // ep
        groups = [(g * k, (g + 1) * k) for g in range(ep) for _ in range(tp)]
        axis, per_tp = split(t.name, t.shape, rule, rules.layout, tp)
        if axis in (None, 0) or tp == 1:   # ... the same on each tp rank of the group
            return TensorPlan(t.name, t.shape, t.dtype, f"expert groups (ep={ep})", 0, [[g] for g in groups], False)
        # ... each expert's own axis split by tp within the group: a piece cut on two axes
        return TensorPlan(t.name, t.shape, t.dtype, f"{rule.describe()} x expert groups (ep={ep})", axis,
                          [per_tp[r % tp] for r in range(ranks)], False, outer=(0, groups))
    axis, per_tp = split(t.name, t.shape, rule, rules.layout, tp)
    if axis is None:
        return TensorPlan(t.name, t.shape, t.dtype, rule.describe() + " -> replicate", None, [None] * ranks, False)
    m = _EXPERT.search(t.name)
    if ep > 1 and m:  # one tensor per expert: only its expert group holds it
        count = experts_named[t.name[:m.start()]]
        if count % ep:
            raise BadInput(f"tensor {t.name!r}: {count} experts cannot be split over ep={ep}")
        group = int(m.group(1)) // (count // ep)
        ranges = [per_tp[r % tp] if r // tp == group else [] for r in range(ranks)]
    else:
        ranges = per_tp if ranks == tp else [per_tp[r % tp] for r in range(ranks)]
    n = t.shape[axis]
    even = ep == 1 and all(ranges[r] == [(r * n // tp, (r + 1) * n // tp)] for r in range(tp))
    return TensorPlan(t.name, t.shape, t.dtype, rule.describe(), axis, ranges, even)


def _scales_plan(t, w: TensorPlan) -> TensorPlan:
    """Scales of a quantized weight follow it: same intervals along N (or experts), group intervals
    along a grouped K axis, replicated when there is one group (within the weight's expert group)."""
    if w.axis is None or len(t.shape) != len(w.shape) or (w.outer and t.shape[0] != w.shape[0]):
        return TensorPlan(t.name, t.shape, t.dtype, "scales of a replicated weight", None, [None] * len(w.ranges),
                          False)
    ws, ss = w.shape[w.axis], t.shape[w.axis]
    if ss == ws:
        return TensorPlan(t.name, t.shape, t.dtype, "scales with their weight", w.axis, w.ranges, w.even,
                          outer=w.outer)
    if ss == 1 and w.outer:
        return TensorPlan(t.name, t.shape, t.dtype, "scales (one group): their weight's expert groups", w.outer[0],
                          [[g] for g in w.outer[1]], False)
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
    return TensorPlan(t.name, t.shape, t.dtype, f"scales by group ({ss} groups)", w.axis, ranges, even,
                      outer=w.outer)


REPLICATED_SHARE = 0.01   # a replicated tensor holding more of the model than this is a mistake, unless asked for


def silent_replication(plans, rules: RuleSet, allow=()) -> list:
    """(name, bytes) of replicated tensors of two or more dimensions that nothing asked to replicate
    (no `replicate` rule, no --allow-replicate pattern): all of them when the preset was guessed from
    tensor names, else those holding more than REPLICATED_SHARE of the model's bytes. A norm or bias
    (one dimension) is always replicated; a whole expert or projection on every rank rarely is meant."""
    total = sum(math.prod(p.shape) * p.dtype.itemsize for p in plans)
    allow = [re.compile(a) for a in allow]   # compiled once (a long list would thrash re's cache)
    found = []
    for p in plans:
        if p.axis is not None or len(p.shape) < 2:
            continue
        nbytes = math.prod(p.shape) * p.dtype.itemsize
        if not (rules.guessed or nbytes > REPLICATED_SHARE * total):
            continue
        rule = rules.match(p.name)
        if (rule is not None and rule.kind == "replicate") or any(a.fullmatch(p.name) for a in allow):
            continue
        found.append((p.name, nbytes))
    return found


def plan_row(p, ranks: int) -> dict:
    """A plan's row in `reshard --dry-run/--json`: name, rule, axis, shape, dtype, bytes_per_rank
    (and ranges or boxes)."""
    return {"name": p.name, "rule": p.rule, "axis": p.axis, "shape": list(p.shape), "dtype": p.dtype.code,
            "bytes_per_rank": [p.piece_bytes(r) for r in range(ranks)], **recorded_cut(p)}


def plan_summary(plans, rules, tp, ep) -> dict:
    ranks = tp * ep
    return {"preset": rules.name, "layout": rules.layout, "params": rules.params, "tp": tp, "ep": ep,
            "ranks": ranks, "tensors": RowView(plans, functools.partial(plan_row, ranks=ranks)),
            "split": sum(p.axis is not None for p in plans),
            "replicated": [p.name for p in plans if p.axis is None],
            "replicated_bytes": sum(math.prod(p.shape) * p.dtype.itemsize for p in plans if p.axis is None),
            "bytes_per_rank": [sum(p.piece_bytes(r) for p in plans) for r in range(ranks)],
            "source_bytes": sum(math.prod(p.shape) * p.dtype.itemsize for p in plans)}
