"""Reader plugins (base.py: the interface and the registry), detection, and what every reader
shares: which files of a source directory are weights, which are carried into OUT, and the
confinement of everything a source names to the source itself.

Detection tries each registered reader in priority order (docs/formats.md#detection) and reads
with the first that recognises the path; when a directory also holds weights another reader
recognises (a model saved both as safetensors and as .bin), the checkpoint lists them in `also`
and the summary says which were read.
"""
import contextlib
import contextvars
import functools
import importlib
import os
import pkgutil
import re
import stat
from pathlib import Path

from ..errors import BadInput, UsageError, brief, encodable, printable
from ..formats.manifest import MANIFEST, index_kind
from ..formats.mesh import MESH
from ..formats.sums import NAME as SUMS, unsafe_name
from . import unknown
from ..storage import files as storage
from ..storage.files import locate, place
from .base import READERS, ReadOptions, Reader, Source

__all__ = ["ReadOptions", "Reader", "Source", "readers", "reader_for", "open_checkpoint", "open_source"]


def wanted(name: str, only) -> bool:
    """--only PREFIX (repeatable): keep names that start with any prefix; no prefix keeps all."""
    return not only or any(name.startswith(p) for p in only)


@functools.cache
def readers() -> dict:
    """{name: Reader}, in detection order: every module of this package is imported (once), and each
    reader module registers itself."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return dict(sorted(READERS.items(), key=lambda kv: kv[1].priority))


def detect(path) -> list:
    """Every reader that recognises `path`, in priority order (the first is the one used)."""
    path = place(path)
    if not path.exists():
        raise BadInput(f"{path}: no such file or directory")
    if not path.is_dir() and not path.is_file():
        raise BadInput(f"{path}: not a regular file or a directory")
    found = [r for r in readers().values() if r.detect(path)]
    if not found and path.is_dir():   # readers do not look at links leading out: say that is why
        root = source_root(path)
        for p in sorted(path.iterdir()):
            if p.name.endswith(weight_suffixes()) and p.is_symlink():
                confined(p, root)
    if not found:
        raise BadInput(unknown.unrecognised(path, [r for r in readers().values() if r.holds_data or r.suffixes]))
    return found


def reader_for(path, fmt=None) -> tuple:
    """(the Reader for `path`: forced by `fmt` or detected, names of other readers that recognise
    the same directory)."""
    if fmt:
        known = readers()
        if fmt not in known:
            raise UsageError(f"--from {fmt!r}: unknown format (known: {', '.join(known)})")
        if not place(path).exists():
            raise BadInput(f"{path}: no such file or directory")
        return known[fmt], []
    reader, *others = detect(path)
    return reader, [r.name for r in others if r.holds_data] if place(path).is_dir() else []


def open_source(source: Source):
    return open_checkpoint(source.path, source.format, source.options)


def open_checkpoint(path, fmt=None, options=None):
    """The Checkpoint at `path` (a local path or a URL, reached with `options.storage`: one storage
    session for everything the job reads of it), read by the reader `fmt` names or detected."""
    options = options or ReadOptions()
    path = locate(path, options.storage)
    reader, also = reader_for(path, fmt)
    index = listing_index(place(path)) if place(path).is_file() else None
    if index is not None and not options.one_shard:
        raise BadInput(f"{path}: is one shard of the model {index.name} indexes; give the directory "
                       f"{printable(str(index.parent), 300)} to convert the whole model (--one-shard converts "
                       "this shard alone)")
    ckpt = reader.load(place(path), options)
    if ckpt.unsupported is not None and not options.skip_unsupported:
        what, hint = ckpt.unsupported
        more = len(ckpt.source.skipped) - 1
        raise BadInput(what + (f" (and {more} more tensor{'s' if more > 1 else ''} it cannot store)" if more else "")
                       + (f"; {hint}" if ckpt.tensors else "; no tensor safetensors can store is left to convert"))
    if index is not None:
        ckpt.source.more["one_shard"] = True   # (verify --against reads the source the same way)
    ckpt.format, ckpt.also, ckpt.root = reader.name, also, path
    beside = paired_files(place(path)) if place(path).is_file() else []
    files, skipped = carried(ckpt.model_files + beside, source_root(place(path)), options.max_extra_size)
    ckpt.model_files, ckpt.skipped_files = files, ckpt.skipped_files + skipped   # (after what the reader skipped)
    if place(path).is_dir():
        ckpt.skipped_files += [{"name": p.name, "reason": f"training state: {what}"}
                               for p, what in training_files(place(path))]
        ckpt.skipped_files += [{"name": name, "reason": "an earlier output's own metadata (OUT gets its own)"}
                               for name in (MANIFEST, SUMS) if storage.exists(place(path) / name)]
    for m in ckpt.mapped:
        # Reading headers touched a page of the mapping per tensor, and the kernel may map a whole 2 MiB
        # folio of the page cache for each (measured: 290 MB of RSS after opening a 2 GB .pt of 165
        # tensors). Let them go; the data is read later, block by block, and released as it goes.
        m.release(0, m.size)
    return ckpt


MAX_INDEXES = 16   # index files beside a file SRC that are read to see whether one lists it


def listing_index(path: Path):
    """The shard index beside a weights file that lists it among other shards
    (`model.safetensors.index.json` naming `model-00001-of-00006.safetensors`), or None; at most
    MAX_INDEXES of them are read, and one that cannot be read or parsed lists nothing."""
    try:
        names = sorted(n for n in storage.listdir(path.parent) if n.endswith(".index.json"))
    except OSError:
        return None
    for name in names[:MAX_INDEXES]:
        try:
            data = storage.load_json(path.parent / name, "shard index", limit=64 << 20)
        except BadInput:
            continue
        entries = data.get("weight_map") if isinstance(data, dict) else None
        shards = {os.path.normpath(v) for v in entries.values() if isinstance(v, str) and v and "\0" not in v} \
            if isinstance(entries, dict) else set()
        if path.name in shards and len(shards) > 1:   # (an index of this file alone: it is the whole model)
            return path.parent / name
    return None


# Weights of frameworks no reader reads (Flax, Keras) and any index: never carried as model files either.
OTHER_WEIGHTS = (".index.json", ".msgpack", ".h5")


@functools.cache
def weight_suffixes() -> tuple:
    """How weight files' names end: what each reader declares (`Reader.suffixes`), and OTHER_WEIGHTS."""
    return tuple(sorted({s for r in readers().values() for s in r.suffixes} | set(OTHER_WEIGHTS)))


