"""An output directory's metadata, both ways: shard and index names, the index, manifest.json, the
resume journal, and the checks verify applies to what it reads back. Layout: docs/output.md."""
import bisect
import hashlib
import itertools
import json
import os
import re
import sys
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from .. import safejson
from ..errors import brief
from .sums import is_digest, unsafe_name

MANIFEST = "manifest.json"
FORMAT = "ckptconv.manifest/1"
JOURNAL = ".ckptconv-journal.json"   # inside the temporary directory of a run, for --resume
SINGLE_KEY = "ckptconv.manifest"      # a single-file output: the __metadata__ entry holding the manifest facts
STEM = "model"                        # `--name` when the source's files take no other stem (source_stem)
# The stems Hugging Face libraries load besides `model`: a PEFT adapter's, a diffusers component's.
HUB_STEMS = ("adapter_model", "diffusion_pytorch_model")
INDEX_SUFFIX = ".safetensors.index.json"
# Hugging Face's `variant` (diffusers' and transformers' `_add_variant`, docs/output.md): `STEM.VARIANT.safetensors`,
# shards `STEM.VARIANT-0000k-of-0000n.safetensors`, and the index `STEM.safetensors.index.VARIANT.json`.
VARIANT = re.compile(r"[A-Za-z0-9_-]{1,64}")
_INDEX = re.compile(r"(?P<stem>.+)\.(?P<kind>safetensors|bin|pt)\.index(?:\.(?P<variant>[A-Za-z0-9_-]{1,64}))?\.json")


def stem_problem(stem: str) -> str | None:
    """Why `--name STEM` cannot name output files, or None: a plain name in the directory."""
    if not stem or len(stem.encode("utf-8", "surrogatepass")) > 128 or stem.startswith(".") \
            or any(c in stem for c in "/\\\0") or not stem.isprintable():
        return "must be a plain file-name stem (1-128 bytes of printable text, no '/', not starting with '.')"
    return None


def source_stem(names) -> str:
    """The stem an output directory takes from the base names of the weight files it was read from
    (docs/output.md): `adapter_model` when every one starts with it (`adapter_model.bin`, a PEFT
    adapter), `diffusion_pytorch_model` likewise (a diffusers component), else `model`."""
    names = [os.path.basename(os.fspath(n)) for n in names]
    return next((stem for stem in HUB_STEMS if names and all(n.startswith(stem) for n in names)), STEM)


def source_name(path) -> str:
    """How an output records SRC (manifest `source.path`, mesh.json, a single file's facts): its base
    name, never the path it was given (docs/output.md, "No machine paths"): the same bytes converted
    from any folder, from any working directory, give the same output, and no user name or mount
    point is published with it."""
    return os.path.basename(os.path.abspath(os.fspath(path)))


def index_name(stem: str = STEM, variant: str | None = None) -> str:
    """The index of shards named after `stem`; of a `variant`'s (their stem `STEM.VARIANT`), the name
    diffusers and transformers give it, `STEM.safetensors.index.VARIANT.json`."""
    return stem + INDEX_SUFFIX if variant is None else f"{stem}.safetensors.index.{variant}.json"


def index_kind(name: str) -> tuple | None:
    """(what the shards it indexes are, `safetensors`, `bin` or `pt`; its variant or None) of an
    index's name, `STEM.KIND.index.json` or `STEM.KIND.index.VARIANT.json`; None for another name."""
    m = _INDEX.fullmatch(name)
    return (m.group("kind"), m.group("variant")) if m else None


def is_index(name: str, kinds=("safetensors",)) -> bool:
    """Whether `name` names an index of shards of one of `kinds`, with or without a variant."""
    kind = index_kind(name)
    return kind is not None and kind[0] in kinds


def shard_name(stem: str, i: int, n: int) -> str:
    """The i-th (from 0) of n shards, as huggingface_hub names them: `STEM.safetensors` when it is the
    only one, else `STEM-0000i-of-0000n.safetensors`."""
    return f"{stem}.safetensors" if n == 1 else f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors"


def indexed(shards: int) -> bool:
    """Whether an output of `shards` shard files has an index: only several do (huggingface_hub's
    rule; ckptconv's outputs before it had one even for a single shard, and verify accepts both)."""
    return shards > 1


class Rows:
    """A top-level object of a document too big to build (a manifest's "tensors", an index's
    "weight_map"): `count` members, and `items()` giving (key, value), keys unique and already
    sorted, each made as it is written."""

    def __init__(self, count: int, items):
        self.count, self.items = count, items


def _encoder():
    return json.JSONEncoder(indent=2, sort_keys=True, ensure_ascii=False)


