"""Reader for DeepSpeed ZeRO checkpoints (stages 1, 2 and 3), without torch or DeepSpeed: the fp32
master weights under the module's parameter names, as DeepSpeed's own
`get_fp32_state_dict_from_zero_checkpoint` gives them, read lazily from the ranks' partitions.

A checkpoint directory holds `latest` (the tag of the newest save) and one directory per tag
(`global_stepN/`); SRC may be either. A tag directory holds, per data-parallel rank R, the rank's
optimizer state, `[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`, and the module's state: one
`mp_rank_00_model_states.pt` at stages 1 and 2, one `zero_pp_rank_R_mp_rank_00_model_states.pt` per
rank at stage 3. All are torch.save zips, read with the torch reader's machinery (every pickle
through the allowlisting VM, with stand-ins for DeepSpeed's classes: pickle/deepspeed_globals.py).

What is read (docs/formats.md#deepspeed):
- of each optimizer-state file, the rank's flat fp32 partition per parameter group
  (`single_partition_of_fp32_groups` at stages 1-2, `fp32_flat_groups` at 3) and the numbers that
  say how the run was split; the Adam moments beside them are unpickled as records and never read;
- of the model-state file(s), `param_shapes` (names and shapes, in partition order), the frozen
  parameters (`frozen_param_fragments`: whole at stages 1-2, one piece per rank at 3), the buffers
  (`buffer_names`, from `module`; floating ones as fp32, as DeepSpeed restores them) and
  `shared_params` (tied names, written once: transforms.untie).

Each parameter is a lazy join of slices of the partitions: at stages 1-2 the groups' partitions end
to end, each parameter followed by its `param_alignment_paddings`; at 3 each parameter holds
ceil(numel / world) elements of every rank, one after another, the last rank's piece padded. Every
file name, count and size is checked against the others before any tensor is handed out.
"""
import math
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .base import Reader, register
from .. import dtypes
from ..errors import BadInput, brief, printable
from ..io.mapped import MappedFile
from ..limits import Budget, shape_problem
from ..tensor import Checkpoint, SourceFacts, Concat, MappedView, TensorSource, cast
from . import DEEPSPEED_RANK_FILE, ReadOptions, confined, deepspeed_tag_directory, model_files, source_root, wanted
from . import ziparchive
from .pickle import unpickler
from .pickle.deepspeed_globals import deepspeed_globals
from .pickle.torch_globals import TORCH_OWNED, TorchTensor
from .torch_pickle import justified, load_zip

NAME = "deepspeed"
LATEST = "latest"            # the file naming the newest tag
MAX_LATEST = 4096            # bytes of `latest` read (a tag is a directory name)

OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d{1,9})_mp_rank_(\d{1,9})_optim_states\.pt")
MODEL = re.compile(r"(?:zero_pp_rank_(\d{1,9})_)?mp_rank_(\d{1,9})_model_states\.pt")
# DeepSpeed files this reader does not merge: pipeline layers, MoE experts and their optimizer state
PIPELINE = re.compile(r"layer_\d+(-model_\d+)?-model_states\.pt")
EXPERT = re.compile(r"(layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt|expp_rank_\d+_mp_rank_\d+_optim_states\.pt")

F32 = dtypes.from_code("F32")


# --- Where the files are -------------------------------------------------------------------------

def read_tag(directory: Path, root: str) -> str | None:
    """The tag `latest` names (its text, stripped), or None when there is no `latest` file; a tag
    that is not a plain directory name, or a `latest` leading outside the checkpoint, is refused."""
    latest = directory / LATEST
    if not latest.is_file():
        return None
    confined(latest, root)
    try:
        with open(latest, "rb") as f:
            raw = f.read(MAX_LATEST + 1)
    except OSError as e:
        raise BadInput(f"{latest}: cannot read: {e.strerror}") from None
    if len(raw) > MAX_LATEST:
        raise BadInput(f"{latest}: longer than {MAX_LATEST} bytes; it should hold a tag (a directory name)")
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise BadInput(f"{latest}: not UTF-8 text; it should hold a tag (a directory name)") from None
    if (not tag or tag in (".", "..") or "/" in tag or "\\" in tag or "\0" in tag or not tag.isprintable()
            or len(tag.encode()) > 255):
        raise BadInput(f"{latest}: names {printable(repr(tag), 300)}, not a plain directory name inside "
                       f"{directory}; refused")
    return tag


