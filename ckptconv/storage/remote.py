"""An object-store location as a path, and an object as an open file, both bound to the bucket
session (bucket.py) that reaches them, so the options a job was given (its endpoint, concurrency,
part size, retries) go wherever its paths go.

`RemotePath` is a URL (a `str`: every string operation works on it) with the part of pathlib.Path's
interface readers use (`/`, name, parent, suffix, stem, is_dir, is_file, exists, iterdir, glob,
stat().st_size), answered by its session. Paths made from it (`/`, `parent`, files.join,
files.realpath) keep the session; a plain string does not, and the storage functions refuse a URL
given as one (files.place binds it).

`RemoteFile` is an object as it was when opened (its ETag and size: objects.py), behind
io/mapped.MappedFile's interface. Its `view` is an anonymous mapping the size of the object that
nothing fills until `need(offset, length)` fetches the range; `release` gives those pages back and
forgets them. Tensor bytes a writer copies whole (`reader`) come from the session's read-ahead window
(window.py): `will_need` names the ranges a writer will read next.
"""
import contextlib
import mmap
import os
import threading
from bisect import bisect_right
from collections import deque
from pathlib import Path

from ..errors import BadInput
from .urls import parse, redact

_PAGE = mmap.PAGESIZE
HEAD = 4096   # an object's first bytes, read once and kept (the readers' detection looks there)