def _nested(value, encoder, indent: str):
    """`value`'s JSON as a member one level down: every line after its first indented by `indent`."""
    for text in encoder.iterencode(value):
        yield text.replace("\n", "\n" + indent) if "\n" in text else text


def _pieces(obj):
    """json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False)'s text in pieces, where the top
    level may hold Rows: those are encoded member by member (same text as the dict they stand for)."""
    encoder = _encoder()
    if not isinstance(obj, dict) or not any(isinstance(v, Rows) for v in obj.values()):
        yield from encoder.iterencode(obj)
        return
    yield "{"
    for i, (key, value) in enumerate(sorted(obj.items())):
        yield ("," if i else "") + "\n  " + encoder.encode(key) + ": "
        if not isinstance(value, Rows):
            yield from _nested(value, encoder, "  ")
        elif not value.count:
            yield "{}"
        else:
            opened, rows = False, iter(value.items())
            while batch := dict(itertools.islice(rows, 1024)):   # a few calls of the encoder per 1,024 rows
                text = encoder.encode(batch)   # "{\n  members\n}": its members, one level deeper
                yield ("," if opened else "{") + text[1:-2].replace("\n", "\n  ")
                opened = True
            yield "\n  }"
    yield "\n}"


def dump_chunks(obj, size=1 << 20):
    """Our JSON files (pretty, sorted, UTF-8) in pieces of about `size` bytes: a manifest of a
    million tensors is written without its whole text in memory twice (as str, then as bytes). Text
    UTF-8 cannot spell (a file name that is not UTF-8, read by Python as unpaired surrogates) is
    written as its JSON escape, which reads back the same."""
    pending, held = [], 0
    for text in _pieces(obj):
        pending.append(text)
        held += len(text)
        if held >= size:
            yield "".join(pending).encode("utf-8", "backslashreplace")
            pending, held = [], 0
    pending.append("\n")
    yield "".join(pending).encode("utf-8", "backslashreplace")


SUMMARY = "__summarised__"      # an extras entry standing for a group too large to write whole
MAX_EXTRAS = 10**6               # --max-extras: JSON bytes of extras written whole, by default
MAX_SUMMARIES = 100              # groups summarised one by one; past it, every extra in one summary
_SUMMARY_BYTES = 220             # about what one summary takes in the manifest
_JSON_TYPES = ((dict, "object"), (list, "array"), (str, "string"), (bool, "boolean"), (int, "number"),
               (float, "number"), (type(None), "null"))


def _group(name: str) -> str:
    """The group an extras name belongs to: its first dotted part (`vocab` of `vocab.tok17`)."""
    return name.split(".", 1)[0]


def _canonical(items) -> bytes:
    """The JSON of a group's {name: value}, sorted and compact: what its summary's size and digest
    are of."""
    return json.dumps(dict(items), sort_keys=True, separators=(",", ":")).encode()


def _summary(group: str, items: list) -> dict:
    data = _canonical(items)
    if group == SUMMARY:   # (every extra: flattened entries of the pickle's top level)
        kind = "object"
    elif len(items) == 1 and items[0][0] == group:   # one value, written whole: its JSON type
        kind = next(t for cls, t in _JSON_TYPES if isinstance(items[0][1], cls))
    else:   # flattened entries of a list (group.0, group.1 ...) or of a dict
        kind = "array" if all(n[len(group) + 1:].split(".", 1)[0].isdigit() for n, _ in items) else "object"
    return {SUMMARY: {"type": kind, "entries": len(items), "json_bytes": len(data),
                      "sha256": hashlib.sha256(data).hexdigest()}}


def summarised(extras: dict, limit: int) -> tuple:
    """(extras as the manifest writes them, [(group, entries, JSON bytes)] summarised): when their
    JSON passes `limit` bytes, the largest groups (by first dotted part) are each replaced by one
    entry `{"__summarised__": {type, entries, json_bytes, sha256}}` until the rest fits; when that
    takes more than MAX_SUMMARIES groups, or cannot fit (many small groups), all the extras are one
    such summary under the key "__summarised__". Linear in the extras' JSON (each value is encoded
    once to measure it, and once more if it is summarised)."""
    groups = _groups(extras)
    sizes = {g: sum(len(json.dumps(n)) + len(json.dumps(v)) + 4 for n, v in items) for g, items in groups.items()}
    total, cut = sum(sizes.values()), set()
    for g in sorted(sizes, key=lambda g: (-sizes[g], g)):
        if total <= limit or sizes[g] <= _SUMMARY_BYTES:   # (a summary would not be smaller)
            break
        cut.add(g)
        total -= sizes[g] - _SUMMARY_BYTES
    if total > limit or len(cut) > MAX_SUMMARIES:   # (many small groups: their summaries are no smaller)
        whole = _summary(SUMMARY, list(extras.items()))
        return {SUMMARY: whole}, [("(all extras)", len(extras), whole[SUMMARY]["json_bytes"])]
    out = _with_summaries(extras, groups, cut)
    return out, [(g, len(groups[g]), out[g][SUMMARY]["json_bytes"]) for g in out if g in cut]


