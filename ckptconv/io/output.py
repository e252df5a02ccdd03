"""Atomic output directories: build beside OUT, publish by rename, and never leave half an OUT.

`OUT` is built in `.OUT.ckptconv-tmp` next to it, guarded by `.OUT.ckptconv-lock` (pid and host).
On success the temporary directory is renamed to OUT; on any failure or terminating signal it is
removed. A lock whose process is gone (a killed run) is recognised and its leftovers are cleaned up
by the next run. What may be replaced is narrow: OUT may not be, or hold, any input; an existing
OUT must be empty, or a previous ckptconv output when `--overwrite` is given.
"""
import contextlib
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from .. import safejson
from ..errors import BadInput, OutputError
from ..signals import check, deferred, on_escape, published


def temp_path(out: Path) -> Path:
    return out.parent / f".{out.name}.ckptconv-tmp"


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.ckptconv-lock"


def _old_path(out: Path) -> Path:
    return out.parent / f".{out.name}.ckptconv-old"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def _never_ours(out: Path, single_file: bool) -> str:
    return "nothing may be replaced here"


@dataclass(frozen=True)
class Inputs:
    """What a run reads: OUT may not be or hold any of `files`, nor lie inside any of `roots` (the
    directories a reader of the source reads from: a later read of the source would take the
    output for part of it)."""

    files: tuple = ()
    roots: tuple = ()


def check_target(out: Path, inputs=(), overwrite=False, single_file=False, not_ours=_never_ours):
    """Refuse an OUT that a run must not replace: a symbolic link, one that is or holds an input or
    lies inside the source (`inputs`: an `Inputs`, or the files alone), an existing file, a non-empty
    directory without --overwrite, or with it, one that is not a previous output (`not_ours(out,
    single_file)` says why not, or None when it is: formats.not_ours). Paths are compared resolved."""
    if out.is_symlink():
        raise OutputError(f"{out}: is a symbolic link (to {os.readlink(out)}); give the path it points to")
    inputs = inputs if isinstance(inputs, Inputs) else Inputs(tuple(inputs))
    real = os.path.realpath(out)
    for p in inputs.files:
        if _inside(os.path.realpath(p), real):
            what = "is" if os.path.realpath(p) == real else "holds"
            raise OutputError(f"{out}: {what} the input {p}; write the output somewhere else")
    for root in inputs.roots:
        if _inside(real, os.path.realpath(root)):
            raise OutputError(f"{out}: lies inside the source directory {root}, where a later read of the source "
                              "would take it for part of the checkpoint; write the output somewhere else")
    if not out.parent.is_dir():
        raise OutputError(f"{out.parent}: output's parent directory does not exist")
    if not os.path.lexists(out):
        return
    if single_file:
        replaceable(out, overwrite, not_ours, True)
        return
    if not out.is_dir():
        raise OutputError(f"{out}: exists and is not a directory; remove it or choose another OUT")
    if not any(os.scandir(out)):
        return  # an empty directory (`mkdir out` first): replaced by the output
    replaceable(out, overwrite, not_ours, False)


def replaceable(out, overwrite: bool, not_ours, single_file: bool):
    """The one rule for an OUT that already holds something, on a disk or in a bucket
    (storage/targets.py): only --overwrite replaces it, and only a previous ckptconv output
    (`not_ours(out, single_file)` says why not, or None); OutputError otherwise."""
    if not overwrite:
        raise OutputError(f"{out}: already exists (use --overwrite to replace a previous ckptconv output)")
    why = not_ours(out, single_file)
    if why and single_file:
        raise OutputError(f"{out}: is not a single-file ckptconv output ({why}); --overwrite replaces only those")
    if why:
        raise OutputError(f"{out}: is not a ckptconv output ({why}); --overwrite replaces only those: remove it "
                          "yourself if it should go")


def _take_lock(out: Path) -> Path:
    lock = lock_path(out)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            try:   # (what is there may be anything: read as a file we do not trust, never waited on)
                holder = json.loads(safejson.read(lock, "lock", limit=1 << 12, follow=False) or b"{}")
            except BadInput as e:
                raise OutputError(f"{lock}: {str(e).split(': ', 1)[-1]}: not a lock of ckptconv's; remove it if "
                                  "no run is active") from None
            except ValueError:
                holder = {}
            holder = holder if isinstance(holder, dict) else {}
            pid, host = holder.get("pid"), holder.get("host")
            if isinstance(pid, int) and host == me["host"] and not _alive(pid):
                lock.unlink(missing_ok=True)  # a killed run's lock: take it over
                continue
            if not holder:
                raise OutputError(f"{out}: another run is starting to write it (lock {lock}); "
                                  "delete the lock if no run is active") from None
            raise OutputError(f"{out}: another ckptconv run (pid {pid} on {host}) is writing it; "
                              f"if it is gone, delete {lock}") from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return lock
    raise OutputError(f"{out}: could not take the lock {lock}")