def weights_name(name: str) -> bool:
    """Whether a file of this name is weights or an index (weight_suffixes, or a variant's index,
    `STEM.safetensors.index.fp16.json`): never carried into OUT as a model file."""
    return name.endswith(weight_suffixes()) or index_kind(name) is not None


OUTPUT_METADATA = (MANIFEST, SUMS, MESH)

# A single weights file given as SRC carries the one config file beside it that its consumer pairs
# with its name (docs/convert.md, "Files carried"): PEFT's adapter config, a transformers model's or a
# diffusers component's config.json. [.VARIANT] is diffusers' and transformers' `variant` (`.fp16`).
_PAIRED = [
    (re.compile(r"adapter_model\.(bin|safetensors)"), "adapter_config.json"),
    (re.compile(r"(diffusion_pytorch_model(\.[\w-]+)?\.(bin|safetensors)|pytorch_model(\.[\w-]+)?\.bin"
                r"|model(\.[\w-]+)?\.safetensors)(\.index\.json)?"), "config.json"),
]


def paired_files(path: Path) -> list:
    """(name, path) of the config file beside a single weights file SRC that its name pairs it with
    (_PAIRED), when there is one; `carried` decides whether it is carried."""
    for pattern, config in _PAIRED:
        if pattern.fullmatch(path.name) and storage.exists(path.parent / config):
            return [(config, path.parent / config)]
    return []


# What a transformers Trainer writes into `checkpoint-N/` beside the model (and DeepSpeed beside it):
# never weights, never carried; named in the summary.
_TRAINING_STATE = [
    (re.compile(r"optimizer\.(pt|bin)"), "optimizer"),
    (re.compile(r"scheduler\.pt"), "learning-rate scheduler"),
    (re.compile(r"scaler\.pt"), "mixed-precision grad scaler"),
    (re.compile(r"rng_state(_\d+)?\.pth"), "random number generator states"),
    (re.compile(r"training_args\.bin"), "TrainingArguments, a pickled Python object"),
    (re.compile(r"trainer_state\.json"), "Trainer progress and logs"),
    (re.compile(r"latest|zero_to_fp32\.py|zero_to_torch\.py"), "DeepSpeed"),
    (re.compile(r"latest_checkpointed_iteration\.txt"), "Megatron's latest iteration"),
]

