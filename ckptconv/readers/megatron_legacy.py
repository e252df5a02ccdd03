"""The Megatron reader's legacy layout (readers/megatron.py reads with it): what one rank's
model_optim_rng.pt says (RankFile), the mp_rank_* directories placed in the tp x pp x ep mesh, and
every chunk of every stage merged into the whole model. The torch_dist layout (megatron_dist.py)
reads args with the same helpers. Registers nothing: megatron.py is the reader.
"""
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path

from ..errors import BadInput, brief, printable
from ..io.mapped import MappedFile
from ..limits import Budget
from ..storage import files as storage
from ..tensor import TensorSource
from ..tp import megatron as mt
from ..tp.intervals import joined
from ..tp.presets import PRESETS
from . import ReadOptions, confined, first_missing, one_save
from . import ziparchive
from .pickle import unpickler
from .pickle.megatron_globals import megatron_globals
from .pickle.torch_globals import TORCH_OWNED, TorchTensor
from .pickle.unpickler import InertObject
from .torch_pickle import justified, load_zip

RANK_FILE = "model_optim_rng.pt"
RANK_DIR = re.compile(r"mp_rank_(\d{2,6})(?:_(\d{3,6}))?(?:_(\d{3,6}))?")
CHUNK = re.compile(r"model(\d{0,4})")
SUPPORTED_VERSION = 3.0          # checkpoint_version: older ones order linear_qkv differently
# args fields that count a run's progress, compared across the rank files as the iteration is; and
# the ones each process sets for itself (its global and local rank), left out of the args compared
SAVED_ARGS = ("iteration", "consumed_train_samples", "consumed_valid_samples", "skipped_train_samples")
PER_PROCESS_ARGS = ("rank", "local_rank")


# --- What one rank file says ---------------------------------------------------------------------

@dataclass
class RankFile:
    """One legacy rank's model_optim_rng.pt: where it sits in the mesh and what it holds."""

    path: Path
    tp: int
    pp: int
    ep: int
    args: dict                        # the Namespace's fields
    arch: mt.Arch
    chunks: list                      # per virtual chunk: {name: TorchTensor or None}, in saved order
    iteration: object
    version: object
    saved: dict                       # what it records of its save, as read (_saved)


def _namespace(obj, where) -> dict:
    if not isinstance(obj, InertObject) or obj.qualname != "argparse.Namespace":
        raise BadInput(f"{where}: 'args' is {_found(obj)}, not the training arguments (an argparse.Namespace)")
    return {k: v for k, v in obj.state.items() if isinstance(k, str)}


def _found(value) -> str:
    if value is None:
        return "None"
    if isinstance(value, InertObject):
        return f"a {value.qualname} record"
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        return printable(repr(value)[:60], 80)
    return f"a {type(value).__name__}"


def _allow(options: ReadOptions):
    return unpickler.allowing(megatron_globals(), options.allow_globals, TORCH_OWNED)


def _load(m: MappedFile, allow, unlisted):
    if not ziparchive.is_zip(m):
        raise BadInput(f"{m.path}: not a torch.save zip archive (Megatron writes its checkpoint files with torch.save)")
    return load_zip(m, allow, budget=Budget(m.path), unlisted=unlisted)


def _chunks(top: dict, where) -> list:
    """The model's state dicts: "model", or "model0", "model1"... (virtual pipeline chunks), in order."""
    keys = sorted((k for k in top if isinstance(k, str) and CHUNK.fullmatch(k)),
                  key=lambda k: int(k[5:]) if k != "model" else -1)
    if keys == ["model"]:
        return [_state(top["model"], "model", where)]
    if keys != [f"model{i}" for i in range(len(keys))] or not keys:
        raise BadInput(f"{where}: holds {', '.join(keys) or 'no model'}: not 'model' or 'model0'..'modelN' (one "
                       "per virtual pipeline chunk)")
    return [_state(top[k], k, where) for k in keys]


def _state(sd, key, where) -> dict:
    if not isinstance(sd, dict):
        raise BadInput(f"{where}: {key!r} is {_found(sd)}, not a state dict")
    out = {}
    for k, v in sd.items():
        if not isinstance(k, str):
            raise BadInput(f"{where}: {key!r} has a key that is {_found(k)}, not a tensor name")
        if v is not None and (not isinstance(v, TorchTensor) or v.unsupported):
            if k.endswith("_extra_state"):
                continue   # (TransformerEngine's FP8 state: bytes, dropped as the None ones are)
            what = v.unsupported if isinstance(v, TorchTensor) else _found(v)
            raise BadInput(f"{where}: {key}.{k} is {what}, not a tensor safetensors can store")
        out[k] = v
    return out


