"""The DeepSpeed reader's tensors (readers/deepspeed.py reads with them): each parameter a lazy
join of slices of the ranks' flat fp32 partitions (stages 1-2 and 3), the frozen parameters, and the
check that no name is listed twice. Registers nothing: deepspeed.py is the reader.
"""
import math

from ..errors import BadInput, brief
from ..tensor import Concat, TensorSource
from .deepspeed_files import ModelStates, _found
from .pickle.torch_globals import TorchTensor


# --- Tensors -------------------------------------------------------------------------------------

class Shaped(TensorSource):
    """A flat (1-D) source seen in `shape`, row-major: a region reads the rows it spans."""

    __slots__ = ("base", "name", "dtype", "shape")

    def __init__(self, base: TensorSource, name: str, shape: tuple):
        self.base, self.name, self.dtype, self.shape = base, name, base.dtype, tuple(shape)

    def _region(self, index):
        if not self.shape:
            return self.base.region((slice(0, 1),)).reshape(())
        inner = math.prod(self.shape[1:])
        rows = index[0]
        flat = self.base.region((slice(rows.start * inner, rows.stop * inner),))
        return flat.reshape((rows.stop - rows.start,) + self.shape[1:])[(slice(None),) + tuple(index[1:])]

    def file_span(self):
        return self.base.file_span()

    def release(self):
        self.base.release()


def _span(parts, start: int, n: int, name: str) -> TensorSource:
    """Elements [start, start + n) of the 1-D sources `parts` laid end to end."""
    pieces, at = [], 0
    for p in parts:
        size = p.shape[0]
        lo, hi = max(start, at), min(start + n, at + size)
        if lo < hi:
            pieces.append(p if (lo, hi) == (at, at + size) else p.sliced(0, lo - at, hi - at))
        at += size
    if not pieces:
        return parts[0].sliced(0, 0, 0)
    return pieces[0] if len(pieces) == 1 else Concat(name, pieces, 0)


def _tensor(base: TensorSource, name: str, shape: tuple) -> TensorSource:
    return Shaped(base, name, shape)


