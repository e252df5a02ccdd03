"""What the process tests of the local executor share (test_worker_processes.py): a run held at a
state it cannot leave, the processes of a run's session, and a test process that adopts what a run
leaves behind, so that nothing the driver failed to reap escapes the test by being reaped elsewhere.

A held run: `convert ... --workers N` in a session of its own, whose worker processes stop, each at
its first opening of a file of the source (after the worker asked to die with its driver, before it
read a byte), and say so over a named pipe the test reads. From then until the test acts, no task can
answer, so the run cannot finish: a signal sent then always finds it mid-run. The stop is an audit
hook (PEP 578) installed by a sitecustomize module on the workers' PYTHONPATH: test code only, nothing
in ckptconv knows of it."""
import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import ROOT

PR_SET_CHILD_SUBREAPER = 36
WAIT_S = 300   # how long a test waits for a run to reach the state it waits for before it fails (a hang guard)

_HOLD = '''
import os, signal, sys
if "--multiprocessing-fork" in sys.orig_argv:   # (a spawned worker: not the driver, not the resource tracker)
    def _hold(event, args, held=[]):
        if event != "open" or held or not args or not isinstance(args[0], (str, bytes)):
            return
        if not os.path.abspath(os.fsdecode(args[0])).startswith({source!r}):
            return
        held.append(True)
        fd = os.open({fifo!r}, os.O_WRONLY)
        os.write(fd, b"%d\\n" % os.getpid())
        while True:   # (until a signal ends this process: SIGINT is ignored here, as in every worker)
            signal.pause()
    sys.addaudithook(_hold)
'''


def session(sid: int) -> list:
    """(pid, state, command line) of every process in session `sid`, zombies included."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if int(fields[3]) == sid:
                found.append((int(entry), fields[0], cmdline.strip()))
    return sorted(found)


def workers_of(sid: int) -> list:
    return [pid for pid, state, cmd in session(sid) if "--multiprocessing-fork" in cmd and state != "Z"]


def _subreaper(on: bool):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _children() -> set:
    found = set()
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                found.add(int(entry))
    return found


@contextlib.contextmanager
def adopting():
    """While the block runs, this process adopts the orphans of its descendants (Linux's child
    subreaper): a process of a run that outlives its driver becomes this test's child, alive or a
    zombie, and stays visible in `session` until this test reaps it. Afterwards, whatever became
    this process's child in the block and is still there is ended and reaped (and nothing else: the
    children of other fixtures are theirs)."""
    before = _children()
    _subreaper(True)
    try:
        yield
    finally:
        _subreaper(False)
        for pid in _children() - before:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def reaped(pid: int) -> int:
    """Wait for `pid` (this process's child: an adopted one) to end, and reap it: its wait status."""
    fd = os.pidfd_open(pid)
    try:
        assert select.select([fd], [], [], WAIT_S)[0], f"process {pid} did not end"
    finally:
        os.close(fd)
    return os.waitpid(pid, 0)[1]


class HeldRun:
    """`ckptconv convert SRC OUT ARGS` in a session of its own (its process group: the run's
    processes), its workers held at the first file of SRC they open (see the module's text)."""

    def __init__(self, tmp_path: Path, src, out, *args):
        hook = tmp_path / "hold-hook"
        hook.mkdir()
        fifo = tmp_path / "held"
        os.mkfifo(fifo)
        self.fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)   # (a reader from the start: a worker never waits)
        (hook / "sitecustomize.py").write_text(_HOLD.format(source=os.path.abspath(src), fifo=str(fifo)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)])}
        self.p = subprocess.Popen([sys.executable, "-m", "ckptconv.cli", "convert", str(src), str(out), *map(str, args)],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True, env=env)
        self.sid = self.p.pid

    def held(self, count: int = 1) -> list:
        """Wait until `count` workers are held; their pids."""
        pids, text = [], b""
        deadline = time.monotonic() + WAIT_S
        while len(pids) < count:
            assert time.monotonic() < deadline, f"{len(pids)} of {count} workers were held"
            if select.select([self.fd], [], [], 1)[0]:
                text += os.read(self.fd, 64)
                *lines, text = text.split(b"\n")
                pids += [int(line) for line in lines]
            elif self.p.poll() is not None:
                raise AssertionError(f"the run ended before {count} worker(s) were held: {self.p.communicate()}")
        return pids

    def ended(self) -> tuple:
        """(exit status, stderr) once the driver ended."""
        _, err = self.p.communicate(timeout=WAIT_S)
        os.close(self.fd)
        return self.p.returncode, err


def stuck_share(i, progress=None):
    """A call of `map` (module-level: a worker imports it) that reports 16 MiB to the driver's bar, then
    never answers."""
    from ckptconv.run.executors import PROGRESS_BYTES
    progress(PROGRESS_BYTES)
    while True:
        signal.pause()


# A driver stuck where no checkpoint comes (its progress callback waits in the standard library):
# a signal is left pending there, and the watcher thread ends the process itself (signals.py).
STUCK_DRIVER = """
import os, sys, threading, time
from ckptconv import signals
from ckptconv.run import executors
from tests.e2e.processes import stuck_share

def say_when_waiting(tid):   # "stuck" once the main thread sleeps in the wait below, not before
    deadline = time.monotonic() + 5   # (a kernel that hides wchan says "0": then after 5 s)
    while time.monotonic() < deadline:
        with open(f"/proc/self/task/{tid}/wchan") as f:
            if "futex" in f.read():
                break
        time.sleep(0.01)
    print("stuck", flush=True)

def progress(n):
    threading.Thread(target=say_when_waiting, args=(threading.get_native_id(),), daemon=True).start()
    threading.Event().wait()

with signals.handled():
    executors.make("local", workers=2).map(stuck_share, [(0,), (1,)], progress=progress)
"""
