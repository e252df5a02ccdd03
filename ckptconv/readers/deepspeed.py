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
  say how the run was split, and what it records of its save (the optimizer's step: a 0-d tensor
  per group, read; the loss scaler's state); the Adam moments beside them are unpickled as records
  and never read;
- of the model-state file(s), `param_shapes` (names and shapes, in partition order), the frozen
  parameters (`frozen_param_fragments`: whole at stages 1-2, one piece per rank at 3), the buffers
  (`buffer_names`, from `module`; floating ones as fp32, as DeepSpeed restores them) and
  `shared_params` (tied names, written once: transforms.untie).

Each parameter is a lazy join of slices of the partitions: at stages 1-2 the groups' partitions end
to end, each parameter followed by its `param_alignment_paddings`; at 3 each parameter holds
ceil(numel / world) elements of every rank, one after another, the last rank's piece padded. Every
file name, count and size is checked against the others, and every file must be of one run and one
save (readers.one_save: what each records of it, deepspeed_files.saved_facts), before any tensor is
handed out.

A pipeline checkpoint (DeepSpeed's PipelineModule: `layer_NN[-model_00]-model_states.pt` per
layer, per stage S `mp_rank_SS_model_states.pt` and `[bf16_]zero_pp_rank_R_mp_rank_SS_optim_states.pt`)
is each stage's masters merged as above, named as DeepSpeed's own load_checkpoint names them
(`N.param`, `tied_modules.KEY.param` once), buffers from the layer files, every layer file checked
against the stages' names and shapes (_pipeline; docs/formats.md#pipeline-checkpoints-deepspeeds-
pipelinemodule). Tensor-parallel pipelines are refused.

What one file says and the tag directory's rank files are deepspeed_files.py's, the joins of the
partitions deepspeed_tensors.py's; this module is the reader. Files are reached through
storage/files.py: in an object store each rank file's zip directory and pickle are read by ranged
reads, and a parameter's bytes are fetched as ranges of the partitions, never a whole file.
"""
from pathlib import Path

from .base import Reader, register
from .. import dtypes
from ..errors import BadInput, brief, printable
from ..io.mapped import SEQUENTIAL
from ..storage import files as storage
from ..checkpoint import Checkpoint, SourceFacts
from ..tensor import MappedView, TensorSource, cast
from . import (DEEPSPEED_RANK_FILE, ReadOptions, confined, deepspeed_tag_directory, model_files, one_save,
               source_root, wanted)
from .deepspeed_files import (ZeroFiles, ModelStates, OptimRank, _found, _layout, _model_files, read_layer, read_model,
                              read_optim)
from .deepspeed_tensors import _check_names, _frozen, _stage12, _stage3
from .pickle import unpickler
from .pickle.deepspeed_globals import deepspeed_globals
from .pickle.torch_globals import TORCH_OWNED

NAME = "deepspeed"
LATEST = "latest"            # the file naming the newest tag
MAX_LATEST = 4096            # bytes of `latest` read (a tag is a directory name)

F32 = dtypes.from_code("F32")


# --- Where the files are -------------------------------------------------------------------------

def read_tag(directory: Path, root: str) -> str | None:
    """The tag `latest` names (its text, stripped), or None when there is no `latest` file; a tag
    that is not a plain directory name, or a `latest` leading outside the checkpoint, is refused."""
    latest = directory / LATEST
    if not latest.is_file():
        return None
    confined(latest, root)
    f = storage.open_file(latest)
    raw = f.read(0, min(f.size, MAX_LATEST + 1))
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
        return any(DEEPSPEED_RANK_FILE.fullmatch(n) for n in storage.listdir(path))
    except (OSError, BadInput):
        return False


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
    mapped = []
    if layout.stages is not None:
        tensors, first, s0, by_name, dropped = _pipeline(layout, root, allow, mapped)
    else:
        tensors, first, s0, (_, tops), saves = _one_stage(layout, root, allow, mapped)
        one_save(saves)   # (all ranks save together)
        _parallelism(tops[0], s0.path)
        by_name = {t.name: t for t in tensors}
        dropped = None
    kept = [t for t in tensors if wanted(t.name, options.only)]
    advised = set()
    for t in kept:   # what is read: ahead of where it is touched, never behind (where the moments lie)
        _advise_sequential(t, advised)
    source = _facts(path, layout, tag, first, s0, by_name, dropped)
    files_beside = model_files(carry, [directory]) if carry.is_dir() else []
    return Checkpoint(kept, {}, source, files_beside, mapped)


def _one_stage(layout: ZeroFiles, root: str, allow, mapped: list) -> tuple:
    """The fp32 masters of one model-parallel rank's files (the whole model, or a pipeline stage's
    parameters): (tensors, its first OptimRank, its first ModelStates, (states, tops), the files'
    facts of their save for one_save)."""
    return _masters(layout, *_read_stage(layout, root, allow, mapped))


def _read_stage(layout: ZeroFiles, root: str, allow, mapped: list) -> tuple:
    """One model-parallel rank's files read and checked: (ranks, states, tops, their facts of the save)."""
    ranks = _optim_ranks(layout, root, allow, mapped)
    first = ranks[0]
    pipeline = layout.layers is not None
    if pipeline and first.stage == 3:
        raise BadInput(f"{first.path}: ZeRO stage 3 in a pipeline checkpoint (DeepSpeed runs pipelines at stages "
                       "0-1 only); refused")
    states, tops = _model_states(layout, first.stage, root, allow, mapped, first, pipeline)
    saves = ([(s.path, f"rank {r}", s.saved) for r, s in enumerate(states)]
             + [(rec.path, f"rank {rec.rank}", rec.saved) for rec in ranks])
    return ranks, states, tops, saves


