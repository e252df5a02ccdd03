"""SHA-256 everywhere it is needed, off the main thread (hashlib releases the GIL on large updates)."""
import hashlib
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import sha256
from .outfile import StagingPool
from .. import signals

CHUNK = 16 * 1024 * 1024
# A tensor this small is digested by the thread that has its bytes (hashlib, ~1 us for 64 bytes) and
# its bytes reach the file's digest with its neighbours': handing each to the hash threads costs about
# 100 us in futures and thread switches (docs/benchmarks.md, "Third pass").
SMALL = 64 * 1024
# The writer gathers small tensors' bytes up to this much before one push: every shard open at once
# holds that much (a reshard to 8 ranks has 8 open); a push of 4 MiB costs no more per byte than 16.
GATHERED = 4 * 1024 * 1024


class OrderedHasher:
    """A thread that applies updates in submission order; the caller keeps buffers alive until done."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sha256")

    def update_all(self, hs, data):
        return self._pool.submit(sha256.update_all, data, hs)

    def digest(self, h):
        return self._pool.submit(h.hexdigest)

    def close(self):
        self._pool.shutdown(wait=True)


def _cpu_binds() -> bool:
    """Fewer cores than a run with taps has busy threads (the writing thread and three digests):
    then the CPU binds, and two streams interleaved in one pass, though no faster than two threads
    where the rounds do not overlap, take fewer cycles (measured on a 2-core Intel Xeon without the
    overlap: 1.41 against 1.18 GB/s of digests; reshard --tp 8 of 2.1 GB used 6 % less CPU and ran
    3-4 % faster, docs/benchmarks.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return sha256.FAST and cores < 4   # (the cores this process may run on, not the machine's)


class HashLanes:
    """Where each kind of digest runs: the shard file's, a tensor's, and a tap (one more stream of the
    same bytes: a resharded tensor's global digest; `taps` says a run has them). Where the compiled
    streams overlap their rounds (sha256.INTERLEAVES) the file's and the tensor's share a thread, one
    interleaved pass, and the tap has its own (measured: 2.2 s against 2.3 s with all three on one
    thread, which uses 0.4 s less CPU); so do they with taps on a machine whose cores the threads
    outnumber (_cpu_binds); elsewhere each has a thread of its own (a CPU that does not overlap them:
    convert of 2.1 GB 2.8 s -> see docs/benchmarks.md). States come from `sha256.new()`."""

    def __init__(self, taps: bool = False):
        file = OrderedHasher()
        self._lanes = {"file": file, "tensor": file if sha256.INTERLEAVES or (taps and _cpu_binds()) else OrderedHasher(),
                       "tap": OrderedHasher()}

    def feed(self, data, file=None, tensor=None, tap=None) -> list:
        """Futures of `data` absorbed into each given state, in submission order per lane."""
        groups = {}
        for lane, h in (("file", file), ("tensor", tensor), ("tap", tap)):
            if h is not None:
                groups.setdefault(self._lanes[lane], []).append(h)
        return [hasher.update_all(hs, data) for hasher, hs in groups.items()]

    def digest(self, lane, h):
        """The future hex digest of `h`, after everything fed to it."""
        return self._lanes[lane].digest(h)

    def close(self):
        for hasher in set(self._lanes.values()):
            hasher.close()


class Digests:
    """Future digests in order, kept as their 32 bytes each once finished: a shard of a million
    small tensors must hold neither a million futures (each with its lock) nor a million hex strings
    until it closes. Which tensor each is, the caller knows by position (its plan, its header).
    Futures are swapped for their bytes, in order, as they finish; iterating waits for the rest and
    gives hex digests."""

    def __init__(self):
        self._done, self._pending = bytearray(), deque()

    def append(self, future):
        self._pending.append(future)
        while self._pending and (self._pending[0].__class__ is bytes or self._pending[0].done()):
            self._done += self._take()

    def append_done(self, digest: bytes):
        """A digest already computed (32 bytes), in its place among the futures."""
        if self._pending:
            self.append(digest)
        else:
            self._done += digest

    def _take(self) -> bytes:
        first = self._pending.popleft()
        return first if first.__class__ is bytes else bytes.fromhex(first.result())

    def _finish(self):
        while self._pending:
            self._done += self._take()

    def packed(self) -> bytearray:
        """Every digest's 32 bytes, in order, back to back (not copied: this Digests is done with)."""
        self._finish()
        return self._done

    def __len__(self):
        return len(self._done) // 32 + len(self._pending)

    def __iter__(self):
        self._finish()
        for k in range(0, len(self._done), 32):
            yield self._done[k:k + 32].hex()


class Pipeline:
    """Bytes go to their files through the shared staging pool (outfile.py) and are hashed there, by
    the HashLanes. At most `depth` chunks are in flight."""

    def __init__(self, depth=4, taps: bool = False):
        self.hashes = HashLanes(taps)
        self.staging = StagingPool()
        self.depth = depth
        self._inflight = deque()

    def push(self, fileobj, file_h, tensor_h, data, tap=None):
        """Copy `data` into `fileobj`'s staging buffers and hash it there; the caller may reuse or
        release `data` as soon as this returns."""
        data = np.frombuffer(memoryview(data).cast("B"), np.uint8)

        def copy(view, offset):
            np.copyto(np.frombuffer(view, np.uint8), data[offset:offset + len(view)])  # without the GIL

        self.push_range(fileobj, file_h, tensor_h, copy, 0, len(data), tap)

    def push_range(self, fileobj, file_h, tensor_h, fill_at, offset, n, tap=None, progress=None):
        """Bytes [offset, offset + n) of a source, put by `fill_at(view, offset)` straight into the
        file's staging buffers (a pread, a gather or a copy) and hashed there."""
        end = offset + n
        while offset < end:
            view, lease = fileobj.stage(lambda v, at=offset: fill_at(v, at), end - offset)
            futures = self.hashes.feed(view, file_h, tensor_h, tap)
            for f in futures:
                lease.hold_until(f)
            lease.let_go()
            self._inflight.append(futures)
            while len(self._inflight) >= self.depth:
                self.retire_one()
            offset += len(view)
            if progress:
                progress(len(view))
            signals.check()

    def drain(self):
        while self._inflight:
            self.retire_one()

    def retire_one(self):
        for f in self._inflight.popleft():
            f.result()

    def close(self):
        try:
            self.drain()
        finally:
            self.staging.close()
            self.hashes.close()


def write_all(fileobj, data):
    view = memoryview(data)
    while len(view):
        n = fileobj.write(view)
        view = view[n:]


def sha256_file(path, chunk=CHUNK, progress=None) -> str:
    """Digest a file with positional reads into one reused buffer (bounded memory, no mmap)."""
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        while True:
            n = os.preadv(fd, [view], offset)
            if n == 0:
                break
            h.update(view[:n])
            offset += n
            if progress is not None:
                progress(n)
    finally:
        os.close(fd)
    return h.hexdigest()