def _stage12(ranks: list, states: ModelStates, paddings) -> list:
    """Each group's partitions end to end; parameters one after another in param_shapes order, each
    followed by its alignment padding; what is left at the end is the group's padding."""
    world, out = len(ranks), []
    first = ranks[0]
    if len(states.param_shapes) != len(first.groups):
        raise BadInput(f"{states.path}: param_shapes has {len(states.param_shapes)} parameter groups, "
                       f"{first.path.name} has {len(first.groups)} partitions")
    align = 2 * world   # DeepSpeed pads each group to a multiple of 2 x world
    for g, shapes in enumerate(states.param_shapes):
        parts = [r.groups[g] for r in ranks]
        pads = paddings[g] if paddings is not None else [0] * len(shapes)
        if len(pads) != len(shapes):
            raise BadInput(f"{first.path}: param_alignment_paddings[{g}] has {len(pads)} entries for "
                           f"{len(shapes)} parameters")
        wanted_elems = sum(math.prod(s) for _, s in shapes) + sum(pads)
        held = sum(p.shape[0] for p in parts)
        if not (wanted_elems <= held and -(-wanted_elems // align) == -(-held // align)):
            raise BadInput(f"{first.path}: parameter group {g}: param_shapes in {states.path.name} need "
                           f"{wanted_elems} elements, the {world} ranks' partitions hold {held} "
                           f"({', '.join(str(p.shape[0]) for p in parts[:8])}{' ...' if world > 8 else ''}): they "
                           f"differ by more than the padding to a multiple of {align} the format allows; refused")
        offset = 0
        for (name, shape), pad in zip(shapes, pads):
            n = math.prod(shape)
            out.append(_tensor(_span(parts, offset, n, name), name, shape))
            offset += n + pad
    return out


def _stage3(ranks: list, states: list) -> list:
    """Each parameter holds ceil(numel / world) elements of every rank's groups (laid end to end),
    in param_shapes order; the pieces of all ranks, in rank order, begin with the parameter."""
    world, first = len(ranks), ranks[0]
    sizes = [p.shape[0] for p in first.groups]
    for r in ranks[1:]:
        mine = [p.shape[0] for p in r.groups]
        if mine != sizes:
            raise BadInput(f"{r.path}: its fp32 partitions hold {brief(mine)} elements, rank 0's {brief(sizes)}; at "
                           "ZeRO stage 3 every rank holds the same; refused")
    shapes = [x for g in states[0].param_shapes for x in g]
    need = sum(-(-math.prod(s) // world) for _, s in shapes)
    if need != sum(sizes):
        raise BadInput(f"{first.path}: param_shapes in {states[0].path.name} need {need} elements of each rank "
                       f"(ceil(numel / {world}) per parameter), the partitions hold {sum(sizes)}; refused")
    out, offset = [], 0
    for name, shape in shapes:
        n = math.prod(shape)
        part = -(-n // world)
        pieces = [_span(r.groups, offset, part, name) for r in ranks]
        joined = pieces[0] if world == 1 else Concat(name, pieces, 0)
        out.append(_tensor(joined if part * world == n else _span([joined], 0, n, name), name, shape))
        offset += part
    return out


def _frozen(states: list, stage: int, world: int) -> list:
    """Frozen parameters: whole in the one model-state file (stages 1-2), or one piece per rank of
    ceil(numel / world) elements (stage 3)."""
    out = []
    for name, shape in states[0].frozen_shapes:
        n = math.prod(shape)
        if stage < 3:
            t = states[0].frozen[name]
            if math.prod(t.shape) != n:
                raise BadInput(f"{states[0].path}: frozen parameter {name!r} holds {list(t.shape)}, "
                               f"frozen_param_shapes says {list(shape)}")
            src = t.source(name)
            out.append(src if tuple(t.shape) == shape else _tensor(_as_flat(src, name), name, shape))
            continue
        part = -(-n // world)
        pieces = []
        for s in states:
            t = s.frozen.get(name)
            if not isinstance(t, TorchTensor) or t.unsupported or math.prod(t.shape) != part:
                got = list(t.shape) if isinstance(t, TorchTensor) else _found(t)
                raise BadInput(f"{s.path}: frozen parameter {name!r}: its piece is {got}, not the {part} elements "
                               f"(ceil({n} / {world})) each rank holds at ZeRO stage 3")
            pieces.append(_as_flat(t.source(name), name))
        if len({p.dtype for p in pieces}) != 1:
            raise BadInput(f"{states[-1].path}: frozen parameter {name!r}: the ranks' pieces differ in dtype")
        joined = pieces[0] if world == 1 else Concat(name, pieces, 0)
        out.append(_tensor(_span([joined], 0, n, name) if part * world != n else joined, name, shape))
    return out


def _as_flat(src: TensorSource, name: str) -> TensorSource:
    """A (contiguous) tensor as one flat row of its elements."""
    if len(src.shape) == 1:
        return src
    n = math.prod(src.shape)
    return _Flattened(src, name, n)


class _Flattened(TensorSource):
    """A source's elements as one row (a frozen piece saved with its parameter's shape)."""

    __slots__ = ("base", "name", "dtype", "shape")

    def __init__(self, base, name, n):
        self.base, self.name, self.dtype, self.shape = base, name, base.dtype, (n,)

    def _region(self, index):
        return self.base.region().reshape(-1)[index[0]]

    def file_span(self):
        return self.base.file_span()

    def release(self):
        self.base.release()


def _check_names(tensors: list, shared: list, where):
    seen = set()
    for t in tensors:
        if t.name in seen:
            raise BadInput(f"{where}: {t.name!r} is listed twice (a buffer, frozen or trained parameter)")
        seen.add(t.name)
    for alias, name in shared:
        if alias in seen:
            raise BadInput(f"{where}: shared_params names {alias!r} a copy of {name!r}, but {alias!r} is saved "
                           "itself; refused")
