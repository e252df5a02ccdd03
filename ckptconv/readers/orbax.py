"""Reader for Orbax checkpoints (JAX, Flax, MaxText), without jax, orbax or tensorstore.

SRC is an item directory (what `Checkpointer.save` writes: `_METADATA`, `_CHECKPOINT_METADATA`,
`_sharding`, and the arrays: one zarr directory per array with use_ocdbt=False, or an OCDBT store,
`manifest.ocdbt`, by default), a step directory holding items (`default/`, `state/`...), or a
CheckpointManager directory holding numbered steps: the latest complete step is read unless --step
names one (a step whose write did not finish is skipped, and refused when named), and the item
holding the parameters unless --item names one (orbax_steps.py). `_METADATA` names the arrays
(their PyTree paths joined with "."); each array is zarr v2 or v3 (zarr_meta.py), read lazily from
its chunks (orbax_zarr.py, decoded by zarr_codecs.py). A training state's `params` is written by
default, under names relative to it (`--state-dict auto`, as for torch training wrappers); the rest
is listed as left out; `--state-dict KEY` writes another top-level entry, `none` everything.
"""
import bisect
import os
from pathlib import Path

from .base import Reader, ReaderOption, register
from ..errors import BadInput
from ..storage import files as storage
from ..checkpoint import Checkpoint, SourceFacts
from . import ReadOptions, confined, source_root, wanted, wrappers
from . import orbax_steps as steps
from .ocdbt import MANIFEST, OcdbtStore
from .orbax_zarr import Counter, DirStore, array_source
from .zarr_meta import read_meta

NAME = "orbax"
PARAMS = "params"


def detect(path: Path) -> bool:
    try:
        return steps.is_item(path) or steps.is_step(path) or steps.is_root(path)
    except (OSError, BadInput):
        return False


def _store(item, root: str):
    # OCDBT by what is there: the root's manifest, or per-process stores never merged into one (which
    # OcdbtStore refuses, naming them)
    if storage.is_file(storage.join(item, MANIFEST)) or \
            any(e.is_dir and e.name.startswith("ocdbt.process_") for e in storage.entries(item)):
        return _Ocdbt(OcdbtStore(storage.place(item), root), item)
    return DirStore(item, lambda p: confined(p, root))


class _Ocdbt:
    """An OcdbtStore as orbax_zarr's stores are used: get, where, files."""

    def __init__(self, store, item):
        self.store, self.item, self._sorted = store, item, None

    def get(self, key):
        return self.store.get(key)

    def where(self, key):
        return f"{self.item}[ocdbt key {key!r}]"

    def count_under(self, prefix: str, limit: int) -> int:
        """How many keys start with `prefix` (the store's keys are sorted), at most `limit`."""
        if self._sorted is None:
            self._sorted = self.store.keys()
        keys = self._sorted
        return min(limit, bisect.bisect_left(keys, prefix + "\U0010ffff") - bisect.bisect_left(keys, prefix))

    @property
    def files(self):
        return self.store.files


def _unwrap(leaves, how: str, where):
    """The entry (a top-level key or a dotted path, `--state-dict`) whose arrays are written under names
    relative to it, or None: every array under its full path. `auto`: `params` when the tree has it."""
    tops = list(dict.fromkeys(leaf.keys[0] for leaf in leaves))
    if how == "none":
        return None
    if how == "auto":
        return PARAMS if PARAMS in tops and any(len(leaf.keys) > 1 and leaf.keys[0] == PARAMS for leaf in leaves) \
            else None
    parts = tuple(how.split("."))
    if not any(leaf.keys[:len(parts)] == parts and len(leaf.keys) > len(parts) for leaf in leaves):
        raise wrappers.NoSuchEntry(f"--state-dict {how!r}: {where} has no entry of arrays under that key or dotted path "
                                   f"(its top level: {', '.join(tops[:12])})")
    return how


def _array(leaf) -> int:
    """1 for a leaf read as a tensor, 0 for one that is not an array."""
    return int(not leaf.skip and leaf.value_type in steps.ARRAY_TYPES)


def _kind(key: str) -> str:
    return wrappers.MODEL if key == PARAMS else wrappers.kind(key)


def _confine_item(item, src, root: str):
    """The item chosen (and so its step), and the metadata files read from it and its step, must
    resolve inside SRC: a step, an item or a _METADATA that is a link leading out is refused, as
    every chunk and data file is."""
    confined(storage.place(item), root)
    alone = os.fspath(storage.place(item)) == os.fspath(storage.place(src))   # (SRC is the item: no step around it)
    for d in (item,) if alone else (item, storage.parent(item)):
        for name in (steps.METADATA, MANIFEST, "_CHECKPOINT_METADATA", "_strings.json", "_sharding",
                     "commit_success.txt"):
            p = storage.join(d, name)
            if storage.exists(p):
                confined(storage.place(p), root)


