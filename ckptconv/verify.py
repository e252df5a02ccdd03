"""verify: prove an output is intact and consistent, equal to its source, and loads onto devices.

Structural checks read every byte once: each shard is streamed from its mapping while one thread
digests the file and another digests each tensor's bytes (both cores), and every finding becomes one
line naming the file and the tensor. Reshard outputs are checked rank by rank, then against
mesh.json by assembling each global tensor lazily from the rank pieces (never in memory).
"""
import dataclasses
import hashlib
import json
import math
import os
import stat
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import safejson, signals
from .io import sha256
from .errors import BadInput, CkptError, UsageError, brief, printable
from .io.hashing import CHUNK, SMALL, Digests, HashLanes
from .io.mapped import MappedFile
from .limits import MAX_NDIM
from .readers import ReadOptions, mesh as mesh_reader, open_checkpoint, readers
from .formats.safetensors import parse_header
from .formats.sums import NAME as SUMS, parse_sums
from .tp import vllm
from .recipe import Recipe
from .tp.rules import check_recorded, read_config
from .tensor import as_bytes, iter_blocks, sha256_of
from . import dtypes, transforms
from .formats import manifest as manifest_format
from .formats.identity import identity
from .formats.manifest import MANIFEST
from .formats.mesh import MESH, intervals, outer_cut, parse_mesh, rank_dir, rank_dirs, rank_number, read_regular

# What a problem is about (docs/verify.md#problems): a listed file or tensor that is absent; one present
# that nothing lists; one in another place than listed, or twice; bytes whose digest or size differs;
# a metadata file or header that is malformed or disagrees; an entry that is not a regular file; one
# that cannot be read; what the safetensors library sees differing from ckptconv; rank pieces that do
# not fit mesh.json; a tensor that differs from the --against source.
KINDS = ("missing", "unlisted", "misplaced", "digest", "metadata", "not-regular", "unreadable", "consumer", "mesh",
         "source", "identity")


@dataclass(frozen=True)
class Problem:
    """One finding: its kind, the file it is in, the tensor it concerns (if one), what is wrong."""

    kind: str
    file: str
    detail: str
    tensor: str | None = None

    def __str__(self) -> str:
        return printable(f"{self.file}: {self.detail}")   # a file called "a\nb" stays one line

    def to_json(self) -> dict:
        """The fields as they are (JSON escapes what it must); `message` is the printed line."""
        return {"kind": self.kind, "file": self.file, "tensor": self.tensor, "detail": self.detail,
                "message": str(self)}


@dataclass
class Report:
    problems: list = field(default_factory=list)   # Problem
    files: int = 0
    tensors: int = 0
    bytes: int = 0
    device: dict | None = None
    shared: int = 0   # problems already merged across processes
    notes: list = field(default_factory=list)   # checks that could not be done, and how it compared
    expected: bool = False   # --expect was given and the output is that one
    foreign: bool = False    # an output ckptconv did not write: no digests were recorded to check

    def add(self, where, what: str, kind: str, tensor: str | None = None):
        assert kind in KINDS, kind
        self.problems.append(Problem(kind, str(where), what, tensor))

    @property
    def ok(self) -> bool:
        return not self.problems


# What an output directory may hold is decided from lstat: nothing in it is followed or opened unless
# it is a regular file named by the output's own metadata, by a plain name (sums.unsafe_name).

def _scan(d: Path, report: Report) -> dict:
    """{name: lstat result} of every entry of `d` (symlinks not followed)."""
    entries = {}
    try:
        with os.scandir(d) as it:
            for entry in it:
                try:
                    entries[entry.name] = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
    except OSError as e:
        report.add(d, f"cannot list the directory: {e.strerror}", "unreadable")
    return entries


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


def _detail(error: BadInput, path) -> str:
    """A BadInput's sentence without the "PATH: " it starts with (the problem line names the file
    already), also when the path itself holds ": "."""
    text, head = str(error), f"{path}: "
    return text[len(head):] if text.startswith(head) else text.split(": ", 1)[-1]


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
    None if what is there now is not a regular file."""
    try:
        with safejson.open_regular(path, follow=False) as fd:
            h = hashlib.sha256()
            while chunk := os.read(fd, CHUNK):
                h.update(chunk)
            return h.hexdigest()
    except BadInput:
        return None


def _index_name(entries: dict) -> str:
    """The index of a directory: the one `STEM.safetensors.index.json` (`--name STEM`), model's by default."""
    found = sorted(n for n in entries if n.endswith(manifest_format.INDEX_SUFFIX))
    return found[0] if len(found) == 1 else manifest_format.index_name()


def _needs_index(index: str, entries: dict, m_files, sums) -> bool:
    """Whether a directory must have its index: it has one, or it lists several shard files (a single
    shard goes without one, as huggingface_hub writes it; docs/output.md). When neither the manifest
    nor SHA256SUMS could be read, the shard files on disk are counted."""
    if index in entries:
        return True
    listed = [*(m_files or {}), *(sums or {})] if m_files is not None or sums is not None else list(entries)
    return manifest_format.indexed(len({n for n in listed if n.endswith(".safetensors")}))


def _read_meta(d: Path, entries: dict, report: Report):
    """Index, manifest and SHA256SUMS of an output directory, type-checked (no index: weight_map and
    its names None)."""
    later = Report()   # (the manifest's and SHA256SUMS' problems are reported after the index's)
    m_files, m_tensors, problems = (_document(d, MANIFEST, entries, later, MANIFEST, manifest_format.read_manifest)
                                    or (None, None, []))
    for p in problems:
        later.add(d / MANIFEST, p, "metadata")
    sums = _sums(d, entries, later)
    index = _index_name(entries)
    weight_map = index_names = None
    if _needs_index(index, entries, m_files, sums):
        weight_map, index_names, problems = (_document(d, index, entries, report, "the index",
                                                       manifest_format.read_index) or (None, None, []))
        for p in problems:
            report.add(d / index, p, "metadata")
    report.problems += later.problems
    return index, weight_map, index_names, m_files, m_tensors, sums


def verify_dir(d: Path, report: Report, progress=None, hash_only=None, structural=True):
    """Check one output directory. `hash_only` limits the (expensive) hashing to some shards;
    `structural=False` skips everything else (another process of a multi-process run does it)."""
    consumer = _check_dir(d, report, progress, hash_only, structural)
    # last, once the directory's tables are let go: the library's own table of a header is about
    # 0.7 KB per tensor (1 KB at its peak), and is never held beside ours
    for path, ours in consumer:
        signals.check()
        _library_view(path, ours, report)


