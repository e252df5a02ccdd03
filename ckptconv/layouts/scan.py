"""An output directory's entries and metadata files, read without following anything: what it holds
(from lstat), its index, manifest.json and SHA256SUMS, each type-checked, and a regular file's digest."""
import functools
import stat
from pathlib import Path

from .. import safejson
from ..errors import BadInput
from ..storage import files as storage
from ..formats import manifest as manifest_format
from ..formats.manifest import MANIFEST
from ..formats.mesh import read_regular
from ..formats.sums import NAME as SUMS, parse_sums
from .report import Report, _detail


# What an output directory may hold is decided from lstat: nothing in it is followed or opened unless
# it is a regular file named by the output's own metadata, by a plain name (sums.unsafe_name).

def _scan(d: Path, report: Report) -> dict:
    """{name: lstat result} of every entry of `d` (symlinks not followed; a prefix's objects are
    regular files: storage/files.scan)."""
    try:
        return storage.scan(d)
    except OSError as e:
        report.add(d, f"cannot list the directory: {e.strerror}", "unreadable")
    except BadInput as e:
        report.add(d, f"cannot list the directory: {_detail(e, d)}", "unreadable")
    return {}


def _kind(st) -> str:
    mode = st.st_mode
    for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def _regular(entries: dict, name: str) -> bool:
    st = entries.get(name)
    return st is not None and stat.S_ISREG(st.st_mode)


def _read(d: Path, name: str, entries: dict, report: Report, what: str):
    """The bytes of a metadata file of `d`; None (and a problem) if it is missing or unreadable. A
    non-regular entry is not opened: the directory check reports it."""
    if name not in entries:
        report.add(d / name, f"{what} is missing", "missing")
        return None
    if not _regular(entries, name):
        return None
    try:
        return read_regular(d / name)
    except BadInput as e:
        report.add(d / name, f"{what} cannot be read: {_detail(e, d / name)}", "unreadable")
        return None


def _document(d: Path, name: str, entries: dict, report: Report, what: str, read_back):
    """`read_back(text, path)` of a JSON metadata file of `d` (formats/manifest.py's read_index or
    read_manifest, each reading it member by member): its result, or None when the file is missing,
    unreadable or not JSON (reported). The bytes go once they are text: a million-tensor manifest
    is 230 MB, held once."""
    data = _read(d, name, entries, report, what)
    if data is None:
        return None
    try:
        text, data = safejson.decode(data, d / name, what), None
        return read_back(text, d / name)
    except BadInput as e:
        report.add(d / name, _detail(e, d / name), "metadata")
    return None


def _sums(d: Path, entries: dict, report: Report):
    """SHA256SUMS of `d` as {plain name: digest}, or None when it is missing or unreadable."""
    data = _read(d, SUMS, entries, report, SUMS)
    if data is None:
        return None
    sums, problems = parse_sums(data)
    for p in problems:
        report.add(d / SUMS, p, "metadata")
    return sums


def _sha256_regular(path: Path) -> str | None:
    """A regular file's SHA-256, opened without following a symlink and without blocking on a FIFO;
    None if what is there now is not a regular file (an object: read by ranges, storage.files.sha256)."""
    return storage.sha256(path)


def _index_name(entries: dict) -> str:
    """The index of a directory: the one `STEM.safetensors.index.json` (`--name STEM`; a variant's
    `STEM.safetensors.index.VARIANT.json`, a pipeline component's), model's by default."""
    found = sorted(n for n in entries if manifest_format.is_index(n))
    return found[0] if len(found) == 1 else manifest_format.index_name()


def _needs_index(index: str, entries: dict, m_files, sums) -> bool:
    """Whether a directory must have its index: it has one, or it lists several shard files (a single
    shard goes without one, as huggingface_hub writes it; docs/output.md). When neither the manifest
    nor SHA256SUMS could be read, the shard files on disk are counted."""
    if index in entries:
        return True
    listed = [*(m_files or {}), *(sums or {})] if m_files is not None or sums is not None else list(entries)
    return manifest_format.indexed(len({n for n in listed if n.endswith(".safetensors")}))


def _read_meta(d: Path, entries: dict, report: Report, sums=None, plain: bool = False):
    """Index, manifest and SHA256SUMS of an output directory, type-checked (no index: weight_map and
    its names None). `sums`: its files' digests as an enclosing output's SHA256SUMS lists them (a
    pipeline's component folder, which has none of its own), instead of its own file; `plain`: a
    convert output (read_manifest)."""
    later = Report()   # (the manifest's and SHA256SUMS' problems are reported after the index's)
    m_files, m_tensors, problems = (_document(d, MANIFEST, entries, later, MANIFEST,
                                              functools.partial(manifest_format.read_manifest, plain=plain))
                                    or (None, None, []))
    for p in problems:
        later.add(d / MANIFEST, p, "metadata")
    sums = _sums(d, entries, later) if sums is None else sums
    index = _index_name(entries)
    weight_map = index_names = None
    if _needs_index(index, entries, m_files, sums):
        weight_map, index_names, problems = (_document(d, index, entries, report, "the index",
                                                       manifest_format.read_index) or (None, None, []))
        for p in problems:
            report.add(d / index, p, "metadata")
    report.problems += later.problems
    return index, weight_map, index_names, m_files, m_tensors, sums


def _checked_manifest(d: Path) -> dict:
    """manifest.json of a directory verify already checked (a regular file, a JSON object)."""
    return safejson.loads(read_regular(d / MANIFEST), d / MANIFEST, MANIFEST)


def shard_sizes(path: Path, meta=None) -> dict:
    """{shard: size} of the regular shard files an output directory's (valid) metadata names, for
    sharing a check out (layouts' check_units); `meta`: (entries, _read_meta's result) when the
    caller has read them already."""
    entries, (_, weight_map, _, m_files, _, sums) = meta or _listed(path)
    names = sorted(set((weight_map or {}).values())
                   | {f for f in (*(m_files or {}), *(sums or {})) if f.endswith(".safetensors")})
    return {n: entries[n].st_size if _regular(entries, n) else 0 for n in names}


def _listed(path: Path) -> tuple:
    """(entries, _read_meta's result) of an output directory, its problems left for the check."""
    entries = _scan(path, Report())
    return entries, _read_meta(path, entries, Report())
