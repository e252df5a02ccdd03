"""Where a checkpoint's bytes come from: one small interface over local paths and object-store URLs
(docs/storage.md). Readers and layouts reach source files only through it
(tests/test_storage_room.py holds them to that):

- names: `is_url`, `join`, `name`, `parent`, `realpath`, `shown`;
- what is there: `is_dir`, `is_file`, `exists`, `size`, `listdir`, `entries` (a directory's or
  prefix's names, each with whether it is a directory and its size);
- small files whole: `read_bytes` (configs, indexes, JSON: at most `limit` bytes);
- weight files: `open_file`, a `MappedFile` for a local path (io/mapped.py: zero-copy views of a
  read-only mapping, SIGBUS guard) or a `RemoteFile` for a URL, behind the same interface; parts of
  an open file for a reader to parse: `buffer` (one range), `read_ranges` (many small ones: an
  object's in a few concurrent GETs), `pieces` (one long range front to back, for a decompressor).

A `RemoteFile` is the object as it was when opened (its ETag and size: objects.py). Its `view` is an
anonymous mapping the size of the object that nothing fills until `need(offset, length)` fetches the
range (ranged GETs); `release` gives those pages back and forgets them, so a later `need` fetches
again. A reader calls `need` before it parses bytes of `view` (a no-op for a local file, whose
mapping is the file). Tensor bytes a writer copies whole (`reader`) do not pass through the mapping:
they come from a read-ahead window shared by every remote file of the process (`will_need` names the
ranges a writer will read next; at most `concurrency` parts of `part_size` bytes are fetched or held
at once), hashed and written as they arrive.
"""
import contextlib
import itertools
import itertools
import mmap
import os
import threading
from bisect import bisect_right
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput
from .objects import GAP
from .urls import Location, StorageOptions, is_url, parse, redact

__all__ = ["configure", "options", "is_url", "join", "name", "parent", "realpath", "shown", "is_dir", "is_file",
           "exists", "size", "listdir", "entries", "read_bytes", "open_file", "RemoteFile", "Entry", "place",
           "RemotePath", "head", "stat", "fingerprint", "load_json", "forget", "scan", "sha256", "same_file",
           "copy_file", "library_path", "buffer", "read_ranges", "pieces"]

_PAGE = mmap.PAGESIZE
MAX_ENTRIES = 1_000_000   # names one listing may hold (objects.MAX_LISTED)
HEAD = 4096               # an object's first bytes, read once and kept (the readers' detection looks there)
_state = threading.local()
_lock = threading.Lock()
_options = StorageOptions()
_stores: dict = {}        # (scheme, bucket, account, options) -> Store for reads
_listings: dict = {}      # URL of a prefix -> _Listing
_opened: dict = {}        # URL of an object -> RemoteFile: one version of each object per run


def configure(options: StorageOptions):
    """The storage options of this process's commands (the CLI's --endpoint-url, --concurrency,
    --part-size ...); what was listed or opened before is forgotten."""
    global _options
    with _lock:
        _options = options
        _stores.clear()
        _listings.clear()
        _opened.clear()
    _Window.reset()


def options() -> StorageOptions:
    return _options


def forget(url):
    """Drop what was listed of `url` and under it, and the objects opened there (an output just
    written, replaced or rolled back there): the next look lists and opens them again."""
    key = realpath(os.fspath(url)) if is_url(os.fspath(url)) else None
    if key is None:
        return
    with _lock:
        for k in [k for k in _listings if k == key or k.startswith(key + "/") or key.startswith(k + "/")
                  or k == key.rpartition("/")[0]]:
            del _listings[k]
        for k in [k for k in _opened if k == key or k.startswith(key + "/")]:
            del _opened[k]


# ---- names ---------------------------------------------------------------------------------------

def join(base, *names) -> str:
    """`base` with `names` appended: os.path.join for a path, "/"-joined for a URL."""
    base = os.fspath(base)
    if not is_url(base):
        return os.path.join(base, *names)
    out = base.rstrip("/")
    for n in names:
        out = f"{out}/{n.strip('/')}" if n else out
    return out


