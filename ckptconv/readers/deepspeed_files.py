"""The DeepSpeed reader's files (readers/deepspeed.py reads with them): what one optimizer- or
model-state file says, checked (OptimRank, ModelStates), and the tag directory's rank files by name
(ZeroFiles). Registers nothing: deepspeed.py is the reader.
"""
import math
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput, brief, printable
from ..io.mapped import RANDOM, MappedFile
from ..limits import Budget, shape_problem
from ..storage import files as storage
from . import first_missing, ziparchive
from .pickle import unpickler
from .pickle.torch_globals import TorchTensor
from .torch_pickle import justified, load_zip

OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d{1,9})_mp_rank_(\d{1,9})_optim_states\.pt")
MODEL = re.compile(r"(?:zero_pp_rank_(\d{1,9})_)?mp_rank_(\d{1,9})_model_states\.pt")
# DeepSpeed's PipelineModule: one file per layer NN (its global index) holding that layer's state
# dict, `-model_XX` the tensor-parallel rank when the topology has a model axis (Megatron-DeepSpeed)
LAYER = re.compile(r"layer_(\d{1,9})(?:-model_(\d{1,9}))?-model_states\.pt")
# DeepSpeed files this reader does not merge: MoE experts and their optimizer state
EXPERT = re.compile(r"(layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt|expp_rank_\d+_mp_rank_\d+_optim_states\.pt")


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
    saved: dict | None = None         # what it records of its save (readers.one_save): saved_facts


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
    saved: dict | None = None         # what it records of its save (readers.one_save): saved_facts
    buffer_names: list | None = None  # `buffer_names` as listed (a pipeline's buffers are in its layer files)


@dataclass
class ZeroFiles:
    """The tag directory's files, by rank, checked by name (a pipeline's: one ZeroFiles per stage in
    `stages`, each with its stage's optimizer- and model-state files, `layers` the layer files)."""

    directory: Path
    optim: list                       # rank -> Path
    model: dict                       # (rank or None, mp rank) -> Path, as named
    mp: int = 0                       # the model-parallel rank these files are of (a pipeline's stage)
    layers: dict | None = None        # a pipeline's: global layer index -> Path
    stages: list | None = None        # a pipeline's: stage -> ZeroFiles


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
    m.advise(RANDOM)
    if not ziparchive.is_zip(m):
        raise BadInput(f"{m.path}: not a torch.save zip archive (DeepSpeed writes its checkpoint files with torch.save)")
    return load_zip(m, allow, budget=Budget(m.path))


def _version(obj, path):
    v = obj.get("ds_version") if isinstance(obj, dict) else None
    if v is not None and not isinstance(v, str):
        raise BadInput(f"{path}: ds_version is {_found(v)}, not a version string")
    return v


# --- What a file records of its save ------------------------------------------------------------

def _number(value):
    """A recorded count or scale as compared across files: an int or a finite float (2.0 as 2), else
    None (not compared); a 0-d or one-element tensor (torch's Adam keeps `step` as one) is read:
    4 or 8 bytes."""
    if isinstance(value, TorchTensor) and not value.unsupported and math.prod(value.shape) == 1:
        value = value.source("step").region().reshape(-1)[0].item()
    if isinstance(value, float) and math.isfinite(value):
        return int(value) if value.is_integer() else value
    return value if type(value) is int else None


def _steps(osd: dict):
    """The optimizer's step count as a rank's file records it: `step` of each entry of the (base)
    optimizer's `state` (one per flat group: torch's Adam and AdamW), one number when they agree."""
    inner = osd.get("base_optimizer_state", osd.get("optimizer_state_dict"))
    state = inner.get("state") if isinstance(inner, dict) else None
    steps = [_number(v.get("step")) for v in state.values() if isinstance(v, dict)] if isinstance(state, dict) else []
    steps = tuple(x for x in steps if x is not None)
    return None if not steps else steps[0] if len(set(steps)) == 1 else steps


def saved_facts(top: dict, osd: dict | None, path) -> dict:
    """What a model- or optimizer-state file records of the save it is of (docs/formats.md#deepspeed):
    the engine's counters (model-state files), the optimizer's step and the loss scaler's (optimizer-
    state files), and the ds_config every file carries (its digest). All ranks save together, so
    all record the same."""
    config = top.get("ds_config")
    facts = {"ds_config (sha256)": unpickler.recorded_digest(config, Budget(path)) if config is not None else None}
    if osd is None:
        for key in ("global_steps", "global_samples", "skipped_steps"):
            facts[key] = _number(top.get(key))
        return {k: v for k, v in facts.items() if v is not None}
    facts["optimizer step"] = _steps(osd)
    scaler = osd.get("loss_scaler")
    state = scaler.state if isinstance(scaler, unpickler.InertObject) and isinstance(scaler.state, dict) else {}
    facts["loss scale"] = _number(state.get("cur_scale"))
    facts["loss scaler iteration"] = _number(state.get("cur_iter"))
    return {k: v for k, v in facts.items() if v is not None}


