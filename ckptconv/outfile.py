"""Shard files written past the page cache (O_DIRECT), several writes in flight.

A checkpoint's shards are written once and not read back soon. Buffered writes copy every byte into
freshly allocated page-cache pages, which on the machines we measured costs more CPU than the
hashing does (2.1 GB with dd: buffered 3.4-6.8 s, nearly all of it system time; O_DIRECT 1.5-1.8 s
with 0.6 s of system time), and that CPU is what the hash threads need. O_DIRECT wants block-aligned
file offsets, lengths and memory, so bytes are copied into aligned staging buffers from a small
shared pool and written at their offsets by I/O threads (the device is faster with more than one
write in flight); a piece's unaligned last bytes wait for the next piece, and the file's tail goes
through the page cache when it is closed. A filesystem that refuses O_DIRECT, at open or at a write,
gets plain buffered writes. Memory is the pool's, however many files are open (reshard --tp 64
writes 64 side by side).
"""
import errno
import mmap
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .errors import OutputError

ALIGN = 4096            # covers 512- and 4096-byte logical blocks


class DirectIO:
    """The staging pool and I/O threads shared by every OutFile of one run."""

    def __init__(self, buffers=6, size=8 << 20, threads=3):
        self.size = size
        self._free = queue.Queue()
        for _ in range(buffers):
            self._free.put(np.frombuffer(mmap.mmap(-1, size), np.uint8))  # anonymous maps are page-aligned
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="write")

    def take(self) -> np.ndarray:
        return self._free.get()

    def submit(self, fn, buffer, *args):
        """Run fn(buffer, *args) on an I/O thread; the buffer returns to the pool afterwards."""
        def run():
            try:
                fn(buffer, *args)
            finally:
                self._free.put(buffer)
        return self._threads.submit(run)

    def close(self):
        self._threads.shutdown(wait=True)


class OutFile:
    """A write-only file; `write` takes any bytes-like object. Every failure is an OutputError
    naming the file. With `io` None (or no O_DIRECT here) writes are plain and synchronous."""

    def __init__(self, path, io: DirectIO = None):
        self.name = os.fspath(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        self.fd = None
        try:
            if io is not None and hasattr(os, "O_DIRECT"):
                try:
                    self.fd = os.open(self.name, flags | os.O_DIRECT, 0o666)
                except OSError as e:
                    if e.errno != errno.EINVAL:  # EINVAL: this filesystem has no direct I/O
                        raise
            self.io = io if self.fd is not None else None
            if self.fd is None:
                self.fd = os.open(self.name, flags, 0o666)
        except OSError as e:
            raise OutputError(f"{self.name}: cannot write: {e.strerror or e}") from None
        self._plain_fd = None if self.io else self.fd  # for tails and refused direct writes
        self._plain_lock = threading.Lock()
        self._pos = 0           # file offset of the first byte not yet handed to a write
        self._carry = b""       # unaligned bytes waiting for more (fewer than ALIGN)
        self._pending = []
        self._failed = False    # after a failed write, close writes nothing more

    def fileno(self):
        return self.fd

    def write(self, data):
        try:
            self._write(memoryview(data).cast("B"))
        except OSError as e:
            self._failed = True
            raise OutputError(f"{self.name}: write failed: {e.strerror or e}") from None

    def _write(self, data):
        if self.io is None:
            _write_all(self.fd, data)
            return
        self._check_pending()
        carry, self._carry = self._carry, b""
        while len(carry) + len(data) >= ALIGN:
            buf = self.io.take()
            n = min(len(data), self.io.size - len(carry))
            total = len(carry) + n
            aligned = total - total % ALIGN  # at least ALIGN, so more than the carry
            buf[:len(carry)] = np.frombuffer(carry, np.uint8)
            np.copyto(buf[len(carry):aligned], np.frombuffer(data[:aligned - len(carry)], np.uint8))
            self._pending.append(self.io.submit(self._pwrite, buf, aligned, self._pos))
            self._pos += aligned
            data = data[aligned - len(carry):]
            carry = b""
        self._carry = bytes(carry) + bytes(data)

    def _pwrite(self, buf, length, offset):
        view = memoryview(buf)[:length]
        done = 0
        try:
            while done < length:
                done += os.pwrite(self.fd, view[done:], offset + done)
                if done % ALIGN:
                    break  # a short write left an unaligned rest: finish it through the page cache
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: these bytes cannot go direct; write them plainly
                raise
        if done < length:
            _pwrite_all(self._plain(), view[done:], offset + done)

    def _plain(self) -> int:
        with self._plain_lock:
            if self._plain_fd is None:
                self._plain_fd = os.open(self.name, os.O_WRONLY | os.O_CLOEXEC)
            return self._plain_fd

    def _check_pending(self, wait=False):
        still = []
        for f in self._pending:
            if wait or f.done():
                f.result()
            else:
                still.append(f)
        self._pending = still

    def close(self, fsync=False):
        """Wait for the writes in flight, write the tail, then close."""
        if self.fd is None:
            return
        try:
            if not self._failed:
                self._check_pending(wait=True)
                if self._carry:
                    _pwrite_all(self._plain(), memoryview(self._carry), self._pos)
                if fsync:
                    for fd in {self.fd, self._plain_fd} - {None}:
                        os.fsync(fd)
        except OSError as e:
            raise OutputError(f"{self.name}: write failed: {e.strerror or e}") from None
        finally:
            for f in self._pending:
                f.exception()  # let every write finish before the descriptors go
            self._pending = []
            for fd in {self.fd, self._plain_fd} - {None}:
                os.close(fd)
            self.fd = self._plain_fd = None


def _write_all(fd, view):
    while len(view):
        view = view[os.write(fd, view):]


def _pwrite_all(fd, view, offset):
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