def _check_dir(d: Path, report: Report, progress, hash_only, structural) -> list:
    """Every check of verify_dir but the safetensors library's; returns the shards that check is
    still owed, as [(path, _our_view of its header)]."""
    found = report if structural else Report()  # what every process would find alike: reported once
    entries = _scan(d, found)
    index, weight_map, index_names, m_files, m_tensors, sums = _read_meta(d, entries, found)
    manifest_ok = m_files is not None
    m_files, m_tensors, sums_ok = m_files or {}, m_tensors or {}, sums is not None
    sums = sums or {}
    shard_names = sorted(set((weight_map or {}).values()) | {f for f in (*m_files, *sums) if f.endswith(".safetensors")})

    located, consumer = {}, []   # tensor -> (file, HeaderEntry); (shard, our view's digest)
    for shard in shard_names:
        signals.check()
        path = d / shard
        if shard not in entries:
            found.add(path, "shard is missing", "missing")
            continue
        if not _regular(entries, shard):
            continue  # never opened; the directory check below reports what it is
        parsed = _parsed(path, found)
        if parsed is None:
            continue
        m, header = parsed
        if structural and not header.problems:
            consumer.append((path, _our_view(header)))   # checked at the end (_library_view)
        for e in header.entries:
            if e.name in located:
                found.add(path, f"tensor {e.name!r} also appears in {located[e.name][0]}", "misplaced", tensor=e.name)
            else:
                located[e.name] = (shard, e)
        if hash_only is None or shard in hash_only:
            _hash_shard(m, header, shard, m_files, lambda name: getattr(m_tensors.get(name), "sha256", None), sums,
                        report, progress)
            report.files += 1
    if not structural:
        return []

    for name, file in (weight_map or {}).items():
        if name not in located:
            report.add(d / index, f"tensor {name!r} is listed in the index (in {file}) but is in no shard",
                       "missing", tensor=name)
        elif located[name][0] != file:
            report.add(d / index, f"tensor {name!r} is listed in {file} but is in {located[name][0]}",
                       "misplaced", tensor=name)
    for name, (file, _) in located.items():
        if index_names is not None and name not in index_names:
            report.add(d / file, f"tensor {name!r} is in the shard but missing from the index", "unlisted", tensor=name)
        if manifest_ok and name not in m_tensors:
            report.add(d / file, f"tensor {name!r} is in the shard but missing from manifest.json",
                       "unlisted", tensor=name)
    for name, entry in m_tensors.items():
        if name not in located:
            report.add(d / MANIFEST, f"tensor {name!r} is in the manifest but in no shard", "missing", tensor=name)
            continue
        if entry is None:
            continue  # malformed: reported
        file, e = located[name]
        if entry.dtype != e.dtype.code or entry.shape != e.shape:
            report.add(d / file, f"tensor {name!r} is {e.dtype.code}{list(e.shape)}, the manifest says "
                                 f"{_as_said(entry.dtype, entry.shape)}", "metadata", tensor=name)
        if entry.file != file:
            report.add(d / file, f"tensor {name!r} is here, the manifest says {entry.file}",
                       "misplaced", tensor=name)
    report.tensors += len(located)

    listed = set(sums) | set(m_files) | set(shard_names)
    for name in sorted(listed - set(shard_names)):
        path = d / name
        if name not in entries:
            report.add(path, "listed in the manifest or SHA256SUMS but missing", "missing")
            continue
        digest = _sha256_regular(path) if _regular(entries, name) else None
        if digest is None:
            continue  # not a regular file: reported below, never opened
        if m_files.get(name) is not None and m_files[name]["sha256"] != digest:
            report.add(path, "sha256 differs from manifest.json", "digest")
        if name in sums and sums[name] != digest:
            report.add(path, "sha256 differs from SHA256SUMS", "digest")
    if sums_ok:
        if MANIFEST not in sums:
            report.add(d / SUMS, "does not list manifest.json", "unlisted")
        for name in sorted(set(m_files) - set(sums)):
            report.add(d / name, "listed in manifest.json but not in SHA256SUMS", "unlisted")
        if manifest_ok:
            for name in sorted(set(sums) - set(m_files) - {MANIFEST}):
                report.add(d / name, "listed in SHA256SUMS but not in manifest.json", "unlisted")
    for name, st in sorted(entries.items()):
        if not stat.S_ISREG(st.st_mode):
            report.add(d / name, f"is {_kind(st)}; an output directory holds only regular files (not followed)",
                       "not-regular")
        elif name != SUMS and name not in listed:
            report.add(d / name, "file is not listed in SHA256SUMS or the manifest", "unlisted")
    return consumer


def _parsed(path: Path, report: Report):
    """(mapping, header) of a safetensors file, its header's problems reported; None (reported too)
    when the header cannot be read at all."""
    try:
        m = MappedFile(path)
        header = parse_header(m.view, m.size, path)
    except BadInput as e:
        report.add(path, _detail(e, path), "metadata")
        return None
    for p in header.problems:
        report.add(path, p, "metadata")
    return m, header


def _view_digest(rows, metadata: dict) -> bytes:
    """One digest of what a consumer sees of a header: (name, dtype code, shape list) rows in name
    order, then the metadata; each piece length-prefixed (names may hold any character)."""
    h, batch = hashlib.sha256(), []
    for name, code, shape in rows:
        batch.append(f"{len(name)}:{name}{code}{shape}\n")
        if len(batch) == 4096:
            h.update("".join(batch).encode("utf-8", "surrogatepass"))
            batch = []
    h.update("".join(batch).encode("utf-8", "surrogatepass"))
    for key, value in sorted(metadata.items()):
        h.update(f"{len(key)}:{key}{len(value)}:{value}".encode("utf-8", "surrogatepass"))
    return h.digest()


def _as_said(dtype: str, shape) -> str:
    """A dtype and shape as manifest.json says them, for a problem line: as written where they could
    be a tensor's, else bounded (a manifest may say a megabyte of dtype or a 4,000-digit size)."""
    said = dtype if len(dtype) <= 16 else brief(dtype, 16)
    if len(shape) <= MAX_NDIM and all(n.bit_length() <= 64 for n in shape):
        return f"{said}{list(shape)}"
    return said + brief(list(shape))


def _header_rows(header):
    """(name, dtype code, shape list) of every tensor of our header, in name order."""
    return ((e.name, e.dtype.code, list(e.shape)) for e in sorted(header.entries, key=lambda e: e.name))


def _library_rows(f):
    """The same rows as the safetensors library sees them (`f` a safe_open handle)."""
    return ((n, (piece := f.get_slice(n)).get_dtype(), list(piece.get_shape())) for n in sorted(f.keys()))


def _our_view(header) -> bytes:
    return _view_digest(_header_rows(header), header.metadata)


def _differences(ours, theirs):
    """(name, what the library sees, what we see) of each name whose rows differ, None for a side
    without it; both row streams in name order, merged as they come."""
    ours, theirs = iter(ours), iter(theirs)
    a, b = next(ours, None), next(theirs, None)
    while a is not None or b is not None:
        if b is None or (a is not None and a[0] < b[0]):
            yield a[0], None, a[1:]
            a = next(ours, None)
        elif a is None or b[0] < a[0]:
            yield b[0], b[1:], None
            b = next(theirs, None)
        else:
            if a[1:] != b[1:]:
                yield a[0], b[1:], a[1:]
            a, b = next(ours, None), next(theirs, None)