class RemotePath(str):
    """A URL bound to its bucket session (see the module docstring)."""

    def __new__(cls, url, session):
        self = super().__new__(cls, str(parse(str(url))).rstrip("/"))
        self.session = session
        return self

    def __reduce__(self):   # (a session holds threads and connections: what crosses processes is the URL)
        return str, (str(self),)

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __fspath__(self) -> str:
        return str(self)

    def __truediv__(self, name) -> "RemotePath":
        return self.child(os.fspath(name))

    def child(self, *names) -> "RemotePath":
        out = str(self)
        for n in names:
            out = f"{out}/{n.strip('/')}" if n else out
        return RemotePath(out, self.session)

    @property
    def name(self) -> str:
        return self.rpartition("/")[2] if parse(self).key else ""

    @property
    def parent(self) -> "RemotePath":
        loc = parse(self)
        if not loc.key:
            return self
        return RemotePath(str(type(loc)(loc.scheme, loc.bucket, loc.key.rpartition("/")[0], loc.account)), self.session)

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
        return tuple(self.split("/"))

    def with_name(self, n: str) -> "RemotePath":
        return self.parent / n

    def with_suffix(self, suffix: str) -> "RemotePath":
        return self.parent / Path(self.name).with_suffix(suffix).name

    def is_dir(self) -> bool:
        return self.session.is_dir(self)

    def is_file(self) -> bool:
        return self.session.is_file(self)

    def exists(self) -> bool:
        return self.session.exists(self)

    def is_symlink(self) -> bool:
        return False

    def resolve(self, strict: bool = False) -> "RemotePath":
        return self

    def absolute(self) -> "RemotePath":
        return self

    def glob(self, pattern: str):
        """The names here matching `pattern` (one level: no "/" nor "**")."""
        import fnmatch
        for e in self.session.entries(self):
            if fnmatch.fnmatchcase(e.name, pattern):
                yield self / e.name

    def iterdir(self):
        for e in self.session.entries(self):
            yield self / e.name

    def relative_to(self, other) -> Path:
        base = str(other).rstrip("/") + "/"
        if not self.startswith(base):
            raise ValueError(f"{self} is not under {other}")
        return Path(self[len(base):])

    def stat(self):
        return self.session.stat(self)


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
    """An object read by ranged GETs, behind MappedFile's interface (io/mapped.py), through `session`."""

    remote = True
    hits = 0

    def __init__(self, path: RemotePath, source):
        """`source`: the objects.SourceObject the session opened (its identity is this file's)."""
        self.path = path
        self.session = path.session
        self.source = source
        self.size = source.size
        self.identity = source.identity
        self._map = None
        self._view = None
        self._pages = _Pages()
        self._head = None   # the first HEAD bytes, once read
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RemoteFile({str(self.path)!r}, size={self.size})"

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
                for piece in self.source.stream([(a, b - a)]):
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
                self._head = self.source.read(0, min(HEAD, self.size))
            return self._head[offset:offset + length]
        held = self._held(offset, length)
        return held if held is not None else self.source.read(offset, length)

    def _held(self, offset: int, length: int):
        """The bytes of [offset, offset+length) copied from `view` if `need` fetched them all, else None."""
        with self._lock:
            held = self._view is not None and not self._pages.missing(
                offset - offset % _PAGE, min(self.size, -(-(offset + length) // _PAGE) * _PAGE))
            return bytes(self._view[offset:offset + length]) if held else None

    def buffer(self, offset: int, length: int):
        """[offset, offset+length), clamped to the object as a slice is, fetched now (files.buffer)."""
        offset = min(max(offset, 0), self.size)
        return self.read(offset, max(0, min(length, self.size - offset)))

    def read_many(self, ranges):
        """The bytes of each (offset, length) of `ranges`, in order (files.read_ranges): copied from
        `view` where `need` fetched them, else by the object's stream (concurrent GETs, nearby ranges
        sharing one), not kept in `view`."""
        pending = deque()   # (held bytes, or None: the next one the stream gives) in order

        def fetched():
            for offset, length in ranges:
                self.check(offset, length, "a read")
                held = self._held(offset, length) if length else b""
                pending.append(held)
                if held is None:
                    yield offset, length
        pieces = self.source.stream(fetched())
        for piece in _whole(pieces):
            while pending and pending[0] is not None:
                yield pending.popleft()
            pending.popleft()
            yield piece
        while pending:
            yield pending.popleft()

    def pieces(self, offset: int, length: int, piece: int):
        """[offset, offset+length) front to back, `piece` bytes at a time (files.pieces)."""
        self.check(offset, length, "a read")
        steps = ((at, min(piece, offset + length - at)) for at in range(offset, offset + length, piece))
        for data in _whole(self.source.stream(steps)):
            yield data

    @contextlib.contextmanager
    def reader(self):
        """`fill_at(view, offset)`: the object's bytes from `offset` into `view`, from the session's
        read-ahead window where `will_need` named them, else fetched now."""
        yield self._fill_at

    def _fill_at(self, view, offset):
        self.check(offset, len(view), "a read")
        self.session.window().fill(self.source, view, offset)

    def check(self, offset: int, length: int, what: str):
        if offset < 0 or length < 0 or offset + length > self.size:
            raise BadInput(f"{redact(self.path)}: {what} needs bytes {offset}..{offset + length} "
                           f"but the object has {self.size} bytes (truncated or corrupt)")

    def will_need(self, offset: int, length: int):
        """The writer will read [offset, offset+length) next: fetch it ahead, in the window."""
        if length > 0:
            self.session.window().ahead(self.source, offset, length)

    def populate(self, offset: int, length: int):
        self.need(offset, length)

    def release(self, offset: int, length: int):
        """Give back the fetched pages of [offset, offset+length) (whole pages: the page it starts in is
        fetched again when needed; the page it ends in is kept, unless the range ends the object, since
        the bytes after it may be read now: a digest's next chunk) and what the window holds of it."""
        if length <= 0:
            return
        self.session.window().drop(self.source, offset, offset + length)
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

    def unchanged(self) -> bool:
        """The object is still the one first read (same ETag and size)."""
        return self.session.identity_now(self.path) == self.identity


def _whole(pieces):
    """The bytes of each range a stream of Pieces gives, whole, in order."""
    parts, index = [], None
    for p in pieces:
        if p.index != index and parts:
            yield parts[0] if len(parts) == 1 else bytearray().join(parts)
            parts = []
        index = p.index
        parts.append(p.data)
    if parts:
        yield parts[0] if len(parts) == 1 else bytearray().join(parts)
