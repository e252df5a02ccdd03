"""The object-store backend: one `Session` per job and its options (endpoint, concurrency, part size,
retries, stall limit), made where the job starts from its typed request (files.locate) and carried
by every path made from it (remote.RemotePath), so a worker process or a Ray task that re-opens the
job's source from the request talks to the same endpoint with the same settings. Nothing here is a
process-wide setting: two jobs in one process with other options have two sessions.

A session keeps, for its job: one client per bucket (`store`), what it listed and what it opened (a
job reads one version of each object: the first seen), and one read-ahead window for the tensor
bytes writers stream (window.py).

Listings are recursive and paged (objects.listing: at most MAX_ENTRIES objects, 1,000 a request):
the first question about a directory lists it once, and every question about a path below it is
answered from that listing. A path no listing covers is looked at by one HEAD (a file) or one
listing of its own (a directory).
"""
import contextlib
import hashlib
import os
import threading

from ..errors import BadInput
from .backend import Entry
from .objects import SourceObject, listing, reading
from .remote import RemoteFile, RemotePath
from .urls import Location, StorageOptions, parse, redact

MAX_ENTRIES = 1_000_000   # objects one listing may hold (objects.MAX_LISTED)
_REGULAR, _DIRECTORY = 0o100444, 0o040555


def _stat(mode: int, n: int) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, 0, 0, n, 0, 0, 0))


class _Tree:
    """Every object under one prefix (all depths), {path relative to it: size}, and, made when first
    asked, each folder's files and subfolders."""

    def __init__(self, entries):
        self.objects = {e.name: e.size for e in entries}
        self._folders = None

    def folders(self) -> dict:
        """{folder relative to the prefix ("" itself): ({file name: size}, {subfolder names})}."""
        if self._folders is None:
            folders = {"": ({}, set())}
            for key, size in self.objects.items():
                parent, _, name = key.rpartition("/")
                folders.setdefault(parent, ({}, set()))[0][name] = size
                while parent:   # (each folder above, once: the first key below it adds them all)
                    up, _, sub = parent.rpartition("/")
                    subs = folders.setdefault(up, ({}, set()))[1]
                    if sub in subs:
                        break
                    subs.add(sub)
                    parent = up
            self._folders = folders
        return self._folders


