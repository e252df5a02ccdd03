"""Objects read from a store: small reads (headers), then long ordered runs of ranges (tensor bytes)
streamed ahead of the writer as concurrent ranged GETs in a bounded window.

An object's identity (ETag and size) is taken when it is opened; every later GET carries
`If-Match: ETAG` and its answer's ETag and size are compared too, so an object replaced while a run
reads it stops the run ("changed while it was being read") instead of mixing two versions' bytes.
Each GET is retried on transient failures within the options' budget (`urls.Retry`); obstore's own
client retries are off for reads, so the count and the seconds are the ones stated.
"""
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

from ..errors import BadInput
from ..signals import check
from .urls import Location, Retry, StorageOptions, Store, failure, open_store, transient

GAP = 64 << 10         # ranges at most this far apart are fetched by one GET (the bytes between are dropped)
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
class Piece:
    """Bytes of the `index`-th range asked of `stream`, starting `offset` bytes into that range. `data`
    is a view of a part still held by the window: use it (copy, write, hash) before asking for the next."""

    index: int
    offset: int
    data: memoryview


@dataclass(frozen=True)
class Entry:
    """An object under a listed prefix: its name relative to the prefix, and its size."""

    name: str
    size: int


@dataclass
class _Part:
    start: int
    end: int
    pieces: list   # (range index, offset in the range, offset in the part, length)


def _bounds(offset, length, size: int, where):
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0 or offset + length > size:
        raise BadInput(f"{where}: range of {length!r} bytes at offset {offset!r} lies outside its {size} bytes")


def _plan(ranges, size: int, part_size: int, where) -> Iterator[_Part]:
    """Group (offset, length) ranges, in the order given, into GETs of at most `part_size` bytes: a long
    range is cut into parts, short ones that follow each other (at most GAP apart) share one."""
    part = None
    for i, (offset, length) in enumerate(ranges):
        _bounds(offset, length, size, where)
        done = 0
        while done < length:
            at = offset + done
            if part is not None and part.end <= at <= part.end + GAP and at - part.start < part_size:
                take = min(length - done, part.start + part_size - at)
                part.pieces.append((i, done, at - part.start, take))
                part.end = at + take
            else:
                if part is not None:
                    yield part
                take = min(length - done, part_size)
                part = _Part(at, at + take, [(i, done, 0, take)])
            done += take
    if part is not None:
        yield part


class SourceObject:
    """One object of a checkpoint, read-only. `open` takes its identity; `read` and `stream` return
    its bytes as they were then, or raise BadInput."""

    def __init__(self, store: Store, location: Location, identity: Identity):
        self.store, self.location, self.identity = store, location, identity

    @classmethod
    def open(cls, location: Location, options: StorageOptions = StorageOptions(), store: Optional[Store] = None):
        """The object at `location` (a HEAD, retried like every read). Pass `store` (from `reading`)
        to share one client among the files of a checkpoint."""
        store = store or reading(location, options)
        meta = _retrying(store, lambda: _obstore().head(store.handle, location.key),
                         f"{location}", missing="no such object")
        return cls(store, location, Identity(meta.get("e_tag"), meta["size"], meta.get("version")))

    @property
    def size(self) -> int:
        return self.identity.size

    def __repr__(self) -> str:
        return f"SourceObject({str(self.location)!r}, size={self.size})"

    def _fetch(self, start: int, end: int):
        """Bytes [start, end), as the object was when opened."""
        obstore, where = _obstore(), f"{self.location} (bytes {start}-{end})"
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
        return _retrying(self.store, get, where, missing="changed while it was being read (it is gone)")

    def read(self, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` (a header): one GET, or the window's for a long read."""
        if length <= self.store.options.part_size:
            _bounds(offset, length, self.size, self.location)
            return bytes(self._fetch(offset, offset + length)) if length else b""
        return b"".join(bytes(p.data) for p in self.stream([(offset, length)]))

    def stream(self, ranges: Iterable, concurrency: Optional[int] = None, part_size: Optional[int] = None
               ) -> Iterator[Piece]:
        """The bytes of (offset, length) `ranges` in the order given, as Pieces (a range longer than a
        part comes in several; an empty one in none). GETs run `concurrency` ahead of the consumer
        (default: the options'), each at most `part_size`; at most concurrency + 1 parts are held."""
        concurrency = concurrency or self.store.options.concurrency
        part_size = part_size or self.store.options.part_size
        window = deque()
        with ThreadPoolExecutor(concurrency, thread_name_prefix="ckptconv-get") as pool:
            try:
                for part in _plan(ranges, self.size, part_size, self.location):
                    if len(window) == concurrency:
                        yield from self._pieces(*window.popleft())
                    window.append((part, pool.submit(self._fetch, part.start, part.end)))
                while window:
                    yield from self._pieces(*window.popleft())
            finally:
                for _, future in window:
                    future.cancel()

    @staticmethod
    def _pieces(part: _Part, future) -> Iterator[Piece]:
        view = memoryview(future.result())
        for index, offset, at, length in part.pieces:
            yield Piece(index, offset, view[at:at + length])
        check()   # a signal that arrived while the main thread waited in the pool (signals.py)


def listing(location: Location, options: StorageOptions = StorageOptions(), store: Optional[Store] = None) -> list:
    """Every object under the prefix `location` names ("directory/"), as Entries sorted by name;
    BadInput past MAX_LISTED objects."""
    store = store or reading(location, options)
    prefix = f"{location.key}/" if location.key else ""
    found = []

    def collect():
        found.clear()
        for batch in _obstore().list(store.handle, prefix or None, chunk_size=1000):
            for meta in batch:
                found.append(Entry(meta["path"][len(prefix):], meta["size"]))
                if len(found) > MAX_LISTED:
                    raise BadInput(f"{location}: holds more than {MAX_LISTED:,} objects; not a checkpoint to list")
        return found
    _retrying(store, collect, f"{location}", missing="no such prefix")
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


def _retrying(store: Store, call, where: str, missing: str):
    """`call()`, retried within the store's budget while it fails transiently. Failures become one
    BadInput line: a changed object, a missing one (`missing`), or the last error and the attempts."""
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
                raise BadInput(f"{where}: {failure(e)} (gave up after {retry.spent()})") from None
            raise BadInput(f"{where}: {failure(e)}") from None