def _leftover(path: Path):
    """A killed run leaves a directory (or, for a single file, a file) at its temporary and old
    names; anything else there (a symbolic link, a FIFO …) was put there by someone else: refused,
    never followed, renamed or removed."""
    if os.path.islink(path) or (os.path.lexists(path) and not (path.is_dir() or path.is_file())):
        what = f"a symbolic link (to {os.readlink(path)})" if os.path.islink(path) else "not a file or directory"
        raise OutputError(f"{path}: is {what}, not what a ckptconv run leaves there; remove it yourself")


def _recover(out: Path, single_file: bool, not_ours):
    """A run killed while publishing left the previous OUT at `.OUT.ckptconv-old`: put it back, if
    it is one (a previous ckptconv output: `not_ours` says so); anything else there is refused."""
    old = _old_path(out)
    _leftover(old)
    why = not_ours(old, single_file) if os.path.lexists(old) and not os.path.lexists(out) else None
    if why:
        raise OutputError(f"{old}: left beside OUT, but not a previous ckptconv output ({why}); remove it yourself")
    if os.path.lexists(old):
        if os.path.lexists(out):
            old.unlink() if old.is_file() else shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(old, out)


@contextlib.contextmanager
def atomic_output(out, overwrite=False, resume=False, inputs=(), single_file=False, not_ours=_never_ours):
    """Yield a temporary directory; publish it as `out` if the block succeeds, remove it otherwise.
    With `resume`, what a killed run left there is handed back for the writer to re-verify.
    `inputs` are the files the run reads: OUT may not be or hold any of them. With `single_file`,
    the directory holds one file named like OUT, and that file is published as OUT. `not_ours` as
    in `check_target`."""
    out = Path(os.path.abspath(out))
    check_target(out, inputs, overwrite, single_file, not_ours)
    tmp, lock = temp_path(out), None
    try:
        with deferred():  # a signal that arrives meanwhile is raised at the end: the lock is ours by then
            lock = _take_lock(out)
            _recover(out, single_file, not_ours)
            check_target(out, inputs, overwrite, single_file, not_ours)  # again, now that we hold the lock
            _leftover(tmp)
            if tmp.is_file():
                tmp.unlink()
            elif tmp.exists() and not resume:
                shutil.rmtree(tmp)  # left by a killed run
            tmp.mkdir(exist_ok=resume)
        with on_escape(lambda: (shutil.rmtree(tmp, ignore_errors=True), lock.unlink(missing_ok=True))):
            yield tmp
            check()  # a signal still pending (it arrived outside our code) stops the run before it publishes
        with deferred():
            _fsync_dir(tmp)
            # again: something may have appeared at OUT while the run wrote (hours, for a big model)
            check_target(out, inputs, overwrite, single_file, not_ours)
            if single_file:
                _publish_file(tmp / out.name, out, overwrite)
                tmp.rmdir()
                _fsync_dir(out.parent)
            else:
                _publish(tmp, out)
            published(out)
    except BaseException:
        if lock is not None:  # (without the lock, the temporary directory is another run's)
            with deferred():
                shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            with deferred():
                lock.unlink(missing_ok=True)


def _publish_file(made: Path, out: Path, overwrite: bool):
    """Without --overwrite, a hard link: it fails if anything took OUT's name since the check (a rename
    would replace it); the temporary name is then let go."""
    if overwrite:
        os.rename(made, out)  # replaces the previous file (checked to be ours) in one step
        return
    try:
        os.link(made, out)
    except FileExistsError:
        raise OutputError(f"{out}: appeared while the output was written; nothing was replaced") from None
    except OSError:
        if os.path.lexists(out):
            raise
        os.rename(made, out)  # a filesystem without hard links
        return
    os.unlink(made)


def _publish(tmp: Path, out: Path):
    if os.path.lexists(out) and any(os.scandir(out)):  # a previous output (check_target allowed it)
        old = _old_path(out)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)  # replaces an empty directory
    _fsync_dir(out.parent)


def _fsync_dir(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