def load(path: Path, options: ReadOptions) -> Checkpoint:
    step_asked, item_asked = options.get("step"), options.get("item")
    item, step, item_name, skipped_steps = steps.choose(path, step_asked, item_asked)
    root = source_root(storage.place(path))
    _confine_item(item, path, root)
    leaves, every_chunk = steps.tree(item)
    store = _store(item, root)
    key = _unwrap(leaves, options.state_dict, storage.join(item, steps.METADATA))
    prefix = tuple(key.split(".")) if key else ()
    counter = Counter(every_chunk)
    tensors, dropped, rest, extras, texts = [], [], {}, {}, None
    for leaf in leaves:
        mine = leaf.keys[:len(prefix)] == prefix and len(leaf.keys) > len(prefix)
        name = ".".join(leaf.keys[len(prefix):]) if prefix else leaf.name
        if not mine:
            # the sibling of the entry written, at the level where the leaf's path leaves it
            at = next((i for i, (k, p) in enumerate(zip(leaf.keys, prefix)) if k != p), len(leaf.keys) - 1)
            top = ".".join(leaf.keys[:at + 1])
            rest[top] = rest.get(top, 0) + _array(leaf)
            continue
        if leaf.value_type == "string" and not leaf.skip:   # kept in _strings.json: an extra, as text
            if texts is None:
                texts = steps.strings(item)
            text = texts.get(leaf.name)
            if isinstance(text, str) and wanted(name, options.only):
                extras[name] = text
                continue
        if leaf.skip or leaf.value_type not in steps.ARRAY_TYPES:
            dropped.append({"name": leaf.name, "reason": f"not an array (Orbax value type {str(leaf.value_type)[:40]})"
                            if not leaf.skip else "saved with skip_deserialize"})
            continue
        if not wanted(name, options.only):
            continue
        meta = read_meta(store, leaf.name)
        if meta is None:
            raise BadInput(f"{storage.join(item, leaf.name)}: array {leaf.name!r} of _METADATA has no .zarray or "
                           "zarr.json in the checkpoint")
        tensors.append(array_source(store, leaf.name, name, meta, counter))
    layout = None
    if rest or key:
        dropped += [{"name": k, "reason": "tensors outside the state dict"} for k, n in rest.items() if n]
        counts = {}
        for leaf in leaves:
            counts[leaf.keys[0]] = counts.get(leaf.keys[0], 0) + _array(leaf)
        chosen = key if key else None
        parts = [wrappers.Part(k, _kind(k), n) for k, n in counts.items()]
        if key and "." in key:
            parts = [wrappers.Part(key, wrappers.MODEL, len(tensors))] + [wrappers.Part(k, _kind(k), n)
                                                                          for k, n in rest.items() if n]
        parts = [p for p in parts if p.tensors or p.key == key]
        layout = wrappers.TrainingParts(tuple(parts), chosen, options.state_dict)
    took = []
    if step is not None:
        took.append(f"step {step}")
    if item_name is not None:
        took.append(f"item {item_name}")
    took.append("OCDBT" if isinstance(store, _Ocdbt) else "per-array zarr")
    if key:
        took.append(f"state dict {key}")
    more = {"took": ", ".join(took), "layout_kind": "ocdbt" if isinstance(store, _Ocdbt) else "zarr"}
    if step is not None:
        more["step"] = step
    if item_name is not None:
        more["item"] = item_name
    if skipped_steps:
        more["incomplete_steps"] = [{"name": n, "reason": why} for n, why in skipped_steps]
    item_path = storage.place(item)
    files = [str(item_path.relative_to(path)) if item_path != path else "."]   # the item read, under SRC
    source = SourceFacts(format=NAME, path=str(path), files=files, dropped=dropped,
                         state_dict=key or ("none" if options.state_dict == "none" else None), more=more)
    return Checkpoint(tensors, extras, source, [], list(store.files), layout=layout)


OPTIONS = (
    ReaderOption("--step", "step", "Orbax CheckpointManager directories: the step to read (default: the latest "
                 "complete one).", type=int),
    ReaderOption("--item", "item", "Orbax steps of several items: the item to read (default: the one holding the "
                 "parameters: default, state, params, items...).",),
)
READER = register(Reader(NAME, "Orbax checkpoints (JAX/Flax/MaxText): item, step or CheckpointManager directories, "
                               "OCDBT or per-array zarr v2/v3",
                         detect, load, priority=22, options=OPTIONS,
                         fuzz=(("_METADATA", None), ("_sharding", b"{}"),
                               ("w/.zarray", b'{"chunks":[2],"compressor":null,"dimension_separator":".",'
                                             b'"dtype":"<f4","fill_value":null,"filters":null,"order":"C",'
                                             b'"shape":[4],"zarr_format":2}'),
                               ("w/0", b"\0" * 8)),
                         looks_for="a directory holding _METADATA with _sharding or manifest.ocdbt (an Orbax item), "
                                   "or numbered step directories of them"))