def detect(path: Path) -> bool:
    """A directory holding `latest` (a DeepSpeed checkpoint directory: load says what is wrong with
    it, if anything) or DeepSpeed's rank files (a tag directory)."""
    try:
        if not path.is_dir():
            return False
        latest = path / LATEST
        if latest.is_file() and latest.stat().st_size <= MAX_LATEST:
            return True
        return any(DEEPSPEED_RANK_FILE.fullmatch(n) for n in os.listdir(path))
    except OSError:
        return False


# --- What one file says --------------------------------------------------------------------------

@dataclass
class OptimRank:
    """What one rank's optimizer-state file says about the fp32 partitions."""

    path: Path
    rank: int
    stage: int
    world: int                        # data-parallel ranks (partition_count)
    ds_version: str | None
    groups: list                      # per parameter group: the rank's flat partition (a 1-D source)
    paddings: list | None = None      # stages 1-2: param_alignment_paddings, per group per parameter


@dataclass
class ModelStates:
    """What a model-state file says: names, shapes, frozen parameters, buffers, tied names."""

    path: Path
    param_shapes: list                # per group: [(name, shape)], in partition order
    frozen_shapes: list               # [(name, shape)]
    frozen: dict                      # name -> TorchTensor (whole at stages 1-2, this rank's piece at 3)
    buffers: list                     # [(name, TorchTensor)], in the module's order
    shared: list                      # [(alias, name)]
    module_params: list               # names in `module` that are neither buffers nor listed parameters
    ds_version: str | None
    dp_world: int | None


@dataclass
class Layout:
    """The tag directory's files, by rank, checked by name."""

    directory: Path
    optim: list                       # rank -> Path
    model: dict                       # (rank or None, mp rank) -> Path, as named


def _field(obj, key, path, kinds, what=None, default=KeyError):
    if not isinstance(obj, dict) or key not in obj:
        if default is not KeyError:
            return default
        raise BadInput(f"{path}: not a DeepSpeed ZeRO checkpoint file: no {what or repr(key)}")
    value = obj[key]
    if not isinstance(value, kinds) or (kinds is int and type(value) is not int):
        raise BadInput(f"{path}: {what or repr(key)} is {_found(value)}, not "
                       f"{' or '.join(k.__name__ for k in (kinds if isinstance(kinds, tuple) else (kinds,)))}")
    return value


def _found(value) -> str:
    if value is None:
        return "None"
    if type(value) is int:
        return str(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, str):
        return printable(repr(value[:60]), 80)
    return f"a {type(value).__name__}"


def _count(value, what, path) -> int:
    if type(value) is not int or value < 0 or value > 2**40:
        raise BadInput(f"{path}: {what} is {_found(value)}, not a count")
    return value


def _flat(t, what, path) -> TorchTensor:
    """A rank's flat partition: a 1-D floating tensor."""
    if not isinstance(t, TorchTensor):
        raise BadInput(f"{path}: {what} is {_found(t)}, not a tensor")
    if t.unsupported or not t.dtype.is_float or len(t.shape) != 1:
        raise BadInput(f"{path}: {what} is a {getattr(t.dtype, 'code', t.unsupported)} tensor of shape "
                       f"{list(t.shape)}, not a flat floating partition")
    return t


def _shape(value, what, path) -> tuple:
    """A torch.Size as the VM builds it (a tuple of ints), checked as every tensor shape is."""
    if not isinstance(value, (tuple, list)):
        raise BadInput(f"{path}: {what} is {_found(value)}, not a shape")
    problem = shape_problem(tuple(value), 4)
    if problem:
        raise BadInput(f"{path}: {what}: {problem}")
    return tuple(value)


def _name(value, what, path) -> str:
    if not isinstance(value, str):
        raise BadInput(f"{path}: {what} is {_found(value)}, not a parameter name")
    return value


