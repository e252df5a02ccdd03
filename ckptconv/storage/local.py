"""The local backend: paths on a file system every process of a job sees the same way. Stateless
(nothing to carry between processes): one instance, `LOCAL`, serves every local path."""
import contextlib
import hashlib
import os
import stat as st

from ..errors import BadInput
from .backend import Entry


def _size(e) -> int:
    try:
        return e.stat().st_size
    except OSError:
        return 0


class Local:
    """Local paths (see backend.Backend for what each operation means)."""

    def place(self, path):
        from pathlib import Path
        return path if isinstance(path, Path) else Path(path)

    def is_dir(self, path) -> bool:
        return os.path.isdir(path)

    def is_file(self, path) -> bool:
        return os.path.isfile(path)

    def exists(self, path) -> bool:
        return os.path.lexists(path)

    def size(self, path) -> int:
        return os.path.getsize(path)

    def entries(self, path) -> list:
        """A directory's names, sorted, as Entries (links followed, as os.path.isdir does)."""
        out = []
        with os.scandir(path) as it:
            for e in it:
                d = e.is_dir()
                out.append(Entry(e.name, d, 0 if d else _size(e)))
        return sorted(out, key=lambda e: e.name)

    def stat(self, path) -> os.stat_result:
        return os.stat(path)

    def scan(self, path) -> dict:
        """{name: its lstat} of every entry, links not followed (OSError when it cannot be listed)."""
        found = {}
        with os.scandir(path) as it:
            for entry in it:
                try:
                    found[entry.name] = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
        return found

    def open(self, path):
        from ..io.mapped import MappedFile
        return MappedFile(path)

    def read_bytes(self, path, what: str, limit: int, follow: bool = True) -> bytes:
        """Through safejson.read: a regular file, opened without blocking; with `follow=False` a
        symbolic link is refused, not followed (an output's own files)."""
        from .. import safejson
        return safejson.read(os.fspath(path), what.removeprefix("the "), limit=limit, follow=follow)

    def head(self, path, n: int) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read(n)
        except OSError:
            return b""

    def fingerprint(self, path) -> str:
        s = os.stat(path)
        return f"{s.st_dev}:{s.st_ino}:{s.st_size}:{s.st_mtime_ns}:{s.st_ctime_ns}"

    def sha256(self, path, chunk: int = 16 << 20, progress=None):
        """Opened without following a link nor blocking on a FIFO; None when not a regular file."""
        from .. import safejson
        h = hashlib.sha256()
        try:
            with safejson.open_regular(os.fspath(path), follow=False) as fd:
                while data := os.read(fd, chunk):
                    h.update(data)
                    if progress is not None:
                        progress(len(data))
                return h.hexdigest()
        except BadInput:
            return None

    def copy_file(self, path, open_dst, chunk: int = 16 << 20) -> tuple:
        """Opened without following a link (one swapped in since it was checked is refused); a regular
        file whose size and modification time do not change while it is read."""
        h = hashlib.sha256()
        src = os.fspath(path)
        try:
            fi = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise BadInput(f"{src}: cannot read: {e.strerror}") from None
        try:
            before = os.fstat(fi)
            if not st.S_ISREG(before.st_mode):
                raise BadInput(f"{src}: is no longer a regular file")
            sink = open_dst(before.st_mode & 0o666)
            try:
                left = before.st_size
                while left > 0 and (data := os.read(fi, min(chunk, left))):
                    h.update(data)
                    sink.write(data)
                    left -= len(data)
            except BaseException:
                sink.abandon()
                raise
            sink.close()
            after = os.fstat(fi)
        finally:
            os.close(fi)
        if left or (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            raise BadInput(f"{src}: changed while it was being read; nothing was written")
        return h.hexdigest(), before.st_size

    @contextlib.contextmanager
    def library_path(self, path, limit: int):
        yield os.fspath(path)

    def forget(self, path):
        pass


LOCAL = Local()