def _masters(layout: ZeroFiles, ranks: list, states: list, tops: list, saves: list) -> tuple:
    """The tensors of one model-parallel rank's files, read by _read_stage."""
    world, first, s0 = len(layout.optim), ranks[0], states[0]
    stage, pipeline = first.stage, layout.layers is not None
    tensors = [] if pipeline else _buffers(s0)
    tensors += _frozen(states, stage, world)
    tensors += _stage12(ranks, s0, first.paddings) if stage < 3 else _stage3(ranks, states)
    _check_names(tensors, s0.shared, s0.path)
    by_name = {t.name: t for t in tensors}
    for alias, name in s0.shared:   # tied: the same source under a second name (written once)
        if name in by_name:
            by_name[alias] = by_name[name].renamed(alias)
            tensors.append(by_name[alias])
    return tensors, first, s0, (states, tops), saves


def _pipeline(layout: ZeroFiles, root: str, allow, mapped: list) -> tuple:
    """A PipelineModule's checkpoint as DeepSpeed's own load_checkpoint gives it: every stage's fp32
    masters under the module's names (`N.param` for the layer of global index N,
    `tied_modules.KEY.param` for a TiedLayerSpec's module, taken from the first stage that holds it,
    as DeepSpeed broadcasts tied weights from there), and the buffers each stage lists from the layer
    files (as saved). Every trained parameter and buffer `N.key` must be in layer N's file, of the
    shape param_shapes says; a layer file holding tensors no stage names is refused.
    (tensors, stage 0's first OptimRank, its ModelStates, by name, what is left out)."""
    tensors, by_name, owner, saves, dropped = [], {}, {}, [], []
    names_by_layer = {}     # layer index -> {key: (stage, shape or None for a buffer)}
    tied = {}               # tied module KEY -> {key: shape (None: a buffer)}
    stages = layout.stages
    read = [_read_stage(layout_s, root, allow, mapped) for layout_s in stages]
    for layout_s, (_, states, tops, sv) in zip(stages, read):
        saves += [(p, f"stage {layout_s.mp} {label}", facts) for p, label, facts in sv]
        _pipeline_parallelism(tops[0], states[0].path, len(stages))
    one_save(saves)   # (all stages and ranks save together)
    first, s0 = read[0][0][0], read[0][1][0]
    for layout_s, r in zip(stages, read):
        st, _, m0, _, _ = _masters(layout_s, *r)
        if m0.frozen_shapes:
            raise BadInput(f"{m0.path}: frozen_param_shapes in a pipeline stage's file (a ZeRO stage 2 pipeline, which "
                           "DeepSpeed does not run); refused")
        for t in st:
            if t.name.startswith("tied_modules."):
                if t.name in by_name:
                    if tuple(by_name[t.name].shape) != tuple(t.shape):
                        raise BadInput(f"{m0.path}: tied {t.name!r} is {list(t.shape)} here, "
                                       f"{list(by_name[t.name].shape)} in pipeline stage {owner[t.name]}'s files; refused")
                    continue
                _, key, sub = t.name.split(".", 2) if t.name.count(".") >= 2 else (None, t.name, "")
                tied.setdefault(key, {})[sub] = tuple(t.shape)
            elif t.name in by_name:
                raise BadInput(f"{m0.path}: {t.name!r} is a parameter of pipeline stage {layout_s.mp} and of stage "
                               f"{owner[t.name]}: two stages claim one layer; refused")
            else:
                _layer_key(t.name, layout_s.mp, tuple(t.shape), names_by_layer, m0.path)
            owner[t.name] = layout_s.mp
            by_name[t.name] = t
            tensors.append(t)
        for b in m0.buffer_names:
            if b.startswith("tied_modules."):
                if b.count(".") >= 2:
                    _, key, sub = b.split(".", 2)
                    tied.setdefault(key, {})[sub] = None
                dropped.append({"name": b, "reason": "a buffer of a tied module (TiedLayerSpec): which layer files hold "
                                                     "it is not recorded; not read"})
                continue
            if b in by_name or b in owner:
                other = (f"is also a parameter of pipeline stage {owner[b]}" if b in by_name and owner[b] == layout_s.mp
                         else f"is listed twice by pipeline stage {layout_s.mp}" if owner[b] == layout_s.mp
                         else f"is listed by pipeline stage {layout_s.mp} and stage {owner[b]}")
                raise BadInput(f"{m0.path}: buffer {b!r} {other}; refused")
            _layer_key(b, layout_s.mp, None, names_by_layer, m0.path)
            owner[b] = layout_s.mp
    tensors = _layer_buffers(layout, root, allow, mapped, names_by_layer, tied, dropped) + tensors
    by_name = {t.name: t for t in tensors}
    return tensors, first, s0, by_name, dropped