def _load(m: MappedFile, allow):
    # Only the pages touched: the zip's headers and the pickle lie between the storages, and a fault
    # otherwise reads around it (the Adam moments next to them); what is read later is advised then.
    m.advise(mmap.MADV_RANDOM)
    if not ziparchive.is_zip(m):
        raise BadInput(f"{m.path}: not a torch.save zip archive (DeepSpeed writes its checkpoint files with torch.save)")
    return load_zip(m, allow, budget=Budget(m.path))


def _version(obj, path):
    v = obj.get("ds_version") if isinstance(obj, dict) else None
    if v is not None and not isinstance(v, str):
        raise BadInput(f"{path}: ds_version is {_found(v)}, not a version string")
    return v


def read_optim(m: MappedFile, rank: int, allow) -> OptimRank:
    path = Path(m.path)
    top = _load(m, allow)
    osd = _field(top, "optimizer_state_dict", path, dict)
    stage = osd.get("zero_stage")
    if type(stage) is not int or stage not in (1, 2, 3):
        raise BadInput(f"{path}: zero_stage is {_found(stage)}, not a ZeRO stage of 1, 2 or 3")
    counts = osd.get("partition_count")
    counts = [counts] if type(counts) is int else counts
    if not isinstance(counts, list) or not counts:
        raise BadInput(f"{path}: partition_count is {_found(counts)}, not a rank count")
    counts = [_count(c, "partition_count", path) for c in counts]
    if len(set(counts)) != 1 or counts[0] < 1:
        raise BadInput(f"{path}: partition_count {brief(counts)}: parameter groups split over different numbers "
                       "of ranks (MoE expert groups) are not supported")
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    raw = _field(osd, key, path, (list, tuple))
    groups = [_flat(t, f"{key}[{i}]", path).source(f"{key}[{i}]") for i, t in enumerate(raw)]
    justified(m, groups)   # (views of one storage, listed a thousand times, are not a thousand partitions)
    version = _version(osd, path) or _version(top, path)
    rec = OptimRank(path, rank, stage, counts[0], version, groups)
    if stage < 3:
        pads = osd.get("param_alignment_paddings")
        if pads is not None:
            if not isinstance(pads, list) or len(pads) != len(groups) or not all(isinstance(p, list) for p in pads):
                raise BadInput(f"{path}: param_alignment_paddings is {_found(pads)}, not one list per group")
            pads = [[_count(x, "a param_alignment_paddings entry", path) for x in p] for p in pads]
        rec.paddings = pads
    return rec


def read_model(m: MappedFile, allow) -> tuple:
    """(ModelStates, the file's top-level dict)."""
    path = Path(m.path)
    top = _load(m, allow)
    if not isinstance(top, dict):
        raise BadInput(f"{path}: not a DeepSpeed model-state file (its pickle is {_found(top)})")
    module = _field(top, "module", path, dict)
    names = _field(top, "buffer_names", path, (list, tuple))
    buffer_names = {_name(n, "a buffer name", path) for n in names}
    groups = _field(top, "param_shapes", path, (list, tuple))
    shapes = []
    for i, g in enumerate(groups):
        if not isinstance(g, dict):
            raise BadInput(f"{path}: param_shapes[{i}] is {_found(g)}, not a dict of shapes")
        shapes.append([(_name(k, "a parameter name", path), _shape(v, f"param_shapes[{i}][{k!r}]", path))
                       for k, v in g.items()])
    frozen_shapes = top.get("frozen_param_shapes") or {}
    frozen = top.get("frozen_param_fragments") or {}
    if not isinstance(frozen_shapes, dict) or not isinstance(frozen, dict):
        raise BadInput(f"{path}: frozen_param_shapes/frozen_param_fragments are not dicts")
    frozen_list = [(_name(k, "a frozen parameter name", path), _shape(v, f"frozen_param_shapes[{k!r}]", path))
                   for k, v in frozen_shapes.items()]
    for name, _ in frozen_list:
        if not isinstance(frozen.get(name), TorchTensor) or frozen[name].unsupported:
            raise BadInput(f"{path}: frozen parameter {name!r} has no tensor in frozen_param_fragments")
    shared = _field(top, "shared_params", path, dict, default={}) or {}
    shared = [(_name(a, "a shared parameter name", path), _name(b, "a shared parameter name", path))
              for a, b in shared.items()]
    listed = {n for g in shapes for n, _ in g} | {n for n, _ in frozen_list}
    buffers, others = [], []
    for k, v in module.items():
        if k in buffer_names:
            if not isinstance(v, TorchTensor):
                raise BadInput(f"{path}: buffer {k!r} in module is {_found(v)}, not a tensor")
            buffers.append((k, v))
        elif isinstance(k, str) and k not in listed:
            others.append(k)
    justified(m, [t for _, t in buffers] + [t for n, t in frozen.items() if n in dict(frozen_list)])
    dp = top.get("dp_world_size")
    return ModelStates(path, shapes, frozen_list, frozen, buffers, shared, others, _version(top, path),
                       dp if type(dp) is int else None), top


