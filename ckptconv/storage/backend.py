"""The source interface: what a reader or a layout may ask of the place a checkpoint's files are,
whatever it is. Two implementations, chosen once per location by files.locate: `local.Local` (a
file system) and `bucket.Session` (an object store, with the job's options). Paths are `pathlib.Path`
or `remote.RemotePath` (a URL that carries its session); files.py dispatches on them."""
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Entry:
    """One name of a directory or prefix: whether it is a directory (a prefix with objects under it)
    and, for a file, its size."""

    name: str
    is_dir: bool
    size: int = 0


class Backend(Protocol):
    def place(self, path):
        """`path` as a path of this backend (pathlib.Path, remote.RemotePath)."""

    def is_dir(self, path) -> bool: ...
    def is_file(self, path) -> bool: ...
    def exists(self, path) -> bool: ...

    def size(self, path) -> int:
        """A file's bytes (BadInput or OSError when there is none)."""

    def entries(self, path) -> list:
        """The names directly in a directory or under a prefix, sorted, as Entries."""

    def stat(self, path):
        """os.stat of a local path (links followed); an object as a regular file of its size."""

    def scan(self, path) -> dict:
        """{name: stat} of a directory's entries (links not followed)."""

    def open(self, path):
        """A weight file: io/mapped.MappedFile or remote.RemoteFile (one interface: view, need, read,
        buffer, read_many, pieces, reader, will_need, release, unchanged, identity, size)."""

    def read_bytes(self, path, what: str, limit: int, follow: bool = True) -> bytes:
        """A small file whole (a config, an index): BadInput when over `limit` or unreadable."""

    def head(self, path, n: int) -> bytes:
        """The first `n` bytes (fewer if shorter); b"" when a local file cannot be read."""

    def fingerprint(self, path) -> str:
        """What changes when the file is written or replaced (--resume's source identity)."""

    def sha256(self, path, chunk: int = 16 << 20, progress=None):
        """The file's SHA-256 (hex); None when a local path is not a regular file."""

    def copy_file(self, path, open_dst, chunk: int = 16 << 20) -> tuple:
        """Copy into the sink `open_dst(mode)` opens: (SHA-256 hex, bytes)."""

    def library_path(self, path, limit: int):
        """A context manager: a local path where the safetensors library sees the file's header."""

    def forget(self, path):
        """Forget what was listed or opened at and under `path` (an output written there)."""