def summarised_like(extras: dict, recorded: dict) -> dict:
    """`extras` (a fresh read of the source) with the groups `recorded` (a manifest's) summarises
    summarised the same way, so the two compare (verify --against)."""
    if set(recorded) == {SUMMARY}:   # (all of them, as one)
        return {SUMMARY: _summary(SUMMARY, list(extras.items()))}
    cut = {g for g, v in recorded.items() if isinstance(v, dict) and set(v) == {SUMMARY}}
    return _with_summaries(extras, _groups(extras, cut), cut)


def _groups(extras: dict, only=None) -> dict:
    """{group: [(name, value)]} of `extras` (of the groups in `only`, if given), in their order."""
    groups = {}
    for name, value in extras.items():
        g = _group(name)
        if only is None or g in only:
            groups.setdefault(g, []).append((name, value))
    return groups


def _with_summaries(extras: dict, groups: dict, cut: set) -> dict:
    """`extras` with each group in `cut` one summary, where its first name was."""
    if not cut:
        return extras
    out = {}
    for name, value in extras.items():
        g = _group(name)
        if g not in cut:
            out[name] = value
        elif g not in out:
            out[g] = _summary(g, groups[g])
    return out


def name_order(shards) -> np.ndarray:
    """Every planned tensor's place in plan order, listed in name order (the order JSON sorts keys):
    sorted once for the index and the manifest, as one array of numbers. Not `sorted(range(n), key=)`:
    that holds an int object per tensor (36 MB for a million) at the end of a run, when every digest is
    held too; argsort of the names as objects compares them as Python does and makes none."""
    names = np.fromiter((t.name for s in shards for t in s.tensors), dtype=object,
                        count=sum(len(s.tensors) for s in shards))
    return np.argsort(names)


def _by_name(shards, order):
    """(shard index, position in it) of each place in `order` (name_order)."""
    starts = list(itertools.accumulate((len(s.tensors) for s in shards), initial=0))
    for n in map(int, order):   # (plain ints, one at a time)
        i = bisect.bisect_right(starts, n) - 1
        yield i, n - starts[i]


def index_document(shards, order) -> dict:
    """{"metadata": {"total_size"}, "weight_map": {tensor: shard}} for planned shards (name, tensors)
    in `order` (name_order)."""
    def items():
        for i, k in _by_name(shards, order):
            yield shards[i].tensors[k].name, shards[i].name
    return {"metadata": {"total_size": sum(t.nbytes for s in shards for t in s.tensors)},
            "weight_map": Rows(sum(len(s.tensors) for s in shards), items)}


def manifest_document(source: dict, files: dict, shards, order, digests: dict, extras: dict, extra=None) -> dict:
    """manifest.json for planned shards in `order` (name_order) whose tensor digests are `digests`
    {shard: the 32-byte digests of its tensors in plan order, packed}."""
    def items():
        for i, k in _by_name(shards, order):
            s = shards[i]
            t = s.tensors[k]
            yield t.name, {"dtype": t.dtype.code, "file": s.name, "sha256": digests[s.name][32 * k:32 * k + 32].hex(),
                           "shape": list(t.shape)}
    manifest = {"format": FORMAT, "source": source, "files": dict(sorted(files.items())),
                "tensors": Rows(sum(len(s.tensors) for s in shards), items), "extras": extras}
    manifest.update(extra or {})
    return manifest


# --- the resume journal


def write_journal(out_dir, job: dict, files: dict, digests: dict):
    """Record the shards finished so far (atomically: storage/targets.Target.replace), bound to the
    job (source identity, plan): their files and their tensors' digests (layouts/files.py's Written:
    32 bytes per tensor, packed), as one hex string per shard, written in slices: a million tensors'
    64 MB of hex is never made whole (nor copied as JSON text, then as bytes). `out_dir`: a local
    directory or an output's Target."""
    from ..storage.targets import as_target

    def chunks():
        yield (json.dumps({**job, "files": files})[:-1] + ', "digests": {').encode()
        for i, (name, row) in enumerate(digests.items()):
            yield (("," if i else "") + json.dumps(name) + ': "').encode()   # hex: nothing to escape
            for at in range(0, len(row), 1 << 19):
                yield row[at:at + (1 << 19)].hex().encode()
            yield b'"'
        yield b"}}"
    as_target(out_dir).replace(JOURNAL, chunks())


