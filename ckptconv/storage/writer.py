"""An object written as a stream (`ObjectWriter`), and the object a consumer opens first (`PointerWriter`).

`ObjectWriter`: `write(bytes)` hashes (SHA-256, the same pass) and buffers at most one part; the
first full part starts a multipart upload (obstore's `put` fed from a queue of one part, in a thread),
`commit()` completes it (an object smaller than a part is one PUT), `abort()` leaves nothing: obstore
aborts the multipart upload its iterator fails (obstore/src/put.rs, put_multipart_inner), and a
committed object is deleted. Parts are at least `part_size` and large enough that the expected size
fits in S3's 10,000 parts.

`PointerWriter`: written as a stream like any object, but it appears only when `commit` completes it,
create-only, after everything else (publisher.Publisher decides when).
"""
import queue
import threading
from dataclasses import dataclass
from typing import Optional

from ..errors import OutputError
from ..io import sha256
from ..signals import check
from .urls import MIB, Location, Store, failure

MAX_PARTS = 10_000      # S3's (and GCS's XML API's) limit of parts per upload
MIN_PART = 5 * MIB      # S3's smallest part but the last
MAX_PART = 5 << 30      # S3's largest part


def part_size_for(expected: Optional[int], preferred: int) -> int:
    """The part size for an object of about `expected` bytes: `preferred` (at least 5 MiB), grown to a
    whole MiB such that the object needs at most 10,000 parts."""
    size = max(preferred, MIN_PART)
    if expected and expected > MAX_PARTS * size:
        size = -(-expected // MAX_PARTS)
        size = -(-size // MIB) * MIB
    if size > MAX_PART:
        raise OutputError(f"an object of {expected:,} bytes needs parts over 5 GiB; the store takes at most "
                          f"{MAX_PARTS:,} parts of 5 GiB")
    return size


@dataclass(frozen=True)
class Committed:
    """An object committed (an ObjectWriter's or PointerWriter's): its location, bytes, SHA-256 (hex) and ETag."""

    location: Location
    size: int
    sha256: str
    etag: Optional[str]


_END, _ABORT = object(), object()


class _Aborted(Exception):
    pass


class ObjectWriter:
    """An object written as a stream. Memory: the part being filled, one queued, and obstore's
    buffer and `upload_concurrency` parts in flight."""

    def __init__(self, store: Store, location: Location, expected_size: Optional[int] = None,
                 mode: str = "overwrite", hashed: bool = True, side_by_side: int = 1):
        """`hashed=False`: the caller hashes the bytes (the write pipeline does: io/hashing.py) and
        `commit` gives no digest; `side_by_side`: how many objects are written side by side (a reshard's
        ranks), among which the options' upload concurrency is divided and parts are made smaller."""
        self.store, self.location, self.mode = store, location, mode
        side_by_side = max(1, side_by_side)
        self.part = part_size_for(expected_size, max(MIN_PART, store.options.part_size // side_by_side))
        self.concurrency = max(1, store.options.upload_concurrency // side_by_side)
        self.size, self.state = 0, "open"
        self._hash, self._buf = (sha256.new() if hashed else None), bytearray()
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._thread: Optional[threading.Thread] = None
        self._result, self._error = None, None

    def __repr__(self) -> str:
        return f"ObjectWriter({str(self.location)!r}, {self.state}, {self.size} bytes)"

    def write(self, data) -> int:
        if self.state != "open":
            raise OutputError(f"{self.location}: written after it was {self.state}")
        view = memoryview(data).cast("B")
        count = len(view)
        if self.mode == "create":   # one PUT at commit (create-only is not a multipart upload)
            if self.size + count > MAX_PART:
                raise OutputError(f"{self.location}: a create-only object holds at most 5 GiB")
            if self._hash is not None:
                self._hash.update(view)
            self._buf += view
            self.size += count
            return count
        if self.size + count > self.part * MAX_PARTS:
            raise OutputError(f"{self.location}: more than {self.part * MAX_PARTS:,} bytes, what {MAX_PARTS:,} parts "
                              f"of {self.part:,} bytes hold; give the expected size when it is opened")
        if self._hash is not None:
            self._hash.update(view)
        self.size += count
        while len(view):
            take = min(len(view), self.part - len(self._buf))
            self._buf += view[:take]
            view = view[take:]
            if len(self._buf) == self.part:
                self._send(self._buf)
                self._buf = bytearray()
                check()   # once per part: a signal pending since it arrived outside our code (signals.py)
        return count

    def _parts(self):
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if item is _ABORT:
                raise _Aborted("aborted")
            yield item

    def _upload(self):
        import obstore
        try:
            self._result = obstore.put(self.store.handle, self.location.key, self._parts(), chunk_size=self.part,
                                       max_concurrency=self.concurrency, use_multipart=True)
        except BaseException as e:  # noqa: BLE001 (handed to the writing thread)
            self._error = e

    def _send(self, item):
        if self._thread is None:
            self._thread = threading.Thread(target=self._upload, name="ckptconv-put", daemon=True)
            self._thread.start()
        while True:
            if self._error is not None or not self._thread.is_alive():
                self._failed()
            try:
                self._queue.put(item, timeout=0.2)
                return
            except queue.Full:
                check()   # a signal that arrived while we waited in the queue's code (signals.py)

    def _failed(self):
        self.state = "failed"
        error = self._error
        if isinstance(error, _Aborted) or error is None:
            raise OutputError(f"{self.location}: the upload stopped")
        raise OutputError(f"{self.location}: upload failed: {failure(error)}") from None

    def commit(self) -> Committed:
        """Complete the object; OutputError if it could not be (then nothing of it is left)."""
        import obstore
        if self.state != "open":
            raise OutputError(f"{self.location}: committed after it was {self.state}")
        if self._thread is None:
            try:
                self._result = obstore.put(self.store.handle, self.location.key, self._buf, mode=self.mode,
                                           use_multipart=False)
            except Exception as e:  # noqa: BLE001
                self.state = "failed"
                if self.mode == "create" and type(e).__name__ in ("AlreadyExistsError", "PreconditionError"):
                    raise OutputError(f"{self.location}: already exists (another run published it)") from None
                raise OutputError(f"{self.location}: upload failed: {failure(e)}") from None
        else:
            if self._buf:
                self._send(self._buf)
            self._send(_END)
            self._thread.join()
            if self._error is not None:
                self._failed()
        self._buf = bytearray()
        self.state = "committed"
        return Committed(self.location, self.size, self._hash.hexdigest() if self._hash is not None else None,
                       (self._result or {}).get("e_tag"))

    def abort(self):
        """Leave nothing: the multipart upload aborted (by obstore, when its parts fail), the object
        deleted if it was committed."""
        import obstore
        state, self.state = self.state, "aborted"
        self._buf = bytearray()
        if self._thread is not None:
            while self._thread.is_alive():
                try:
                    self._queue.get_nowait()   # a part not yet taken: never uploaded
                except queue.Empty:
                    pass
                try:
                    self._queue.put(_ABORT, timeout=0.2)
                    break
                except queue.Full:
                    continue
            self._thread.join()
        if state == "committed":
            obstore.delete(self.store.handle, self.location.key)


class PointerWriter:
    """An output's pointer: written as a stream like any object, but it appears only when `commit`
    completes it, create-only, after everything else. Its first part (`head` bytes at least, a single
    file's header rewritten at the end: `patch`) is held until then; an object larger than that and
    one more part goes to S3 as a multipart upload of ours (s3api.Multipart: part 1 sent last, the
    upload completed with `If-None-Match: *`); a smaller one is one create-only PUT on any store.
    obstore has no conditional multipart completion, so on gs:// and az:// a larger pointer is refused
    (docs/storage.md). Memory: the first part, the part being filled, and the parts in flight."""

    def __init__(self, store: Store, location: Location, expected_size: Optional[int] = None, head: int = 0):
        self.store, self.location = store, location
        self.part = part_size_for(expected_size, store.options.part_size)
        self.first = max(self.part, -(-head // MIB) * MIB)
        if self.first > MAX_PART:
            raise OutputError(f"{location}: its first {head:,} bytes, held until it is published, pass a part's 5 GiB")
        self.size, self.state = 0, "open"
        self._head, self._buf, self._next = bytearray(), bytearray(), 2
        self._upload = None

    def __repr__(self) -> str:
        return f"PointerWriter({str(self.location)!r}, {self.state}, {self.size} bytes)"

    def write(self, data) -> int:
        if self.state != "open":
            raise OutputError(f"{self.location}: written after it was {self.state}")
        view = memoryview(data).cast("B")
        count = len(view)
        if self.size + count > self.first + self.part * (MAX_PARTS - 1):
            raise OutputError(f"{self.location}: more bytes than {MAX_PARTS:,} parts of {self.part:,} hold")
        self.size += count
        if len(self._head) < self.first:
            take = min(len(view), self.first - len(self._head))
            self._head += view[:take]
            view = view[take:]
        while len(view):
            take = min(len(view), self.part - len(self._buf))
            self._buf += view[:take]
            view = view[take:]
            if len(self._buf) == self.part:
                self._send()
        return count

    def _send(self):
        if self._upload is None:
            if self.location.kind != "s3":
                self.state = "failed"
                raise OutputError(f"{self.location}: the file a consumer opens first is written create-only when "
                                  f"everything else is; past {self.first + self.part:,} bytes that takes S3's "
                                  "conditional multipart completion, which this store does not offer through "
                                  "ckptconv (raise --part-size to hold it, at most 5 GiB, or write a sharded OUT)")
            from .s3api import Multipart
            self._upload = Multipart(self.location, self.store.options)
        self._upload.part(self._next, self._buf)
        self._next += 1
        self._buf = bytearray()

    def patch(self, offset: int, data):
        """Rewrite bytes [offset, offset + len(data)) of the held first part."""
        view = memoryview(data).cast("B")
        if offset < 0 or offset + len(view) > len(self._head):
            raise OutputError(f"{self.location}: bytes {offset}..{offset + len(view)} are not held to be rewritten")
        self._head[offset:offset + len(view)] = view

    def finish(self):
        """Every byte is written (the object is still not there: `commit` makes it appear)."""
        if self.state == "open":
            self.state = "written"

    def commit(self) -> Committed:
        """Make the object appear, create-only: OutputError (and nothing left) if it already exists."""
        import obstore
        try:
            if self._upload is None:
                result = obstore.put(self.store.handle, self.location.key, bytes(self._head + self._buf), mode="create",
                                     use_multipart=False)
                etag = result.get("e_tag")
            else:
                from .s3api import Refused
                if self._buf:
                    self._upload.part(self._next, self._buf)
                self._upload.part(1, self._head)
                try:
                    etag = self._upload.complete(create_only=True)["e_tag"]
                except Refused as e:
                    if e.status == 412:
                        raise OutputError(f"{self.location}: already exists (another run published it)") from None
                    raise
        except OutputError:
            self.abort()
            raise
        except Exception as e:  # noqa: BLE001 (obstore's)
            self.abort()
            if type(e).__name__ in ("AlreadyExistsError", "PreconditionError"):
                raise OutputError(f"{self.location}: already exists (another run published it)") from None
            raise OutputError(f"{self.location}: upload failed: {failure(e)}") from None
        self.state = "committed"
        self._head = self._buf = bytearray()
        return Committed(self.location, self.size, None, etag)

    def abort(self):
        """Leave nothing: the held bytes dropped, a multipart upload begun aborted."""
        self.state = "aborted"
        self._head = self._buf = bytearray()
        upload, self._upload = self._upload, None
        if upload is not None:
            upload.abort()
