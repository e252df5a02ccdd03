"""SHA-256 everywhere it is needed, off the main thread (hashlib releases the GIL on large updates)."""
import errno
import hashlib
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor

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
    """Write chunks to a file while two hashers digest them (the file's hash and one tensor's)."""

    def __init__(self, depth=4):
        self.file_hasher, self.tensor_hasher, self.tap_hasher = OrderedHasher(), OrderedHasher(), OrderedHasher()
        self.depth = depth
        self.kernel_copy = True
        self._inflight = deque()

    def _copy(self, copy_from, fileobj, data):
        fd, offset = copy_from
        done = 0
        try:
            while done < len(data):
                n = os.copy_file_range(fd, fileobj.fileno(), len(data) - done, offset + done)
                if n == 0:
                    raise OSError(errno.EIO, "source ended during copy")
                done += n
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                raise
            self.kernel_copy = False  # this filesystem pair cannot: write from our buffer instead
            write_all(fileobj, memoryview(data)[done:])

    def push(self, fileobj, file_h, tensor_h, data, done=None, copy_from=None, tap=None):
        """Hash `data` twice in the background and write it here; `done()` runs when it is free again.

        With `copy_from=(fd, offset)` naming where `data` came from, the kernel copies those bytes
        file to file (copy_file_range), which costs a third of a write from our buffer. `tap` is one
        more hash fed with the same bytes (a resharded tensor's global digest).
        """
        futures = [self.file_hasher.update(file_h, data)]
        if tensor_h is not None:
            futures.append(self.tensor_hasher.update(tensor_h, data))
        if tap is not None:
            futures.append(self.tap_hasher.update(tap, data))
        if copy_from is not None and self.kernel_copy:
            self._copy(copy_from, fileobj, data)
        else:
            write_all(fileobj, data)
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
        self.drain()
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