def _layer_key(name: str, stage: int, shape, names_by_layer: dict, path):
    """Note `N.key` (a parameter with its shape, or a buffer: None) as layer N's, of `stage`."""
    head, _, key = name.partition(".")
    if not (head.isascii() and head.isdigit() and len(head) <= 9 and key and head == str(int(head))):
        raise BadInput(f"{path}: {printable(repr(name), 120)} is not a PipelineModule name (N.key, N the layer's "
                       "global index, or tied_modules.KEY.key); refused")
    names_by_layer.setdefault(int(head), {})[key] = (stage, shape)


def _layer_buffers(layout: ZeroFiles, root: str, allow, mapped: list, names_by_layer: dict, tied: dict,
                   dropped: list) -> list:
    """Each layer file read and checked against what the stages name: every name `N.key` held by
    layer N's file (a trained parameter with the shape param_shapes gives it; the 16-bit copy is never
    read, the master is), the buffers handed out as saved; a file of a layer no stage names holding
    tensors is refused unless its keys are a tied module's."""
    buffers = []
    last = max(names_by_layer, default=0)
    for index in sorted(names_by_layer):
        if index not in layout.layers:
            stage = next(iter(names_by_layer[index].values()))[0]
            raise BadInput(f"{layout.directory}: the layer file of layer {index} (layer_{index:02d}-model_states.pt), "
                           f"whose parameters pipeline stage {stage} lists, is missing; refused")
    for index in sorted(layout.layers):
        p = layout.layers[index]
        if index > last + len(layout.layers):   # (a number from a name: compared, never counted to)
            raise BadInput(f"{p}: layer index {index} is past the last layer the pipeline stages name ({last}) by more "
                           f"than the directory's {len(layout.layers)} layer files could be; refused")
        m = storage.open_file(confined(p, root))
        mapped.append(m)
        held = read_layer(m, allow)
        named = names_by_layer.get(index)
        if named is None:
            if held and not _a_tied_module(held, tied):
                raise BadInput(f"{p}: holds tensors ({brief(list(held), 60)}) of layer {index}, which no pipeline "
                               "stage's param_shapes or buffer_names names: a file of another model; refused")
            continue
        for key, (stage, shape) in named.items():
            t = held.get(key)
            if t is None:
                raise BadInput(f"{p}: holds no {key!r}, which pipeline stage {stage} lists as {index}.{key}; refused")
            if shape is not None and tuple(t.shape) != tuple(shape):
                raise BadInput(f"{p}: {key!r} is {list(t.shape)}, pipeline stage {stage}'s param_shapes says "
                               f"{list(shape)} for {index}.{key}; refused")
            if shape is None:
                if t.unsupported:
                    raise BadInput(f"{p}: buffer {key!r} has dtype {t.unsupported}, which safetensors cannot store")
                buffers.append(t.source(f"{index}.{key}"))
        for key in held:
            if key not in named:
                dropped.append({"name": f"{index}.{key}", "reason": "saved only in its layer file, not among the fp32 "
                                                                    "masters or listed buffers (a frozen parameter): "
                                                                    "not read"})
    return buffers


