"""Outputs written to a store: each object uploaded as it is written, and one OUT's life.

`ObjectWriter`: `write(bytes)` hashes (SHA-256, the same pass) and buffers at most one part; the
first full part starts a multipart upload (obstore's `put` fed from a queue of one part, in a thread),
`commit()` completes it (an object smaller than a part is one PUT), `abort()` leaves nothing: obstore
aborts the multipart upload its iterator fails (obstore/src/put.rs, put_multipart_inner), and a
committed object is deleted. Parts are at least `part_size` and large enough that the expected size
fits in S3's 10,000 parts.

`Publisher`: one OUT prefix. `claim()` creates the lock object `.NAME.ckptconv-lock` beside OUT with
a create-only PUT (naming host, pid, time; a heartbeat rewrites it, conditional on its ETag, while
the run lives); a second claimer refuses at once. A lock whose run is gone (same host and its pid
dead, or no heartbeat for `stale_seconds`) is reported, and taken over with `take_over=True`
(--resume/--overwrite), which also aborts the multipart uploads pending under OUT. Every object
written through it is tracked; `publish(pointer, data)` writes the pointer last with a create-only
PUT (a consumer that finds it finds everything); `rollback()` aborts what is open, deletes what was
created and lets the lock go.
"""
import contextlib
import json
import os
import queue
import socket
import threading
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Optional

from .. import safejson
from ..errors import BadInput, OutputError
from ..io import sha256
from ..signals import check, deferred, on_escape
from .urls import MIB, Location, StorageOptions, Store, failure, open_store