# --- The tag directory ---------------------------------------------------------------------------

def _layout(directory: Path) -> Layout:
    """The rank files by name: every rank once, one model-parallel rank, no pipeline or expert files."""
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        raise BadInput(f"{directory}: cannot list: {e.strerror}") from None
    optim, model, mp = {}, {}, {}
    for n in names:
        o, md = OPTIM.fullmatch(n), MODEL.fullmatch(n)
        if PIPELINE.fullmatch(n):
            raise BadInput(f"{directory / n}: a pipeline-parallel layer file (DeepSpeed's PipelineModule): each "
                           "pipeline stage's files hold other layers, and merging them is not supported; refused")
        if EXPERT.fullmatch(n):
            raise BadInput(f"{directory / n}: a mixture-of-experts file; ZeRO checkpoints with expert parallelism "
                           "are not supported; refused")
        if o:
            rank, mp_rank = int(o.group(2)), int(o.group(3))
            if (rank, mp_rank) in optim:
                raise BadInput(f"{directory / n}: holds rank {rank}'s optimizer state, as "
                               f"{optim[(rank, mp_rank)].name} does: two runs' files in one directory; refused")
            optim[(rank, mp_rank)] = directory / n
            mp.setdefault(mp_rank, n)
        elif md:
            rank = int(md.group(1)) if md.group(1) is not None else None
            mp.setdefault(int(md.group(2)), n)
            if (rank, int(md.group(2))) in model:
                raise BadInput(f"{directory / n}: a second model-state file of rank {rank}; refused")
            model[(rank, int(md.group(2)))] = directory / n
    if not optim:
        raise BadInput(f"{directory}: holds no ZeRO optimizer-state files (*_optim_states.pt): not a DeepSpeed "
                       "ZeRO checkpoint, or one saved without its optimizer state")
    if set(mp) != {0}:
        shown = ", ".join(sorted({f"mp_rank_{k:02d}" for k in mp})[:6])
        raise BadInput(f"{directory}: holds files of {len(mp)} model-parallel ranks ({shown}): a tensor- or "
                       "pipeline-parallel checkpoint (as Megatron-DeepSpeed writes), whose ranks hold different "
                       "parts of each layer; merging them is not supported; refused")
    world = max(r for r, _ in optim) + 1
    missing = [r for r in range(world) if (r, 0) not in optim]
    if missing:
        raise BadInput(f"{directory}: the optimizer state of rank {missing[0]} is missing "
                       f"(zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt; {len(optim)} rank files for ranks "
                       f"0-{world - 1}); refused")
    return Layout(directory, [optim[(r, 0)] for r in range(world)], model)


