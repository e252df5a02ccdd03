"""Objects read from a store: small reads (headers), then long ordered runs of ranges (tensor bytes)
streamed ahead of the writer as concurrent ranged GETs in a bounded window.

An object's identity (ETag and size) is taken when it is opened; every later GET carries
`If-Match: ETAG` and its answer's ETag and size are compared too, so an object replaced while a run
reads it stops the run ("changed while it was being read") instead of mixing two versions' bytes.
Each GET is retried on transient failures within the options' budget (`urls.Retry`); obstore's own
client retries are off for reads, so the count and the seconds are the ones stated.
"""
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

from ..errors import BadInput
from ..signals import check
from .urls import Location, Retry, StorageOptions, Store, failure, open_store, transient
from .window import Piece, stream as window_stream

MAX_LISTED = 1_000_000  # objects one listing may return


@dataclass(frozen=True)
class Identity:
    """What an object was when first seen: a later read of different bytes is refused."""

    etag: Optional[str]
    size: int
    version: Optional[str] = None

    def matches(self, meta) -> bool:
        return meta["size"] == self.size and (self.etag is None or meta.get("e_tag") == self.etag)


@dataclass(frozen=True)
class Entry:
    """An object under a listed prefix: its name relative to the prefix, and its size."""

    name: str
    size: int


def _bounds(offset, length, size: int, where):
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0 or offset + length > size:
        raise BadInput(f"{where}: range of {length!r} bytes at offset {offset!r} lies outside its {size} bytes")


class SourceObject:
    """One object of a checkpoint, read-only. `open` takes its identity; `read` and `stream` return
    its bytes as they were then, or raise BadInput."""

    def __init__(self, store: Store, location: Location, identity: Identity):
        self.store, self.location, self.identity = store, location, identity

    @classmethod
    def open(cls, location: Location, options: StorageOptions = StorageOptions(), store: Optional[Store] = None,
             missing_ok: bool = False):
        """The object at `location` (a HEAD, retried like every read); None when there is none and
        `missing_ok`. Pass `store` (from `reading`) to share one client among the files of a checkpoint."""
        store = store or reading(location, options)

        def head():
            try:
                return _obstore().head(store.handle, location.key)
            except FileNotFoundError:
                if missing_ok:
                    return None
                raise
        meta = retrying(store, head, f"{location}", "HEAD", missing="no such object")
        if meta is None:
            return None
        return cls(store, location, Identity(meta.get("e_tag"), meta["size"], meta.get("version")))

    @property
    def size(self) -> int:
        return self.identity.size

    def __repr__(self) -> str:
        return f"SourceObject({str(self.location)!r}, size={self.size})"

    def check(self, offset: int, length: int, what: str = "a read"):
        """Refuse a range that does not lie inside the object."""
        _bounds(offset, length, self.size, self.location)

    def fetch(self, start: int, end: int):
        """Bytes [start, end), as the object was when opened (one GET, retried)."""
        obstore, where = _obstore(), f"{self.location}"
        options = {"range": (start, end)}
        if self.identity.etag is not None:
            options["if_match"] = self.identity.etag

        def get():
            result = obstore.get(self.store.handle, self.location.key, options=options)
            if not self.identity.matches(result.meta):
                raise _Changed()
            data = result.bytes()
            if len(data) != end - start:
                raise _Short(f"{len(data)} bytes came back of {end - start} asked")
            return data
        return retrying(self.store, get, where, f"GET of bytes {start}-{end}",
                        missing="changed while it was being read (it is gone)")

    def read(self, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` (a header): one GET, or a window's for a long read."""
        self.check(offset, length)
        if not length:
            return b""
        if length <= self.store.options.part_size:
            return bytes(self.fetch(offset, offset + length))
        return b"".join(bytes(p.data) for p in self.stream([(offset, length)]))

    def stream(self, ranges: Iterable, concurrency: Optional[int] = None, part_size: Optional[int] = None
               ) -> Iterator[Piece]:
        """The bytes of (offset, length) `ranges` in the order given, as Pieces of at most `part_size`
        (default: the options'), fetched `concurrency` GETs ahead (window.stream)."""
        return window_stream(self, ranges, concurrency or self.store.options.concurrency,
                             part_size or self.store.options.part_size)


def listing(location: Location, options: StorageOptions = StorageOptions(), store: Optional[Store] = None,
            limit: int = MAX_LISTED) -> list:
    """Every object under the prefix `location` names ("directory/", all depths), as Entries sorted
    by name: listed page by page (1,000 names a request), stopped with BadInput as soon as more than
    `limit` have come, so a prefix of millions of objects, or a server that always says more follow,
    costs at most `limit` names of memory and the time they take."""
    store = store or reading(location, options)
    prefix = f"{location.key}/" if location.key else ""
    found = []

    def collect():
        found.clear()
        for batch in _obstore().list(store.handle, prefix or None, chunk_size=1000):
            for meta in batch:
                found.append(Entry(meta["path"][len(prefix):], meta["size"]))
            if len(found) > limit:
                raise BadInput(f"{location}: holds more than {limit:,} objects; not a checkpoint to list")
            check()
        return found
    retrying(store, collect, f"{location}", "listing", missing="no such prefix")
    return sorted(found, key=lambda e: e.name)


def reading(location: Location, options: StorageOptions) -> Store:
    """A store for reads: obstore's own retries off (ours count them)."""
    return open_store(location, options, retries=0)


class _Changed(Exception):
    pass


class _Short(Exception):
    pass


def _obstore():
    import obstore
    return obstore


def retrying(store: Store, call, where: str, operation: str, missing: str):
    """`call()`, retried within the store's budget while it fails transiently. Failures become one
    BadInput line: a changed object, a missing one (`missing`), or `operation`, the attempts and the
    time they took, and the server's last answer (urls.failure)."""
    import obstore.exceptions as ox
    retry = Retry(store.options)
    while True:
        try:
            return call()
        except BadInput:
            raise
        except (_Changed, ox.PreconditionError):
            raise BadInput(f"{where}: changed while it was being read (its ETag or size differs from the first "
                           "read); run again once it no longer changes") from None
        except FileNotFoundError:
            raise BadInput(f"{where}: {missing}") from None
        except Exception as e:  # noqa: BLE001 (what obstore raises: classified by `transient`)
            if isinstance(e, _Short) or transient(e):
                if retry.again():
                    continue
                raise BadInput(f"{where}: {operation} failed after {retry.spent()}: {failure(e)}") from None
            raise BadInput(f"{where}: {operation} failed: {failure(e)}") from None
