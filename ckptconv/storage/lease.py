"""The lock that makes one run the only writer of an OUT prefix: the object `.NAME.ckptconv-lock`
beside OUT, created with a create-only PUT (naming host, pid, run, time) and rewritten by a heartbeat,
conditional on its ETag, while the run lives; a second claimer refuses at once. A lock whose run is
gone (same host and its pid dead, or no heartbeat for `stale_seconds`) is reported, and taken over
only when asked (--resume, --overwrite), conditional on its version: of two runs taking over, one
wins. A run whose lock was taken over (its heartbeat refused) must not publish (`check`).
"""
import json
import os
import socket
import threading
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Optional

from .. import safejson
from ..errors import BadInput, OutputError
from ..signals import deferred
from .urls import Location, Store, failure

LOCK_LIMIT = 4096       # bytes of a lock object read


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



class Lease:
    """OUT's lock object, as this run holds it or not (see the module docstring)."""

    def __init__(self, store: Store, out: Location, heartbeat_seconds: float = 60.0, stale_seconds: float = 600.0):
        self.store, self.out = store, out
        self.location = out.sibling(f".{out.key.rpartition('/')[2]}.ckptconv-lock")
        self.heartbeat_seconds, self.stale_seconds = heartbeat_seconds, stale_seconds
        self.version: Optional[dict] = None   # this run's lock object's ETag and version, while it holds it
        self.lost = False
        self._stop = threading.Event()
        self._beater: Optional[threading.Thread] = None
        self._guard = threading.Lock()
        self.me = {"ckptconv": "lock", "host": socket.gethostname(), "pid": os.getpid(), "run": uuid.uuid4().hex,
                   "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}

    @property
    def held(self) -> bool:
        return self.version is not None

    def holder(self) -> Optional[Holder]:
        """Who holds OUT's lock now, or None when there is none."""
        import obstore
        try:
            meta = obstore.head(self.store.handle, self.location.key)
            data = b"" if meta["size"] > LOCK_LIMIT else bytes(obstore.get(
                self.store.handle, self.location.key,
                options={"if_match": meta["e_tag"]} if meta.get("e_tag") else None).bytes())
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001
            raise OutputError(f"{self.location}: cannot read the lock: {failure(e)}") from None
        try:
            fields = safejson.loads(data, str(self.location), "lock") if data else None
        except BadInput:
            fields = None
        if not (isinstance(fields, dict) and fields.get("ckptconv") == "lock" and isinstance(fields.get("pid"), int)
                and all(isinstance(fields.get(k), str) for k in ("host", "run", "started"))):
            raise OutputError(f"{self.location}: is not a lock of ckptconv's; remove it if no run is writing {self.out}")
        return Holder(fields["host"], fields["pid"], fields["run"], fields["started"], meta["last_modified"],
                      _version(meta))

    def claim(self, take_over: bool = False) -> Optional[Holder]:
        """Create the lock, or refuse: another live run holds it; or one that is gone does and
        `take_over` is not given. Taking over replaces that lock, conditional on its version. Returns
        the holder taken over from, if any; the heartbeat runs from now until `release`."""
        import obstore
        body = json.dumps(self.me).encode()
        with deferred():
            try:
                self.version = _version(obstore.put(self.store.handle, self.location.key, body, mode="create"))
                self._beat_start()
                return None
            except Exception as e:  # noqa: BLE001
                if type(e).__name__ not in ("AlreadyExistsError", "PreconditionError"):
                    raise OutputError(f"{self.location}: cannot create the lock: {failure(e)}") from None
            holder = self.holder()
            if holder is None:
                raise OutputError(f"{self.out}: another run is claiming it; try again")
            if not holder.gone(self.stale_seconds):
                raise OutputError(f"{self.out}: another ckptconv run ({holder}) is writing it")
            if not take_over:
                raise OutputError(f"{self.out}: a run that is gone ({holder}) left its lock {self.location}; "
                                  "--resume or --overwrite takes it over")
            try:
                self.version = _version(obstore.put(self.store.handle, self.location.key, body, mode=holder.version))
            except Exception as e:  # noqa: BLE001
                raise OutputError(f"{self.out}: another run took over its lock first ({failure(e)})") from None
            self._beat_start()
        return holder

    def _beat_start(self):
        self._beater = threading.Thread(target=self._beat, name="ckptconv-lock", daemon=True)
        self._beater.start()

    def _beat(self):
        import obstore
        while not self._stop.wait(self.heartbeat_seconds):
            try:
                with self._guard:
                    if self._stop.is_set():
                        return
                    self.version = _version(obstore.put(self.store.handle, self.location.key,
                                                        json.dumps(self.me).encode(), mode=self.version))
            except Exception as e:  # noqa: BLE001
                if type(e).__name__ == "PreconditionError" or isinstance(e, FileNotFoundError):
                    self.lost = True   # taken over: this run must not publish
                    return
                # a transient failure: the next beat tries again (stale_seconds is many beats)

    def check(self):
        """OutputError unless this run holds the lock now."""
        if self.version is None:
            raise OutputError(f"{self.out}: written before it was claimed")
        if self.lost:
            raise OutputError(f"{self.out}: another run took over its lock; this run stops without publishing")

    def release(self):
        """Let the lock go, if it is still this run's (checked by ETag just before it is deleted)."""
        import obstore
        self._stop.set()
        with self._guard:
            if self.version is None:
                return
            mine, self.version = self.version, None
            if self.lost:
                return
            try:
                if obstore.head(self.store.handle, self.location.key).get("e_tag") == mine.get("e_tag"):
                    obstore.delete(self.store.handle, self.location.key)
            except FileNotFoundError:
                pass
