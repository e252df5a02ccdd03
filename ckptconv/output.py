"""Atomic output directories: build beside OUT, publish by rename, and never leave half an OUT.

`OUT` is built in `.OUT.ckptconv-tmp` next to it, guarded by `.OUT.ckptconv-lock` (pid and host).
On success the temporary directory is renamed to OUT; on any failure it is removed. A lock whose
process is gone (a killed run) is recognised and its leftovers are cleaned up by the next run.
"""
import contextlib
import json
import os
import shutil
import socket
import time
from pathlib import Path

from .errors import OutputError


def temp_path(out: Path) -> Path:
    return out.parent / f".{out.name}.ckptconv-tmp"


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.ckptconv-lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _take_lock(out: Path) -> Path:
    lock = lock_path(out)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(lock.read_text() or "{}")
            except (OSError, ValueError):
                holder = {}
            pid, host = holder.get("pid"), holder.get("host")
            if isinstance(pid, int) and host == me["host"] and not _alive(pid):
                lock.unlink(missing_ok=True)  # a killed run's lock: take it over
                continue
            if not holder:
                raise OutputError(f"{out}: another run is starting to write it (lock {lock}); "
                                  "delete the lock if no run is active")
            raise OutputError(f"{out}: another ckptconv run (pid {pid} on {host}) is writing it; "
                              f"if it is gone, delete {lock}")
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return lock
    raise OutputError(f"{out}: could not take the lock {lock}")


@contextlib.contextmanager
def atomic_output(out, overwrite=False, resume=False):
    """Yield a temporary directory; publish it as `out` if the block succeeds, remove it otherwise.
    With `resume`, what a killed run left there is handed back for the writer to re-verify."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise OutputError(f"{out}: already exists (use --overwrite to replace it)")
    if not out.parent.is_dir():
        raise OutputError(f"{out.parent}: output's parent directory does not exist")
    lock = _take_lock(out)
    tmp = temp_path(out)
    try:
        if tmp.exists() and not resume:
            shutil.rmtree(tmp)  # left by a killed run
        tmp.mkdir(exist_ok=resume)
        yield tmp
        _fsync_dir(tmp)
        if out.exists():
            old = out.parent / f".{out.name}.ckptconv-old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        lock.unlink(missing_ok=True)


def _fsync_dir(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