def name(path) -> str:
    path = os.fspath(path)
    return path.rstrip("/").rpartition("/")[2] if is_url(path) else os.path.basename(path)


def parent(path) -> str:
    path = os.fspath(path)
    if is_url(path):
        loc = _location(path)
        return str(Location(loc.scheme, loc.bucket, loc.key.rpartition("/")[0], loc.account)).rstrip("/")
    return os.path.dirname(path)


def realpath(path) -> str:
    """What `path` names, resolved: a local path's links followed, a URL in its one spelling."""
    path = os.fspath(path)
    return str(_location(path)).rstrip("/") if is_url(path) else os.path.realpath(path)


def shown(path) -> str:
    """`path` as messages show it (a URL's credentials never; urls.redact)."""
    return redact(os.fspath(path))


def _location(url: str) -> Location:
    return parse(url)


# ---- what is there -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    """One name of a directory or prefix: whether it is a directory (a prefix with objects under it)
    and, for a file, its size."""

    name: str
    is_dir: bool
    size: int = 0


class _Listing:
    """One prefix's names (one delimited LIST, all pages), as the object store gave them."""

    def __init__(self, url: str):
        from .objects import _retrying
        loc = _location(url)
        store = _store(loc)
        prefix = f"{loc.key}/" if loc.key else ""
        self.files, self.dirs = {}, set()

        def collect():
            import obstore
            self.files.clear()
            self.dirs.clear()
            found = obstore.list_with_delimiter(store.handle, prefix or None)
            for meta in found["objects"]:
                rest = meta["path"][len(prefix):]
                if rest and "/" not in rest:
                    self.files[rest] = meta["size"]
            for p in found["common_prefixes"]:
                rest = p[len(prefix):].strip("/")
                if rest and "/" not in rest:
                    self.dirs.add(rest)
            if len(self.files) + len(self.dirs) > MAX_ENTRIES:
                raise BadInput(f"{loc}: holds more than {MAX_ENTRIES:,} names; not a checkpoint to list")
        _retrying(store, collect, str(loc), missing="no such prefix")


def _listing(url: str) -> _Listing:
    key = realpath(url)
    return _kept(_listings, key, lambda: _Listing(key))


def _kept(table: dict, key, make):
    """table[key], made once (outside the lock: a listing or a HEAD takes a request) and kept until
    the next `configure` (or `forget`); of two made at once, the first kept wins."""
    with _lock:
        found = table.get(key)
    if found is None:
        made = make()
        with _lock:
            found = table.setdefault(key, made)
    return found


def _in_parent(url: str):
    """(the parent's listing, this name), or (None, None) for a bucket's root."""
    loc = _location(url)
    if not loc.key:
        return None, None
    return _listing(parent(url)), loc.key.rpartition("/")[2]


def is_dir(path) -> bool:
    path = os.fspath(path)
    if not is_url(path):
        return os.path.isdir(path)
    up, n = _in_parent(path)
    if up is None:
        return True   # a bucket's root (a missing bucket fails when it is listed)
    return n in up.dirs


def is_file(path) -> bool:
    path = os.fspath(path)
    if not is_url(path):
        return os.path.isfile(path)
    up, n = _in_parent(path)
    return up is not None and n in up.files


def exists(path) -> bool:
    path = os.fspath(path)
    if not is_url(path):
        return os.path.lexists(path)
    return is_file(path) or is_dir(path)


def size(path) -> int:
    path = os.fspath(path)
    if not is_url(path):
        return os.path.getsize(path)
    up, n = _in_parent(path)
    if up is None or n not in up.files:
        raise BadInput(f"{shown(path)}: no such object")
    return up.files[n]


def entries(path) -> list:
    """The names in a directory or under a prefix, sorted, as Entries (a local entry's links
    followed, as os.path.isdir does)."""
    path = os.fspath(path)
    if is_url(path):
        found = _listing(path)
        out = [Entry(n, False, s) for n, s in found.files.items()] + [Entry(n, True) for n in found.dirs]
        return sorted(out, key=lambda e: e.name)
    out = []
    with os.scandir(path) as it:
        for e in it:
            d = e.is_dir()
            out.append(Entry(e.name, d, 0 if d else _local_size(e)))
    return sorted(out, key=lambda e: e.name)


