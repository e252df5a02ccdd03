"""SHA-256 everywhere it is needed, off the main thread (hashlib releases the GIL on large updates)."""
import hashlib
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from .outfile import DirectIO

CHUNK = 16 * 1024 * 1024


class OrderedHasher:
    """A thread that applies `update`s in submission order; the caller keeps buffers alive until done."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sha256")

    def update(self, h, data):
        return self._pool.submit(h.update, data)

    def digest(self, h):
        return self._pool.submit(h.hexdigest)

    def close(self):
        self._pool.shutdown(wait=True)


class Pipeline:
    """Write chunks to their files while threads hash them (the file's hash, one tensor's, and a tap);
    `io` is the staging pool and I/O threads of the files written with O_DIRECT."""

    def __init__(self, depth=4):
        self.file_hasher, self.tensor_hasher, self.tap_hasher = OrderedHasher(), OrderedHasher(), OrderedHasher()
        self.io = DirectIO()
        self.depth = depth
        self._inflight = deque()

    def push(self, fileobj, file_h, tensor_h, data, done=None, tap=None):
        """Hash `data` in the background (the file's hash, the tensor's, and `tap`, one more fed with
        the same bytes: a resharded tensor's global digest) and hand it to `fileobj`; `done()` runs
        once the hashes are done with it."""
        futures = [self.file_hasher.update(file_h, data)]
        if tensor_h is not None:
            futures.append(self.tensor_hasher.update(tensor_h, data))
        if tap is not None:
            futures.append(self.tap_hasher.update(tap, data))
        fileobj.write(data)
        self._inflight.append((futures, done))
        while len(self._inflight) >= self.depth:
            self.retire_one()

    def drain(self):
        while self._inflight:
            self.retire_one()

    def retire_one(self):
        futures, done = self._inflight.popleft()
        for f in futures:
            f.result()
        if done is not None:
            done()

    def close(self):
        try:
            self.drain()
        finally:
            self.io.close()
            for hasher in (self.file_hasher, self.tensor_hasher, self.tap_hasher):
                hasher.close()


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
