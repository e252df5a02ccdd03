"""Terminating signals end a run the way an error does: the temporary output and the lock are removed,
then the process exits with 128 + the signal's number.

Every signal whose default action ends the process and that a program can catch without corrupting
its own state gets one handler (a closed terminal's SIGHUP, SIGQUIT, SIGUSR1, a batch system's SIGXCPU,
the real-time signals ...). Faults (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTRAP, SIGSYS) are not
among them: returning from a handler would re-run the faulting instruction. Signals a parent set to be
ignored (`nohup`'s SIGHUP) stay ignored, and so do SIGPIPE and SIGXFSZ, which Python ignores so that
writes fail with an error instead.

Python runs signal handlers in the main thread between bytecodes, and an exception raised by one
appears "out of thin air" there. Most library code cannot survive that (Python's signal docs, "Note on
Signal Handlers and Exceptions", bpo-42340): raised just after `threading.Condition.__enter__` took
its lock, it leaves the lock held, and the next thread to notify that condition (a hash or write
thread finishing a future) waits forever, and so does the run. So the handler raises only when the
main thread was running ckptconv's own code. Anywhere else (the standard library, numpy, click) the
signal is left pending, and raised at the next checkpoint: `check()`, called once per chunk where
bytes are written or hashed, per small tensor written, and before anything is published. A second
signal while the first is pending is raised at once, wherever it lands: if the run waits on something
that never comes, the user's insistence is worth that risk. A few steps must not be cut in half
(taking the lock, publishing, cleaning up): they run inside `deferred()`, and a signal that arrives
there is raised when the step is done. A raise that lands where Python can only print it (a `__del__`,
a weakref callback) is caught by our `sys.unraisablehook` and made pending again, not lost.

One signal must still end a run that waits where no checkpoint comes: in a blocking call of a C
library (a collective that never completes), or in Python code of the standard library that loops.
Python runs handlers only between bytecodes of the main thread, so a watcher thread learns of each
signal from the wakeup descriptor (`signal.set_wakeup_fd`, written by Python's C-level handler at
once) and, if the run has not turned it into an exception within GRACE_S seconds (outside a deferred
step), ends the process itself: the cleanups the run registered (`on_escape`: its temporary output
and lock) run, one line is printed, and the process exits with 128 + n.
"""
import contextlib
import os
import select
import signal
import sys
import threading
import time

GRACE_S = 2.0   # how long a pending signal may wait for a checkpoint before the watcher ends the run

_FAULTS = {"SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGIOT", "SIGTRAP", "SIGSYS", "SIGKILL", "SIGSTOP"}
_NAMED = ["SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGVTALRM", "SIGPROF",
          "SIGIO", "SIGPWR", "SIGXCPU", "SIGSTKFLT"]


def terminating() -> list:
    """The catchable signals whose default action ends the process."""
    sigs = [getattr(signal, n) for n in _NAMED if hasattr(signal, n)]
    if hasattr(signal, "SIGRTMIN"):
        sigs += range(signal.SIGRTMIN, signal.SIGRTMAX + 1)
    return sorted(set(sigs))