# DeepSpeed's rank files in a tag directory (`global_stepN/`): read by the deepspeed reader, never
# taken for a directory's torch weights.
DEEPSPEED_RANK_FILE = re.compile(r"(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt"
                                 r"|(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt")

# Lightning's file of a sharded FSDP checkpoint's other state, beside DCP's `.metadata`
# (lightning.fabric.utilities.load._METADATA_FILENAME): read by the dcp reader (dcp_lightning.py),
# never taken for a directory's torch weights.
LIGHTNING_META = "meta.pt"


def deepspeed_tag_directory(d: Path) -> bool:
    """A DeepSpeed tag directory inside its checkpoint directory (the parent holds `latest`), whose
    model files (config.json, tokenizer) the Hugging Face Trainer leaves in that parent."""
    try:
        return (d.parent / "latest").is_file() and any(DEEPSPEED_RANK_FILE.fullmatch(n) for n in storage.listdir(d))
    except OSError:
        return False


def training_state(name: str):
    """What a Trainer checkpoint file beside the model holds (its description), or None."""
    return next((what for pattern, what in _TRAINING_STATE if pattern.fullmatch(name)), None)


def training_files(directory: Path) -> list:
    """(path, description) of the training-state files in a directory (a Trainer `checkpoint-N/`)."""
    return [(p, training_state(p.name)) for p in sorted(directory.iterdir()) if training_state(p.name)]


def model_files(directory: Path, consumed=()) -> list:
    """Files beside the weights (config.json, tokenizer, README...) that may be carried into OUT:
    (name, path) candidates; `carried` decides which are."""
    consumed = {storage.realpath(p) for p in consumed}
    out = []
    for p in sorted(directory.iterdir()):
        if (p.name.startswith(".") or storage.realpath(p) in consumed or weights_name(p.name)
                or p.name in OUTPUT_METADATA or p.is_dir() or training_state(p.name)):
            continue
        out.append((p.name, p))
    return out


# The directory of a source made of parts (a diffusers pipeline), while a part of it is read
# (`within`): every file of the part must resolve inside it, not just inside the part's own folder.
_WITHIN = contextvars.ContextVar("ckptconv_source_within", default=None)


@contextlib.contextmanager
def within(root: str):
    """Read the parts of the source whose root is `root` (source_root of the whole, resolved): a part's
    files may lead anywhere inside it (one folder's file linked to another's, a Hugging Face cache
    snapshot's links into its repo's blobs), and nowhere outside."""
    token = _WITHIN.set(root)
    try:
        yield
    finally:
        _WITHIN.reset(token)


def source_root(path: Path) -> str:
    """The directory every file of the source must resolve into: SRC itself (a file's directory), or
    for a Hugging Face cache snapshot (`.../snapshots/REV/`, whose files link into the repo's
    `blobs/`), that repo; for a DeepSpeed tag directory (`global_stepN/` beside `latest`), its
    checkpoint directory; for a part of a source made of parts (`within`), the whole's."""
    d = path if path.is_dir() else path.parent
    whole = _WITHIN.get()
    if whole is not None and inside(d, whole):
        return whole
    if d.parent.name == "snapshots" and (d.parent.parent / "blobs").is_dir():
        d = d.parent.parent
    elif path.is_dir() and deepspeed_tag_directory(d):
        d = d.parent
    return storage.realpath(d)


def inside(path, root: str) -> bool:
    """Whether `path` resolves (symbolic links followed) to `root` or below it; for a Hugging Face
    cache repository (source_root of a snapshot), to its `snapshots/` or `blobs/` only: never its
    `refs/`, nor anything else a link inside the cache could name."""
    real = storage.realpath(path)
    if real == root:
        return True
    if storage.is_dir(storage.join(root, "blobs")) and storage.is_dir(storage.join(root, "snapshots")):
        return any(real.startswith(storage.join(root, part) + "/") for part in ("blobs", "snapshots"))
    return real.startswith(root.rstrip("/") + "/")


def confined(path: Path, root: str) -> Path:
    """`path`, refused (never opened) when it resolves outside the source: an index or a symbolic link
    must not make ckptconv read other files."""
    if not inside(path, root):
        raise BadInput(f"{path}: leads outside the checkpoint (to {storage.realpath(path)}); refused")
    return path


