"""The Orbax reader's directories (readers/orbax.py reads with them): which directory SRC is (an item
directory, a step directory holding items, a CheckpointManager root holding numbered steps), which
steps are complete, the step and the item read (--step, --item), and the PyTree metadata (`_METADATA`)
naming the arrays. Registers nothing: orbax.py is the reader.
"""
import re

from ..errors import BadInput, UsageError, brief
from ..limits import MAX_DEPTH
from ..storage import files as storage

TMP = ".orbax-checkpoint-tmp"
COMMIT = "commit_success.txt"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
METADATA = "_METADATA"
MAX_TREE_BYTES = 64 << 20          # _METADATA (the PyTree's paths and value metadata)
MAX_SMALL_JSON = 1 << 20           # _CHECKPOINT_METADATA
MAX_ENTRIES = 1 << 16              # entries of a manager root or step directory looked at
DETECT_DIRS = 8                    # subdirectories of a directory detection looks into
ITEM_PREFERENCE = ("default", "state", "params", "items", "model", "train_state")
_STEP = re.compile(r"(?:(.*)_)?([0-9]{1,4000})")   # ASCII digits, as Orbax's int() of a name it made
_ITEM_MARKS = ("manifest.ocdbt", "_sharding", "array_metadatas", CHECKPOINT_METADATA, COMMIT)


def is_item(path) -> bool:
    """An Orbax PyTree item directory: `_METADATA` beside what Orbax writes with it."""
    try:
        if not storage.is_dir(path) or not storage.is_file(storage.join(path, METADATA)):
            return False
    except (OSError, BadInput):
        return False
    return any(storage.exists(storage.join(path, n)) for n in _ITEM_MARKS)


def _subdirs(path) -> list:
    """The names of a directory's subdirectories (from its one listing), sorted."""
    try:
        found = storage.entries(path)
    except (OSError, BadInput):
        return []
    if len(found) > MAX_ENTRIES:
        raise BadInput(f"{path}: {len(found)} entries, more than the {MAX_ENTRIES} an Orbax directory may hold")
    return [e.name for e in found if e.is_dir and not e.name.startswith(".")]


def items_of(step) -> list:
    """The item directories of a step directory, sorted (an item whose write did not finish, under
    Orbax's temporary name, is none)."""
    return [n for n in _subdirs(step) if TMP not in n and is_item(storage.join(step, n))]


def is_step(path) -> bool:
    """A step directory: `_CHECKPOINT_METADATA` beside item directories, or (a step whose write did
    not finish) one of its first few subdirectories an item. Cheap for any directory detection asks
    about: one listing, and at most DETECT_DIRS subdirectories looked into."""
    if not storage.is_dir(path) or is_item(path):
        return False
    subdirs = _subdirs(path)
    preferred = [n for n in ITEM_PREFERENCE if n in subdirs]
    return any(is_item(storage.join(path, n)) for n in (preferred + subdirs)[:DETECT_DIRS])


def step_number(name: str):
    """The step a manager root's entry is (int), or None."""
    m = _STEP.fullmatch(name.split(TMP)[0])
    return int(m.group(2)) if m else None


def steps_of(root) -> list:
    """(step, name) of the step directories of a manager root, by step (temporary ones included)."""
    out = []
    for n in _subdirs(root):
        number = step_number(n)
        if number is not None:
            out.append((number, n))
    return sorted(out)


def is_root(path) -> bool:
    if not storage.is_dir(path) or is_item(path):
        return False
    return any(is_step(storage.join(path, n)) for _, n in steps_of(path)[-4:])


def incomplete(step, name: str, markers: bool):
    """Why a step directory is not a finished save (None: it is): Orbax's temporary name, no
    _CHECKPOINT_METADATA (written last, with the commit time), or no commit_success.txt where the
    other steps of its root have one (`markers`)."""
    if TMP in name:
        return f"its name ends in {TMP}-…: Orbax's write of it did not finish"
    meta = storage.join(step, CHECKPOINT_METADATA)
    if not storage.is_file(meta):
        return f"it has no {CHECKPOINT_METADATA}, which Orbax writes when a save finishes"
    if markers and not storage.is_file(storage.join(step, COMMIT)):
        return f"it has no {COMMIT}, which Orbax writes when a save is committed"
    doc = storage.load_json(meta, "Orbax checkpoint metadata", MAX_SMALL_JSON)
    if isinstance(doc, dict) and "commit_timestamp_nsecs" in doc and doc["commit_timestamp_nsecs"] is None:
        return f"its {CHECKPOINT_METADATA} records no commit time"
    return None


def _confined_incomplete(root, step, name, markers):
    """incomplete(), for a step that resolves inside SRC (`root`): one linked out is refused unread."""
    from . import confined
    confined(storage.place(step), root)
    return incomplete(step, name, markers)


