"""Where an output's bytes go: the one interface layouts write through (docs/storage.md).

A `Target` is an output being written, named by paths relative to it (`model-00001-of-00002.safetensors`,
`rank-00000/manifest.json`): a local directory (`LocalTarget`: the temporary directory of
io/output.atomic_output, published by one rename, as before) or an object-store prefix
(`BucketTarget`: every file an object of publisher.Publisher's, uploaded as it is written, the pointer
last and create-only). Layouts never name a local path: they `create` the shard files the write
pipeline feeds (io/hashing.Pipeline: the same staging buffers and digests either way, each file's
SHA-256 in the pass that writes it), `open` the small ones (JSON, SHA256SUMS, files carried), and
look at what is there (`stat`, `entries`) for --resume.

A bucket OUT's life (claimed, prepared, published or rolled back) is bucket_out.py's.
"""
import contextlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BadInput, OutputError


def write_all(fileobj, data):
    view = memoryview(data)
    while len(view):
        n = fileobj.write(view)
        view = view[n:]


def as_target(where) -> "Target":
    """`where` as a Target: itself, or a local directory's path as a LocalTarget."""
    return where if isinstance(where, Target) else LocalTarget(where)


class Target:
    """An output being written (see the module docstring). Paths are relative, "/"-separated."""

    remote = False

    def path(self, rel: str = "") -> str:
        """Where `rel` is, as messages show it (a local path, or a URL)."""
        raise NotImplementedError

    def sub(self, folder: str) -> "Target":
        """The folder `folder` of this output (a rank directory, a pipeline's component) as a Target."""
        raise NotImplementedError

    def mkdir(self, rel: str = "", exist_ok: bool = False):
        """Make the folder `rel` (an object store has none: nothing to do)."""

    def create(self, rel: str, pool, size=None, direct: bool = True, head: int = 0):
        """A file the write pipeline feeds (outfile.OutFile's calls: stage, close, abandon). `size`: its
        expected bytes; `head`: its first bytes that `patch` may still rewrite before publication."""
        raise NotImplementedError

    def open(self, rel: str, mode: int = 0o666, exclusive: bool = False, size=None):
        """A small file written whole (`write`, then `close`; `abandon` after a failure)."""
        raise NotImplementedError

    def put(self, rel: str, data, mode: int = 0o666, exclusive: bool = False):
        """Write the file `rel` whole with `data`."""
        sink = self.open(rel, mode, exclusive, len(data))
        try:
            sink.write(data)
        except BaseException:
            sink.abandon()
            raise
        sink.close()

    def replace(self, rel: str, chunks):
        """Write `rel` anew from `chunks` (bytes), replacing what was there in one step (a journal)."""
        raise NotImplementedError

    def read_bytes(self, rel: str):
        """The bytes of `rel` (a journal), or None when it is not there or cannot be read."""
        raise NotImplementedError

    def patch(self, rel: str, offset: int, pieces, fsync: bool = False):
        """Rewrite `rel` from `offset` with `pieces` (a single file's header, once its digests are known)."""
        raise NotImplementedError

    def link(self, source: str, rel: str):
        """`rel` holding the bytes of `source` without writing them again (vLLM's names for rank shards)."""
        raise NotImplementedError

    def stat(self, rel: str):
        """`rel`'s lstat (links not followed), or None when nothing is there."""
        raise NotImplementedError

    def is_dir(self, rel: str) -> bool:
        """Whether `rel` is a folder (a real directory, not a link to one)."""
        raise NotImplementedError

    def entries(self, rel: str = "") -> list:
        """[(name, is a folder)] of what the folder `rel` holds, sorted."""
        raise NotImplementedError

    def remove(self, rel: str):
        """Remove the file or folder `rel` (all it holds), if it is there."""
        raise NotImplementedError

    def chunks(self, rel: str, chunk: int):
        """`rel`'s bytes, `chunk` at a time (a file a killed run finished, re-hashed by --resume)."""
        raise NotImplementedError

    def free(self):
        """Bytes that can still be written, or None where that is not bounded (an object store)."""
        return None

    def side_by_side(self, files: int):
        """`files` files of this output will be written at once (a reshard's ranks): a store divides
        its upload concurrency and part size among them, so memory does not grow with their number."""


# ---- a local directory ----------------------------------------------------------------------------