def read_optim(m: MappedFile, rank: int, allow) -> OptimRank:
    path = storage.place(m.path)
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
    rec = OptimRank(path, rank, stage, counts[0], version, groups, saved=saved_facts(top, osd, path))
    if stage < 3:
        pads = osd.get("param_alignment_paddings")
        if pads is not None:
            if not isinstance(pads, list) or len(pads) != len(groups) or not all(isinstance(p, list) for p in pads):
                raise BadInput(f"{path}: param_alignment_paddings is {_found(pads)}, not one list per group")
            pads = [[_count(x, "a param_alignment_paddings entry", path) for x in p] for p in pads]
        rec.paddings = pads
    return rec


def read_model(m: MappedFile, allow, pipeline=False) -> tuple:
    """(ModelStates, the file's top-level dict). A pipeline stage's file holds no `module` (None:
    its layers are in the layer files)."""
    path = storage.place(m.path)
    top = _load(m, allow)
    if not isinstance(top, dict):
        raise BadInput(f"{path}: not a DeepSpeed model-state file (its pickle is {_found(top)})")
    if pipeline and isinstance(top.get("module"), dict) and top["module"]:
        raise BadInput(f"{path}: holds a module state beside the pipeline's layer files: not a PipelineModule's "
                       "stage file; refused")
    module = {} if pipeline and top.get("module", {}) is None else _field(top, "module", path, dict)
    names = _field(top, "buffer_names", path, (list, tuple))
    listed_buffers = [_name(n, "a buffer name", path) for n in names]
    buffer_names = set(listed_buffers)
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
                       dp if type(dp) is int else None, saved_facts(top, None, path), listed_buffers), top


def read_layer(m: MappedFile, allow) -> dict:
    """A pipeline layer file: the layer's state dict, {key: TorchTensor} (an empty one for a layer
    without parameters or buffers)."""
    path = storage.place(m.path)
    top = _load(m, allow)
    if not isinstance(top, dict):
        raise BadInput(f"{path}: not a DeepSpeed pipeline layer file (its pickle is {_found(top)}, not a state dict)")
    for k, v in top.items():
        _name(k, "a key", path)
        if not isinstance(v, TorchTensor):
            raise BadInput(f"{path}: {printable(repr(k), 80)} is {_found(v)}, not a tensor")
    justified(m, list(top.values()))
    return top


# --- The tag directory ---------------------------------------------------------------------------

def _layout(directory: Path) -> ZeroFiles:
    """The rank files by name: every rank once, one model-parallel rank, no pipeline or expert files."""
    try:
        names = storage.listdir(directory)
    except OSError as e:
        raise BadInput(f"{directory}: cannot list: {e.strerror}") from None
    optim, model, mp, layers = {}, {}, {}, {}
    for n in names:
        o, md, ly = OPTIM.fullmatch(n), MODEL.fullmatch(n), LAYER.fullmatch(n)
        if ly:
            _layer_file(directory, n, ly, layers)
            continue
        if n.startswith("layer_") and n.endswith("model_states.pt"):   # (never silently left out)
            raise BadInput(f"{directory / n}: a layer file whose name does not spell its layer as DeepSpeed does "
                           "(layer_NN[-model_XX]-model_states.pt, numbers of at most 9 digits); refused")
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
        elif n.endswith(("_optim_states.pt", "_model_states.pt")):   # (never silently left out)
            raise BadInput(f"{directory / n}: a rank file whose name does not spell its ranks as DeepSpeed does "
                           "(zero_pp_rank_R_mp_rank_MM_..., numbers of at most 9 digits); refused")
    if not optim:
        raise BadInput(f"{directory}: holds no ZeRO optimizer-state files (*_optim_states.pt): not a DeepSpeed "
                       "ZeRO checkpoint, or one saved without its optimizer state")
    if layers:
        return _pipeline_layout(directory, optim, model, mp, layers)
    if set(mp) != {0}:
        shown = ", ".join(sorted({f"mp_rank_{k:02d}" for k in mp})[:6])
        raise BadInput(f"{directory}: holds files of {len(mp)} model-parallel ranks ({shown}): a tensor- or "
                       "pipeline-parallel checkpoint (as Megatron-DeepSpeed writes), whose ranks hold different "
                       "parts of each layer; merging them is not supported; refused")
    world = max(r for r, _ in optim) + 1   # (a number from a name: looked at only as far as the files go)
    missing = first_missing({r for r, _ in optim}, world)
    if missing is not None:
        raise BadInput(f"{directory}: the optimizer state of rank {missing} is missing "
                       f"(zero_pp_rank_{missing}_mp_rank_00_optim_states.pt; {len(optim)} rank files for ranks "
                       f"0-{world - 1}); refused")
    return ZeroFiles(directory, [optim[(r, 0)] for r in range(world)], model)