def _local_size(e) -> int:
    try:
        return e.stat().st_size
    except OSError:
        return 0


def listdir(path) -> list:
    """The names in a directory or under a prefix, sorted."""
    return [e.name for e in entries(path)]


def read_bytes(path, what: str, limit: int, follow: bool = True) -> bytes:
    """A small file's bytes (a config, an index): BadInput naming it when it is larger than `limit`
    or cannot be read. A local file is read through safejson.read (a regular file, opened without
    blocking; with `follow=False`, a symbolic link is refused, not followed: an output's own files)."""
    path = os.fspath(path)
    if not is_url(path):
        from .. import safejson
        return safejson.read(path, what.removeprefix("the "), limit=limit, follow=follow)
    f = open_file(path)
    if f.size > limit:
        raise BadInput(f"{shown(path)}: {what} has {f.size} bytes, more than the {limit} accepted")
    return f.read(0, f.size)


def open_file(path):
    """A weight file: a MappedFile (a local path) or a RemoteFile (a URL; the same one for every open of
    the URL until the next `configure`, so a run reads one version of each object)."""
    path = os.fspath(path)
    if is_url(path):
        return _kept(_opened, realpath(path), lambda: RemoteFile(path))
    from ..io.mapped import MappedFile
    return MappedFile(path)


def buffer(f, offset: int, length: int):
    """[offset, offset+length) of an open file (clamped to its end, as a slice is) as a buffer to
    parse whole: a view of a local file's mapping (nothing copied), an object's bytes fetched now
    (one GET, or the window's for a long range; nothing kept in its mapping)."""
    if not f.remote:
        return f.view[offset:offset + length]
    offset = min(max(offset, 0), f.size)
    return f.read(offset, max(0, min(length, f.size - offset)))


def read_ranges(f, ranges):
    """The bytes of each (offset, length) of `ranges` (an iterable, consumed lazily), in order: a
    local file's by pread (nothing mapped), an object's by concurrent ranged GETs a bounded window
    ahead, ranges near each other sharing one (objects.GAP): the local headers of a zip's entries or
    the element counts before a legacy torch file's storages cost a few requests, not one each.
    Every range must lie inside the file (BadInput otherwise, when it is reached)."""
    if f.remote:
        yield from f.read_many(ranges)
        return
    with f.reader() as fill_at:
        for offset, length in ranges:
            f.check(offset, length, "a read")
            out = bytearray(length)
            fill_at(memoryview(out), offset)
            yield out


def pieces(f, offset: int, length: int, piece: int):
    """[offset, offset+length) of an open file front to back, `piece` bytes at a time (the last
    shorter), for a decompressor: views of a local file's mapping; an object's bytes fetched a bounded
    window ahead (nothing kept: memory stays (concurrency + 1) x part_size whatever the length)."""
    f.check(offset, length, "a read")
    steps = ((at, min(piece, offset + length - at)) for at in range(offset, offset + length, piece))
    if f.remote:
        yield from f.read_many(steps)
        return
    for at, n in steps:
        yield f.view[at:at + n]


def _store(loc: Location):
    from .objects import reading
    return _kept(_stores, (loc.scheme, loc.bucket, loc.account),
                 lambda: reading(Location(loc.scheme, loc.bucket, "", loc.account), _options))


# ---- remote files --------------------------------------------------------------------------------