class Interrupted(BaseException):
    """A terminating signal arrived. A BaseException, like KeyboardInterrupt: `except Exception`
    blocks do not swallow it, cleanup in `finally` and `except BaseException` runs."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.published = _state.published   # the output, when the signal came after it was published

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def name(self) -> str:
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"


class _State:
    received = None   # the first signal; later ones are ignored while the run winds down
    raised = False
    deferring = 0
    active = False    # inside handled()
    published = None  # this run's output, once published: an interruption after that leaves it complete
    cleanups = []     # what the watcher undoes if it must end the run itself (on_escape)


_state = _State()


_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _ours(frame) -> bool:
    """Whether `frame` runs ckptconv's code: its own, or code generated for it (a dataclass's or
    namedtuple's `__init__`, filed as "<string>") called from ours. Not importlib's frozen modules."""
    while frame is not None and frame.f_code.co_filename.startswith("<") \
            and not frame.f_code.co_filename.startswith("<frozen"):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(_OURS)


def _handler(signum, frame):
    if _state.received is not None:
        if not _state.raised and not _state.deferring:   # a second one while the first waits: now, wherever
            _state.raised = True
            raise Interrupted(_state.received)
        return
    _state.received = signum
    if not _state.deferring and _ours(frame):
        _state.raised = True
        raise Interrupted(signum)


def check():
    """Raise the signal received in this run if it is still pending (it arrived outside our own code,
    or its exception was swallowed). Cheap: call it once per unit of work, from the main thread."""
    if _state.received is not None and not _state.raised and not _state.deferring \
            and threading.current_thread() is threading.main_thread():
        _state.raised = True
        raise Interrupted(_state.received)


@contextlib.contextmanager
def handled():
    """Handle every terminating signal that is not ignored while the block runs (a command, from the
    main thread); then the process's own handlers and unraisable hook are back, and no signal of the
    run stays pending (a test suite or a program calling the API after an in-process run). Nested,
    the inner block changes nothing. Our hook makes an Interrupted that was swallowed where Python
    can only print it pending again, for the next check()."""
    if _state.active:
        yield
        return
    _state.received, _state.raised, _state.deferring, _state.published = None, False, 0, None
    previous, before = sys.unraisablehook, {}

    def hook(args):
        if isinstance(args.exc_value, Interrupted):
            _state.raised = False
            return
        previous(args)

    sys.unraisablehook, _state.active, _state.cleanups = hook, True, []
    watcher = None
    try:
        for sig in terminating():
            try:
                current = signal.getsignal(sig)
                if current is not signal.SIG_IGN:
                    signal.signal(sig, _handler)
                    before[sig] = current
            except (OSError, ValueError):  # not settable here (or not in the main thread)
                continue
        if before:
            watcher = _Watcher(set(before))
        yield
    finally:
        if watcher is not None:
            watcher.stop()
        for sig, h in before.items():
            signal.signal(sig, signal.SIG_DFL if h is None else h)
        sys.unraisablehook, _state.active = previous, False
        _state.received, _state.raised, _state.cleanups = None, False, []


class _Watcher:
    """The thread that ends a run whose pending signal finds no checkpoint (see the module's text)."""

    def __init__(self, handled: set):
        self.handled, self.first, self.done = handled, None, threading.Event()
        self.read, write = os.pipe()
        os.set_blocking(write, False)
        self.write = write
        try:
            self.previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:   # not the main thread: no watcher
            os.close(self.read), os.close(write)
            self.read = None
            return
        threading.Thread(target=self._run, name="ckptconv-signal-watcher", daemon=True).start()

    def stop(self):
        if self.read is None:
            return
        signal.set_wakeup_fd(self.previous)
        os.write(self.write, b"\0")   # (wakes the thread; 0 is no signal), before it may close the pipe
        self.done.set()

    def _run(self):
        try:
            while not self.done.is_set():
                ready, _, _ = select.select([self.read], [], [], 0.25)
                if ready:
                    for signum in os.read(self.read, 512):
                        if signum in self.handled and self.first is None:
                            self.first = (signum, time.monotonic())
                if self.first is None or self.done.is_set() or _state.raised:
                    continue
                if _state.deferring:   # a step that must not be cut: the grace starts after it
                    self.first = (self.first[0], time.monotonic())
                elif time.monotonic() - self.first[1] >= GRACE_S:
                    _escape(self.first[0])
        finally:
            os.close(self.read)
            os.close(self.write)


def _escape(signum: int):
    """End the process from the watcher: the run's cleanups, one line, exit 128 + n."""
    e = Interrupted(signum)
    after = f"{e.published} was published before it and is complete" if e.published else "no output was published"
    for cleanup in reversed(_state.cleanups):
        try:
            cleanup()
        except Exception:   # (best effort: a later run recognises what is left, docs/security.md)
            pass
    try:
        os.write(2, f"ckptconv: error: interrupted by {e.name} while waiting outside ckptconv's code; "
                    f"{after}\n".encode("utf-8", "backslashreplace"))
    finally:
        os._exit(e.exit_code)


@contextlib.contextmanager
def on_escape(cleanup):
    """While the block runs, `cleanup()` is what the watcher calls before it ends the process itself
    (a signal that found no checkpoint): the run's temporary output and lock."""
    _state.cleanups.append(cleanup)
    try:
        yield
    finally:
        _state.cleanups.remove(cleanup)


def published(out):
    """This run's output is published: a signal from now on still ends the run (128 + n), and the
    message says that `out` is complete."""
    _state.published = out


def received():
    """The `Interrupted` for the signal received in this run, or None. An error raised while a signal
    unwinds the threads (a lock half-released by the handler's exception) is reported as the signal."""
    return None if _state.received is None else Interrupted(_state.received)


@contextlib.contextmanager
def deferred():
    """Run a step that must not be cut in half; a signal received meanwhile is raised after it (unless
    the step is already failing: then its own error ends the run)."""
    _state.deferring += 1
    try:
        yield
    finally:
        _state.deferring -= 1
    check()