def _layer_file(directory: Path, n: str, match, layers: dict):
    """A layer file by name: tensor-parallel rank 0 only (or none named), each layer once."""
    index, tp = int(match.group(1)), match.group(2)
    if tp is not None and int(tp) != 0:
        raise BadInput(f"{directory / n}: a layer file of tensor-parallel rank {int(tp)} (a pipeline with tensor "
                       "parallelism, as Megatron-DeepSpeed writes): its ranks hold different parts of each layer, "
                       "split by rules of the model the files do not record; merging them is not supported "
                       "(Megatron-DeepSpeed's tools/convert_checkpoint or ds_to_universal.py merge them); refused")
    if index in layers:
        raise BadInput(f"{directory / n}: holds layer {index}, as {layers[index].name} does: two files claim one "
                       "layer; refused")
    layers[index] = directory / n


def _pipeline_layout(directory: Path, optim: dict, model: dict, mp: dict, layers: dict) -> ZeroFiles:
    """A PipelineModule's tag directory: per stage S (its model-parallel rank, tensor parallelism
    being 1) the optimizer state of every data-parallel rank R (zero_pp_rank_R_mp_rank_SS_...) and
    one mp_rank_SS_model_states.pt; stages 0..P-1 all present, each with the same rank count."""
    stages_named = max(mp) + 1
    missing = first_missing(mp, stages_named)
    if missing is not None:
        raise BadInput(f"{directory}: the files of pipeline stage {missing} (mp_rank_{missing:02d}) are missing "
                       f"beside those of stages up to {stages_named - 1}; refused")
    by_stage = [{r: p for (r, m), p in optim.items() if m == s} for s in range(stages_named)]
    world = max(max(ranks) + 1 if ranks else 0 for ranks in by_stage)   # (every stage has as many ranks)
    stages = []
    for s, ranks in enumerate(by_stage):
        if not ranks:
            raise BadInput(f"{directory}: pipeline stage {s} has no optimizer-state file "
                           f"(zero_pp_rank_0_mp_rank_{s:02d}_optim_states.pt); refused")
        miss = first_missing(ranks, world)
        if miss is not None:
            prefix = "bf16_" if next(iter(ranks.values())).name.startswith("bf16_") else ""
            raise BadInput(f"{directory}: the optimizer state of rank {miss} of pipeline stage {s} is missing "
                           f"({prefix}zero_pp_rank_{miss}_mp_rank_{s:02d}_optim_states.pt; {len(ranks)} rank files of "
                           f"the stage, {world} data-parallel ranks in the directory); refused")
        files = {k: p for k, p in model.items() if k[1] == s}
        stages.append(ZeroFiles(directory, [ranks[r] for r in range(world)], files, mp=s, layers=layers))
    first = stages[0]
    return ZeroFiles(directory, first.optim, model, layers=layers, stages=stages)


def _model_files(layout: ZeroFiles, stage: int) -> list:
    d, model, mp = layout.directory, layout.model, layout.mp
    world = len(layout.optim)
    if stage < 3:
        if (None, mp) not in model:
            raise BadInput(f"{d}: mp_rank_{mp:02d}_model_states.pt (names and shapes of the parameters) is missing")
        extra = sorted(p.name for k, p in model.items() if k != (None, mp))
        if extra:
            raise BadInput(f"{d / extra[0]}: a ZeRO stage-3 model-state file beside the stage-{stage} files; "
                           "two runs' files in one directory; refused")
        return [model[(None, mp)]]
    if layout.layers is not None or mp:
        raise BadInput(f"{layout.optim[0]}: ZeRO stage 3 in a pipeline checkpoint (DeepSpeed runs pipelines at "
                       "stages 0-1 only); refused")
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