def _library(path: Path, view):
    """`view(f)` of the file opened by the safetensors library; the reason as a str when the library
    cannot open it."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise UsageError("verify needs the safetensors library: pip install safetensors") from None
    try:
        with safe_open(str(path), framework="numpy") as f:
            return view(f)
    except Exception as e:  # its own error types, whatever they are: the file is what is wrong
        return str(e).splitlines()[0] if str(e) else type(e).__name__


def _library_view(path: Path, ours: bytes, report: Report):
    """The safetensors library, as a consumer, must see what we parsed: the same names, dtypes,
    shapes and metadata (headers only; the data is read once, by the hashes). Compared first as one
    digest each (`ours` is _our_view of the header), so that the library's table of a million
    tensors is never held beside ours; only when they differ is the header parsed again and
    compared name by name to say what differs (or that the file is not the one checked)."""
    theirs = _library(path, lambda f: _view_digest(_library_rows(f), f.metadata() or {}))
    if isinstance(theirs, str):
        report.add(path, f"the safetensors library cannot open it: {theirs}", "consumer")
        return
    if theirs == ours:
        return
    parsed = _parsed(path, Report())
    if parsed is None or _our_view(parsed[1]) != ours:
        report.add(path, "changed while verify read it: its header is not the one checked (verify again)", "digest")
        return
    header = parsed[1]
    seen = _library(path, lambda f: (list(_differences(_header_rows(header), _library_rows(f))), f.metadata() or {}))
    if isinstance(seen, str):
        report.add(path, f"the safetensors library cannot open it: {seen}", "consumer")
        return
    differ, metadata = seen
    for name, theirs, mine in differ:
        report.add(path, f"tensor {name!r}: the safetensors library sees {theirs}, ckptconv {mine}", "consumer",
                   tensor=name)
    if metadata != header.metadata:
        report.add(path, "the safetensors library sees different __metadata__", "consumer")
    elif not differ:   # the digests differed, yet nothing does now: the file changed between its reads
        report.add(path, "changed while verify read it: the safetensors library saw another header (verify "
                         "again)", "digest")


def _hash_shard(m, header, shard, m_files, recorded, sums, report, progress):
    """Digest the file and each tensor in one streaming pass (hashing.HashLanes), while this thread
    maps the next chunk's pages in; pages are dropped once the hashes are done with them. A tensor
    of at most SMALL bytes is digested here, in this thread, and its bytes go to the file's digest with
    its neighbours' in CHUNK pieces (hashing.SMALL). `m_files` is None for a single-file output (no
    file digest to compare)."""
    path = Path(m.path)
    hashes, file_h, chunks, digests = HashLanes(), sha256.new(), deque(), Digests()
    fed = released = 0   # the file's bytes before `fed` are on their way to its digest

    def feed(upto, tensor_h=None):
        """File bytes [fed, upto) to the file's digest (and `tensor_h`), CHUNK at a time."""
        nonlocal fed, released
        while fed < upto:
            n = min(CHUNK, upto - fed)
            m.populate(fed, n)
            chunks.append((hashes.feed(m.view[fed:fed + n], file_h, tensor_h), fed + n))
            fed += n
            if len(chunks) > 4:  # wait for the oldest chunk, drop the pages the hashes are done with
                futures, done_to = chunks.popleft()
                for f in futures:
                    f.result()
                m.release(released, done_to - released)
                released = done_to
            if progress:
                progress(n)
            signals.check()

    try:
        pos = 0   # the end of the furthest range so far (overlapping entries: a header problem)
        ranges = [(None, 0, header.data_start)] + [(e, e.begin, e.end) for e in header.entries if e.end <= m.size]
        for entry, begin, end in ranges:
            begin = max(begin, pos)
            if entry is not None and end - begin <= SMALL:
                digests.append_done(hashlib.sha256(m.view[begin:max(begin, end)]).digest())
                if end - fed >= CHUNK:   # the file's digest follows (and drops the pages read here)
                    feed(end)
            elif entry is not None:
                feed(begin)
                tensor_h = sha256.new()
                feed(end, tensor_h)
                digests.append(hashes.digest("tensor", tensor_h))
            pos = max(pos, end)
        feed(m.size)
        for futures, _ in chunks:
            for f in futures:
                f.result()
        file_digest = hashes.digest("file", file_h).result()
    finally:
        hashes.close()
        m.release(0, m.size)
    report.bytes += m.size
    info = (m_files or {}).get(shard)
    if m_files is None:
        pass  # a single-file output: it cannot record its own digest
    elif shard not in m_files:
        report.add(path, "shard is not listed in manifest.json files", "unlisted")
    elif info is not None:  # (a malformed entry is reported with the manifest)
        if info.get("size") != m.size:
            report.add(path, f"size is {m.size} bytes, the manifest says {brief(info.get('size'))} (truncated?)",
                       "digest")
        if info.get("sha256") != file_digest:
            report.add(path, "sha256 differs from manifest.json", "digest")
    if shard in sums and sums[shard] != file_digest:
        report.add(path, "sha256 differs from SHA256SUMS", "digest")
    for (entry, _, _), digest in zip(ranges[1:], digests):   # (a digest per entry of `ranges`, in order)
        want = recorded(entry.name)
        if want is not None and want != digest:
            report.add(path, f"tensor {entry.name!r}: sha256 differs from the manifest (its bytes "
                             f"{entry.begin}..{entry.end} are corrupted)", "digest", tensor=entry.name)


def verify_file(path: Path, report: Report, progress=None):
    """A single-file output: its header, the safetensors library's view, `format: pt`, and every
    tensor's digest against the manifest facts in its `__metadata__` (a file cannot hold its own
    digest; `sha256sum` it apart)."""
    try:
        m = MappedFile(path)
        header = parse_header(m.view, m.size, path)
        raw = manifest_format.single_document(header.metadata, path)
    except BadInput as e:
        report.add(path, _detail(e, path), "metadata")
        return
    if raw is None:
        _verify_foreign_files(path, [path], {}, report)
        return
    for p in header.problems:
        report.add(path, p, "metadata")
    if header.problems:
        return
    _library_view(path, _our_view(header), report)
    if header.metadata.get("format") != "pt":
        report.add(path, f"__metadata__ format is {brief(header.metadata.get('format'))}, not 'pt'", "metadata")
    added = sorted(set(header.metadata) - {"format", manifest_format.SINGLE_KEY})
    if added:
        report.add(path, f"__metadata__ holds {', '.join(brief(k, 60) for k in added[:8])}, which ckptconv "
                         "does not write", "metadata")
    tensors, problems = manifest_format.check_single(raw)
    for p in problems:
        report.add(path, f"__metadata__ {manifest_format.SINGLE_KEY!r}: {p}", "metadata")
    present = {e.name for e in header.entries}
    for name in tensors:
        if name not in present:
            report.add(path, f"tensor {name!r} is in the manifest but not in the file", "missing", tensor=name)
    for name in sorted(present - set(tensors)):
        report.add(path, f"tensor {name!r} is in the file but missing from the manifest", "unlisted", tensor=name)
    _hash_shard(m, header, path.name, None, tensors.get, {}, report,
                progress)
    report.files += 1
    report.tensors += len(present)