def read_rank(m: MappedFile, coords: tuple, allow, unlisted) -> RankFile:
    path = storage.place(m.path)
    top = _load(m, allow, unlisted)
    if not isinstance(top, dict) or "args" not in top:
        raise BadInput(f"{path}: not a Megatron checkpoint file (no 'args' beside the model)")
    args = _namespace(top["args"], path)
    version = top.get("checkpoint_version")
    if version != SUPPORTED_VERSION:
        raise BadInput(f"{path}: checkpoint_version is {_found(version)}; only {SUPPORTED_VERSION} (Megatron-LM since "
                       "2020: linear_qkv per query group) is read; older ones order q, k, v differently")
    chunks = _chunks(top, path)
    justified(m, [t for c in chunks for t in c.values() if t is not None])
    sched = top.get("opt_param_scheduler")
    saved = {k: top[k] for k in ("iteration", "num_floating_point_operations_so_far") if k in top}
    saved.update({f"args.{k}": args[k] for k in SAVED_ARGS if k in args})
    if isinstance(sched, dict) and "num_steps" in sched:
        saved["opt_param_scheduler's num_steps"] = sched["num_steps"]
    return RankFile(path, *coords, args, mt.arch(args, path), chunks, top.get("iteration"), version, saved)


def _saved(rf: RankFile) -> dict:
    """What a rank file records of the save it is of (readers.one_save): the iteration, the counters
    in args and beside it, and args itself (its digest, without the fields each process sets
    for itself): every rank saves the same at once."""
    budget = Budget(rf.path)
    out = {k: v if v is None or isinstance(v, (int, float, str)) else unpickler.recorded_digest(v, budget)
           for k, v in rf.saved.items()}
    out["args (sha256)"] = unpickler.recorded_digest({k: v for k, v in rf.args.items() if k not in PER_PROCESS_ARGS},
                                                     budget)
    return out


# --- The legacy layout ---------------------------------------------------------------------------

def _rank_dirs(d: Path) -> dict:
    """{directory name: the numbers in it} of every mp_rank_* directory holding model_optim_rng.pt."""
    try:
        names = storage.listdir(d)
    except OSError as e:
        raise BadInput(f"{d}: cannot list: {e.strerror}") from None
    out = {}
    for n in names:
        m = RANK_DIR.fullmatch(n)
        if not m and n.startswith("mp_rank_") and (d / n / RANK_FILE).is_file():   # (never silently left out)
            raise BadInput(f"{d / n}: a rank directory whose name is not mp_rank_TT[_PPP][_EEE] with numbers of 2 to "
                           "6 digits; refused")
        if m and (d / n).is_dir():
            if not (d / n / RANK_FILE).is_file():
                raise BadInput(f"{d / n}: a rank directory without {RANK_FILE}")
            out[n] = tuple(int(g) for g in m.groups() if g is not None)
    if not out:
        raise BadInput(f"{d}: holds no mp_rank_*/{RANK_FILE} rank files and no torch_dist metadata.json")
    return out


def _coords(name: str, numbers: tuple, a: mt.Arch, where) -> tuple:
    """(tp, pp, ep) a directory name spells, as args' parallel sizes read it: `mp_rank_TT` with `_PPP`
    when pp > 1 and `_EEE` when ep > 1 (one 3-digit suffix is pp or ep: args says which)."""
    want = 1 + (a.pp > 1) + (a.ep > 1)
    if len(numbers) != want:
        raise BadInput(f"{where / name}: a rank directory of {len(numbers)} number(s), but args says tp "
                       f"{a.tp} x pp {a.pp} x ep {a.ep}, whose rank directories are mp_rank_TT"
                       + ("_PPP" if a.pp > 1 else "") + ("_EEE" if a.ep > 1 else ""))
    tp = numbers[0]
    pp = numbers[1] if a.pp > 1 else 0
    ep = numbers[-1] if a.ep > 1 else 0
    return tp, pp, ep


