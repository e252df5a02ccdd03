"""One safetensors shard: its header parsed and its problems reported, what the safetensors library sees
of it compared with what ckptconv parsed, and its file and tensor digests computed in one streaming pass and
compared with those recorded."""
import hashlib
from collections import deque
from pathlib import Path

from .. import signals
from ..io import sha256
from ..errors import BadInput, UsageError, brief
from ..io.hashing import CHUNK, SMALL, Digests, HashLanes
from ..storage import files as storage
from ..formats.safetensors import file_header
from .report import Report, _detail

AHEAD = 4 * CHUNK   # bytes of an object fetched at once by verify (its parts concurrently)


def _parsed(path: Path, report: Report):
    """(mapping, header) of a safetensors file, its header's problems reported; None (reported too)
    when the header cannot be read at all."""
    try:
        m = storage.open_file(path)
        header = file_header(m, path)
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
    try:   # (an object: the library opens a sparse local copy of its header, storage.files.library_path)
        with storage.library_path(path) as local, safe_open(str(local), framework="numpy") as f:
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
    """Digest the file and each tensor in one streaming pass (_digest_shard), and compare the digests
    with those recorded: the file's in manifest.json (`m_files`, None for a single-file output: no
    file digest to compare) and SHA256SUMS (`sums`), each tensor's as `recorded(name)` gives it."""
    path = storage.place(m.path)
    ranges, digests, file_digest = _digest_shard(m, header, progress)
    report.bytes += m.size
    _check_file_digest(path, m.size, file_digest, shard, m_files, sums, report)
    for (entry, _, _), digest in zip(ranges[1:], digests):   # (a digest per entry of `ranges`, in order)
        want = recorded(entry.name)   # (32 bytes; `digest` is hex)
        if want is not None and want.hex() != digest:
            report.add(path, f"tensor {entry.name!r}: sha256 differs from the manifest (its bytes "
                             f"{entry.begin}..{entry.end} are corrupted)", "digest", tensor=entry.name)


def _digest_shard(m, header, progress):
    """The file's digest and each tensor's, in one streaming pass (hashing.HashLanes), while this thread
    maps the next chunk's pages in; pages are dropped once the hashes are done with them. A tensor
    of at most SMALL bytes is digested here, in this thread, and its bytes go to the file's digest with
    its neighbours' in CHUNK pieces (hashing.SMALL). Returns (the ranges read: the header's, then each
    tensor's as (entry, begin, end), the tensors' Digests in that order, the file's digest)."""
    hashes, file_h, chunks, digests = HashLanes(), sha256.new(), deque(), Digests()
    fed = released = fetched = 0   # the file's bytes before `fed` are on their way to its digest

    def feed(upto, tensor_h=None):
        """File bytes [fed, upto) to the file's digest (and `tensor_h`), CHUNK at a time (an object's
        fetched AHEAD at a time: concurrent ranged GETs, storage/files.RemoteFile.need)."""
        nonlocal fed, released, fetched
        while fed < upto:
            n = min(CHUNK, upto - fed)
            if m.remote and fed + n > fetched:
                fetched = min(m.size, fed + AHEAD)
                m.need(fed, fetched - fed)
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
                if m.remote:   # (fetched a CHUNK at a time: one GET for many small tensors)
                    m.need(begin, min(m.size, max(end, begin + CHUNK)) - begin)
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
    return ranges, digests, file_digest


def _check_file_digest(path: Path, size: int, file_digest, shard, m_files, sums, report: Report):
    """A shard's size and digest as manifest.json (`m_files`; None for a single-file output, which
    cannot record its own digest) and SHA256SUMS record them."""
    info = (m_files or {}).get(shard)
    if m_files is None:
        pass  # a single-file output: it cannot record its own digest
    elif shard not in m_files:
        report.add(path, "shard is not listed in manifest.json files", "unlisted")
    elif info is not None:  # (a malformed entry is reported with the manifest)
        if info.get("size") != size:
            report.add(path, f"size is {size} bytes, the manifest says {brief(info.get('size'))} (truncated?)",
                       "digest")
        if info.get("sha256") != file_digest:
            report.add(path, "sha256 differs from manifest.json", "digest")
    if shard in sums and sums[shard] != file_digest:
        report.add(path, "sha256 differs from SHA256SUMS", "digest")