FOREIGN_NOTE = ("written without ckptconv's manifest: no file or tensor digests are recorded, so they were not "
                "checked; headers, the index and what the safetensors library sees were"
                + "; use --against SRC to compare every tensor with its source")


def _verify_foreign_files(where: Path, files: list, weight_map: dict, report: Report):
    """Safetensors files ckptconv did not write (save_pretrained, the Hub's conversion bot): their
    headers, what the safetensors library sees, each tensor once, and the index (when there is one)
    against the headers. What only a manifest could prove is listed in `report.notes`."""
    report.notes.append(f"{where}: {FOREIGN_NOTE}")
    report.foreign = True
    located = {}
    for path in files:
        parsed = _parsed(path, report)
        if parsed is None or parsed[1].problems:
            continue
        m, header = parsed
        _library_view(path, _our_view(header), report)
        for e in header.entries:
            if e.name in located:
                report.add(path, f"tensor {e.name!r} also appears in {located[e.name]}", "misplaced", tensor=e.name)
            located[e.name] = path.name
        report.files += 1
        report.bytes += m.size
        m.release(0, m.size)
    for name, file in weight_map.items():
        if located.get(name) != file:
            report.add(where, f"tensor {name!r} is listed in {file} but is "
                              + (f"in {located[name]}" if name in located else "in no file"),
                              "misplaced" if name in located else "missing", tensor=name)
    for name, file in located.items():
        if weight_map and name not in weight_map:
            report.add(where, f"tensor {name!r} is in {file} but missing from the index", "unlisted", tensor=name)
    report.tensors += len(located)


def _verify_foreign_dir(path: Path, report: Report, progress=None):
    """A directory of safetensors files without ckptconv's manifest: its one index and the files it
    names, or every .safetensors file in it."""
    entries = _scan(path, report)
    indexes = sorted(n for n in entries if n.endswith(manifest_format.INDEX_SUFFIX) and not n.startswith("."))
    weight_map = {}
    if len(indexes) > 1:
        report.add(path, f"holds {len(indexes)} indexes ({', '.join(indexes[:4])})", "metadata")
        return
    if indexes and not _regular(entries, indexes[0]):
        report.add(path / indexes[0], f"is {_kind(entries[indexes[0]])}; an index is a regular file (not followed)",
                   "not-regular")
        return
    if indexes:
        weight_map, _, problems = (_document(path, indexes[0], entries, report, "the index",
                                             manifest_format.read_index) or ({}, None, []))
        for p in problems:
            report.add(path / indexes[0], p, "metadata")
        names = sorted(set((weight_map or {}).values()))
        for n in sorted(n for n in entries if n.endswith(".safetensors") and n not in names):
            report.add(path / n, "is not in the index: a consumer following the index never loads it", "unlisted")
    else:
        names = sorted(n for n in entries if n.endswith(".safetensors") and not n.startswith("."))
    for n in names:
        if n not in entries:
            report.add(path / n, "listed in the index but missing", "missing")
        elif not _regular(entries, n):
            report.add(path / n, f"is {_kind(entries[n])}; not followed", "not-regular")
    _verify_foreign_files(path, [path / n for n in names if _regular(entries, n)], weight_map or {}, report)


def verify_mesh(path: Path, report: Report, progress=None, mine=lambda kind, key: True):
    """A reshard output: its top level (SHA256SUMS over mesh.json and every other file, exactly the
    rank directories mesh.json counts, nothing else), then every rank dir on its own. `mine(kind, key)`
    says which rank dirs this process checks and whether it checks the top level (all, in a single
    process). Returns mesh.json, validated, or None."""
    found = report if mine("structure", None) else Report()
    entries = _scan(path, found)
    sums = _sums(path, entries, found)
    data = _read(path, MESH, entries, found, MESH)
    dirs = {}  # every rank-XXXXX directory on disk
    for name, st in sorted(entries.items()):
        r = rank_number(name)
        if r is not None and stat.S_ISDIR(st.st_mode):
            dirs[r] = name
        elif not stat.S_ISREG(st.st_mode):
            found.add(path / name, f"is {_kind(st)}; a reshard output holds only its rank directories and regular "
                                   "files (not followed)", "not-regular")
        elif name != SUMS and name not in (sums or {}):
            found.add(path / name, "file is not listed in SHA256SUMS", "unlisted")
    mesh = None
    if data is not None:
        try:  # its rank count must be the number of rank directories before anything loops over it
            mesh = check_recorded(parse_mesh(data, path / MESH, len(dirs)), path / MESH)
        except BadInput as e:
            found.add(path / MESH, _detail(e, path / MESH), "metadata")
    target = mesh.get("source", {}).get("target") if mesh is not None else None
    vllm_parts = _vllm_parts(path, mesh["ranks"]) if isinstance(target, dict) and \
        target.get("engine") == vllm.TARGET and len(dirs) == mesh["ranks"] else None
    # a top-level part that is the very inode of its rank shard is hashed with that shard's directory
    # (against its manifest; its SHA256SUMS line is tied to the same digest below): not read twice
    linked = {n for n, (shard, _) in (vllm_parts or {}).items() if _same_file(path / n, path / shard)}
    if sums is not None:
        if MESH not in sums:
            found.add(path / SUMS, "does not list mesh.json", "unlisted")
        for name in sorted(sums):
            if name not in entries:
                found.add(path / name, "listed in SHA256SUMS but missing", "missing")
            elif stat.S_ISDIR(entries[name].st_mode):
                found.add(path / name, "listed in SHA256SUMS but is a directory", "not-regular")
            elif _regular(entries, name) and name not in linked:
                digest = hashlib.sha256(data).hexdigest() if name == MESH and data is not None \
                    else _sha256_regular(path / name)
                if digest is not None and digest != sums[name]:
                    found.add(path / name, "sha256 differs from SHA256SUMS", "digest")
    present = dirs
    if mesh is not None:  # as many directories as ranks (checked): rank-00000 … exactly, or some are off
        ranks = mesh["ranks"]
        present = {r: n for r, n in dirs.items() if r < ranks}
        for r, name in sorted(dirs.items()):
            if r >= ranks:
                found.add(path / name, f"rank directory beyond the {ranks} ranks of mesh.json", "unlisted")
        for r in range(ranks):
            if r not in dirs:
                found.add(path / rank_dir(r), "rank directory is missing", "missing")
    for r, name in sorted(present.items()):
        if mine("rank", r):
            verify_dir(path / name, report, progress)
    if vllm_parts is not None and sums is not None:
        _verify_vllm_files(path, vllm_parts, entries, sums, found)
    elif sums is not None and mesh is not None:   # a mesh output holds mesh.json and rank directories only
        for name in sorted(set(sums) - {MESH}):
            if rank_number(name) is None:
                found.add(path / name, "is listed in SHA256SUMS, but reshard writes no such file here", "unlisted")
    return mesh


