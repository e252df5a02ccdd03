"""Memory-mapped input files: zero-copy views, bounds checks, and page release.

`ru_maxrss` counts every mapped page a process touched, so after a tensor is written its pages are
advised away (`release`); the kernel keeps them in the page cache, only our resident set shrinks.

A file truncated by another process while it is mapped would kill us with SIGBUS at the first
page past its new end (no message, temporary output left behind). With the compiled guard
(`_mapguard.c`, `GUARDED`), every mapping is registered, such a page reads as zeros instead and
the hit is recorded: `unchanged()` is then False and `changed_files()` names the file, so the run
stops with "changed while it was being read" and the atomic output is cleaned up. We read a
mapping only through its Guard (`view`), which holds the mapping until the last view is gone and
unregisters it before letting it go, so a registered range is always still this file's mapping.
"""
import contextlib
import errno
import mmap
import os
import sys
import stat

from ..errors import BadInput

try:
    from .. import _mapguard
except ImportError:  # built without a compiler (or not on Linux): unguarded, as before
    _mapguard = None

GUARDED = _mapguard is not None

_PAGE = mmap.PAGESIZE
_NO_FD = {"trackfd": False} if sys.version_info >= (3, 13) else {}  # 3.13+: the map keeps no descriptor
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux's value; not named by Python 3.11
# The advice a reader gives `advise` (readers reach no mmap themselves: tests/test_storage_room.py)
RANDOM, SEQUENTIAL = mmap.MADV_RANDOM, mmap.MADV_SEQUENTIAL


def _identity(st) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _guard(mapping, path):
    """The mapping's SIGBUS guard, or None: unguarded without the compiled module, or when its table
    is full (65,536 mappings at once) — the file is then read exactly as it was before the guard."""
    if _mapguard is None or mapping is None:
        return None
    try:
        return _mapguard.Guard(mapping, path)
    except (OverflowError, OSError):
        return None


def changed_files() -> list:
    """Paths of mapped files that lost pages while we read them (the guard answered with zeros), in
    this process: mappings still open and those released since `forget_changes()`. Whatever a
    reader made of those zeros (a wrong digest, a bad opcode), the truth is that the file changed."""
    return sorted(set(_mapguard.changed())) if _mapguard is not None else []


def forget_changes():
    """Forget the released mappings that `changed_files()` reports (one command of several run in
    the same process starts clean)."""
    if _mapguard is not None:
        _mapguard.forget()


def _hint(e: OSError) -> str:
    return " (every mapped input holds a descriptor: raise `ulimit -n`)" if e.errno == errno.EMFILE else ""