def read_journal(out_dir) -> dict | None:
    """A killed run's journal, or None when there is none or it is not one (it is never trusted
    beyond the shards re-hashed against it)."""
    from ..storage.targets import as_target
    data = as_target(out_dir).read_bytes(JOURNAL)
    try:
        journal = json.loads(data) if data is not None else None
    except ValueError:
        return None
    ok = isinstance(journal, dict) and isinstance(journal.get("files"), dict) and isinstance(journal.get("digests"), dict)
    return journal if ok else None


# --- reading back (verify): what the files say, checked for types; problems as sentences


def read_index(text, where) -> tuple:
    """(valid {tensor: shard}, every tensor name listed (a set-like view), problems) of an index's
    text, its weight_map read member by member (safejson.members); (None, None, problems) when it is
    not an index. A shard that is not a plain file name in the directory is never returned.
    BadInput when it is not JSON."""
    listed, files = None, {}   # files: a few shard names, each kept once however often it is named
    try:
        with safejson.no_gc():
            for key, value in safejson.members(text, where, "the index", nested="weight_map"):
                if key == "weight_map" and isinstance(value, safejson.Members):
                    listed = {sys.intern(name): files.setdefault(file, file) if file.__class__ is str else file
                              for name, file in value}   # (names interned: verify holds three tables of them)
    except safejson.NotAnObject:
        pass
    if listed is None:
        return None, None, ["the index has no 'weight_map' object"]
    problems, safe = [], set()
    for name, file in listed.items():
        if file.__class__ is str and file in safe:
            continue
        why = unsafe_name(file)
        if why is None:
            safe.add(file)
            continue
        problems.append(f"tensor {name!r} is listed in {brief(file)}, which is not a plain file name in this "
                        f"directory ({why}); not opened")
    weight_map = {n: f for n, f in listed.items() if f.__class__ is str and f in safe} if problems else listed
    return weight_map, listed.keys(), problems


class ManifestTensor(NamedTuple):
    """A tensor as manifest.json lists it (a tuple: a manifest of a million tensors is read back)."""

    dtype: str
    shape: tuple
    file: str
    sha256: bytes     # its 32 bytes (the hex text is twice the size, held a million times)


class ManifestTensors(Mapping):
    """manifest.json's "tensors" as read back: name -> ManifestTensor, or None where malformed. A
    million are held at once (verify), so each is kept packed: one bytes object of its digest's 32
    bytes and the number of its (dtype, shape, file) among the distinct ones the manifest names; its
    ManifestTensor is made when asked for."""

    def __init__(self):
        self._rows, self._kinds, self._kind_of = {}, [], {}

    def put(self, name: str, tensor: ManifestTensor | None):
        if tensor is None:
            self._rows[name] = None
            return
        kind = (tensor.dtype, tensor.shape, tensor.file)
        k = self._kind_of.get(kind)
        if k is None:
            k = self._kind_of[kind] = len(self._kinds)
            self._kinds.append(kind)
        self._rows[name] = tensor.sha256 + k.to_bytes(4, "little")

    def __getitem__(self, name) -> ManifestTensor | None:
        row = self._rows[name]
        if row is None:
            return None
        return ManifestTensor(*self._kinds[int.from_bytes(row[32:], "little")], row[:32])

    def __contains__(self, name):
        return name in self._rows

    def __iter__(self):
        return iter(self._rows)

    def __len__(self):
        return len(self._rows)


_ABSENT = object()


def file_entry_problem(name, info) -> str | None:
    """Why a manifest's `files` entry is not {"sha256": digest, "size": bytes}, or None."""
    if isinstance(info, dict) and is_digest(info.get("sha256")) and type(info.get("size")) is int and info["size"] >= 0:
        return None
    return f"files entry {brief(name, 80)} is {brief(info)}, not {{\"sha256\": digest, \"size\": bytes}}"


