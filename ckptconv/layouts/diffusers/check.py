"""A converted diffusers pipeline, checked against its own records: every component folder of weights
as the sharded output it is (sharded/check.verify_dir: its shards, index and manifest, against the
top-level SHA256SUMS's lines for its files, as it has none of its own), and the tree as the top level
records it — the top-level SHA256SUMS and manifest.json listing the same files with the same digests,
every one of them there and a regular file, nothing unlisted, no folder but the components."""
import stat
from pathlib import Path

from ...errors import BadInput
from ...formats.manifest import MANIFEST
from ...formats.mesh import read_regular
from ...formats.pipeline import MODEL_INDEX, WEIGHTS, read_document
from ...formats.sums import NAME as SUMS, parse_sums
from ..report import Report, _detail
from ..scan import _kind, _read, _regular, _scan, _sha256_regular, shard_sizes
from ..sharded.check import verify_dir
from ...storage import files as storage


def verify_pipeline(path: Path, report: Report, progress=None, mine=None, structural=True):
    """Check a converted pipeline. `mine(kind, key)`: on several processes, which components' shards
    (`FOLDER/NAME`) this one hashes; `structural=False`: only that (process 0 checks the rest)."""
    found = report if structural else Report()   # (what every process would find alike: reported once)
    entries = _scan(path, found)
    doc, sums = _records(path, entries, found)
    kinds = doc.components if doc is not None else {}
    folders = _folders(path, entries, kinds, found)
    for name, kind in sorted(kinds.items()):
        if kind == WEIGHTS and name in folders:
            hash_only = None if mine is None else {f.partition("/")[2] for f in _shards(path, name)
                                                   if mine("shard", f)}
            _check_folder(path / name, _inner(sums, name), report, progress, hash_only, structural)
    if not structural or doc is None or sums is None:
        return
    _check_lists(path, doc, sums, report)
    listed = set(sums) | set(doc.files)
    for name, st in sorted(entries.items()):   # the top level: regular files, listed; folders: components
        if stat.S_ISREG(st.st_mode) and name != SUMS and name not in listed:
            report.add(path / name, "file is not listed in SHA256SUMS or the manifest", "unlisted")
    for name, kind in sorted(kinds.items()):
        if kind != WEIGHTS and name in folders:   # (a folder of weights: its own check lists what it holds)
            for file, st in sorted(_scan(path / name, report).items()):
                if not stat.S_ISREG(st.st_mode):
                    report.add(path / name / file, f"is {_kind(st)}; a component folder holds only regular files "
                                                   "(not followed)", "not-regular")
                elif f"{name}/{file}" not in listed:
                    report.add(path / name / file, "file is not listed in SHA256SUMS or the manifest", "unlisted")
    _check_digests(path, entries, folders, kinds, doc, sums, report)


def _inner(sums, name: str) -> dict:
    """The lines of a pipeline's SHA256SUMS for the files of its folder `name`, by their names in it."""
    return {f.partition("/")[2]: d for f, d in (sums or {}).items() if "/" in f and f.partition("/")[0] == name}


def _check_folder(d: Path, sums: dict, report: Report, progress, hash_only, structural):
    """A component folder of weights: the sharded output it is, against the pipeline's lines for it."""
    if structural and storage.exists(d / SUMS):
        report.add(d / SUMS, "a component folder holds no SHA256SUMS of its own (the pipeline's lists its files)",
                   "unlisted")
    verify_dir(d, report, progress, hash_only, structural, sums, plain=True)


def component_of(path: Path):
    """The pipeline's SHA256SUMS lines for `path`'s files when `path` is a component folder of weights
    of a converted pipeline (its parent's top-level manifest.json says so), else None. Never raises."""
    try:
        parent = path.resolve().parent
        if not path.is_dir() or not (parent / MODEL_INDEX).is_file():
            return None
        doc, _ = read_document(read_regular(parent / MANIFEST), parent / MANIFEST)
        if doc is None or doc.components.get(path.resolve().name) != WEIGHTS:
            return None
        sums, _ = parse_sums(read_regular(parent / SUMS), paths=True)
    except (BadInput, OSError):
        return None
    return _inner(sums, path.resolve().name)


def check_component(path: Path, report: Report, progress=None, hash_only=None, structural=True):
    """A component folder of weights given alone: as its pipeline checks it."""
    sums = component_of(path)
    if sums is None:
        report.add(path, "is no longer a component folder of a converted pipeline", "metadata")
        return
    _check_folder(path, sums, report, progress, hash_only, structural)