MAX_PARTS = 10_000      # S3's (and GCS's XML API's) limit of parts per upload
MIN_PART = 5 * MIB      # S3's smallest part but the last
MAX_PART = 5 << 30      # S3's largest part
LOCK_LIMIT = 4096       # bytes of a lock object read


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
class Written:
    """An object committed: its location, bytes, SHA-256 (hex) and ETag."""

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
                 mode: str = "overwrite", hashed: bool = True, share: int = 1):
        """`hashed=False`: the caller hashes the bytes (the write pipeline does: io/hashing.py) and
        `commit` gives no digest; `share`: how many objects are written side by side (a reshard's
        ranks), among which the options' upload concurrency is divided and parts are made smaller."""
        self.store, self.location, self.mode = store, location, mode
        share = max(1, share)
        self.part = part_size_for(expected_size, max(MIN_PART, store.options.part_size // share))
        self.concurrency = max(1, store.options.upload_concurrency // share)
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

    def commit(self) -> Written:
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
        return Written(self.location, self.size, self._hash.hexdigest() if self._hash is not None else None,
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


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, from the lock object: a run on `host` with `pid`, its `run` id; `beat`: when
    the store last saw it renewed (the object's last-modified time)."""

    host: str
    pid: int
    run: str
    started: str
    beat: datetime
    version: dict      # the lock object's ETag and version: what a take-over is conditional on

    def gone(self, stale_seconds: float) -> bool:
        """Whether its run is known to be gone: a dead pid on this host, or no heartbeat for long."""
        if self.host == socket.gethostname() and _dead(self.pid):
            return True
        return (datetime.now(timezone.utc) - self.beat).total_seconds() > stale_seconds

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}"


def _version(meta) -> dict:
    """An object's ETag and version (what obstore's conditional update takes; S3 uses the ETag, GCS
    the generation), from a put's result or an object's metadata."""
    return {k: meta[k] for k in ("e_tag", "version") if meta.get(k) is not None}


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError):
        return False
    return False


class Publisher:
    """One OUT prefix: claim it, write into it, publish it pointer last, or roll it back."""

    def __init__(self, out: Location, options: StorageOptions = StorageOptions(), store: Optional[Store] = None,
                 heartbeat_seconds: float = 60.0, stale_seconds: float = 600.0, single: bool = False):
        """`single`: OUT is one object (a .safetensors file), not a prefix; the objects written are
        OUT itself, by its name."""
        if not out.key:
            raise OutputError(f"{out}: OUT must be a prefix inside the bucket (s3://BUCKET/NAME), not the bucket")
        self.out, self.options, self.single = out, options, single
        self.pointer_writer: Optional[PointerWriter] = None
        self.store = store or open_store(out, options)
        self.lock = out.sibling(f".{out.key.rpartition('/')[2]}.ckptconv-lock")
        self.heartbeat_seconds, self.stale_seconds = heartbeat_seconds, stale_seconds
        self.created: list = []     # keys of the objects committed, in order
        self.open: list = []        # ObjectWriters not yet committed
        self.started: set = set()   # keys any writer of this run was given: a signal between a PUT's
        #                             answer and its bookkeeping leaves an object only this names
        self._lock: Optional[dict] = None   # this run's lock object's ETag and version, while it holds it
        self._lost = False
        self._stop = threading.Event()
        self._beater: Optional[threading.Thread] = None
        self._escape = contextlib.ExitStack()   # while claimed: the rollback a signal's last resort runs
        self._guard = threading.Lock()
        self.me = {"ckptconv": "lock", "host": socket.gethostname(), "pid": os.getpid(), "run": uuid.uuid4().hex,
                   "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}

    def __repr__(self) -> str:
        held = "claimed" if self._lock else "unclaimed"
        return f"Publisher({str(self.out)!r}, {len(self.created)} created, {held})"

    # -- the lock ---------------------------------------------------------------------------------
    def holder(self) -> Optional[Holder]:
        """Who holds OUT's lock now, or None when there is none."""
        import obstore
        try:
            meta = obstore.head(self.store.handle, self.lock.key)
            data = b"" if meta["size"] > LOCK_LIMIT else bytes(obstore.get(
                self.store.handle, self.lock.key, options={"if_match": meta["e_tag"]} if meta.get("e_tag") else None
            ).bytes())
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001
            raise OutputError(f"{self.lock}: cannot read the lock: {failure(e)}") from None
        try:
            fields = safejson.loads(data, str(self.lock), "lock") if data else None
        except BadInput:
            fields = None
        if not (isinstance(fields, dict) and fields.get("ckptconv") == "lock" and isinstance(fields.get("pid"), int)
                and all(isinstance(fields.get(k), str) for k in ("host", "run", "started"))):
            raise OutputError(f"{self.lock}: is not a lock of ckptconv's; remove it if no run is writing {self.out}")
        return Holder(fields["host"], fields["pid"], fields["run"], fields["started"], meta["last_modified"],
                      _version(meta))

    def claim(self, take_over: bool = False) -> Optional[Holder]:
        """Create OUT's lock, or refuse: another live run holds it; or one that is gone does and
        `take_over` is not given (--resume, --overwrite). Taking over replaces that lock, conditional on
        its ETag (of two runs taking over, one wins), and aborts the uploads pending under OUT. Returns
        the holder taken over from, if any."""
        import obstore
        body = json.dumps(self.me).encode()
        with deferred():
            try:
                self._lock = _version(obstore.put(self.store.handle, self.lock.key, body, mode="create"))
                self._beat_start()
                return None
            except Exception as e:  # noqa: BLE001
                if type(e).__name__ not in ("AlreadyExistsError", "PreconditionError"):
                    raise OutputError(f"{self.lock}: cannot create the lock: {failure(e)}") from None
            holder = self.holder()
            if holder is None:
                raise OutputError(f"{self.out}: another run is claiming it; try again")
            if not holder.gone(self.stale_seconds):
                raise OutputError(f"{self.out}: another ckptconv run ({holder}) is writing it")
            if not take_over:
                raise OutputError(f"{self.out}: a run that is gone ({holder}) left its lock {self.lock}; "
                                  "--resume or --overwrite takes it over")
            try:
                self._lock = _version(obstore.put(self.store.handle, self.lock.key, body, mode=holder.version))
            except Exception as e:  # noqa: BLE001
                raise OutputError(f"{self.out}: another run took over its lock first ({failure(e)})") from None
            self._beat_start()
        self.abort_pending()
        return holder

    def _beat_start(self):
        self._escape.close()
        self._escape.enter_context(on_escape(self.rollback))
        self._beater = threading.Thread(target=self._beat, name="ckptconv-lock", daemon=True)
        self._beater.start()

    def _beat(self):
        import obstore
        while not self._stop.wait(self.heartbeat_seconds):
            try:
                with self._guard:
                    if self._stop.is_set():
                        return
                    self._lock = _version(obstore.put(self.store.handle, self.lock.key,
                                                      json.dumps(self.me).encode(), mode=self._lock))
            except Exception as e:  # noqa: BLE001
                if type(e).__name__ == "PreconditionError" or isinstance(e, FileNotFoundError):
                    self._lost = True   # taken over: this run must not publish
                    return
                # a transient failure: the next beat tries again (stale_seconds is many beats)

    def _check_held(self):
        if self._lock is None:
            raise OutputError(f"{self.out}: written before it was claimed")
        if self._lost:
            raise OutputError(f"{self.out}: another run took over its lock; this run stops without publishing")

    def release(self):
        """Let the lock go, if it is still this run's (checked by ETag just before it is deleted)."""
        import obstore
        self._stop.set()
        self._escape.close()
        with self._guard:
            if self._lock is None:
                return
            mine, self._lock = self._lock, None
            if self._lost:
                return
            try:
                if obstore.head(self.store.handle, self.lock.key).get("e_tag") == mine.get("e_tag"):
                    obstore.delete(self.store.handle, self.lock.key)
            except FileNotFoundError:
                pass

    # -- writing ----------------------------------------------------------------------------------
    def place(self, name: str) -> Location:
        """Where the object `name` of OUT goes: OUT/`name`; for a single-file OUT, OUT itself."""
        if self.single:
            if name != self.out.key.rpartition("/")[2]:
                raise OutputError(f"{self.out}: one object, not a prefix holding {name}")
            return self.out
        return self.out.child(name)

    def writer(self, name: str, expected_size: Optional[int] = None, hashed: bool = True,
               share: int = 1) -> ObjectWriter:
        """An ObjectWriter for OUT/`name`, tracked: committed through it, rolled back with the rest."""
        self._check_held()
        w = _Tracked(self, self.store, self.place(name), expected_size, hashed=hashed, share=share)
        self.started.add(w.location.key)
        self.open.append(w)
        return w

    def pointer(self, name: str, expected_size: Optional[int] = None, head: int = 0) -> "PointerWriter":
        """The writer of OUT's pointer (the file a consumer opens first): its bytes are written now and
        held or sent as parts, but the object appears only at `publish_pointer`, create-only. `head`:
        its first bytes that may still be rewritten (`patch`) until then (a single file's header)."""
        self._check_held()
        if self.pointer_writer is not None:
            raise OutputError(f"{self.out}: its pointer is already being written")
        self.pointer_writer = PointerWriter(self.store, self.place(name), expected_size, head)
        return self.pointer_writer

    def publish_pointer(self) -> Written:
        """Complete the pointer, create-only, after everything else (see `publish`), and let the lock
        go: from now on a consumer finds the whole output."""
        self._check_held()
        w = self.pointer_writer
        if w is None or w.state != "written":
            raise OutputError(f"{self.out}: its pointer was not written; nothing was published")
        if self.open:
            raise OutputError(f"{self.out}: {len(self.open)} object(s) still being written, "
                              f"{self.open[0].location} first; the pointer is written last")
        with deferred():
            self._check_held()
            done = w.commit()
            self.pointer_writer = None
            self.created.append(w.location.key)
            self.release()
        return done

    def copy(self, source: str, name: str):
        """OUT/`name` as a copy of OUT/`source`, made by the store (no bytes pass through here), tracked."""
        import obstore
        self._check_held()
        to = self.place(name)
        try:
            obstore.copy(self.store.handle, self.place(source).key, to.key)
        except Exception as e:  # noqa: BLE001
            raise OutputError(f"{to}: cannot copy {source} there: {failure(e)}") from None
        if to.key not in self.created:
            self.created.append(to.key)

    def adopt(self, keys):
        """Objects already under OUT (what a killed run left, taken over) become this run's: kept if it
        publishes, deleted with the rest if it fails."""
        self._check_held()
        self.created += [k for k in keys if k not in self.created]

    def delete(self, keys):
        """Delete objects under OUT (this run's, or adopted), a thousand a request."""
        import obstore
        self._check_held()
        keys = list(keys)
        for at in range(0, len(keys), 1000):
            try:
                obstore.delete(self.store.handle, keys[at:at + 1000])
            except Exception as e:  # noqa: BLE001
                raise OutputError(f"{self.out}: cannot delete {keys[at]}: {failure(e)}") from None
        gone = set(keys)
        self.created = [k for k in self.created if k not in gone]

    def put(self, name: str, data: bytes) -> Written:
        """A small object (manifest.json, SHA256SUMS, an extra) written whole."""
        w = self.writer(name, len(data))
        w.write(data)
        return w.commit()

    def publish(self, pointer: str, data: bytes) -> Written:
        """Write the pointer (the file a consumer opens first), create-only, after everything else:
        OutputError if any writer is still open, the lock was lost, or a pointer is already there."""
        self._check_held()
        if self.open:
            raise OutputError(f"{self.out}: {len(self.open)} object(s) still being written, "
                              f"{self.open[0].location} first; the pointer is written last")
        with deferred():
            self._check_held()
            w = _Tracked(self, self.store, self.out.child(pointer), len(data), mode="create")
            self.open.append(w)
            w.write(data)
            done = w.commit()
            self.release()
        return done

    def rollback(self) -> list:
        """Abort what is open, delete what was created, abort uploads of this run's keys left pending,
        let the lock go; each step is tried whatever the others did, and what failed is returned (one
        line each). Nothing is deleted once the lock was taken over (it is the other run's OUT now)."""
        import obstore
        problems = []

        def attempt(step, *args):
            try:
                step(*args)
            except Exception as e:  # noqa: BLE001
                problems.append(str(e) if isinstance(e, OutputError) else f"{self.out}: {failure(e)}")
        with deferred():
            multipart = {w.location.key for w in self.open if w._thread is not None}
            for w in list(self.open):
                attempt(w.abort)
            self.open.clear()
            if self.pointer_writer is not None:
                attempt(self.pointer_writer.abort)
                self.pointer_writer = None
            if not self._lost and self._lock is not None:
                # what was committed, and what any writer was given (deleting a key never written is a no-op)
                doomed = self.created + sorted(self.started - set(self.created))
                for at in range(0, len(doomed), 1000):
                    attempt(self._sweep, doomed[at:at + 1000])
                self.created.clear()
                self.started.clear()
                if multipart and self.out.kind == "s3":   # (obstore aborts what fails; a sweep for what it could not)
                    attempt(self.abort_pending, multipart)
            attempt(self.release)
        return problems

    def _sweep(self, keys: list):
        """Delete `keys`, some of which may never have been written: S3 says nothing of a key that is
        not there, GCS answers 404 (obstore's FileNotFoundError), the others are deleted one by one."""
        import obstore
        try:
            obstore.delete(self.store.handle, keys)
        except FileNotFoundError:
            for key in keys:
                with contextlib.suppress(FileNotFoundError):
                    obstore.delete(self.store.handle, key)

    def pending(self) -> Optional[list]:
        """The multipart uploads pending under OUT (s3api.Pending), or None where the store offers no
        listing of them (GCS and Azure: see docs/security.md)."""
        if self.out.kind != "s3":
            return None
        from . import s3api
        return s3api.pending(self.out, self.options, exact=self.single)

    def abort_pending(self, only: Optional[set] = None):
        """Abort the multipart uploads pending under OUT (those of `only`'s keys, when given)."""
        from . import s3api
        for upload in self.pending() or ():
            if only is None or upload.key in only:
                s3api.abort(self.out, upload, self.options)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if kind is not None:
            self.rollback()
        else:
            self.release()
        return False


class _Tracked(ObjectWriter):
    """An ObjectWriter whose commit and abort the Publisher records."""

    def __init__(self, publisher: Publisher, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.publisher = publisher

    def commit(self) -> Written:
        self.publisher._check_held()
        done = super().commit()   # (one that fails stays open: the rollback sweeps what it may have left)
        self.publisher.open.remove(self)
        if self.location.key not in self.publisher.created:   # (a journal is written again and again)
            self.publisher.created.append(self.location.key)
        return done

    def abort(self):
        if self in self.publisher.open:
            self.publisher.open.remove(self)
        super().abort()
        if self.location.key in self.publisher.created:
            self.publisher.created.remove(self.location.key)


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

    def commit(self) -> Written:
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
        return Written(self.location, self.size, None, etag)

    def abort(self):
        """Leave nothing: the held bytes dropped, a multipart upload begun aborted."""
        self.state = "aborted"
        self._head = self._buf = bytearray()
        upload, self._upload = self._upload, None
        if upload is not None:
            upload.abort()