class _Pages:
    """Which pages of a mapping hold fetched bytes: sorted, disjoint [start, end) page runs."""

    def __init__(self):
        self.starts, self.ends = [], []

    def missing(self, lo: int, hi: int) -> list:
        """The runs of [lo, hi) not held."""
        out, at = [], lo
        i = bisect_right(self.starts, lo) - 1
        if i >= 0 and self.ends[i] > at:
            at = self.ends[i]
        i += 1
        while at < hi:
            if i < len(self.starts) and self.starts[i] < hi:
                if self.starts[i] > at:
                    out.append((at, self.starts[i]))
                at = max(at, self.ends[i])
                i += 1
            else:
                out.append((at, hi))
                break
        return out

    def add(self, lo: int, hi: int):
        self.remove(lo, hi)
        i = bisect_right(self.starts, lo)
        if i > 0 and self.ends[i - 1] == lo:
            lo = self.starts[i - 1]
            del self.starts[i - 1], self.ends[i - 1]
            i -= 1
        if i < len(self.starts) and self.starts[i] == hi:
            hi = self.ends[i]
            del self.starts[i], self.ends[i]
        self.starts.insert(i, lo)
        self.ends.insert(i, hi)

    def remove(self, lo: int, hi: int):
        keep_s, keep_e = [], []
        for s, e in zip(self.starts, self.ends):
            if e <= lo or s >= hi:
                keep_s.append(s)
                keep_e.append(e)
            else:
                if s < lo:
                    keep_s.append(s)
                    keep_e.append(lo)
                if e > hi:
                    keep_s.append(hi)
                    keep_e.append(e)
        self.starts, self.ends = keep_s, keep_e


