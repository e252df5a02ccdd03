"""Terminating signals end a run the way an error does: the temporary output and the lock are removed,
then the process exits with 128 + the signal's number.

Every signal whose default action ends the process and that a program can catch without corrupting
its own state gets one handler (a closed terminal's SIGHUP, SIGQUIT, SIGUSR1, a batch system's SIGXCPU,
the real-time signals ...). Faults (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTRAP, SIGSYS) are not
among them: returning from a handler would re-run the faulting instruction. Signals a parent set to be
ignored (`nohup`'s SIGHUP) stay ignored, and so do SIGPIPE and SIGXFSZ, which Python ignores so that
writes fail with an error instead.

Python runs signal handlers in the main thread between bytecodes, so the handler can raise. A few steps
must not be cut in half (taking the lock, publishing, cleaning up): they run inside `deferred()`, and a
signal that arrives there is raised when the step is done.
"""
import contextlib
import signal

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


_state = _State()


def _handler(signum, _frame):
    if _state.received is not None:
        return
    _state.received = signum
    if not _state.deferring:
        _state.raised = True
        raise Interrupted(signum)


def install():
    """Handle every terminating signal that is not ignored (call once, from the main thread)."""
    _state.received, _state.raised, _state.deferring = None, False, 0
    for sig in terminating():
        try:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, _handler)
        except (OSError, ValueError):  # not settable here (or not in the main thread)
            continue


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
    if not _state.deferring and _state.received is not None and not _state.raised:
        _state.raised = True
        raise Interrupted(_state.received)