def weights_file(path: Path, root: str) -> Path:
    """`path` confined to the source, and not a Trainer's training state (an index or a link that
    leads to optimizer.pt is not the model's weights)."""
    confined(path, root)
    for name in (path.name, storage.name(storage.realpath(path))):
        if training_state(name):
            raise BadInput(f"{path}: is (or leads to) {name}, a Trainer's {training_state(name)}, not model weights; "
                           "refused (give that file as SRC to convert it)")
    return path


def carried(candidates, root: str, max_size: int):
    """Split model files into those carried into OUT — regular files resolving inside the source, at
    most `max_size` bytes — and those skipped, each with the reason (listed in the summary and the
    manifest). Carried paths are resolved, so the copy opens exactly what was checked."""
    files, skipped = [], []
    for rel, p in candidates:
        real = storage.realpath(p)
        try:
            st = storage.stat(real)
        except OSError as e:
            skipped.append({"name": rel, "reason": f"unreadable: {e.strerror}"})
            continue
        if unsafe_name(rel) or not encodable(rel):
            skipped.append({"name": rel, "reason": "a name SHA256SUMS cannot list"})
        elif not inside(real, root):
            skipped.append({"name": rel, "reason": "a symbolic link leading outside the source"})
        elif not stat.S_ISREG(st.st_mode):
            skipped.append({"name": rel, "reason": "not a regular file"})
        elif st.st_size > max_size:
            skipped.append({"name": rel, "reason": f"{st.st_size} bytes, more than --max-extra-size {max_size}"})
        else:
            files.append((rel, place(real)))
    return files, skipped


def weight_map(index: Path, only=()) -> dict:
    """The index's {tensor: shard file} entries that `only` keeps, validated: shard names are plain
    file names in the index's directory (shared by the .bin index of readers/torch_pickle.py)."""
    data = storage.load_json(index, "shard index")
    entries = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        raise BadInput(f"{index}: not a valid shard index (needs a 'weight_map' object)")
    out = {}
    for name, shard in entries.items():
        if not isinstance(shard, str) or not shard or "/" in shard or "\\" in shard or shard.startswith(".") \
                or "\0" in shard:
            raise BadInput(f"{index}: weight_map entry {name!r} names an invalid shard {brief(shard)}")
        if wanted(name, only):
            out[name] = shard
    for shard in set(out.values()):
        if not (index.parent / shard).is_file():
            raise BadInput(f"{index}: shard {shard!r} listed in the index is missing")
    return out


def one_save(files, kind: str = "saves"):
    """The one rule for a source of several files that each record what run and what save they are
    of (DeepSpeed's and Megatron's rank files; docs/security.md, class 26): every
    file that records a fact records what the first file to record it does. `files`: (path, label,
    {fact: value}) in rank order, the label naming the file's rank ("rank 1"), a fact the file does
    not record left out; values are compared with ==, so what is not a number or text is compared
    as its digest (pickle.extras.recorded_digest). The first disagreement is refused in one line
    naming the file, its rank, the fact and both values: `PATH: rank 1: global_steps 1, rank 0's 2:
    files of different saves; refused` (`kind` "runs" for what a run fixes: its architecture, ZeRO
    stage, version)."""
    first = {}
    for path, label, facts in files:
        for fact, value in facts.items():
            if fact not in first:
                first[fact] = (label, value)
                continue
            theirs_label, theirs = first[fact]
            if value != theirs and not (isinstance(value, float) and isinstance(theirs, float) and value != value
                                        and theirs != theirs):   # (NaN recorded twice is the same)
                raise BadInput(f"{path}: {label}: {fact} {brief(value, 60)}, {theirs_label}'s {brief(theirs, 60)}: "
                               f"files of different {kind}; refused")


def first_missing(held, count: int):
    """The first of 0..count-1 that `held` (a set of numbers, or a dict keyed by them) lacks, or None:
    found in at most len(held) + 1 steps, however large `count` is (a number from a file name or
    a file: docs/security.md, "rank and index numbers in file names")."""
    for i in range(min(count, len(held) + 1)):
        if i not in held:
            return i
    return None


def by_shard(entries: dict) -> dict:
    """{shard file: [tensor names the index places there]}."""
    out = {}
    for name, shard in entries.items():
        out.setdefault(shard, []).append(name)
    return out


def check_listed(index: Path, shard: str, names: list, held: set):
    """Every tensor the index places in `shard` must be there: none disappears silently."""
    for name in names:
        if name not in held:
            raise BadInput(f"{index}: tensor {name!r} is listed in {shard}, which does not hold it")