def _a_tied_module(held: dict, tied: dict) -> bool:
    """A layer file no stage names by index is a TiedLayerSpec's module saved at its index (its
    parameters read from the masters under tied_modules.KEY.): every key one tied module's, of its
    shape."""
    return any(all(k in members and (members[k] is None or members[k] == tuple(t.shape)) for k, t in held.items())
               for members in tied.values())


def _optim_ranks(layout: ZeroFiles, root: str, allow, mapped: list) -> list:
    """Every rank's OptimRank (its file mapped into `mapped`), checked to be of one run and one world."""
    world = len(layout.optim)
    ranks = []
    for r, p in enumerate(layout.optim):
        m = storage.open_file(confined(p, root))
        mapped.append(m)
        ranks.append(read_optim(m, r, allow))
    first = ranks[0]
    one_save([(rec.path, f"rank {rec.rank}", {"ZeRO stage": rec.stage, "ds_version": rec.ds_version, "partition_count":
               rec.world, "parameter groups": len(rec.groups)}) for rec in ranks], "runs")
    for rec in ranks:
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
    return ranks


def _model_states(layout: ZeroFiles, stage: int, root: str, allow, mapped: list, first: OptimRank,
                  pipeline=False) -> tuple:
    """(the ModelStates of the model-state file(s), their top-level dicts), checked against the
    optimizer state and each other; their files mapped into `mapped`."""
    world = len(layout.optim)
    states, tops = [], []
    for p in _model_files(layout, stage):
        m = storage.open_file(confined(p, root))
        mapped.append(m)
        s, top = read_model(m, allow, pipeline)
        states.append(s)
        tops.append(top)
    s0 = states[0]
    one_save([(p, f"rank {r}", {"ds_version": v} if v is not None else {}) for p, r, v in
              [(first.path, 0, first.ds_version)] + [(s.path, r, s.ds_version) for r, s in enumerate(states)]], "runs")
    for s in states:
        if s.dp_world is not None and s.dp_world != world:
            raise BadInput(f"{s.path}: dp_world_size says {s.dp_world} ranks, the directory holds {world} "
                           "optimizer-state files; refused")
        if (s.param_shapes, s.frozen_shapes) != (s0.param_shapes, s0.frozen_shapes):   # (rank 0 alone lists the
            raise BadInput(f"{s.path}: its param_shapes or frozen_param_shapes differ from "  # shared_params)
                           f"{s0.path.name}'s: files of different runs; refused")
    return states, tops


