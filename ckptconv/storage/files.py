"""Where a checkpoint's bytes come from: the one way readers and layouts reach files, local or in an
object store (docs/storage.md; tests/test_storage_room.py holds them to it).

The backend is chosen once per location (`locate(path, options)`, where a job starts: readers'
open_checkpoint, verify, a bucket output): a local path is a `pathlib.Path` served by local.LOCAL; a
URL is a remote.RemotePath bound to a bucket.Session made with the job's StorageOptions, and every
path made from it keeps that session. Every function below dispatches on the path it is given
(backend.Backend says what each means); a URL as a plain string has no session and is refused
(TypeError: a bug, never an input's fault).

- names: `is_url`, `join`, `name`, `parent`, `realpath`, `shown`, `place`, `locate`;
- what is there: `is_dir`, `is_file`, `exists`, `size`, `stat`, `listdir`, `entries`, `scan`,
  `fingerprint`, `head`;
- small files whole: `read_bytes`, `load_json`;
- weight files: `open_file`, and the parts of an open file a reader parses: `buffer` (one range),
  `read_ranges` (many small ones: an object's in a few concurrent GETs), `pieces` (one long range
  front to back, for a decompressor);
- an output's own files: `sha256`, `copy_file`, `same_file`, `library_path`, `forget`.
"""
import os
from pathlib import Path

from .backend import Entry
from .bucket import Session
from .local import LOCAL
from .remote import RemoteFile, RemotePath
from .urls import StorageOptions, is_url, parse, redact

__all__ = ["is_url", "join", "name", "parent", "realpath", "shown", "place", "locate", "session_of", "is_dir",
           "is_file", "exists", "size", "stat", "listdir", "entries", "scan", "fingerprint", "head", "read_bytes",
           "load_json", "open_file", "buffer", "read_ranges", "pieces", "sha256", "copy_file", "same_file",
           "library_path", "forget", "Entry", "RemoteFile", "RemotePath"]


def locate(path, options: StorageOptions = None):
    """`path` with its backend: a URL bound to a new bucket.Session with `options` (a job's storage
    options: one session a job); a RemotePath, or a local path, as it is (as given: messages show it
    so; `place` makes it a Path)."""
    if isinstance(path, (Path, RemotePath)) or not is_url(os.fspath(path)):
        return path
    return Session(options if options is not None else StorageOptions()).place(os.fspath(path))


def place(path):
    """`path` as a Path or the RemotePath it already is; a URL must have been located (TypeError)."""
    if isinstance(path, (Path, RemotePath)):
        return path
    path = os.fspath(path)
    if is_url(path):
        raise TypeError(f"{redact(path)}: a URL reached storage without its session (files.locate binds it)")
    return Path(path)


def _backend(path):
    if isinstance(path, RemotePath):
        return path.session
    if is_url(path):
        raise TypeError(f"{redact(path)}: a URL reached storage without its session (files.locate binds it)")
    return LOCAL


def session_of(path):
    """The bucket.Session a located URL carries (None for a local path)."""
    return path.session if isinstance(path, RemotePath) else None


# ---- names ---------------------------------------------------------------------------------------

def join(base, *names):
    """`base` with `names` appended: os.path.join for a path, "/"-joined for a URL (a RemotePath
    stays bound to its session)."""
    if isinstance(base, RemotePath):
        return base.child(*names)
    base = os.fspath(base)
    if not is_url(base):
        return os.path.join(base, *names)
    out = base.rstrip("/")
    for n in names:
        out = f"{out}/{n.strip('/')}" if n else out
    return out


def name(path) -> str:
    if isinstance(path, RemotePath):
        return path.name
    path = os.fspath(path)
    return path.rstrip("/").rpartition("/")[2] if is_url(path) else os.path.basename(path)


def parent(path):
    if isinstance(path, RemotePath):
        return path.parent
    path = os.fspath(path)
    if is_url(path):
        loc = parse(path)
        return str(type(loc)(loc.scheme, loc.bucket, loc.key.rpartition("/")[0], loc.account)).rstrip("/")
    return os.path.dirname(path)


def realpath(path):
    """What `path` names, resolved: a local path's links followed (a str), a URL in its one spelling
    (a RemotePath stays one)."""
    if isinstance(path, RemotePath):
        return path
    path = os.fspath(path)
    return str(parse(path)).rstrip("/") if is_url(path) else os.path.realpath(path)


