"""Shard files written through aligned staging buffers, past the page cache (O_DIRECT).

A checkpoint's shards are written once and not read back soon. Buffered writes copy every byte into
freshly allocated page-cache pages, which on the machines we measured costs more CPU than the
hashing does (2.1 GB with dd: buffered 3.4-6.8 s, nearly all of it system time; O_DIRECT 1.5-1.8 s
with 0.6 s of system time), and that CPU is what the hash threads need.

Every byte of a shard passes through a staging buffer from a small pool shared by all open files
(memory does not grow with their number: reshard --tp 64 writes 64 side by side). A contiguous
source range is read straight into it (`stage`: pread, one kernel copy, nothing mapped) and hashed
there; other bytes are copied in (`write`). The aligned part of each buffer is written at its
offset by an I/O thread (the device is faster with several writes in flight); the unaligned rest
waits for the next bytes, and the file's tail goes through the page cache at close. A buffer
returns to the pool when its write and every hash reading it are done. A filesystem that refuses
O_DIRECT, at open or at a write, gets plain writes from the same buffers.
"""
import errno
import mmap
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import OutputError

ALIGN = 4096            # covers 512- and 4096-byte logical blocks


class StagingPool:
    """The staging buffers and I/O threads shared by every OutFile of one run."""

    def __init__(self, buffers=6, size=8 << 20, threads=3):
        self.size = size
        self._free = queue.Queue()
        for _ in range(buffers):
            self._free.put(np.frombuffer(mmap.mmap(-1, size), np.uint8))  # anonymous maps are page-aligned
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="write")

    def lease(self) -> "Lease":
        """A free buffer (waiting for one if all are in use), held once by the caller."""
        return Lease(self, self._free.get())

    def give(self, buffer):
        self._free.put(buffer)

    def submit(self, fn, *args):
        return self._threads.submit(fn, *args)

    def close(self):
        self._threads.shutdown(wait=True)


class Lease:
    """A staging buffer and how many are still using it; the last to let go returns it to the pool."""

    def __init__(self, pool, buffer):
        self.pool, self.buffer, self._users, self._lock = pool, buffer, 1, threading.Lock()

    def hold(self):
        with self._lock:
            self._users += 1

    def let_go(self, *_):
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last:
            self.pool.give(self.buffer)

    def hold_until(self, future):
        """Keep the buffer until `future` (a hash or a write reading it) is done."""
        self.hold()
        future.add_done_callback(self.let_go)


class OutFile:
    """A write-only file fed through the staging pool. Every failure is an OutputError naming the file."""

    def __init__(self, path, pool: StagingPool, direct=True):
        self.name, self.pool = os.fspath(path), pool
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW   # (never through a link)
        self.fd = None
        try:
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    self.fd = os.open(self.name, flags | os.O_DIRECT, 0o666)
                except OSError as e:
                    if e.errno != errno.EINVAL:  # EINVAL: this filesystem has no direct I/O
                        raise
            self.direct = self.fd is not None
            if self.fd is None:
                self.fd = os.open(self.name, flags, 0o666)
        except OSError as e:
            raise OutputError(f"{self.name}: cannot write: {e.strerror or e}") from None
        self._plain_fd = None if self.direct else self.fd  # for tails and refused direct writes
        self._plain_lock = threading.Lock()
        self._pos = 0           # file offset of the first byte not yet handed to a write
        self._carry = b""       # unaligned bytes waiting for more (fewer than ALIGN)
        self._pending = []
        self._failed = False    # after a failed write, close writes nothing more

    def stage(self, fill, n):
        """Put up to `n` next bytes of the file into a staging buffer — `fill(view)` fills `view` with
        them — and write them; returns (a view of those bytes, its Lease held once for the caller,
        who lets go when done reading the view). Fewer than `n` bytes when a buffer is full."""
        try:
            self._check_pending()
            lease = self.pool.lease()
            buf, carry = lease.buffer, len(self._carry)
            k = min(n, self.pool.size - carry)
            buf[:carry] = np.frombuffer(self._carry, np.uint8)
            view = memoryview(buf)[carry:carry + k]
            try:
                fill(view)
            except BaseException:
                lease.let_go()
                raise
            total = carry + k
            aligned = total - total % ALIGN if self.direct else total
            self._carry = bytes(buf[aligned:total])
            if aligned:
                lease.hold()
                write = self.pool.submit(self._pwrite, lease, aligned, self._pos)
                self._pending.append(write)
                self._pos += aligned
            return view, lease
        except OSError as e:
            self._failed = True
            raise OutputError(f"{self.name}: write failed: {e.strerror or e}") from None

    def _pwrite(self, lease, length, offset):
        try:
            view = memoryview(lease.buffer)[:length]
            done = 0
            try:
                while done < length:
                    done += os.pwrite(self.fd, view[done:], offset + done)
                    if self.direct and done % ALIGN:
                        break  # a short write left an unaligned rest: finish it through the page cache
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL):  # EINVAL: the device will not take these
                    raise
            if done < length:
                pwrite_all(self._plain(), view[done:], offset + done)
        finally:
            lease.let_go()

    def _plain(self) -> int:
        with self._plain_lock:
            if self._plain_fd is None:
                self._plain_fd = os.open(self.name, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            return self._plain_fd

    def _check_pending(self, wait=False):
        still = []
        for f in self._pending:
            if wait or f.done():
                f.result()
            else:
                still.append(f)
        self._pending = still

    def abandon(self):
        """Close without writing more (the run failed; its output is removed)."""
        self._failed = True
        self.close()

    def close(self, fsync=False):
        """Wait for the writes in flight, write the tail, then close."""
        if self.fd is None:
            return
        try:
            if not self._failed:
                self._check_pending(wait=True)
                if self._carry:
                    pwrite_all(self._plain(), memoryview(self._carry), self._pos)
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


def pwrite_all(fd, view, offset):
    """Write all of `view` at `offset` (pwrite may write less than asked)."""
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