class RemoteFile:
    """An object read by ranged GETs, behind MappedFile's interface (io/mapped.py)."""

    remote = True

    def __init__(self, url: str):
        from .objects import SourceObject
        loc = _location(url)
        self.path = url
        self._object = SourceObject.open(loc, _options, _store(loc))
        self.size = self._object.size
        self.identity = self._object.identity
        self._map = None
        self._view = None
        self._pages = _Pages()
        self._head = None   # the first HEAD bytes, once read
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RemoteFile({self.path!r}, size={self.size})"

    @property
    def view(self) -> memoryview:
        """The object's bytes as a read-only view; only ranges `need` fetched hold them."""
        if self._view is None:
            with self._lock:
                if self._view is None:
                    if self.size:
                        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
                        self._map = mmap.mmap(-1, self.size, flags=flags)
                        self._view = memoryview(self._map).toreadonly()
                    else:
                        self._view = memoryview(b"")
        return self._view

    def need(self, offset: int, length: int):
        """Fetch [offset, offset+length) into `view` (whole pages), unless already there."""
        if length <= 0:
            return
        self.check(offset, length, "a read")
        self.view
        lo, hi = offset - offset % _PAGE, min(self.size, -(-(offset + length) // _PAGE) * _PAGE)
        with self._lock:
            for a, b in self._pages.missing(lo, hi):
                at = a
                for piece in self._object.stream([(a, b - a)]):
                    n = len(piece.data)
                    self._map[at:at + n] = piece.data
                    at += n
                self._pages.add(a, b)

    def read(self, offset: int, length: int) -> bytes:
        """`length` bytes at `offset`, fetched (held ranges are copied from `view`)."""
        self.check(offset, length, "a read")
        if not length:
            return b""
        if offset + length <= HEAD:   # (detection: every reader looks at the first bytes)
            if self._head is None:
                self._head = self._object.read(0, min(HEAD, self.size))
            return self._head[offset:offset + length]
        held = self._held(offset, length)
        return held if held is not None else self._object.read(offset, length)

    def _held(self, offset: int, length: int):
        """The bytes of [offset, offset+length) copied from `view` if `need` fetched them all, else None."""
        with self._lock:
            held = self._view is not None and not self._pages.missing(
                offset - offset % _PAGE, min(self.size, -(-(offset + length) // _PAGE) * _PAGE))
            return bytes(self._view[offset:offset + length]) if held else None

    def read_many(self, ranges):
        """The bytes of each (offset, length) of `ranges`, in order (files.read_ranges): copied from
        `view` where `need` fetched them, else by the object's stream (concurrent GETs, nearby
        ranges sharing one), not kept in `view`."""
        queue, fetching, numbers = deque(), {}, itertools.count()   # [bytes, bytes to come]; stream index -> one

        def planned():
            for offset, length in ranges:
                self.check(offset, length, "a read")
                held = self._held(offset, length) if length else b""
                entry = [held, 0] if held is not None else [None, length]   # (filled when its bytes come)
                queue.append(entry)
                if held is None:
                    fetching[next(numbers)] = entry
                    yield offset, length

        for piece in self._object.stream(planned()):
            entry = fetching[piece.index]
            if entry[0] is None:
                entry[0] = bytearray(entry[1])
            entry[0][piece.offset:piece.offset + len(piece.data)] = piece.data
            entry[1] -= len(piece.data)
            if not entry[1]:
                del fetching[piece.index]
            while queue and not queue[0][1]:
                yield queue.popleft()[0]
        while queue:   # (what is left was held: nothing more to fetch)
            yield queue.popleft()[0]

    @contextlib.contextmanager
    def reader(self):
        """`fill_at(view, offset)`: the object's bytes from `offset` into `view`, from the read-ahead
        window where `will_need` named them, else fetched now."""
        yield self._fill_at

    def _fill_at(self, view, offset):
        self.check(offset, len(view), "a read")
        _Window.get().fill(self, view, offset)

    def check(self, offset: int, length: int, what: str):
        if offset < 0 or length < 0 or offset + length > self.size:
            raise BadInput(f"{shown(self.path)}: {what} needs bytes {offset}..{offset + length} "
                           f"but the object has {self.size} bytes (truncated or corrupt)")

    def will_need(self, offset: int, length: int):
        """The writer will read [offset, offset+length) next: fetch it ahead, in the window."""
        if length > 0:
            _Window.get().ahead(self, offset, length)

    def populate(self, offset: int, length: int):
        self.need(offset, length)

    def release(self, offset: int, length: int):
        """Give back the fetched pages of [offset, offset+length) (whole pages: the page it starts in is
        fetched again when needed; the page it ends in is kept, unless the range ends the object, since
        the bytes after it may be read now: a digest's next chunk) and what the window holds of it."""
        if length <= 0:
            return
        _Window.get().drop(self, offset, offset + length)
        if self._map is None:
            return
        start = offset - offset % _PAGE
        end = min(self.size, offset + length)
        end_page = self.size if end >= self.size else end - end % _PAGE
        if end_page <= start:
            return
        with self._lock:
            if self._pages.starts:
                self._pages.remove(start, end_page)
                with contextlib.suppress(OSError, ValueError):
                    self._map.madvise(mmap.MADV_DONTNEED, start, end_page - start)

    def advise(self, advice: int, offset: int = 0, length=None):
        pass

    hits = 0

    def unchanged(self) -> bool:
        """The object is still the one first read (same ETag and size)."""
        from .objects import SourceObject
        try:
            now = SourceObject.open(self._object.location, _options, self._object.store)
        except BadInput:
            return False
        return now.identity == self.identity


@dataclass
class _Part:
    file: RemoteFile
    start: int
    end: int
    future: object


class _Window:
    """The read-ahead of every remote file of the process: ranges a writer named (`ahead`), fetched
    `part_size` at a time, at most `concurrency` parts fetched or held at once. A `fill` the window
    holds is served from it; one it does not is fetched at once (never waiting for a slot, so a
    writer never waits on parts only it would consume)."""

    _one = None
    _guard = threading.Lock()

    def __init__(self, opts: StorageOptions):
        self.part_size, self.slots = opts.part_size, opts.concurrency
        self._pool = ThreadPoolExecutor(opts.concurrency, thread_name_prefix="ckptconv-ahead")
        self._parts = deque()    # _Part, in the order named
        self._wanted = deque()   # [file, start, end] not yet started
        self._lock = threading.Lock()

    @classmethod
    def get(cls) -> "_Window":
        with cls._guard:
            if cls._one is None:
                cls._one = _Window(_options)
            return cls._one

    @classmethod
    def reset(cls):
        with cls._guard:
            one, cls._one = cls._one, None
        if one is not None:
            one._pool.shutdown(wait=False, cancel_futures=True)

    def ahead(self, file: RemoteFile, offset: int, length: int):
        """Want [offset, offset+length) of `file` next. A range already wanted or in the window is not
        asked twice; one that starts at most GAP after the last one wanted of the same file joins it
        (a zip's tensors lie between small local headers: one GET of `part_size` serves several).
        Parts are started when a `fill` comes (every range a shard names is known by then)."""
        end = offset + length
        with self._lock:
            # (a writer names the tensor it reads now: at the window's head, among the parts or the first
            # ranges wanted; looking no further keeps a shard of a million names linear)
            near = itertools.islice(self._wanted, 4)
            if any(p.file is file and p.start <= offset and end <= p.end for p in self._parts) or \
                    any(w[0] is file and w[1] <= offset and end <= w[2] for w in near):
                return
            last = self._wanted[-1] if self._wanted else None
            if last is not None and last[0] is file and 0 <= offset - last[2] <= GAP:
                last[2] = max(last[2], end)
            else:
                self._wanted.append([file, offset, end])

    def _top_up(self):
        while len(self._parts) < self.slots and self._wanted:
            w = self._wanted[0]
            file, start = w[0], w[1]
            end = min(w[2], start + self.part_size)
            w[1] = end
            if w[1] >= w[2]:
                self._wanted.popleft()
            self._parts.append(_Part(file, start, end, self._pool.submit(file._object._fetch, start, end)))

    def drop(self, file: RemoteFile, lo: int, hi: int):
        """Forget what is held or wanted of [lo, hi) of `file` (its tensor was written)."""
        with self._lock:
            kept = deque()
            for p in self._parts:
                if p.file is file and lo <= p.start and p.end <= hi:
                    p.future.cancel()
                else:
                    kept.append(p)
            self._parts = kept
            wanted = deque()
            for w in self._wanted:
                if w[0] is file and w[1] < hi and w[2] > lo:
                    if w[1] < lo:
                        wanted.append([file, w[1], lo])
                    if w[2] > hi:
                        wanted.append([file, hi, w[2]])
                else:
                    wanted.append(w)
            self._wanted = wanted
            self._top_up()

    def fill(self, file: RemoteFile, view, offset: int):
        with self._lock:
            self._top_up()
        got, n = 0, len(view)
        while got < n:
            at = offset + got
            with self._lock:
                part = next((p for p in self._parts if p.file is file and p.start <= at < p.end), None)
                if part is not None:   # parts of this file named before it were not read: let them go
                    for p in [p for p in self._parts if p.file is file and p.end <= at]:
                        p.future.cancel()
                        self._parts.remove(p)
            if part is None:
                take = min(n - got, self.part_size)
                view[got:got + take] = memoryview(file._object._fetch(at, at + take))
                got += take
                continue
            data = part.future.result()
            take = min(n - got, part.end - at)
            view[got:got + take] = memoryview(data)[at - part.start:at - part.start + take]
            got += take
            if at + take >= part.end:   # used up: its slot goes to the next part wanted
                with self._lock:
                    with contextlib.suppress(ValueError):
                        self._parts.remove(part)
                    self._top_up()


# ---- paths ---------------------------------------------------------------------------------------

class RemotePath:
    """A URL with the part of pathlib.Path's interface readers use (`/`, name, parent, suffix, stem,
    is_dir, is_file, exists, iterdir, stat().st_size), answered from the listings above."""

    __slots__ = ("_url",)

    def __init__(self, url):
        self._url = str(url).rstrip("/")

    def __fspath__(self) -> str:
        return self._url

    def __str__(self) -> str:
        return self._url

    def __repr__(self) -> str:
        return f"RemotePath({self._url!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, RemotePath) and realpath(self._url) == realpath(other._url)

    def __hash__(self) -> int:
        return hash(realpath(self._url))

    def __lt__(self, other) -> bool:
        return str(self) < str(other)

    def __truediv__(self, name) -> "RemotePath":
        return RemotePath(join(self._url, os.fspath(name)))

    @property
    def name(self) -> str:
        return name(self._url)

    @property
    def parent(self) -> "RemotePath":
        return RemotePath(parent(self._url))

    @property
    def suffix(self) -> str:
        return Path(self.name).suffix

    @property
    def suffixes(self) -> list:
        return Path(self.name).suffixes

    @property
    def stem(self) -> str:
        return Path(self.name).stem

    @property
    def parts(self) -> tuple:
        return tuple(self._url.split("/"))

    def with_name(self, n: str) -> "RemotePath":
        return self.parent / n

    def with_suffix(self, suffix: str) -> "RemotePath":
        return self.parent / Path(self.name).with_suffix(suffix).name

    def is_dir(self) -> bool:
        return is_dir(self._url)

    def is_file(self) -> bool:
        return is_file(self._url)

    def exists(self) -> bool:
        return exists(self._url)

    def is_symlink(self) -> bool:
        return False

    def resolve(self, strict: bool = False) -> "RemotePath":
        return RemotePath(realpath(self._url))

    def absolute(self) -> "RemotePath":
        return self

    def glob(self, pattern: str):
        """The names here matching `pattern` (one level: no "/" nor "**")."""
        import fnmatch
        for n in listdir(self._url):
            if fnmatch.fnmatchcase(n, pattern):
                yield self / n

    def iterdir(self):
        for n in listdir(self._url):
            yield self / n

    def relative_to(self, other) -> Path:
        base = realpath(os.fspath(other)) + "/"
        mine = realpath(self._url)
        if not mine.startswith(base):
            raise ValueError(f"{self._url} is not under {other}")
        return Path(mine[len(base):])

    def stat(self):
        return stat(self._url)


def place(path):
    """`path` as a Path: a pathlib.Path for a local path, a RemotePath for a URL."""
    if isinstance(path, (Path, RemotePath)):
        return path
    path = os.fspath(path)
    return RemotePath(path) if is_url(path) else Path(path)


def head(path, n: int) -> bytes:
    """The first `n` bytes of a file or object (fewer if it is shorter); b"" when a local file cannot
    be read. An object that cannot be read is BadInput (the store's failure, in one line)."""
    path = os.fspath(path)
    if is_url(path):
        f = open_file(path)
        return f.read(0, min(n, f.size))
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError:
        return b""


def stat(path) -> os.stat_result:
    """os.stat of a local path (links followed); for an object, a regular file of its size (OSError
    ENOENT when there is none)."""
    path = os.fspath(path)
    if not is_url(path):
        return os.stat(path)
    if not is_file(path):
        import errno
        raise FileNotFoundError(errno.ENOENT, "No such object")
    return os.stat_result((0o100444, 0, 0, 1, 0, 0, size(path), 0, 0, 0))


def fingerprint(path) -> str:
    """What changes when the file at `path` is written or replaced: a local file's device, inode,
    size, modification and change times; an object's ETag and size (--resume's source identity)."""
    path = os.fspath(path)
    if is_url(path):
        if not is_file(path) and is_dir(path):   # a prefix: what it holds, by name and size
            import hashlib
            listed = "\n".join(f"{e.name}/{int(e.is_dir)}/{e.size}" for e in entries(path))
            return "prefix:" + hashlib.sha256(listed.encode()).hexdigest()
        ident = open_file(path).identity
        return f"{ident.etag}:{ident.size}"
    st = os.stat(path)
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def load_json(path, what: str = "JSON", limit: int = 1 << 30):
    """A small JSON file or object (a config, an index), parsed by safejson (bounded depth and size)."""
    from .. import safejson
    return safejson.loads(read_bytes(path, what, limit), os.fspath(path), what)


# ---- an output's own files (verify, --resume, files carried into OUT) -------------------------------

_REGULAR, _DIRECTORY = 0o100444, 0o040555


def _stat(mode: int, n: int) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, 0, 0, n, 0, 0, 0))


def scan(path) -> dict:
    """{name: its lstat} of every entry of a directory, links not followed (OSError when it cannot
    be listed); of a prefix, each object as a regular file of its size and each deeper prefix as a
    directory (BadInput when it cannot be listed)."""
    path = os.fspath(path)
    if is_url(path):
        found = _listing(path)
        out = {n: _stat(_DIRECTORY, 0) for n in found.dirs}
        out.update({n: _stat(_REGULAR, s) for n, s in found.files.items()})
        return out
    entries = {}
    with os.scandir(path) as it:
        for entry in it:
            try:
                entries[entry.name] = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
    return entries


def sha256(path, chunk: int = 16 << 20, progress=None):
    """The SHA-256 (hex) of a regular file, opened without following a link and without blocking on
    a FIFO; None when what is there is not a regular file. An object is read by ranged GETs (BadInput
    when it cannot be, or changes meanwhile)."""
    import hashlib
    path = os.fspath(path)
    h = hashlib.sha256()
    if is_url(path):
        f = open_file(path)
        for at in range(0, f.size, chunk):
            data = f.read(at, min(chunk, f.size - at))
            h.update(data)
            if progress is not None:
                progress(len(data))
        return h.hexdigest()
    from .. import safejson
    try:
        with safejson.open_regular(path, follow=False) as fd:
            while data := os.read(fd, chunk):
                h.update(data)
                if progress is not None:
                    progress(len(data))
            return h.hexdigest()
    except BadInput:
        return None


def same_file(a, b) -> bool:
    """Both regular files (no link followed) and one inode; two objects never are."""
    a, b = os.fspath(a), os.fspath(b)
    if is_url(a) or is_url(b):
        return False
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except OSError:
        return False
    import stat as st
    return st.S_ISREG(sa.st_mode) and st.S_ISREG(sb.st_mode) and (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def copy_file(src, open_dst, chunk: int = 16 << 20) -> tuple:
    """Copy the file or object `src` into what `open_dst(mode)` opens (a sink: `write`, `close`,
    `abandon`; `mode` the source's permission bits, never wider than 0o666): (its SHA-256 hex, its
    bytes). A local file is opened without following a link (one swapped in since it was checked is
    refused) and must be a regular file whose size and modification time do not change while it is
    read; an object is read by ranges as it was when opened (its ETag). BadInput otherwise."""
    import hashlib
    import stat as st
    h = hashlib.sha256()
    src = os.fspath(src)
    if is_url(src):
        remote = open_file(src)
        sink = open_dst(0o644)
        try:
            for at in range(0, remote.size, chunk):
                data = remote.read(at, min(chunk, remote.size - at))
                h.update(data)
                sink.write(data)
        except BaseException:
            sink.abandon()
            raise
        sink.close()
        return h.hexdigest(), remote.size
    try:
        fi = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise BadInput(f"{src}: cannot read: {e.strerror}") from None
    try:
        before = os.fstat(fi)
        if not st.S_ISREG(before.st_mode):
            raise BadInput(f"{src}: is no longer a regular file")
        sink = open_dst(before.st_mode & 0o666)
        try:
            left = before.st_size
            while left > 0 and (data := os.read(fi, min(chunk, left))):
                h.update(data)
                sink.write(data)
                left -= len(data)
        except BaseException:
            sink.abandon()
            raise
        sink.close()
        after = os.fstat(fi)
    finally:
        os.close(fi)
    if left or (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise BadInput(f"{src}: changed while it was being read; nothing was written")
    return h.hexdigest(), before.st_size


@contextlib.contextmanager
def library_path(path, limit: int = 100 * 1000 * 1000):
    """A local path where the safetensors library sees `path`'s header as the file holds it: `path`
    itself, or for an object a sparse temporary file of the object's size holding its first 8 bytes
    and the header they count (at most `limit`), the rest holes (nothing else fetched or written)."""
    path = os.fspath(path)
    if not is_url(path):
        yield path
        return
    import tempfile
    f = open_file(path)
    head = f.read(0, min(8, f.size))
    n = int.from_bytes(head, "little") if len(head) == 8 else 0
    head += f.read(8, min(n, limit, f.size - len(head))) if len(head) == 8 else b""
    with tempfile.NamedTemporaryFile(prefix="ckptconv-header-", suffix=".safetensors") as local:
        local.write(head)
        local.truncate(f.size)
        local.flush()
        yield local.name
