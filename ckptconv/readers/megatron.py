"""Reader for Megatron checkpoints, both layouts, without torch or Megatron: every tensor-, pipeline-
(and expert-) parallel rank merged into the whole model, offline, each tensor a lazy join of the
ranks' slices (docs/formats.md#megatron).

- **legacy** (Megatron-LM without --use-dist-ckpt): `DIR/latest_checkpointed_iteration.txt` names
  the iteration; `DIR/iter_0000500/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` per (tp, pp, ep) rank,
  a torch.save zip of `{"args", "checkpoint_version", "iteration", "model" (or "model0"... per virtual
  pipeline chunk), "optimizer", "rng_state", ...}`. Each pipeline stage (and virtual chunk) numbers
  its layers from 0; each tp rank holds its slice of every split tensor; each ep rank its experts.
- **torch_dist** (Megatron-Core's `dist_checkpointing`): the iteration directory holds
  `metadata.json` (`"sharded_backend": "torch_dist"`), `common.pt` (args, iteration) and a PyTorch
  DCP checkpoint, read with readers/dcp.py's machinery: global tensors, layers stacked on a leading
  axis (experts on a second), unstacked here as lazy views.

Both give the same names: Megatron-Core's, with global layer (and expert) numbers and the layer
norms as the modules are named (tp/megatron.py). How a tensor is split over tp ranks is the
`megatron` partition preset (tp/presets.py), which reshard splits with: a merge is `layout.joined`,
the inverse of that split. `--to hf` maps the result to Llama / Qwen2 / Mixtral names and makes a
config.json from `args` (tp/megatron.py). Optimizer, RNG and scheduler state are unpickled as
references (never read); `distrib_optim.pt` is never opened.

The legacy layout is megatron_legacy.py's, the torch_dist layout megatron_dist.py's; this module
finds the iteration and is the reader. Files are reached through storage/files.py: in an object store
each rank file's zip directory and pickle are read by ranged reads, and each tensor's bytes as the
ranges its slices reach.
"""
from pathlib import Path

from .base import Reader, ReaderOption, register
from ..storage import files as storage
from ..errors import BadInput, UsageError, printable
from ..checkpoint import Checkpoint, SourceFacts
from ..tp import megatron as mt
from . import ReadOptions, confined, model_files, source_root, wanted
from .megatron_dist import _torch_dist
from .megatron_legacy import RANK_DIR, RANK_FILE, _legacy

NAME = "megatron"
TRACKER = "latest_checkpointed_iteration.txt"
MAX_TRACKER = 64                 # bytes read of the tracker: an iteration number or "release"
MAX_METADATA = 64 << 10          # metadata.json: a few keys


# --- Where the files are -------------------------------------------------------------------------

def _metadata(d: Path):
    """metadata.json of a dist_checkpointing directory, or None when there is none (or it says no
    sharded backend)."""
    p = d / "metadata.json"
    try:
        if not p.is_file() or p.stat().st_size > MAX_METADATA:
            return None
    except OSError:
        return None
    try:
        data = storage.load_json(p, "metadata.json", limit=MAX_METADATA)
    except BadInput:
        return None
    return data if isinstance(data, dict) and "sharded_backend" in data else None


def _is_iteration_dir(d: Path) -> bool:
    try:
        return _metadata(d) is not None or any(RANK_DIR.fullmatch(n) and (d / n / RANK_FILE).is_file()
                                               for n in storage.listdir(d))
    except (OSError, BadInput):
        return False


def detect(path: Path) -> bool:
    """A Megatron checkpoint directory (holding latest_checkpointed_iteration.txt) or one of its
    iteration directories (mp_rank_* rank directories, or a torch_dist metadata.json)."""
    try:
        if not path.is_dir():
            return False
        tracker = path / TRACKER
        if tracker.is_file() and tracker.stat().st_size <= MAX_TRACKER:
            return True
        return _is_iteration_dir(path)
    except OSError:
        return False


def _iteration(path: Path, root: str) -> tuple:
    """(the iteration directory, its name, the checkpoint directory whose model files are carried)."""
    tracker = path / TRACKER
    if not tracker.is_file():
        return path, path.name, path
    confined(tracker, root)
    f = storage.open_file(tracker)
    raw = f.read(0, min(f.size, MAX_TRACKER + 1))
    text = raw.decode("ascii", "replace").strip()
    if len(raw) > MAX_TRACKER or not (text == "release" or text.isdigit() and len(text) <= 12):
        raise BadInput(f"{tracker}: says {printable(repr(text[:80]), 100)}, not an iteration number or 'release'")
    name = "release" if text == "release" else f"iter_{int(text):07d}"
    d = path / name
    confined(d, root)
    if not d.is_dir():
        raise BadInput(f"{tracker}: names iteration {text}, but {d} is not a directory")
    return d, name, path


# --- Load ------------------------------------------------------------------------------------------

def load(path: Path, options: ReadOptions) -> Checkpoint:
    root = source_root(path)
    d, tag, top = _iteration(path, root)
    meta = _metadata(d)
    if meta is not None:
        tensors, a, extras, described, dropped, mapped = _torch_dist(d, root, options, meta)
    else:
        tensors, a, extras, described, dropped, mapped = _legacy(d, root, options)
    to = options.get("to") or "megatron"
    if to not in ("megatron", "hf"):
        raise UsageError(f"--to {to!r}: only 'megatron' or 'hf'")
    made, config = {}, a.config()
    if to == "hf":
        tensors = mt.to_hf(tensors, a)
        config = mt.hf_config(a)
        made = {"config.json": mt.config_bytes(config)}
    tensors = [t for t in tensors if wanted(t.name, options.only)]
    files, damaged = described.pop("files"), described.pop("damaged", [])
    source = SourceFacts(format=NAME, path=str(path), layout=described.pop("layout"),
                         files=[f"{tag}/{f}" for f in files] if d != path else files,
                         damaged=[{**r, "file": f"{tag}/{r['file']}"} for r in damaged] if d != path else damaged,
                         placeholders=described.pop("placeholders", []), to="hf" if to == "hf" else None,
                         dropped=dropped, more={"iteration": tag, **described})
    carried = [(rel, p) for rel, p in model_files(top, [d, d / "metadata.json"]) if rel not in made]
    return Checkpoint(tensors, extras, source, carried, mapped, config=config, made=made)


OPTIONS = (ReaderOption("--to", "to", "Megatron checkpoints: the names written, Megatron-Core's (default) or "
                        "Hugging Face's (Llama, Qwen2, Mixtral) with a config.json made from the training arguments.",
                        choices=("megatron", "hf")),)
READER = register(Reader(NAME, "Megatron checkpoints (legacy mp_rank_* files and torch_dist), TP x PP x EP merged",
                         detect, load, priority=15, parses_pickles=True, options=OPTIONS, suffixes=(".pt",),
                         fuzz=(("latest_checkpointed_iteration.txt", b"1"),
                               ("iter_0000001/mp_rank_00/model_optim_rng.pt", None)),
                         looks_for="latest_checkpointed_iteration.txt or iter_*/mp_rank_*/model_optim_rng.pt, or "
                                   "metadata.json with sharded_backend beside .metadata"))