def _model_files(layout: Layout, stage: int) -> list:
    d, model = layout.directory, layout.model
    world = len(layout.optim)
    if stage < 3:
        if (None, 0) not in model:
            raise BadInput(f"{d}: mp_rank_00_model_states.pt (names and shapes of the parameters) is missing")
        extra = sorted(p.name for k, p in model.items() if k != (None, 0))
        if extra:
            raise BadInput(f"{d / extra[0]}: a ZeRO stage-3 model-state file beside the stage-{stage} files; "
                           "two runs' files in one directory; refused")
        return [model[(None, 0)]]
    if (None, 0) in model:
        raise BadInput(f"{d}/mp_rank_00_model_states.pt: a ZeRO stage-1/2 model-state file beside the stage-3 "
                       "files; two runs' files in one directory; refused")
    for r in range(world):
        if (r, 0) not in model:
            raise BadInput(f"{d}: the model state of rank {r} is missing (zero_pp_rank_{r}_mp_rank_00_model_states.pt)")
    extra = sorted(p.name for (r, _), p in model.items() if r >= world)
    if extra:
        raise BadInput(f"{d / extra[0]}: a model-state file of a rank the {world} optimizer-state files do not "
                       "have; refused")
    return [model[(r, 0)] for r in range(world)]


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


# --- Load ------------------------------------------------------------------------------------------

def _tag_directory(path: Path, root: str) -> tuple:
    """(the tag directory, the tag, the directory whose model files are carried)."""
    tag = read_tag(path, root)
    if tag is None:
        carry = path.parent if deepspeed_tag_directory(path) else path
        return path, path.name, carry
    d = path / tag
    confined(d, root)
    if not d.is_dir():
        raise BadInput(f"{path / LATEST}: names {printable(repr(tag), 300)}, which is not a directory in {path}")
    return d, tag, path


def load(path: Path, options: ReadOptions) -> Checkpoint:
    allow = unpickler.allowing(deepspeed_globals(), options.allow_globals, TORCH_OWNED)
    root = source_root(path)
    directory, tag, carry = _tag_directory(path, root)
    layout = _layout(directory)
    world = len(layout.optim)
    mapped, ranks = [], []
    for r, p in enumerate(layout.optim):
        m = MappedFile(confined(p, root))
        mapped.append(m)
        ranks.append(read_optim(m, r, allow))
    first = ranks[0]
    for rec in ranks:
        for what, mine, theirs in (("ZeRO stage", rec.stage, first.stage), ("ds_version", rec.ds_version,
                                   first.ds_version), ("partition_count", rec.world, first.world),
                                   ("parameter groups", len(rec.groups), len(first.groups))):
            if mine != theirs:
                raise BadInput(f"{rec.path}: {what} {_found(mine)}, {first.path.name} says {_found(theirs)}: files of "
                               "different runs; refused")
        if rec.world > world:
            raise BadInput(f"{rec.path}: partition_count says {rec.world} ranks, the directory holds the optimizer "
                           f"state of {world} (rank {world}'s, *zero_pp_rank_{world}_mp_rank_00_optim_states.pt, is "
                           "missing); refused")
        if rec.world != world:
            raise BadInput(f"{rec.path}: partition_count says {rec.world} ranks, the directory holds {world} "
                           "optimizer-state files: files of different runs; refused")
        if len({p.dtype for p in rec.groups} | {p.dtype for p in first.groups}) > 1:
            raise BadInput(f"{rec.path}: its fp32 partitions differ in dtype from {first.path.name}'s")
    if not first.groups:
        raise BadInput(f"{first.path}: holds no parameter groups")
    stage = first.stage
    states, tops = [], []
    for p in _model_files(layout, stage):
        m = MappedFile(confined(p, root))
        mapped.append(m)
        s, top = read_model(m, allow)
        states.append(s)
        tops.append(top)
    s0 = states[0]
    for s in states:
        if s.ds_version is not None and first.ds_version is not None and s.ds_version != first.ds_version:
            raise BadInput(f"{s.path}: ds_version {_found(s.ds_version)}, {first.path.name} says "
                           f"{_found(first.ds_version)}: files of different runs; refused")
        if s.dp_world is not None and s.dp_world != world:
            raise BadInput(f"{s.path}: dp_world_size says {s.dp_world} ranks, the directory holds {world} "
                           "optimizer-state files; refused")
        if (s.param_shapes, s.frozen_shapes) != (s0.param_shapes, s0.frozen_shapes):   # (rank 0 alone lists the
            raise BadInput(f"{s.path}: its param_shapes or frozen_param_shapes differ from "  # shared_params)
                           f"{s0.path.name}'s: files of different runs; refused")
    _parallelism(tops[0], s0.path)
    tensors = []
    for name, t in s0.buffers:   # as DeepSpeed restores them: floating buffers in fp32
        if t.unsupported:
            raise BadInput(f"{s0.path}: buffer {name!r} has dtype {t.unsupported}, which safetensors cannot store")
        src = t.source(name)
        tensors.append(cast(src, F32) if src.dtype.is_float else src)
    tensors += _frozen(states, stage, world)
    tensors += _stage12(ranks, s0, first.paddings) if stage < 3 else _stage3(ranks, states)
    _check_names(tensors, s0.shared, s0.path)
    by_name = {t.name: t for t in tensors}
    for alias, name in s0.shared:   # tied: the same source under a second name (written once)
        if name in by_name:
            by_name[alias] = by_name[name].renamed(alias)
            tensors.append(by_name[alias])
    kept = [t for t in tensors if wanted(t.name, options.only)]
    advised = set()
    for t in kept:   # what is read: ahead of where it is touched, never behind (where the moments lie)
        _advise_sequential(t, advised)
    files = [str(p.relative_to(path)) for p in layout.optim + _model_files(layout, stage)]
    source = SourceFacts(format=NAME, path=str(path), files=files, more={
        "tag": tag, "zero_stage": stage, "world_size": world, "ds_version": first.ds_version,
        "master_dtype": first.groups[0].dtype.code})
    left = [n for n in s0.module_params if n not in by_name]
    if left:   # ZeRO-1 does not save frozen parameters among the fp32 state: DeepSpeed's merge leaves them out
        source.dropped = [{"name": n, "reason": "a parameter saved only in the 16-bit module state (a frozen one, "
                                                  "at ZeRO stage 1), not among the fp32 masters; DeepSpeed's merge "
                                                  "leaves it out too"} for n in left[:1000]]
    files_beside = model_files(carry, [directory]) if carry.is_dir() else []
    return Checkpoint(kept, {}, source, files_beside, mapped)