class MappedFile:
    """A whole file mapped read-only. We keep no descriptor open, but before Python 3.13 the mmap
    object holds a duplicate of one while the file is mapped: a Grok-1 directory of several hosts
    maps thousands of files, so the CLI raises the soft limit on open files to the hard one."""

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            if not stat.S_ISREG(os.stat(self.path).st_mode):
                raise BadInput(f"{self.path}: not a regular file")
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise BadInput(f"{self.path}: cannot open: {e.strerror}{_hint(e)}") from None
        try:
            st = os.fstat(fd)
            self.size = st.st_size
            self.identity = _identity(st)
            self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ, **_NO_FD) if self.size else None
        except OSError as e:
            raise BadInput(f"{self.path}: cannot map: {e.strerror}{_hint(e)}") from None
        finally:
            os.close(fd)
        # The Guard takes the map's buffer and is what every view is made from, so the map is unmapped
        # only after the last view and the Guard are gone, and the Guard leaves the table first: its
        # slot, free for reuse, never covers an unmapped range another mapping could take later.
        # (mmap.close() would raise BufferError meanwhile; nothing here closes maps.)
        self._guard = _guard(self._map, self.path)
        through = self._guard if self._guard is not None else self._map  # the Guard re-exports the map
        self.view = memoryview(through) if through is not None else memoryview(b"")

    @contextlib.contextmanager
    def reader(self):
        """`fill_at(view, offset)`, filling `view` with the file's bytes from `offset` by pread: the
        kernel copies from the page cache, nothing is mapped (so nothing to release)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise BadInput(f"{self.path}: cannot open: {e.strerror}{_hint(e)}") from None

        def fill_at(view, offset):
            got = 0
            while got < len(view):
                try:
                    n = os.preadv(fd, [view[got:]], offset + got)
                except OSError as e:
                    raise BadInput(f"{self.path}: cannot read at byte {offset + got}: {e.strerror}") from None
                if n == 0:
                    # `check` held the range against the size at open: the file shrank since
                    raise BadInput(f"{self.path}: changed while it was being read (it now ends at byte "
                                   f"{offset + got}, before the data it promised)")
                got += n

        try:
            yield fill_at
        finally:
            os.close(fd)

    remote = False   # (storage/remote.py: a RemoteFile has the same interface)

    def buffer(self, offset: int, length: int):
        """[offset, offset+length), clamped as a slice is: a view of the mapping, nothing copied."""
        return self.view[offset:offset + length]

    def read_many(self, ranges):
        """The bytes of each (offset, length) of `ranges` (consumed lazily), in order, by pread:
        nothing mapped. Every range must lie inside the file (BadInput otherwise, when reached)."""
        with self.reader() as fill_at:
            for offset, length in ranges:
                self.check(offset, length, "a read")
                out = bytearray(length)
                fill_at(memoryview(out), offset)
                yield out

    def pieces(self, offset: int, length: int, piece: int):
        """[offset, offset+length) front to back, `piece` bytes at a time: views of the mapping."""
        self.check(offset, length, "a read")
        for at in range(offset, offset + length, piece):
            yield self.view[at:at + min(piece, offset + length - at)]

    def need(self, offset: int, length: int):
        """`view` holds [offset, offset+length) already: the mapping is the file (a RemoteFile
        fetches it here)."""

    def read(self, offset: int, length: int) -> bytes:
        """`length` bytes at `offset`, copied out of the mapping."""
        self.check(offset, length, "a read")
        return bytes(self.view[offset:offset + length])

    def check(self, offset: int, length: int, what: str):
        """Refuse a region that does not lie inside the file (a truncated or lying file)."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise BadInput(f"{self.path}: {what} needs bytes {offset}..{offset + length} "
                           f"but the file has {self.size} bytes (truncated or corrupt)")

    def populate(self, offset: int, length: int):
        """Map [offset, offset+length) in now, in one call (MADV_POPULATE_READ, Linux 5.14+), so the
        thread that reads it next does not take the page faults; a no-op where unsupported."""
        self._advise(_MADV_POPULATE_READ, offset, length)

    def will_need(self, offset: int, length: int):
        """Start reading [offset, offset+length) from the disk now, without waiting for it
        (MADV_WILLNEED: the kernel queues the reads and returns), so that whoever reads it next finds
        it in the page cache; a no-op where unsupported."""
        self._advise(mmap.MADV_WILLNEED, offset, length)

    def release(self, offset: int, length: int):
        """Drop our mapping of [offset, offset+length) from RSS; later access faults it back in."""
        if self._map is None or length <= 0:
            return
        start = offset - offset % _PAGE
        end = min(self.size, offset + length)
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def advise(self, advice: int, offset: int = 0, length: int | None = None):
        """How the kernel should read [offset, offset+length) (the whole file by default) when it is
        touched: `mmap.MADV_RANDOM`, only the page touched (a fault otherwise reads around it, as much
        as the disk's read-ahead: 8 MiB on some); `mmap.MADV_SEQUENTIAL`, ahead of it, never behind."""
        self._advise(advice, offset, self.size - offset if length is None else length)

    def _advise(self, advice: int, offset: int, length: int):
        """madvise [offset, offset+length), from its page, within the file; a no-op without a mapping
        or where the kernel does not know the advice."""
        if self._map is None or length <= 0:
            return
        start = offset - offset % _PAGE
        end = min(self.size, offset + length)
        if end > start:
            with contextlib.suppress(OSError):
                self._map.madvise(advice, start, end - start)

    @property
    def hits(self) -> int:
        """Faults the guard answered with zeros (pages gone from the file): it shrank under us."""
        return self._guard.hits if self._guard is not None else 0

    def unchanged(self) -> bool:
        """The path still names the file we mapped (device, inode, size, mtime, ctime: a file
        replaced by another of the same size and mtime is caught too) and no page of it vanished."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return _identity(st) == self.identity and self.hits == 0


class MemoryFile(MappedFile):
    """Bytes that did not come from a mappable file (a decompressed DCP chunk), behind MappedFile's
    interface: tensors over it are views of this buffer."""

    def __init__(self, data: bytes, path: str):
        self.path, self.size, self.identity = path, len(data), None
        self._map = self._guard = None
        self.view = memoryview(data)

    @contextlib.contextmanager
    def reader(self):
        def fill_at(view, offset):
            view[:] = self.view[offset:offset + len(view)]

        yield fill_at

    def release(self, offset: int, length: int):
        pass

    def unchanged(self) -> bool:
        return True