def choose(path, step_asked, item_asked):
    """(item directory, step number or None, item name or None, skipped steps [(step, why)]) for SRC."""
    from . import source_root
    root = source_root(storage.place(path))   # (a step linked out of SRC is refused before it is read)
    skipped = []
    if is_item(path):
        if step_asked is not None or item_asked is not None:
            raise UsageError(f"{path}: is one Orbax item directory; --step and --item choose within a "
                             "CheckpointManager directory or a step")
        name = storage.name(path)
        if TMP in name:
            raise BadInput(f"{path}: incomplete Orbax checkpoint: its name ends in {TMP}-…: Orbax's write of it did "
                           "not finish; refused")
        parent = storage.parent(path)
        if storage.is_file(storage.join(path, CHECKPOINT_METADATA)):
            why = _confined_incomplete(root, path, name, storage.is_file(storage.join(path, COMMIT)) or False)
        elif is_step(parent):
            why = incomplete(parent, storage.name(parent), False)   # (the step SRC is an item of)
        else:
            why = None
        if why:
            raise BadInput(f"{path}: incomplete Orbax checkpoint: {why}; refused")
        return path, None, None, skipped
    if is_root(path):
        steps = steps_of(path)
        markers = any(storage.is_file(storage.join(path, n, COMMIT)) for _, n in steps if TMP not in n)
        if step_asked is not None:
            named = [n for s, n in steps if s == step_asked]
            if not named:
                raise UsageError(f"{path}: no step {step_asked} (steps: {', '.join(str(s) for s, _ in steps[:20])})")
            done = [n for n in named if not _confined_incomplete(root, storage.join(path, n), n, markers)]
            if not done:
                why = _confined_incomplete(root, storage.join(path, named[0]), named[0], markers)
                raise BadInput(f"{storage.join(path, named[0])}: incomplete Orbax checkpoint step {step_asked}: {why}; "
                               "refused")
            step, name = step_asked, done[0]
        else:
            step = name = None
            for s, n in reversed(steps):
                why = _confined_incomplete(root, storage.join(path, n), n, markers)
                if why is None:
                    step, name = s, n
                    break
                skipped.append((n, why))
            if name is None:
                raise BadInput(f"{path}: no complete Orbax checkpoint step ({skipped[0][0]}: {skipped[0][1]})")
        item_dir, item = _item(storage.join(path, name), item_asked)
        return item_dir, step, item, skipped
    if is_step(path):
        if step_asked is not None:
            raise UsageError(f"{path}: is one step's directory; --step chooses within a CheckpointManager directory")
        why = _confined_incomplete(root, path, storage.name(path), storage.is_file(storage.join(path, COMMIT)) or
                         any(storage.is_file(storage.join(storage.parent(path), n, COMMIT))
                             for _, n in steps_of(storage.parent(path))[-3:]))
        if why:
            raise BadInput(f"{path}: incomplete Orbax checkpoint: {why}; refused")
        item_dir, item = _item(path, item_asked)
        return item_dir, step_number(storage.name(path)), item, skipped
    raise BadInput(f"{path}: not an Orbax checkpoint (no _METADATA, step directories or items)")


def _item(step, asked):
    items = items_of(step)
    if asked is not None:
        if asked not in items:
            raise UsageError(f"{step}: no item {asked!r} (items: {', '.join(items) or 'none'})")
        return storage.join(step, asked), asked
    if not items:
        raise BadInput(f"{step}: an Orbax step without any item directory holding _METADATA")
    if len(items) == 1:
        return storage.join(step, items[0]), items[0]
    for name in ITEM_PREFERENCE:
        if name in items:
            return storage.join(step, name), name
    raise UsageError(f"{step}: holds items {', '.join(items[:10])}; none is the usual one for parameters "
                     f"({', '.join(ITEM_PREFERENCE)}): give --item NAME")


# --- The PyTree metadata ----------------------------------------------------------------------------

class Leaf:
    __slots__ = ("keys", "name", "value_type", "skip")

    def __init__(self, keys, value_type, skip):
        self.keys, self.name, self.value_type, self.skip = keys, ".".join(keys), value_type, skip


ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")


def tree(item) -> tuple:
    """(leaves in the file's order, whether every chunk is stored) from the item's `_METADATA`."""
    path = storage.join(item, METADATA)
    doc = storage.load_json(path, "Orbax PyTree metadata", MAX_TREE_BYTES)
    if not isinstance(doc, dict) or not isinstance(doc.get("tree_metadata"), dict):
        raise BadInput(f"{path}: not Orbax PyTree metadata (needs a 'tree_metadata' object)")
    leaves, seen = [], set()
    for entry in doc["tree_metadata"].values():
        keys = entry.get("key_metadata") if isinstance(entry, dict) else None
        value = entry.get("value_metadata") if isinstance(entry, dict) else None
        if not isinstance(keys, list) or not keys or len(keys) > MAX_DEPTH or not isinstance(value, dict):
            raise BadInput(f"{path}: a tree_metadata entry needs key_metadata (1 to {MAX_DEPTH} keys) and "
                           "value_metadata")
        parts = []
        for k in keys:
            key = k.get("key") if isinstance(k, dict) else None
            if isinstance(key, int) and not isinstance(key, bool):
                key = str(key)
            if not isinstance(key, str) or not key or "/" in key or "\\" in key or "\0" in key:
                raise BadInput(f"{path}: a tree key {brief(key, 60)} is not a name ckptconv accepts "
                               "(text without '/', '\\' or NUL)")
            parts.append(key)
        leaf = Leaf(tuple(parts), value.get("value_type"), value.get("skip_deserialize") is True)
        if leaf.name in (".", "..") or leaf.name in seen:
            raise BadInput(f"{path}: tree path {leaf.name[:100]!r} is not a name an array can have, or is listed twice")
        seen.add(leaf.name)
        leaves.append(leaf)
    # Orbax stores every chunk when it records this, and its restore then refuses a missing one
    return leaves, doc.get("store_array_data_equal_to_fill_value") is True


STRINGS = "_strings.json"
MAX_STRINGS_BYTES = 16 << 20       # _strings.json (the tree's string leaves)


def strings(item) -> dict:
    """{tree path: text} of the string leaves Orbax keeps in the item's `_strings.json` ({} without one)."""
    path = storage.join(item, STRINGS)
    if not storage.is_file(path):
        return {}
    doc = storage.load_json(path, "Orbax string leaves", MAX_STRINGS_BYTES)
    if not isinstance(doc, dict):
        raise BadInput(f"{path}: not a JSON object of string leaves")
    return doc