def _advise_sequential(src: TensorSource, done: set):
    """madvise(MADV_SEQUENTIAL) the file ranges a tensor built here reads (each range once)."""
    if isinstance(src, MappedView):
        offset, length = src.strided.held if src.strided is not None and src.strided.held else (src.start, src.nbytes)
        if (id(src.mapped), offset) not in done:
            done.add((id(src.mapped), offset))
            src.mapped.advise(mmap.MADV_SEQUENTIAL, offset, length)
        return
    for attr in ("base", "parts", "_inputs"):
        below = getattr(src, attr, None)
        for b in (below if isinstance(below, (list, tuple)) else [below] if below is not None else []):
            _advise_sequential(b, done)


def _parallelism(top, path):
    """Tensor and pipeline parallelism, as the model-state file records them: refused (not merged)."""
    mp = top.get("mp_world_size")
    dims = top.get("checkpoint_parallel_dimensions")
    tp = dims.get("tp_degree") if isinstance(dims, dict) else None
    pp = dims.get("pp_degree") if isinstance(dims, dict) else None
    for what, value in (("mp_world_size", mp), ("tp_degree", tp), ("pp_degree", pp)):
        if value is not None and (type(value) is not int or value != 1):
            raise BadInput(f"{path}: {what} is {_found(value)}: a tensor- or pipeline-parallel checkpoint, whose "
                           "ranks hold different parts of each layer; merging them is not supported; refused")


READER = register(Reader(NAME, "DeepSpeed ZeRO checkpoint directories (latest + global_stepN/, stages 1-3): the fp32 "
                               "master weights", detect, load, priority=38, parses_pickles=True, suffixes=(".pt",),
                               fuzz=(("latest", b"global_step1"), ("global_step1/mp_rank_00_model_states.pt", None),
                                     ("global_step1/zero_pp_rank_0_mp_rank_00_optim_states.pt", None)),
                               looks_for="a directory holding latest, or *_optim_states.pt and *_model_states.pt rank "
                               "files"))