def _legacy(d: Path, root: str, options: ReadOptions):
    """(merged tensors, Arch, extras, what the source description adds, mapped files)."""
    allow = _allow(options)
    dirs = _rank_dirs(d)
    first = sorted(dirs, key=lambda n: dirs[n])[0]
    mapped, unlisted = [], []

    def read(name, coords):
        m = storage.open_file(confined(d / name / RANK_FILE, root))
        mapped.append(m)
        u = unpickler.Unlisted(m.path)
        unlisted.append(u)
        return read_rank(m, coords, allow, u)

    head = read(first, (None, None, None))
    a = head.arch
    etp = head.args.get("expert_tensor_parallel_size")
    if a.experts and etp not in (None, a.tp):
        raise BadInput(f"{head.path}: args.expert_tensor_parallel_size is {_found(etp)}, not the tp size {a.tp}: "
                       "experts split otherwise than the dense layers are not merged; refused")
    ranks = _rank_coords(dirs, a, d)
    files = {}
    for coords, name in sorted(ranks.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        rf = head if name == first else read(name, coords)
        rf.tp, rf.pp, rf.ep = coords
        files[coords] = rf
        _agree(rf, head)
    for u in unlisted:   # what the run keeps (weights and args) may hold no class on no allowlist
        for rf in files.values():
            if os.fspath(rf.path) == os.fspath(u.path) and unpickler.unread_in(rf.args) is not None:
                raise u.refusal()
    one_save([(rf.path, _rank(rf), _saved(rf)) for rf in files.values()])
    tensors, dropped = _merge_legacy(files, a, d)
    extras = unpickler.extras_json({"args": _record(head), "checkpoint_version": head.version,
                                    "iteration": head.iteration}, Budget(head.path))
    described = {"layout": "legacy", "files": [f"{ranks[c]}/{RANK_FILE}" for c in sorted(ranks)],
                 "tp": a.tp, "pp": a.pp, "ep": a.ep, **({"vp": a.vp} if a.vp else {})}
    placeholders = unpickler.listing(unlisted)
    if placeholders:
        described["placeholders"] = placeholders
    return tensors, a, extras, described, dropped, mapped


def _rank_coords(dirs: dict, a: mt.Arch, d: Path) -> dict:
    """{(tp, pp, ep): directory name} of every rank directory, each inside the mesh args gives, once,
    and none missing."""
    ranks = {}
    for name, numbers in dirs.items():
        coords = _coords(name, numbers, a, d)
        if any(c >= n for c, n in zip(coords, (a.tp, a.pp, a.ep))):
            raise BadInput(f"{d / name}: rank (tp {coords[0]}, pp {coords[1]}, ep {coords[2]}) is outside the mesh "
                           f"args says: tp {a.tp} x pp {a.pp} x ep {a.ep}")
        if coords in ranks:
            raise BadInput(f"{d / name}: holds rank (tp {coords[0]}, pp {coords[1]}, ep {coords[2]}), as "
                           f"{ranks[coords]} does; refused")
        ranks[coords] = name
    # every rank held is inside the mesh: one missing is found in at most len(ranks) + 1 steps, whatever
    # sizes args claims
    i = first_missing({t + a.tp * (p + a.pp * e) for t, p, e in ranks}, a.tp * a.pp * a.ep)
    if i is not None:
        t, p, e = i % a.tp, i // a.tp % a.pp, i // (a.tp * a.pp)
        spelled = f"mp_rank_{t:02d}" + (f"_{p:03d}" if a.pp > 1 else "") + (f"_{e:03d}" if a.ep > 1 else "")
        raise BadInput(f"{d}: rank (tp {t}, pp {p}, ep {e}) is missing ({spelled}/{RANK_FILE}); args "
                       f"says tp {a.tp} x pp {a.pp} x ep {a.ep}")
    return ranks

def _record(rf: RankFile):
    """The args record as read (the extras keep it as data)."""
    return InertObject("argparse.Namespace", state=dict(rf.args))


def _rank(rf: RankFile) -> str:
    return f"rank (tp {rf.tp}, pp {rf.pp}, ep {rf.ep})"


def _agree(rf: RankFile, head: RankFile):
    """Every rank file is of the same run (the same architecture and parallel sizes, as args gives
    them: readers.one_save) and holds the number of virtual chunks args says; that they are of
    one save is checked once all are read (_saved)."""
    one_save([(f.path, _rank(f), {f"args' {x.name}": getattr(f.arch, x.name) for x in fields(mt.Arch)})
              for f in (head, rf)], "runs")
    want = head.arch.vp or 1
    if len(rf.chunks) != want:
        raise BadInput(f"{rf.path}: rank (tp {rf.tp}, pp {rf.pp}, ep {rf.ep}) holds {len(rf.chunks)} model chunk(s), "
                       f"args.virtual_pipeline_model_parallel_size says {want}")


def _layers(chunk: dict, where) -> int:
    """How many layers a chunk holds: its layer numbers must be 0..n-1."""
    found = set()
    for k in chunk:
        m = mt.LAYER.fullmatch(k)
        if m:
            if str(int(m.group(1))) != m.group(1):
                raise BadInput(f"{where}: layer number {m.group(1)!r} of {k!r} is not written canonically")
            found.add(int(m.group(1)))
    if found != set(range(len(found))):
        raise BadInput(f"{where}: its layers are numbered {brief(sorted(found), 80)}, not 0..{len(found) - 1}")
    return len(found)


def _merge_legacy(files: dict, a: mt.Arch, d: Path) -> tuple:
    """Every chunk of every stage, in global layer order, each tensor the join of its tp ranks'
    slices (experts: each ep rank's, numbered globally)."""
    rules = PRESETS[a.preset].build(a.rules_params)
    vp = a.vp or 1
    order = [(v, p) for v in range(vp) for p in range(a.pp)]   # Megatron's interleaved chunk order
    counts = _layer_counts(files, a, d, order)
    local = a.experts // a.ep if a.experts else 0
    if a.experts and a.experts % a.ep:
        raise BadInput(f"{d}: args says {a.experts} experts, which ep {a.ep} does not divide")
    out, dropped, offset = [], {}, 0
    for v, p in order:
        out += _merge_chunk(files, a, rules, (v, p), order, offset, local, dropped)
        offset += counts[(v, p)]
    if a.experts and not any(mt.EXPERT.fullmatch(t.name.split(".", 3)[3]) for t in out
                             if t.name.startswith("decoder.layers.")):
        raise BadInput(f"{d}: args says {a.experts} experts, but no layer holds any")
    listed = [{"name": k, "reason": f"TransformerEngine's extra state, not a weight ({n} entr{'y' if n == 1 else 'ies'})" if n else
               "the last pipeline stage's copy of the tied embedding (args.untie_embeddings_and_output_weights is "
               "false): written once, as embedding.word_embeddings.weight"} for k, n in dropped.items()]
    return out, listed


def _layer_counts(files: dict, a: mt.Arch, d: Path, order: list) -> dict:
    """{(chunk, stage): its layers}: every tp and ep rank of a stage holds the same tensors, and the
    stages hold args.num_layers in all."""
    vp = a.vp or 1
    counts = {}
    for v, p in order:
        base = files[(0, p, 0)]
        n = _layers(base.chunks[v], f"{base.path}: chunk {v}")
        for (t, pp_, e), rf in files.items():
            if pp_ == p:
                if set(rf.chunks[v]) != set(base.chunks[v]):
                    extra = sorted(set(rf.chunks[v]) ^ set(base.chunks[v]))
                    raise BadInput(f"{rf.path}: rank (tp {t}, pp {p}, ep {e}), chunk {v}: its tensors differ from "
                                   f"{base.path.parent.name}'s ({printable(brief(extra[:4], 200), 240)} in one only)")
        counts[(v, p)] = n
    total = sum(counts.values())
    if total != a.layers:
        per = ", ".join(f"stage {p}" + (f" chunk {v}" if vp > 1 else "") + f": {counts[(v, p)]}" for v, p in order)
        raise BadInput(f"{d}: the stages hold {total} layers ({per}); args.num_layers says {a.layers}")
    return counts


def _merge_chunk(files: dict, a: mt.Arch, rules, at: tuple, order: list, offset: int, local: int,
                 dropped: dict) -> list:
    """Chunk at[0] of stage at[1] under global names, in saved order (its layers numbered from
    `offset`); what it leaves out is counted into `dropped`."""
    v, p = at
    first_stage, last = order[0], order[-1]
    out = []
    base = files[(0, p, 0)].chunks[v]
    experts_done = set()
    for name in base:
        if name.endswith("_extra_state"):
            key = re.sub(r"local_experts\.\d+\.", "local_experts.*.", mt.LAYER.sub(
                lambda m: f"decoder.layers.*.{m.group(2)}", name))
            dropped[key] = dropped.get(key, 0) + 1
            continue
        if base[name] is None:
            raise BadInput(f"{files[(0, p, 0)].path}: {name!r} is None, not a tensor")
        m = mt.LAYER.fullmatch(name)
        if m is None:
            where = (v, p)
            if name.startswith("embedding.") and where != first_stage or \
                    (name.startswith(("output_layer.", "decoder.final_layernorm.")) and where != last):
                raise BadInput(f"{files[(0, p, 0)].path}: holds {name!r}, which only the "
                               f"{'first' if name.startswith('embedding.') else 'last'} pipeline stage holds")
            if name == "output_layer.weight" and a.tied:
                dropped["output_layer.weight"] = 0
                continue   # (the last stage's copy of the tied embedding)
            out.append(_join(name, name, files, (p, 0, v), rules, a))
            continue
        layer, rest = int(m.group(1)), m.group(2)
        e = mt.EXPERT.fullmatch(rest)
        if e is None and rest.startswith("mlp.experts."):
            raise BadInput(f"{files[(0, p, 0)].path}: {name!r}: experts not kept one by one (grouped GEMM) are "
                           "not merged; refused")
        if e is None:
            out.append(_join(mt.layer_name(offset + layer, rest), name, files, (p, 0, v), rules, a))
            continue
        if layer in experts_done:
            continue
        experts_done.add(layer)   # a layer's experts, once: every ep rank's, in global order
        out += _merge_experts(files, a, rules, at, layer, offset, local)
    return out


def _merge_experts(files: dict, a: mt.Arch, rules, at: tuple, layer: int, offset: int, local: int) -> list:
    """The experts of `layer` in chunk at[0] of stage at[1]: every ep rank's, numbered globally."""
    v, p = at
    base = files[(0, p, 0)].chunks[v]
    out = []
    parts = _expert_parts(base, layer)
    held = {int(x.group(1)) for k in base if (y := mt.LAYER.fullmatch(k)) and int(y.group(1)) == layer
            and (x := mt.EXPERT.fullmatch(y.group(2)))}
    if len(held) != local or held != set(range(len(held))):
        raise BadInput(f"{files[(0, p, 0)].path}: layer {layer} holds local experts {brief(sorted(held), 60)}, "
                       f"not 0..{local - 1} ({a.experts} experts over ep {a.ep})")
    for ep in range(a.ep):
        for j in range(local):
            for what in parts:
                src = f"decoder.layers.{layer}.mlp.experts.local_experts.{j}.{what}"
                if src not in base:
                    raise BadInput(f"{files[(0, p, 0)].path}: local expert {j} of layer {layer} has no {what}, "
                                   "as local expert 0 has")
                glob = mt.layer_name(offset + layer, f"mlp.experts.local_experts.{ep * local + j}.{what}")
                out.append(_join(glob, src, files, (p, ep, v), rules, a))
    return out


def _expert_parts(chunk: dict, layer: int) -> list:
    """The tensors of local expert 0 of a layer (`linear_fc1.weight`, ...), in saved order."""
    out = []
    for k in chunk:
        m = mt.LAYER.fullmatch(k)
        if m and int(m.group(1)) == layer:
            e = mt.EXPERT.fullmatch(m.group(2))
            if e and e.group(1) == "0" and not e.group(2).endswith("_extra_state"):
                out.append(e.group(2))
    return out


def _join(out_name: str, name: str, files: dict, at: tuple, rules, a: mt.Arch) -> TensorSource:
    """The global `out_name`: `name` from the tp ranks of stage at[0], ep rank at[1], chunk at[2]."""
    p, e, v = at
    pieces = []
    for t in range(a.tp):
        rf = files[(t, p, e)]
        src = rf.chunks[v][name]
        if src is None:
            raise BadInput(f"{rf.path}: {name!r} is None, not a tensor")
        pieces.append(src.source(name))
    rule = rules.match(out_name)
    if rule is None and a.tp > 1:
        raise BadInput(f"{files[(0, p, e)].path}: tensor {name!r}: no rule says how Megatron splits it over tp ranks "
                       "(docs/formats.md#megatron); refused rather than guessed")
    if a.ep > 1 and not mt.EXPERT.search(name):   # dense tensors: every ep rank holds the same
        for ep in range(1, a.ep):
            other = files[(0, p, ep)].chunks[v].get(name)
            if other is None or tuple(other.shape) != tuple(pieces[0].shape):
                raise BadInput(f"{files[(0, p, ep)].path}: {name!r} is {list(other.shape) if other is not None else None}"
                               f", ep rank 0 holds {list(pieces[0].shape)}")
    where = f"{files[(0, p, e)].path.parent.parent / 'mp_rank_*'}: "
    return joined(out_name, pieces, rule, rules.layout, where)