def read_manifest(data, where, plain: bool = False) -> tuple:
    """(files {name: {"sha256", "size"} or None if malformed}, tensors {name: ManifestTensor or None
    if malformed}, problems) of manifest.json's bytes, read member by member (safejson.members): its
    "tensors" are checked as they come, never first built as a million dicts. BadInput when it is
    not a JSON object. `plain`: the manifest of a convert output (not a rank directory's), which
    records no engine's target."""
    fmt, files, tensors = _ABSENT, {}, ManifestTensors()
    odd, file_problems, tensor_problems, safe, shapes = [], [], [], set(), {}
    with safejson.no_gc():   # (tuples by the million, see safejson)
        for key, value in safejson.members(data, where, MANIFEST, nested="tensors", nested_keys=tensors):
            if key == "format":
                fmt = value
            elif key == "source" and plain and isinstance(value, dict):
                odd += [f"source.{k} is {brief(value[k], 80)}: a convert output records no {what} (a reshard "
                        "output's rank directories and mesh.json do)"
                        for k, what in (("target", "engine's target"), ("resharded", "resharding"))
                        if value.get(k) is not None]
            elif key == "target" and plain:
                odd.append(f"'target' is {brief(value, 80)}: a manifest records its target under source.target, "
                           "and a convert output none")
            elif key == "files" and not isinstance(value, dict):
                odd.append("'files' is not an object")
            elif key == "files":
                for name, info in value.items():
                    why = unsafe_name(name)
                    if why is not None:
                        file_problems.append(f"files lists {name!r}, which is not a plain file name in this "
                                             f"directory ({why}); not opened")
                        continue
                    why = file_entry_problem(name, info)
                    if why is not None:
                        file_problems.append(why)
                    files[name] = info if why is None else None
            elif key == "tensors" and not isinstance(value, safejson.Members):
                odd.append("'tensors' is not an object")
            elif key == "tensors":
                for name, entry in value:
                    tensors.put(sys.intern(name), _tensor(name, entry, safe, shapes, tensor_problems))
    problems = [] if fmt == FORMAT else [f"format is {brief(None if fmt is _ABSENT else fmt)}, not {FORMAT}"]
    return files, tensors, problems + sorted(odd) + file_problems + tensor_problems


def _tensor(name, entry, safe: set, shapes: dict, problems: list) -> ManifestTensor | None:
    """A "tensors" member checked: its ManifestTensor (shapes, dtypes and files shared through
    `shapes`), or None (and a problem)."""
    ok = (isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and isinstance(entry.get("shape"), list)
          and all(type(n) is int and n >= 0 for n in entry["shape"]) and isinstance(entry.get("file"), str)
          and is_digest(entry.get("sha256")))
    if not ok:
        problems.append(f"tensor {name!r}: entry {brief(entry)} is not {{dtype, shape, file, sha256}}")
        return None
    if entry["file"] not in safe:
        why = unsafe_name(entry["file"])
        if why is None:
            safe.add(entry["file"])
        else:
            problems.append(f"tensor {name!r}: file {entry['file']!r} is not a plain file name in this directory "
                            f"({why})")
    shape, dtype, file = tuple(entry["shape"]), entry["dtype"], entry["file"]
    # (one object per distinct shape, dtype and file: a manifest of a million tensors repeats them)
    return ManifestTensor(shapes.setdefault(dtype, dtype), shapes.setdefault(shape, shape),
                          shapes.setdefault(file, file), bytes.fromhex(entry["sha256"]))


def single_document(metadata: dict, where):
    """The manifest facts a single-file output keeps in its `__metadata__`, parsed (BadInput if it is
    not JSON), or None when the file has none (it was not written by ckptconv)."""
    if SINGLE_KEY not in metadata:
        return None
    return safejson.loads(metadata[SINGLE_KEY], where, f"__metadata__ {SINGLE_KEY!r}")


def check_single(raw) -> tuple:
    """({tensor: its sha256's 32 bytes, or None if malformed}, problems) of a single-file output's
    manifest facts."""
    if not isinstance(raw, dict):
        return {}, ["is not a JSON object"]
    problems = []
    if raw.get("format") != FORMAT:
        problems.append(f"format is {brief(raw.get('format'))}, not {FORMAT}")
    if isinstance(raw.get("source"), dict) and raw["source"].get("target") is not None:
        problems.append(f"source.target is {brief(raw['source']['target'], 80)}: a single file records no engine's "
                        "target")
    if not isinstance(raw.get("tensors"), dict):
        return {}, problems + ["'tensors' is not an object"]
    tensors = {}
    for name, entry in raw["tensors"].items():
        ok = isinstance(entry, dict) and is_digest(entry.get("sha256"))
        if not ok:
            problems.append(f"tensor {name!r}: entry {brief(entry)} is not {{sha256}}")
        tensors[name] = bytes.fromhex(entry["sha256"]) if ok else None   # (32 bytes, as read_manifest's)
    return tensors, problems