def shown(path) -> str:
    """`path` as messages show it (a URL's credentials never; urls.redact)."""
    return redact(os.fspath(path))


# ---- what is there -------------------------------------------------------------------------------

def is_dir(path) -> bool:
    return _backend(path).is_dir(path)


def is_file(path) -> bool:
    return _backend(path).is_file(path)


def exists(path) -> bool:
    return _backend(path).exists(path)


def size(path) -> int:
    return _backend(path).size(path)


def stat(path) -> os.stat_result:
    return _backend(path).stat(path)


def entries(path) -> list:
    return _backend(path).entries(path)


def listdir(path) -> list:
    """The names in a directory or under a prefix, sorted."""
    return [e.name for e in entries(path)]


def scan(path) -> dict:
    return _backend(path).scan(path)


def fingerprint(path) -> str:
    return _backend(path).fingerprint(path)


def head(path, n: int) -> bytes:
    return _backend(path).head(path, n)


def read_bytes(path, what: str, limit: int, follow: bool = True) -> bytes:
    return _backend(path).read_bytes(path, what, limit, follow)


def load_json(path, what: str = "JSON", limit: int = 1 << 30):
    """A small JSON file or object (a config, an index), parsed by safejson (bounded depth and size)."""
    from .. import safejson
    return safejson.loads(read_bytes(path, what, limit), os.fspath(path), what)


# ---- weight files --------------------------------------------------------------------------------

def open_file(path):
    """A MappedFile (a local path) or a RemoteFile (a URL: the same one for every open of it in a job)."""
    return _backend(path).open(path)


def buffer(f, offset: int, length: int):
    """[offset, offset+length) of an open file (clamped to its end, as a slice is) to parse whole: a
    view of a local file's mapping (nothing copied), an object's bytes fetched now (nothing kept)."""
    return f.buffer(offset, length)


def read_ranges(f, ranges):
    """The bytes of each (offset, length) of `ranges` (consumed lazily), in order: a local file's by
    pread, an object's by concurrent ranged GETs a bounded window ahead, nearby ranges sharing one
    (window.GAP). Every range must lie inside the file (BadInput otherwise, when it is reached)."""
    return f.read_many(ranges)


def pieces(f, offset: int, length: int, piece: int):
    """[offset, offset+length) of an open file front to back, `piece` bytes at a time (the last
    shorter), for a decompressor: a local file's mapping's views; an object's bytes a bounded window
    ahead (memory stays (concurrency + 1) x part_size whatever the length)."""
    return f.pieces(offset, length, piece)


# ---- an output's own files (verify, --resume, files carried into OUT) -------------------------------

def sha256(path, chunk: int = 16 << 20, progress=None):
    """The SHA-256 (hex) of a regular file, opened without following a link and without blocking on
    a FIFO; None when what is there is not a regular file. An object is read by ranged GETs."""
    return _backend(path).sha256(path, chunk, progress)


def copy_file(src, open_dst, chunk: int = 16 << 20) -> tuple:
    """Copy the file or object `src` into what `open_dst(mode)` opens (a sink: `write`, `close`,
    `abandon`; `mode` the source's permission bits, never wider than 0o666): (its SHA-256 hex, its
    bytes). BadInput when a local file changes or is swapped while it is read."""
    return _backend(src).copy_file(src, open_dst, chunk)


def same_file(a, b) -> bool:
    """Both regular files (no link followed) and one inode; two objects never are."""
    if isinstance(a, RemotePath) or isinstance(b, RemotePath) or is_url(a) or is_url(b):
        return False
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except OSError:
        return False
    import stat as st
    return st.S_ISREG(sa.st_mode) and st.S_ISREG(sb.st_mode) and (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def library_path(path, limit: int = 100 * 1000 * 1000):
    """A context manager: a local path where the safetensors library sees `path`'s header as the
    file holds it: `path` itself, or for an object a sparse temporary file of its size holding only
    its first 8 bytes and the header they count (at most `limit`)."""
    return _backend(path).library_path(path, limit)


def forget(path):
    """Drop what the job listed and opened at and under `path` (an output just written there)."""
    _backend(path).forget(path)
