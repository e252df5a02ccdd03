"""Decompressed bytes kept off the heap: an unlinked temporary file they are streamed into, each
extent starting where a mapping can start, and mapped back read-only, its pages released as they
are read. The DCP reader's zstd items and the numpy reader's deflated .npz members use it."""
import mmap
import tempfile

from ..errors import OutputError
from .mapped import MemoryFile
from .outfile import pwrite_all


class Spilled(MemoryFile):
    """One extent of a spill file, mapped read-only. Its pages are the kernel's page cache (clean,
    file-backed); `release` drops them from our RSS."""

    def __init__(self, mm, path):
        super().__init__(mm, path)
        self._mm = mm

    def release(self, offset: int, length: int):
        start = offset - offset % mmap.PAGESIZE
        end = min(self.size, offset + length)
        if end > start:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)


class SpillFile:
    """The temporary file, made on first use. `what` names its contents in the one-line errors
    ("inflated zstd chunks"); `prefix` its name while it exists."""

    def __init__(self, prefix: str, what: str):
        self.prefix, self.what, self.file, self.end = prefix, what, None, 0

    def begin(self) -> int:
        """Where the next extent starts (the file made if it is not yet)."""
        if self.file is None:
            try:
                self.file = tempfile.TemporaryFile(prefix=self.prefix)
            except OSError as e:
                raise OutputError(f"{tempfile.gettempdir()}: cannot create a temporary file for {self.what}: "
                                  f"{e.strerror} (set TMPDIR)") from None
        return -(-self.end // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY

    def write(self, piece, at: int):
        """`piece` at `at` (OSError is the caller's to name)."""
        pwrite_all(self.file.fileno(), memoryview(piece), at)

    def done(self, start: int, size: int):
        """The extent that began at `start` holds `size` bytes; the next begins after it."""
        self.end = start + size

    def map(self, start: int, size: int, path: str) -> Spilled:
        try:
            mm = mmap.mmap(self.file.fileno(), size, access=mmap.ACCESS_READ, offset=start)
        except OSError as e:
            raise OutputError(f"{path}: cannot map the inflated bytes: {e.strerror}") from None
        return Spilled(mm, path)
