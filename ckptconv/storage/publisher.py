"""One OUT in an object store, from claim to publication (docs/storage.md): `claim()` takes OUT's
lock (lease.py); every object written through it is tracked (`writer`, `put`, `copy`, `adopt`);
`publish(pointer, data)` / `publish_pointer()` write the pointer last with a create-only PUT (a
consumer that finds it finds everything); `rollback()` aborts what is open, deletes what was created
and lets the lock go.
"""
import contextlib
from typing import Optional

from ..errors import OutputError
from ..signals import deferred, on_escape
from .lease import Holder, Lease
from .urls import Location, StorageOptions, Store, failure, open_store
from .writer import Committed, ObjectWriter, PointerWriter


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
        self.lease = Lease(self.store, out, heartbeat_seconds, stale_seconds)
        self.created: list = []     # keys of the objects committed, in order
        self.open: list = []        # ObjectWriters not yet committed
        self.started: set = set()   # keys any writer of this run was given: a signal between a PUT's
        #                             answer and its bookkeeping leaves an object only this names
        self._escape = contextlib.ExitStack()   # while claimed: the rollback a signal's last resort runs

    def __repr__(self) -> str:
        held = "claimed" if self.lease.held else "unclaimed"
        return f"Publisher({str(self.out)!r}, {len(self.created)} created, {held})"

    # -- the lock (lease.py) ----------------------------------------------------------------------
    @property
    def lock(self) -> Location:
        return self.lease.location

    @property
    def me(self) -> dict:
        return self.lease.me

    @property
    def _lost(self) -> bool:
        return self.lease.lost

    def holder(self) -> Optional[Holder]:
        return self.lease.holder()

    def claim(self, take_over: bool = False) -> Optional[Holder]:
        """Claim OUT (Lease.claim): from now on a signal's last resort rolls the run back. Taking over a
        gone run's lock also aborts the uploads pending under OUT. Returns the holder taken over from."""
        with deferred():
            taken = self.lease.claim(take_over)
            self._escape.close()
            self._escape.enter_context(on_escape(self.rollback))
        if taken is not None:
            self.abort_pending()
        return taken

    def _check_held(self):
        self.lease.check()

    def release(self):
        """Let the lock go, if it is still this run's."""
        self._escape.close()
        self.lease.release()

    # -- writing ----------------------------------------------------------------------------------
    def place(self, name: str) -> Location:
        """Where the object `name` of OUT goes: OUT/`name`; for a single-file OUT, OUT itself."""
        if self.single:
            if name != self.out.key.rpartition("/")[2]:
                raise OutputError(f"{self.out}: one object, not a prefix holding {name}")
            return self.out
        return self.out.child(name)

    def writer(self, name: str, expected_size: Optional[int] = None, hashed: bool = True,
               side_by_side: int = 1) -> ObjectWriter:
        """An ObjectWriter for OUT/`name`, tracked: committed through it, rolled back with the rest."""
        self._check_held()
        w = _Tracked(self, self.store, self.place(name), expected_size, hashed=hashed, side_by_side=side_by_side)
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

    def publish_pointer(self) -> Committed:
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

    def put(self, name: str, data: bytes) -> Committed:
        """A small object (manifest.json, SHA256SUMS, an extra) written whole."""
        w = self.writer(name, len(data))
        w.write(data)
        return w.commit()

    def publish(self, pointer: str, data: bytes) -> Committed:
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

    def rollback(self, everything: bool = False) -> list:
        """Abort what is open, delete what was created, abort uploads of this run's keys left pending
        (with `everything`: every upload pending under OUT, a task's too), let the lock go; each step
        is tried whatever the others did, and what failed is returned (one line each). Nothing is
        deleted once the lock was taken over (it is the other run's OUT now)."""
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
            if not self.lease.lost and self.lease.held:
                # what was committed, and what any writer was given (deleting a key never written is a no-op)
                doomed = self.created + sorted(self.started - set(self.created))
                for at in range(0, len(doomed), 1000):
                    attempt(self._sweep, doomed[at:at + 1000])
                self.created.clear()
                self.started.clear()
                if (multipart or everything) and self.out.kind == "s3":   # (obstore aborts what fails; a sweep
                    attempt(self.abort_pending, None if everything else multipart)   # for what it could not)
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

    def commit(self) -> Committed:
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