def _vllm_parts(path: Path, ranks: int):
    """{`model-rank-R-part-P.safetensors`: (rank R's shard P, its digest in rank R's manifest)} of a
    --target vllm output; None when a rank's manifest cannot be read (reported with its directory)."""
    expected = {}
    for r in range(ranks):
        try:
            files = _checked_manifest(path / rank_dir(r)).get("files", {})
        except (BadInput, OSError):
            return None
        if not isinstance(files, dict):
            return None
        shards = sorted(n for n in files if n.endswith(".safetensors"))
        expected.update({vllm.part_name(r, p): (f"{rank_dir(r)}/{n}", (files[n] or {}).get("sha256")
                                                if isinstance(files[n], dict) else None)
                         for p, n in enumerate(shards)})
    return expected


def _same_file(a: Path, b: Path) -> bool:
    """Both regular files (no link followed) and one inode."""
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except OSError:
        return False
    return stat.S_ISREG(sa.st_mode) and stat.S_ISREG(sb.st_mode) and (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _verify_vllm_files(path: Path, expected: dict, entries: dict, sums: dict, report: Report):
    """What vLLM reads at the top of a --target vllm output is what the rank directories hold: each
    `model-rank-R-part-P.safetensors` is rank R's shard P (its digest in SHA256SUMS is the one rank R's
    manifest records), parts 0..n-1 and no others, and the model files are rank 0's."""
    try:
        rank0 = _checked_manifest(path / rank_dir(0)).get("files", {})
    except (BadInput, OSError):
        return
    rank0 = rank0 if isinstance(rank0, dict) else {}
    for name in sorted(entries):
        if vllm.PART.fullmatch(name) and name not in expected:
            report.add(path / name, "is not a part of any rank's shards", "unlisted")
    for name, (shard, digest) in expected.items():
        if name not in entries:
            report.add(path / name, f"is missing (vLLM loads it: it is {shard})", "missing")
        elif sums.get(name) != digest:
            report.add(path / name, f"differs from {shard}, which it must be", "digest")
    for name in sorted(sums):
        if name in rank0 and not name.endswith(".safetensors") and isinstance(rank0[name], dict) \
                and sums[name] != rank0[name].get("sha256"):
            report.add(path / name, f"differs from {rank_dir(0)}/{name}", "digest")
        elif name != MESH and name not in expected and name not in rank0 and rank_number(name) is None:
            report.add(path / name, f"is listed in SHA256SUMS, but is neither a part vLLM loads nor a model file of "
                                    f"{rank_dir(0)}", "unlisted")


def _ranks_agree(path: Path, mesh: dict, documents: list, report: Report):
    """Every rank's manifest says what rank 0's says of the source (its description but the rank it
    holds, its extras and other facts) and carries the same model files, and mesh.json's target is
    the one they record: verify --against compares rank 0's with the source, so none may differ."""
    def facts(doc):
        source = {k: v for k, v in doc.get("source", {}).items() if k != "resharded"} \
            if isinstance(doc.get("source"), dict) else doc.get("source")
        files = doc.get("files") if isinstance(doc.get("files"), dict) else {}
        carried = {n: f for n, f in files.items() if not n.endswith((".safetensors", manifest_format.INDEX_SUFFIX))}
        rest = {k: v for k, v in doc.items() if k not in ("source", "files", "tensors")}
        return {"source": source, "model files": carried, **rest}
    first = facts(documents[0])
    for r, doc in enumerate(documents[1:], 1):
        mine = facts(doc)
        differs = next((k for k in sorted(set(first) | set(mine)) if first.get(k) != mine.get(k)), None)
        if differs is not None:
            report.add(path / rank_dir(r) / MANIFEST, f"{differs}: not what {rank_dir(0)}'s manifest records (every "
                                                      "rank records the same source)", "mesh")
    target = mesh.get("source", {}).get("target")
    recorded = first["source"].get("target") if isinstance(first["source"], dict) else None
    if target != recorded:
        report.add(path / MESH, f"its source.target is {brief(target, 80)}, the ranks' manifests record "
                                f"{brief(recorded, 80)}", "mesh")


def verify_mesh_tensors(path: Path, mesh: dict, report: Report, mine=lambda kind, key: True):
    """With every rank dir intact: the same tensors as mesh.json, replicas equal, shared intervals
    equal, pieces where mesh.json puts them, reassembled digests right."""
    ranks = mesh["ranks"]
    documents = [_checked_manifest(path / rank_dir(r)) for r in range(ranks)]
    per_rank = [d["tensors"] for d in documents]
    if mine("structure", None):
        _ranks_agree(path, mesh, documents, report)
    del documents   # (their tensors stay, in per_rank)
    held = {}
    for r, tensors in enumerate(per_rank):
        for name in tensors:
            held.setdefault(name, []).append(r)
    if mine("structure", None):
        for name in sorted(set(held) - set(mesh["tensors"])):
            report.add(path / MESH, f"tensor {name!r} is on ranks {_ranks(held[name])} but not in mesh.json",
                       "unlisted", tensor=name)
        for name in sorted(set(mesh["tensors"]) - set(held)):
            report.add(path / MESH, f"tensor {name!r} is in mesh.json but in no rank directory", "missing", tensor=name)
    pieces, _ = mesh_reader.rank_pieces(path, ranks)  # headers parsed once, for every check below
    for name, entry in mesh["tensors"].items():
        if not mine("tensor", name) or name not in held:
            continue
        holders = held[name]
        if entry["axis"] is None:
            digests = {per_rank[r][name]["sha256"] for r in holders}
            if len(holders) != ranks:
                report.add(path / MESH, f"replicated tensor {name!r} is missing on ranks "
                                               f"{_ranks(sorted(set(range(ranks)) - set(holders)))}",
                                               "missing", tensor=name)
            if len(digests) > 1:
                report.add(path / MESH, f"replicated tensor {name!r} differs between ranks", "mesh", tensor=name)
        else:
            expected = [r for r in range(ranks) if intervals(entry, ranks, r, name)]
            if holders != expected:
                report.add(path / MESH, f"tensor {name!r} has pieces on ranks {_ranks(holders)}, mesh.json "
                                               f"puts them on ranks {_ranks(expected)}", "mesh", tensor=name)
                continue
            _check_shared_intervals(name, entry, pieces, path, report)
        try:
            if sha256_of(mesh_reader.assemble(name, entry, pieces, ranks)) != entry["sha256"]:
                report.add(path / MESH, f"tensor {name!r}: the global tensor reassembled from the rank "
                                               "pieces does not match its sha256 (a piece is on the wrong rank "
                                               "or cut on the wrong axis)", "mesh", tensor=name)
        except BadInput as e:
            report.add(path / MESH, str(e), "mesh")


def _ranks(rs, limit=16) -> str:
    rs = list(rs)
    return str(rs) if len(rs) <= limit else f"{rs[:limit]}... ({len(rs)} ranks)"


def _check_shared_intervals(name, entry, pieces, path, report):
    """Where several ranks hold the same interval (a shared kv head), their bytes must be equal."""
    if "ranges" not in entry and "boxes" not in entry:
        return
    axis, ranks = entry["axis"], len(pieces)
    seen = {}
    for r in range(ranks):
        if name not in pieces[r]:
            continue
        held = intervals(entry, ranks, r, name)
        shape = pieces[r][name].shape
        if len(shape) != len(entry["shape"]) or shape[axis] != sum(b - a for a, b in held):
            return   # a piece of the wrong shape: reported when the tensor is assembled
        at = 0
        for a, b in held:
            seen.setdefault((outer_cut(entry, r), a, b), []).append((r, at))
            at += b - a
    for (_, a, b), holders in seen.items():
        if len(holders) < 2:
            continue
        digests = {sha256_of(pieces[r][name].sliced(axis, at, at + b - a)) for r, at in holders}
        if len(digests) > 1:
            report.add(path / MESH, f"tensor {name!r}: interval {a}..{b} of axis {axis} differs between "
                                           f"ranks {[r for r, _ in holders]}", "mesh", tensor=name)


def _checked_manifest(d: Path) -> dict:
    """manifest.json of a directory verify already checked (a regular file, a JSON object)."""
    return safejson.loads(read_regular(d / MANIFEST), d / MANIFEST, MANIFEST)


def _recorded_source(out_path: Path, is_mesh: bool) -> tuple:
    """(where the manifest is, its "source" entry, its aliases, the whole document) of an output
    verify already checked: what convert did to the source (prefix stripped, cast) is applied again
    before comparing."""
    if out_path.is_file():
        m = MappedFile(out_path)
        raw = manifest_format.single_document(parse_header(m.view, m.size, out_path).metadata, out_path)
        where = out_path
    else:
        first = out_path / rank_dir(0) if is_mesh else out_path
        where, raw = first / MANIFEST, _checked_manifest(first) if (first / MANIFEST).is_file() else {}
    source = raw.get("source", {}) if isinstance(raw, dict) else {}
    aliases = raw.get("aliases", {}) if isinstance(raw, dict) else {}
    aliases = {a: b for a, b in aliases.items() if isinstance(a, str) and isinstance(b, str)} \
        if isinstance(aliases, dict) else {}
    # (a malformed source is informational: the tensors still compare)
    return where, source if isinstance(source, dict) else {}, aliases, raw if isinstance(raw, dict) else {}


def compare_against(out_path: Path, src, read: ReadOptions, fmt, report: Report, mine=lambda kind, key: True):
    """Every tensor (global tensor, for a reshard output) equal to the source, bit for bit, streaming."""
    is_mesh = (out_path / MESH).is_file()
    # what OUT holds is read as what ckptconv writes, never by detection: a .pt or .metadata slipped
    # into OUT (and listed in its sums) must not become "the output" that matches the source
    out = open_checkpoint(out_path, "mesh" if is_mesh else "safetensors", ReadOptions())
    recorded, manifest, aliases, document = _recorded_source(out_path, is_mesh)
    applied = _as_recorded(read, manifest, fmt)
    if applied != read:  # say so: "matches the source" then means the selection convert recorded
        replayed = ([f"--state-dict {brief(applied.state_dict)}"] if applied.state_dict != read.state_dict else []) \
            + ([f"--only {brief(applied.only)}"] if applied.only != read.only else []) \
            + [f"--{k.replace('_', '-')} {brief(v)}" for k, v in applied.declared.items() if read.declared.get(k) != v]
        report.notes.append(f"{out_path}: compared with the part of the source the output records it was made "
                            f"from: {', '.join(replayed)}")
    read = applied
    source = open_checkpoint(src, fmt, read)
    if mine("structure", None) and document.get("format") == manifest_format.FORMAT:   # (not a foreign output)
        _compare_facts(recorded, document, manifest, source, report, beside=Path(src).is_file())
    try:
        recipe = Recipe.recorded(manifest)
    except BadInput as e:
        report.add(recorded, str(e), "metadata")
        return
    try:   # convert's own steps, with their own checks (a name clash, a layout that does not fit)
        src_list, _ = recipe.apply(source.tensors, src)
    except CkptError as e:
        report.add(recorded, f"the source cannot be made what the output records: {e}", "source")
        return
    src_tensors = {t.name: t for t in src_list}
    written = {t.name: t for t in out.tensors}
    if mine("structure", None):
        prefix = _prefix_between([n for n in written if n not in src_tensors and n not in aliases],
                                 [n for n in src_tensors if n not in written and n not in aliases])
        if prefix is not None:
            report.add(out_path, prefix, "source")
    tied = [(written[aliases[n]], src_tensors.pop(n)) for n in list(src_tensors)
            if n in aliases and aliases[n] in written]   # written once (tied weights): the same bytes
    for t, s in [(t, src_tensors.pop(t.name, None)) for t in out.tensors] + tied:
        if not mine("tensor", t.name):
            continue
        if s is None:
            report.add(out_path, f"tensor {t.name!r} is not in the source {src}", "source", tensor=t.name)
            continue
        if s.dtype != t.dtype or s.shape != t.shape:
            report.add(out_path, f"tensor {t.name!r} is {t.dtype.code}{list(t.shape)}, the source has "
                                 f"{s.dtype.code}{list(s.shape)}", "source", tensor=t.name)
            continue
        _compare(t, s, out_path, report)
    for name in src_tensors if mine("structure", None) else ():
        report.add(out_path, f"tensor {name!r} of the source is missing from the output", "source", tensor=name)


def _prefix_between(only_out: list, only_src: list) -> str | None:
    """When the names on one side are the other side's with a prefix added (9 in 10 or more of them),
    one line saying so, to read before the details; else None. Bounded: the prefixes tried are those
    of the first 16 names, at most 200 characters long."""
    if not only_out or not only_src:
        return None
    for longer, shorter, side in ((only_src, only_out, "source"), (only_out, only_src, "output")):
        held, tried = set(shorter), set()
        for name in longer[:16]:
            for cut in range(1, min(len(name), 201)):
                prefix = name[:cut]
                if name[cut:] not in held or prefix in tried:
                    continue
                tried.add(prefix)
                hits = sum(n.startswith(prefix) and n[cut:] in held for n in longer)
                if hits * 10 >= 9 * max(len(longer), len(shorter)):
                    return (f"the {side}'s names are the {'output' if side == 'source' else 'source'}'s with "
                            f"the prefix {prefix!r} ({hits} of {len(longer)}): " + (
                                f"convert with --strip-prefix {prefix!r} gives the output's names"
                                if side == "source" else "the source lacks it"))
    return None


def _as_recorded(read: ReadOptions, manifest: dict, fmt=None) -> ReadOptions:
    """The source read the way convert read it: its recorded --state-dict and --only (when they are
    what convert writes: a key or "none", a list of prefixes) and the options its reader declares and
    records (Grok's --dequantize and --layout: one of their choices), unless given again here."""
    wrapper, only = manifest.get("state_dict"), manifest.get("only")
    if isinstance(wrapper, str) and wrapper and read.state_dict == "auto":
        read = dataclasses.replace(read, state_dict=wrapper)
    if isinstance(only, list) and 0 < len(only) <= 1000 and all(isinstance(p, str) and len(p) <= 1000 for p in only) \
            and not read.only:
        read = dataclasses.replace(read, only=list(only))
    reader = readers().get(manifest.get("format") if fmt is None else fmt)
    declared = dict(read.declared)
    for opt in reader.options if reader is not None else ():
        value = manifest.get(opt.dest)
        if opt.choices and value in opt.choices and opt.dest not in declared:
            declared[opt.dest] = value
    return dataclasses.replace(read, declared=declared) if declared != read.declared else read


# What convert and reshard add to the reader's description of the source (the options they applied,
# replayed by compare_against, and where the source was): the rest is the reader's, and must be what
# the reader says of the source today.
_APPLIED = ("path", "cast", "strip_prefix", "only", "skipped_files", "config_edits", "resharded", "target",
            "model_files", "with")


def _compare_facts(recorded: Path, document: dict, manifest: dict, source, report: Report, beside=False):
    """Everything else the output records of its source: the reader's description and the extras
    (when the output was made by the same reader: an output converted again records the output it
    was made from), and the model files carried (each the source's bytes, or config.json as --dtype
    edits it; `beside`: SRC is one file, whose paired config ckptconv carries, docs/convert.md)."""
    if not isinstance(document.get("source"), dict):
        report.add(recorded, f"source is {brief(document.get('source'), 80)}, not the object ckptconv records",
                   "source")
        return
    fresh = {k: v for k, v in _plain(source.source).items() if k != "path"}
    kept = {k: v for k, v in _plain(manifest).items() if k not in _APPLIED}
    if kept.get("format") != fresh.get("format"):
        report.notes.append(f"{recorded}: made from a {brief(kept.get('format'), 40)} source, compared with a "
                            f"{brief(fresh.get('format'), 40)} one: its tensors and model files are compared, not "
                            "its extras or what its reader recorded")
        fresh = kept = {}
        document = {**source.manifest, **{
            k: document[k] for k in ("format", "source", "files", "tensors", "aliases") if k in document},
            "extras": source.extras}
    for key in sorted(set(fresh) | set(kept)):
        if key in fresh and fresh.get(key) != kept.get(key):
            report.add(recorded, f"source.{key} is {brief(kept.get(key), 120)}, the source gives "
                                 f"{brief(fresh[key], 120)}", "source")
        elif key not in fresh:
            report.add(recorded, f"source.{key} ({brief(kept[key], 120)}) is not what the source gives", "source")
    extras, theirs = _plain(document.get("extras", {})), _plain(source.extras)
    for key in sorted(set(extras) | set(theirs), key=str) if extras != theirs else ():
        if extras.get(key) != theirs.get(key):
            report.add(recorded, f"extras {key!r} is {brief(extras.get(key), 120)}, the source's is "
                                 f"{brief(theirs.get(key), 120)}", "source")
    others = _plain({k: v for k, v in document.items() if k not in _OWN_KEYS})   # (not its million tensors)
    theirs_top = _plain(source.manifest)
    for key in sorted(set(others) | set(theirs_top)) if others != theirs_top else ():
        if others.get(key) != theirs_top.get(key):
            report.add(recorded, f"{key} is {brief(others.get(key), 120)}, the source's reader gives "
                                 f"{brief(theirs_top.get(key), 120)}", "source")
    files = document.get("files")
    if not isinstance(files, dict) or recorded.name != MANIFEST:
        return   # (a single file carries no model files)
    carried, edited = source.out_files()   # (the files a reader makes, as it makes them from the source today)
    try:
        target = Recipe.recorded(manifest).cast
    except BadInput:   # (reported where the tensors are compared)
        target = None
    if target is not None and manifest.get("config_edits"):
        edited.update(transforms.config_with_dtype(_config(source.model_files, source.made), target, {}))
    skipped = {s.get("name") for s in manifest.get("skipped_files", []) if isinstance(s, dict)}
    theirs = {rel for rel, _ in carried}
    added = set(manifest["with"]) if isinstance(manifest.get("with"), list) and all(
        isinstance(n, str) for n in manifest["with"]) else set()   # (--with: written from elsewhere, not compared)
    for name in sorted(files):
        if name not in theirs | added and not name.endswith((".safetensors", manifest_format.INDEX_SUFFIX)):
            report.add(recorded.parent / name, "is listed as carried, but the source has no such model file", "source")
    for rel, path in carried:
        info = files.get(rel)
        if rel in added:
            continue
        if info is None:
            if rel in skipped or manifest.get("model_files") == "not carried":
                pass
            elif beside:   # (an output of ckptconv from before a file's paired config was carried)
                report.notes.append(f"{recorded.parent}: does not hold {rel}, the config beside the source file "
                                    "that convert now carries with it (docs/convert.md, \"Files carried\")")
            else:
                report.add(recorded.parent, f"model file {rel!r} of the source was not carried", "source")
            continue
        digest = hashlib.sha256(edited[rel]).hexdigest() if rel in edited else _sha256_regular(Path(path))
        if not isinstance(info, dict) or info.get("sha256") != digest:
            report.add(recorded.parent / rel, f"is not the source's {rel}" + (" as --dtype edits it" if rel in edited
                                                                              else ""), "source")


# What a manifest holds beside what its reader recorded of the source (the rest: `quantization` …)
_OWN_KEYS = ("format", "source", "extras", "files", "tensors", "aliases")


def _plain(value):
    """`value` as JSON gives it back (tuples are lists, keys strings): what a manifest holds."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _config(model_files, made=None) -> dict:
    try:
        return read_config(model_files, made) or {}
    except BadInput:
        return {}


def _compare(a, b, where, report):
    done = 0
    for x, y in zip(iter_blocks(a, CHUNK), iter_blocks(b, CHUNK)):
        xb, yb = as_bytes(x), as_bytes(y)
        if xb != yb:
            i = int(np.flatnonzero(np.frombuffer(xb, np.uint8) != np.frombuffer(yb, np.uint8))[0]) // x.dtype.itemsize
            index = np.unravel_index(done + i, a.shape) if a.shape else ()
            report.add(where, f"tensor {a.name!r} differs from the source at index {tuple(int(v) for v in index)}: "
                              f"{x.reshape(-1)[i]!r} != {y.reshape(-1)[i]!r}", "source", tensor=a.name)
            break
        done += x.size
        a.release()
        b.release()
        signals.check()


def verify(path, against=None, read=None, fmt=None, device=None, allow_fewer=False, progress=None,
           cluster=None, expect=None) -> Report:
    """Every check, in order; each stage runs only if the one before found nothing; with `expect`
    (an output's identity, formats/identity.py), the output must also be exactly that one. On several
    processes each checks its share (shards, rank dirs, tensors) and process 0 gathers the report;
    they first agree that they verify the same output the same way."""
    report = _verify(Path(path), against, read, fmt, device, allow_fewer, progress, cluster)
    if expect is not None and (cluster is None or cluster.is_main):
        try:
            found = identity(path)
        except BadInput as e:
            found, why = None, f"has nothing to name it by ({_detail(e, path)})"
        if found is not None and found != expect:
            why = f"is not the expected output: its identity is {found}, not {expect}"
        if found != expect:
            report.add(path, why, "identity")
        else:
            report.expected = True
    return report


def _verify(path: Path, against, read, fmt, device, allow_fewer, progress, cluster) -> Report:
    if cluster is not None and cluster.num_processes > 1:
        from .cluster import agree
        agree(cluster, _job(path, against, fmt, device, allow_fewer))
    if path.name.endswith(".safetensors") and path.is_file():
        return _verify_single(path, against, read, fmt, device, allow_fewer, progress, cluster)
    if not path.is_dir():
        raise UsageError(f"{path}: neither an output directory nor a .safetensors file")
    is_mesh = os.path.lexists(path / MESH)
    names = os.listdir(path)
    if not is_mesh and not os.path.lexists(path / MANIFEST) and not os.path.lexists(path / SUMS):
        if not any(n.endswith((".safetensors", manifest_format.INDEX_SUFFIX)) for n in names):
            raise UsageError(f"{path}: holds no safetensors files, index, {MANIFEST} or {MESH}; not a ckptconv output "
                             "nor any other safetensors output")
        return _verify_single(path, against, read, fmt, device, allow_fewer, progress, cluster, _verify_foreign_dir)
    mine = _share(path, is_mesh, cluster)
    report = Report()
    if is_mesh:
        mesh = verify_mesh(path, report, progress, mine)
        _merge(cluster, "rank-dirs", report)
        if not report.problems and mesh is not None:
            verify_mesh_tensors(path, mesh, report, mine)
    else:
        shards = None if cluster is None else {f for f in _shard_sizes(path) if mine("shard", f)}
        verify_dir(path, report, progress, shards, structural=cluster is None or cluster.is_main)
    _merge(cluster, "structure", report)
    if against is not None and not report.problems:
        compare_against(path, against, read or ReadOptions(), fmt, report, mine)
        _merge(cluster, "against", report)
    if device is not None and not report.problems:
        from .device import device_check
        report.device = device_check(path, device, allow_fewer, report, cluster)
        _merge(cluster, "device", report)
    _merge(cluster, "totals", report)
    return report


def _verify_single(path, against, read, fmt, device, allow_fewer, progress, cluster, check=None) -> Report:
    """One file (or an output ckptconv did not write) is checked whole by process 0; the others wait
    for its report."""
    report = Report()
    if cluster is None or cluster.is_main:
        (check or verify_file)(path, report, progress)
        if against is not None and not report.problems:
            compare_against(path, against, read or ReadOptions(), fmt, report)
        if device is not None and not report.problems and report.foreign:
            report.notes.append(f"{path}: --device compares what reaches the device with the recorded digests; "
                                "there are none here, so nothing was placed")
        elif device is not None and not report.problems:
            from .device import device_check
            report.device = device_check(path, device, allow_fewer, report)
    _merge(cluster, "totals", report)
    return report


def _shard_sizes(path: Path) -> dict:
    """{shard: size} of the regular shard files the output's (valid) metadata names, for sharing work."""
    entries = _scan(path, Report())
    _, weight_map, _, m_files, _, sums = _read_meta(path, entries, Report())
    names = sorted(set((weight_map or {}).values())
                   | {f for f in (*(m_files or {}), *(sums or {})) if f.endswith(".safetensors")})
    return {n: entries[n].st_size if _regular(entries, n) else 0 for n in names}


def _share(path: Path, is_mesh: bool, cluster):
    """Which rank dirs, shards and tensors this process checks: balanced by bytes, as runs split work.
    Only what is on disk and valid is shared out; process 0 reports everything else."""
    if cluster is None:
        return lambda kind, key: True
    from .writers.base import assign
    owners = {}
    if is_mesh:
        try:
            mesh = mesh_reader.read_mesh(path)
        except BadInput:
            mesh = None
        ranks = sorted(r for r in rank_dirs(path) if mesh is not None and r < mesh["ranks"])
        sizes = [sum(_shard_sizes(path / rank_dir(r)).values()) for r in ranks]
        owners.update({("rank", r): o for r, o in zip(ranks, assign(sizes, cluster.num_processes))})
        tensors = mesh["tensors"] if mesh is not None else {}
        names = list(tensors)
        tsizes = [math.prod(tensors[n]["shape"]) * dtypes.from_code(tensors[n]["dtype"]).itemsize for n in names]
    else:
        shards = _shard_sizes(path)
        owners.update({("shard", n): o for n, o in zip(shards, assign(list(shards.values()), cluster.num_processes))})
        _, _, _, _, m_tensors, _ = _read_meta(path, _scan(path, Report()), Report())
        tensors = {n: e for n, e in (m_tensors or {}).items() if e is not None}
        names = list(tensors)
        tsizes = [math.prod(tensors[n].shape) for n in names]
    owners.update({("tensor", n): o for n, o in zip(names, assign(tsizes, cluster.num_processes))})
    return lambda kind, key: owners.get((kind, key), 0) == cluster.process_id


def _merge(cluster, stage, report: Report):
    """Process 0 collects every process's findings for a stage, and tells everyone the total. (A
    stage's end is a checkpoint for a pending signal, see signals.py.)"""
    signals.check()
    if cluster is None:
        return
    from .cluster import gather
    found = {"problems": [asdict(p) for p in report.problems[report.shared:]]}
    if stage == "totals":
        found.update(files=report.files, tensors=report.tensors, bytes=report.bytes)
    results = gather(cluster, f"verify/{stage}", found)
    if cluster.is_main:
        merged = {"problems": [asdict(p) for p in report.problems[:report.shared]]
                  + [p for r in results for p in r["problems"]]}
        if stage == "totals":
            merged.update({k: sum(r[k] for r in results) for k in ("files", "tensors", "bytes")})
        cluster.put(f"verify/{stage}/all", merged)
    total = cluster.get(f"verify/{stage}/all", 0)
    report.problems = [Problem(**p) for p in total["problems"]]
    report.shared = len(report.problems)
    if stage == "totals":
        report.files, report.tensors, report.bytes = total["files"], total["tensors"], total["bytes"]


def _job(path: Path, against, fmt, device, allow_fewer) -> dict:
    """What one process of a verify is about to check, for `cluster.agree`: the options, and the
    output by what names every file of it (its SHA256SUMS, or a single file's header), as digests."""
    first = path / SUMS if path.is_dir() else path
    try:
        with safejson.open_regular(first, follow=False) as fd:
            head = os.read(fd, 1 << 20)
    except BadInput:
        head = b""
    return {"options": {"--against": against is not None, "--from": fmt, "--device": device,
                        "--allow-fewer-devices": allow_fewer},
            "output": {"name": path.name, "digest": hashlib.sha256(head).hexdigest()}}


def total_bytes(path: Path) -> int:
    """Bytes of the .safetensors files in an output and its rank directories (for the progress bar);
    symlinks are not followed, and nothing deeper than a rank directory is walked."""
    total = 0

    def scan(d, depth):
        nonlocal total
        with os.scandir(d) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    if depth == 0:
                        scan(entry.path, 1)
                elif entry.name.endswith(".safetensors") and entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size

    try:
        scan(path, 0)
    except OSError:
        pass
    return total