class _FileSink:
    def __init__(self, path: str, mode: int, exclusive: bool):
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_EXCL if exclusive else os.O_TRUNC)
        self.f = open(os.open(path, flags, mode), "wb")

    def write(self, data):
        write_all(self.f, data)

    def close(self):
        self.f.close()

    def abandon(self):
        self.f.close()


class LocalTarget(Target):
    """A local directory (a run's temporary directory): today's files, byte for byte."""

    def __init__(self, root):
        self.root = Path(root)

    def __fspath__(self) -> str:
        return str(self.root)

    def __repr__(self) -> str:
        return f"LocalTarget({str(self.root)!r})"

    def path(self, rel: str = "") -> str:
        return os.path.join(self.root, rel) if rel else str(self.root)

    def sub(self, folder: str) -> "LocalTarget":
        return LocalTarget(self.root / folder)

    def mkdir(self, rel: str = "", exist_ok: bool = False):
        if exist_ok:
            os.makedirs(self.path(rel), exist_ok=True)
        else:
            os.mkdir(self.path(rel))

    def create(self, rel: str, pool, size=None, direct: bool = True, head: int = 0):
        from ..io.outfile import OutFile
        return OutFile(self.path(rel), pool, direct)

    def open(self, rel: str, mode: int = 0o666, exclusive: bool = False, size=None):
        return _FileSink(self.path(rel), mode, exclusive)

    def replace(self, rel: str, chunks):
        tmp = self.path(rel + ".tmp")
        with open(tmp, "wb") as f:
            for data in chunks:
                write_all(f, data)
        os.replace(tmp, self.path(rel))

    def read_bytes(self, rel: str):
        try:
            with open(self.path(rel), "rb") as f:
                return f.read()
        except OSError:
            return None

    def patch(self, rel: str, offset: int, pieces, fsync: bool = False):
        from ..io.outfile import pwrite_all
        fd = os.open(self.path(rel), os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            at = offset
            for piece in pieces:
                pwrite_all(fd, memoryview(piece), at)
                at += len(piece)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def link(self, source: str, rel: str):
        os.link(self.path(source), self.path(rel))

    def stat(self, rel: str):
        try:
            return os.lstat(self.path(rel))
        except OSError:
            return None

    def is_dir(self, rel: str) -> bool:
        return os.path.isdir(self.path(rel)) and not os.path.islink(self.path(rel))

    def entries(self, rel: str = "") -> list:
        with os.scandir(self.path(rel)) as it:
            return sorted((e.name, e.is_dir(follow_symlinks=False)) for e in it)

    def remove(self, rel: str):
        path = self.path(rel)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def chunks(self, rel: str, chunk: int):
        with open(os.open(self.path(rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb", buffering=0) as f:
            while data := f.read(chunk):
                yield data

    def free(self):
        return shutil.disk_usage(self.root).free


# ---- an object-store prefix -----------------------------------------------------------------------

@dataclass
class BucketOut:
    """What every folder of one bucket output shares: its publisher, its pointer's name, how many
    files are written side by side, and the objects under OUT this run knows of, {path: size}."""

    publisher: object
    pointer: str | None
    session: object = None    # bucket.Session: reads of what is under OUT (a journal, --resume's re-hash)
    side_by_side: int = 1
    known: dict = field(default_factory=dict)


class _ObjectSink:
    """A file written whole through an object's writer (manifest.json, SHA256SUMS, a carried file):
    committed on close (or, for the pointer, finished: written, to be published last), aborted on
    abandon."""

    def __init__(self, out: BucketOut, rel: str, writer, pointer: bool):
        self.out, self.rel, self.writer, self.pointer = out, rel, writer, pointer

    def write(self, data):
        self.writer.write(data)

    def close(self):
        if self.pointer:
            self.writer.finish()
        else:
            self.writer.commit()
        self.out.known[self.rel] = self.writer.size

    def abandon(self):
        self.writer.abort()


class _ObjectFile(_ObjectSink):
    """The write pipeline's file (stage, close, abandon) as an object: each staged buffer's bytes are
    handed to the object's writer, which sends them part by part, while the hash threads read the
    same buffer (the file's digest is the pipeline's: the writer does not hash them again)."""

    def __init__(self, out: BucketOut, rel: str, writer, pool, pointer: bool):
        self.out, self.rel, self.writer, self.pool, self.pointer = out, rel, writer, pool, pointer
        self.name = str(writer.location)

    def stage(self, fill, n):
        lease = self.pool.lease()
        view = memoryview(lease.buffer)[:min(n, self.pool.size)]
        try:
            fill(view)
            self.writer.write(view)
        except BaseException:
            lease.let_go()
            raise
        return view, lease

    def close(self, fsync: bool = False):
        super().close()


class BucketTarget(Target):
    """An output under an object-store prefix (or one object, for a single-file OUT)."""

    remote = True

    def __init__(self, out: BucketOut, prefix: str = ""):
        self.out, self.prefix = out, prefix

    def __repr__(self) -> str:
        return f"BucketTarget({self.path()!r})"

    def _rel(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix and rel else rel or self.prefix

    def path(self, rel: str = "") -> str:
        full = self._rel(rel)
        return str(self.out.publisher.place(full)) if full else str(self.out.publisher.out)

    def sub(self, folder: str) -> "BucketTarget":
        return BucketTarget(self.out, self._rel(folder))

    def side_by_side(self, files: int):
        self.out.side_by_side = max(1, files)

    def _is_pointer(self, full: str) -> bool:
        return full == self.out.pointer

    def create(self, rel: str, pool, size=None, direct: bool = True, head: int = 0):
        full = self._rel(rel)
        publisher = self.out.publisher
        if self._is_pointer(full):
            return _ObjectFile(self.out, full, publisher.pointer(full, size, head), pool, True)
        return _ObjectFile(self.out, full, publisher.writer(full, size, hashed=False, side_by_side=self.out.side_by_side), pool,
                           False)

    def open(self, rel: str, mode: int = 0o666, exclusive: bool = False, size=None):
        full = self._rel(rel)
        publisher = self.out.publisher
        if self._is_pointer(full):
            return _ObjectSink(self.out, full, publisher.pointer(full, size), True)
        return _ObjectSink(self.out, full, publisher.writer(full, size, hashed=False), False)

    def replace(self, rel: str, chunks):
        sink = self.open(rel)
        try:
            for data in chunks:
                sink.write(data)
        except BaseException:
            sink.abandon()
            raise
        sink.close()

    def read_bytes(self, rel: str):
        try:
            return self.out.session.read_bytes(self.path(rel), "journal", 1 << 34)
        except BadInput:
            return None

    def patch(self, rel: str, offset: int, pieces, fsync: bool = False):
        full = self._rel(rel)
        writer = self.out.publisher.pointer_writer
        if not self._is_pointer(full) or writer is None:
            raise OutputError(f"{self.path(rel)}: an object cannot be rewritten once it is written")
        for piece in pieces:
            writer.patch(offset, piece)
            offset += len(piece)

    def link(self, source: str, rel: str):
        full = self._rel(rel)
        self.out.publisher.copy(self._rel(source), full)
        self.out.known[full] = self.out.known.get(self._rel(source), 0)

    def stat(self, rel: str):
        full = self._rel(rel)
        if full in self.out.known:
            return os.stat_result((0o100444, 0, 0, 1, 0, 0, self.out.known[full], 0, 0, 0))
        if self.is_dir(rel):
            return os.stat_result((0o040555, 0, 0, 1, 0, 0, 0, 0, 0, 0))
        return None

    def is_dir(self, rel: str) -> bool:
        below = self._rel(rel) + "/" if self._rel(rel) else ""
        return any(k.startswith(below) for k in self.out.known)

    def entries(self, rel: str = "") -> list:
        below = self._rel(rel) + "/" if self._rel(rel) else ""
        found = {}
        for k in self.out.known:
            if k.startswith(below):
                head, sep, _ = k[len(below):].partition("/")
                found[head] = found.get(head, False) or bool(sep)
        return sorted(found.items())

    def remove(self, rel: str):
        full = self._rel(rel)
        gone = [k for k in self.out.known if k == full or k.startswith(full + "/")]
        publisher = self.out.publisher
        publisher.delete([publisher.place(k).key for k in gone])
        for k in gone:
            del self.out.known[k]

    def chunks(self, rel: str, chunk: int):
        f = self.out.session.open(self.path(rel))
        for at in range(0, f.size, chunk):
            yield f.read(at, min(chunk, f.size - at))


def no_space(target: Target, needed: int):
    """OutputError when `target` cannot take `needed` more bytes (never, for an object store)."""
    free = target.free()
    if free is not None and free < needed:
        raise OutputError(f"{target.path()}: not enough free disk space for {needed} bytes")


__all__ = ["Target", "LocalTarget", "BucketTarget", "as_target", "no_space", "write_all"]