class Session:
    """The object-store side of one job (see the module docstring)."""

    def __init__(self, options: StorageOptions):
        self.options = options
        self._lock = threading.Lock()
        self._stores: dict = {}     # (scheme, bucket, account) -> Store for reads
        self._trees: dict = {}      # URL of a listed prefix -> _Tree
        self._opened: dict = {}     # URL of an object -> RemoteFile
        self._missing: set = set()  # URLs a HEAD found nothing at
        self._window = None

    def __repr__(self) -> str:
        return f"Session({redact(self.options.endpoint_url or 'default endpoint')})"

    def place(self, url) -> RemotePath:
        return url if isinstance(url, RemotePath) and url.session is self else RemotePath(url, self)

    # -- clients, the window ----------------------------------------------------------------------
    def store(self, loc: Location):
        key = (loc.scheme, loc.bucket, loc.account)
        with self._lock:
            found = self._stores.get(key)
        if found is None:
            made = reading(Location(loc.scheme, loc.bucket, "", loc.account), self.options)
            with self._lock:
                found = self._stores.setdefault(key, made)
        return found

    def window(self):
        """The read-ahead window every remote file of this job shares (window.py)."""
        with self._lock:
            if self._window is None:
                from .window import Window
                self._window = Window(self.options.concurrency, self.options.part_size)
            return self._window

    def forget(self, url):
        """Drop what was listed of `url`, under it and above it, and the objects opened there (an
        output just written, replaced or rolled back): the next look lists and opens them again."""
        key = str(parse(str(url))).rstrip("/")
        with self._lock:
            for k in [k for k in self._trees if k == key or k.startswith(key + "/") or key.startswith(k + "/")]:
                del self._trees[k]
            for k in [k for k in self._opened if k == key or k.startswith(key + "/")]:
                del self._opened[k]
            self._missing = {k for k in self._missing if not (k == key or k.startswith(key + "/"))}

    # -- listings ---------------------------------------------------------------------------------
    def _covering(self, url: str, above: bool = False):
        """(the listing of `url` or of a prefix above it (only above, with `above`: what an object is
        is told by its folder's listing), `url` relative to that prefix), or (None, None)."""
        with self._lock:
            at = url
            if above:
                cut = at.rfind("/")
                if cut <= at.find("://") + 2:
                    return None, None
                at = at[:cut]
            while True:
                tree = self._trees.get(at)
                if tree is not None:
                    return tree, url[len(at) + 1:] if len(url) > len(at) else ""
                cut = at.rfind("/")
                if cut <= at.find("://") + 2:
                    return None, None
                at = at[:cut]

    def _tree(self, url: str) -> _Tree:
        tree, rel = self._covering(url)
        if tree is not None and rel == "":
            return tree
        made = _Tree(listing(parse(url), self.options, self.store(parse(url)), limit=MAX_ENTRIES))
        with self._lock:
            return self._trees.setdefault(url, made)

    def _folder(self, url: str):
        """({file: size}, {subfolders}) directly under `url`, from the listing that covers it."""
        tree, rel = self._covering(url)
        if tree is None:
            tree, rel = self._tree(url), ""
        return tree.folders().get(rel, ({}, set()))

    # -- what is there ----------------------------------------------------------------------------
    def is_dir(self, url) -> bool:
        url = str(url)
        loc = parse(url)
        if not loc.key:
            return True   # a bucket's root (a missing bucket fails when it is listed)
        tree, rel = self._covering(url)
        if tree is not None:
            return rel in tree.folders() if rel else bool(tree.objects)
        return bool(self._tree(url).objects)

    def is_file(self, url) -> bool:
        url = str(url)
        if not parse(url).key:
            return False
        tree, rel = self._covering(url, above=True)
        if tree is not None:
            return rel in tree.objects
        return self._open(url, missing_ok=True) is not None

    def exists(self, url) -> bool:
        return self.is_file(url) or self.is_dir(url)

    def size(self, url) -> int:
        url = str(url)
        tree, rel = self._covering(url, above=True)
        if tree is not None:
            if rel not in tree.objects:
                raise BadInput(f"{redact(url)}: no such object")
            return tree.objects[rel]
        return self.open(url).size

    def entries(self, url) -> list:
        """The names directly under the prefix `url`, sorted, as Entries."""
        files, dirs = self._folder(str(url))
        out = [Entry(n, False, s) for n, s in files.items()] + [Entry(n, True) for n in dirs]
        return sorted(out, key=lambda e: e.name)

    def stat(self, url) -> os.stat_result:
        """A regular file of the object's size (OSError ENOENT when there is none)."""
        if not self.is_file(url):
            import errno
            raise FileNotFoundError(errno.ENOENT, "No such object")
        return _stat(_REGULAR, self.size(url))

    def scan(self, url) -> dict:
        """{name: stat} of what is directly under `url`: objects as regular files, prefixes as folders."""
        files, dirs = self._folder(str(url))
        out = {n: _stat(_DIRECTORY, 0) for n in dirs}
        out.update({n: _stat(_REGULAR, s) for n, s in files.items()})
        return out

    # -- objects ----------------------------------------------------------------------------------
    def _open(self, url: str, missing_ok: bool = False):
        with self._lock:
            found = self._opened.get(url)
            if found is None and missing_ok and url in self._missing:
                return None
        if found is not None:
            return found
        loc = parse(url)
        obj = SourceObject.open(loc, self.options, self.store(loc), missing_ok=missing_ok)
        if obj is None:
            with self._lock:
                self._missing.add(url)
            return None
        made = RemoteFile(self.place(url), obj)
        with self._lock:
            return self._opened.setdefault(url, made)

    def open(self, url) -> RemoteFile:
        """The object at `url` as first seen in this job (one version of each object per job)."""
        return self._open(str(url))

    def identity_now(self, url):
        """The object's identity by a HEAD now (None when it cannot be read): RemoteFile.unchanged."""
        loc = parse(str(url))
        try:
            return SourceObject.open(loc, self.options, self.store(loc)).identity
        except BadInput:
            return None

    def read_bytes(self, url, what: str, limit: int, follow: bool = True) -> bytes:
        f = self.open(url)
        if f.size > limit:
            raise BadInput(f"{redact(url)}: {what} has {f.size} bytes, more than the {limit} accepted")
        return f.read(0, f.size)

    def head(self, url, n: int) -> bytes:
        f = self.open(url)
        return f.read(0, min(n, f.size))

    def fingerprint(self, url) -> str:
        """An object's ETag and size; a prefix's names and sizes, digested (--resume's identity)."""
        if not self.is_file(url) and self.is_dir(url):
            listed = "\n".join(f"{e.name}/{int(e.is_dir)}/{e.size}" for e in self.entries(url))
            return "prefix:" + hashlib.sha256(listed.encode()).hexdigest()
        ident = self.open(url).identity
        return f"{ident.etag}:{ident.size}"

    def sha256(self, url, chunk: int = 16 << 20, progress=None):
        h = hashlib.sha256()
        f = self.open(url)
        for at in range(0, f.size, chunk):
            data = f.read(at, min(chunk, f.size - at))
            h.update(data)
            if progress is not None:
                progress(len(data))
        return h.hexdigest()

    def copy_file(self, url, open_dst, chunk: int = 16 << 20) -> tuple:
        """(SHA-256 hex, bytes) of the object copied into the sink `open_dst(0o644)` opens."""
        h = hashlib.sha256()
        f = self.open(url)
        sink = open_dst(0o644)
        try:
            for at in range(0, f.size, chunk):
                data = f.read(at, min(chunk, f.size - at))
                h.update(data)
                sink.write(data)
        except BaseException:
            sink.abandon()
            raise
        sink.close()
        return h.hexdigest(), f.size

    @contextlib.contextmanager
    def library_path(self, url, limit: int):
        """A sparse temporary file of the object's size holding its first 8 bytes and the header they
        count (at most `limit`), the rest holes, where the safetensors library sees that header."""
        import tempfile
        f = self.open(url)
        head = f.read(0, min(8, f.size))
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        head += f.read(8, min(n, limit, f.size - len(head))) if len(head) == 8 else b""
        with tempfile.NamedTemporaryFile(prefix="ckptconv-header-", suffix=".safetensors") as local:
            local.write(head)
            local.truncate(f.size)
            local.flush()
            yield local.name