def _buffers(s0: ModelStates) -> list:
    """The module's buffers, as DeepSpeed restores them: floating buffers in fp32."""
    tensors = []
    for name, t in s0.buffers:
        if t.unsupported:
            raise BadInput(f"{s0.path}: buffer {name!r} has dtype {t.unsupported}, which safetensors cannot store")
        src = t.source(name)
        tensors.append(cast(src, F32) if src.dtype.is_float else src)
    return tensors


def _facts(path: Path, layout: ZeroFiles, tag: str, first: OptimRank, s0: ModelStates, by_name: dict,
           dropped=None) -> SourceFacts:
    """What the source description says: the files read, the run's numbers, what DeepSpeed leaves out."""
    stage, world = first.stage, len(layout.optim)
    read = [p for st in (layout.stages or [layout]) for p in st.optim + _model_files(st, stage)]
    read += [layout.layers[i] for i in sorted(layout.layers or {})]
    files = [str(p.relative_to(path)) for p in read]
    source = SourceFacts(format=NAME, path=str(path), files=files, more={
        "tag": tag, "zero_stage": stage, "world_size": world, "ds_version": first.ds_version,
        "master_dtype": first.groups[0].dtype.code})
    if layout.stages is not None:
        source.more["pipeline_stages"] = len(layout.stages)
        source.dropped = dropped[:1000]
        return source
    left = [n for n in s0.module_params if n not in by_name]
    if left:   # ZeRO-1 does not save frozen parameters among the fp32 state: DeepSpeed's merge leaves them out
        source.dropped = [{"name": n, "reason": "a parameter saved only in the 16-bit module state (a frozen one, "
                                                  "at ZeRO stage 1), not among the fp32 masters; DeepSpeed's merge "
                                                  "leaves it out too"} for n in left[:1000]]
    return source


def _advise_sequential(src: TensorSource, done: set):
    """madvise(MADV_SEQUENTIAL) the file ranges a tensor built here reads (each range once)."""
    if isinstance(src, MappedView):
        offset, length = src.strided.held if src.strided is not None and src.strided.held else (src.start, src.nbytes)
        if (id(src.mapped), offset) not in done:
            done.add((id(src.mapped), offset))
            src.mapped.advise(SEQUENTIAL, offset, length)
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


def _pipeline_parallelism(top, path, stages: int):
    """A pipeline stage's file: pp_degree the number of stages the directory holds, tensor
    parallelism 1 (mp_world_size, the stages times the tensor-parallel ranks, equal to pp_degree)."""
    dims = top.get("checkpoint_parallel_dimensions")
    dims = dims if isinstance(dims, dict) else {}
    for what, value, want in (("pp_degree", dims.get("pp_degree"), stages),
                              ("mp_world_size", top.get("mp_world_size"), stages), ("tp_degree", dims.get("tp_degree"), 1)):
        if value is not None and (type(value) is not int or value != want):
            tp = " and no tensor parallelism (merging it is not supported)" if what == "tp_degree" else ""
            raise BadInput(f"{path}: {what} is {_found(value)}, the directory holds {stages} pipeline stages' files{tp}; "
                           "refused")


READER = register(Reader(NAME, "DeepSpeed ZeRO checkpoint directories (latest + global_stepN/, stages 1-3; "
                               "PipelineModule layer files merged): the fp32 master weights", detect, load,
                               priority=38, parses_pickles=True, suffixes=(".pt",),
                               fuzz=(("latest", b"global_step1"), ("global_step1/mp_rank_00_model_states.pt", None),
                                     ("global_step1/zero_pp_rank_0_mp_rank_00_optim_states.pt", None)),
                               looks_for="a directory holding latest, or *_optim_states.pt and *_model_states.pt rank "
                               "files"))