def _records(path: Path, entries: dict, found: Report) -> tuple:
    """(the top-level manifest.json, validated, or None; SHA256SUMS {path: digest}, or None)."""
    data = _read(path, MANIFEST, entries, found, MANIFEST)
    doc = None
    if data is not None:
        try:
            doc, problems = read_document(data, path / MANIFEST)
        except BadInput as e:
            problems = [_detail(e, path / MANIFEST)]
        for p in problems:
            found.add(path / MANIFEST, p, "metadata")
    data = _read(path, SUMS, entries, found, SUMS)
    sums = None
    if data is not None:
        sums, problems = parse_sums(data, paths=True)
        for p in problems:
            found.add(path / SUMS, p, "metadata")
    return doc, sums


def _folders(path: Path, entries: dict, kinds: dict, found: Report) -> set:
    """The component folders on disk: every one the manifest lists, a real folder (not followed if a
    link); any other folder or entry that is not a regular file is a problem."""
    folders = set()
    for name, st in sorted(entries.items()):
        if stat.S_ISDIR(st.st_mode) and name in kinds:
            folders.add(name)
        elif stat.S_ISDIR(st.st_mode):
            found.add(path / name, "folder is not a component the manifest lists", "unlisted")
        elif not stat.S_ISREG(st.st_mode):
            found.add(path / name, f"is {_kind(st)}; a pipeline output holds only its component folders and regular "
                                   "files (not followed)", "not-regular")
    for name in sorted(set(kinds) - set(entries)):
        found.add(path / name, "component folder is missing", "missing")
    for name in sorted(set(kinds) & set(entries) - folders):
        if stat.S_ISREG(entries[name].st_mode):
            found.add(path / name, "is a file where the manifest lists a component folder", "not-regular")
    return folders


def _check_lists(path: Path, doc, sums: dict, report: Report):
    """The top-level SHA256SUMS and manifest.json list the same files (SHA256SUMS also manifest.json)
    with the same digests."""
    if MANIFEST not in sums:
        report.add(path / SUMS, "does not list manifest.json", "unlisted")
    for name in sorted(set(doc.files) - set(sums)):
        report.add(path / name, "listed in manifest.json but not in SHA256SUMS", "unlisted")
    for name in sorted(set(sums) - set(doc.files) - {MANIFEST}):
        report.add(path / name, "listed in SHA256SUMS but not in manifest.json", "unlisted")
    for name in sorted(set(sums) & set(doc.files)):
        if sums[name] != doc.files[name]["sha256"]:
            report.add(path / name, "sha256 differs between SHA256SUMS and manifest.json", "digest")


def _check_digests(path: Path, entries: dict, folders: set, kinds: dict, doc, sums: dict, report: Report):
    """Every listed file beside the folders of weights (whose own check hashes theirs) is there, a
    regular file, with its listed digest. Each carried folder is listed once (not once per file:
    a tokenizer folder of 30,000 files)."""
    scanned = {"": entries}
    for name in sorted(set(sums) | set(doc.files)):
        folder, _, file = name.rpartition("/")
        if kinds.get(folder) == WEIGHTS:
            continue
        if folder and folder not in folders:
            if folder not in kinds:
                report.add(path / name, "listed, but not in a component folder the manifest lists", "unlisted")
            continue   # (a missing component folder is reported once)
        if folder not in scanned:
            scanned[folder] = _scan(path / folder, Report())
        inner = scanned[folder]
        if file not in inner:
            report.add(path / name, "listed in the manifest or SHA256SUMS but missing", "missing")
            continue
        if not _regular(inner, file):
            continue   # reported where its folder is checked, never opened
        digest = _sha256_regular(path / name)
        if digest is not None and name in sums and sums[name] != digest:
            report.add(path / name, "sha256 differs from SHA256SUMS", "digest")
        elif digest is not None and name in doc.files and doc.files[name]["sha256"] != digest:
            report.add(path / name, "sha256 differs from manifest.json", "digest")


def _shards(path: Path, name: str) -> list:
    """`FOLDER/SHARD` of every shard a component's own records name."""
    return [f"{name}/{s}" for s in shard_sizes(path / name)]


def check_units(path: Path, sharded) -> dict:
    """Every component of weights' shards by bytes and tensors by elements (`sharded.check_units` of
    its folder), as `FOLDER/NAME`; from the top-level manifest as it is (its problems are the check's)."""
    entries = _scan(path, Report())
    doc, _ = _records(path, entries, Report())
    units = {"shard": [], "tensor": []}
    for name, kind in sorted((doc.components if doc is not None else {}).items()):
        if kind == WEIGHTS and name in entries and stat.S_ISDIR(entries[name].st_mode):
            for key, rows in sharded.check_units(path / name).items():
                units.setdefault(key, []).extend((f"{name}/{k}", n) for k, n in rows)
    return units
