"""Memory-mapped input files: zero-copy views, bounds checks, and page release.

`ru_maxrss` counts every mapped page a process touched, so after a tensor is written its pages are
advised away (`release`); the kernel keeps them in the page cache, only our resident set shrinks.
"""
import contextlib
import errno
import mmap
import os
import sys
import stat

from .errors import BadInput

_PAGE = mmap.PAGESIZE
_NO_FD = {"trackfd": False} if sys.version_info >= (3, 13) else {}  # 3.13+: the map keeps no descriptor
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux's value; not named by Python 3.11


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
            self.stamp = (st.st_size, st.st_mtime_ns)
            self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ, **_NO_FD) if self.size else None
        except OSError as e:
            raise BadInput(f"{self.path}: cannot map: {e.strerror}{_hint(e)}") from None
        finally:
            os.close(fd)
        self.view = memoryview(self._map) if self._map is not None else memoryview(b"")

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
                    raise BadInput(f"{self.path}: ends at byte {offset + got}, before the data it promised "
                                   "(truncated while being read)")
                got += n

        try:
            yield fill_at
        finally:
            os.close(fd)

    def check(self, offset: int, length: int, what: str):
        """Refuse a region that does not lie inside the file (a truncated or lying file)."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise BadInput(f"{self.path}: {what} needs bytes {offset}..{offset + length} "
                           f"but the file has {self.size} bytes (truncated or corrupt)")

    def populate(self, offset: int, length: int):
        """Map [offset, offset+length) in now, in one call (MADV_POPULATE_READ, Linux 5.14+), so the
        thread that reads it next does not take the page faults; a no-op where unsupported."""
        if self._map is None or length <= 0:
            return
        start = offset - offset % _PAGE
        with contextlib.suppress(OSError):
            self._map.madvise(_MADV_POPULATE_READ, start, min(self.size, offset + length) - start)

    def release(self, offset: int, length: int):
        """Drop our mapping of [offset, offset+length) from RSS; later access faults it back in."""
        if self._map is None or length <= 0:
            return
        start = offset - offset % _PAGE
        end = min(self.size, offset + length)
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def unchanged(self) -> bool:
        st = os.stat(self.path)
        return (st.st_size, st.st_mtime_ns) == self.stamp


class MemoryFile(MappedFile):
    """Bytes that did not come from a mappable file (a decompressed DCP chunk), behind MappedFile's
    interface: tensors over it are views of this buffer."""

    def __init__(self, data: bytes, path: str):
        self.path, self.size, self.stamp = path, len(data), None
        self._map = None
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
