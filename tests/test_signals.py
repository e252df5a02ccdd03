"""Where a terminating signal becomes an exception (ckptconv/signals.py): at once in ckptconv's own
code, and otherwise only at a checkpoint, so that it never lands inside the standard library's locks."""
import signal
import sys
import threading

import pytest

from ckptconv import cli as cli_module, signals
from ckptconv.io import output
from ckptconv.io.hashing import Digests


@pytest.fixture
def install():
    """Our handlers for the test (installed in its body: pytest sets its own unraisable hook for each
    phase), the process's own afterwards, and no signal left pending."""
    saved = {sig: signal.getsignal(sig) for sig in signals.terminating()}
    hook = sys.unraisablehook
    yield signals.install
    signals.install()   # forget what the test received
    for sig, h in saved.items():
        signal.signal(sig, h)
    sys.unraisablehook = hook


def _frame_in_threading():
    """A live frame of the standard library's threading.py (Condition.wait_for calling us back)."""
    cond, frames = threading.Condition(), []
    with cond:
        cond.wait_for(lambda: frames.append(sys._getframe(1)) or True)
    assert frames[0].f_code.co_filename == threading.__file__
    return frames[0]


def test_a_signal_inside_the_standard_library_waits_for_a_checkpoint(install):
    """Raised just after `Condition.__enter__` took its lock, the exception would leave the lock held and
    the thread that next notifies it (a hash or write thread finishing a future) blocked forever
    (bpo-42340): the hang a signal test met twice. There, the handler only records the signal."""
    install()
    signals._handler(signal.SIGUSR1, _frame_in_threading())
    assert signals.received().signum == signal.SIGUSR1
    with pytest.raises(signals.Interrupted) as e:
        signals.check()
    assert e.value.signum == signal.SIGUSR1
    signals.check()   # raised once


def test_a_signal_in_our_own_code_is_raised_at_once(install):
    install()
    ours = iter(Digests()).gi_frame          # a frame of ckptconv/io/hashing.py
    with pytest.raises(signals.Interrupted):
        signals._handler(signal.SIGTERM, ours)
    signals.check()   # already raised: nothing pending


def test_a_real_signal_outside_our_code_is_pending_until_checked(install):
    install()
    signal.raise_signal(signal.SIGUSR2)   # lands in this test's frame: not ckptconv's
    with pytest.raises(signals.Interrupted) as e:
        signals.check()
    assert e.value.exit_code == 128 + signal.SIGUSR2


def test_a_deferred_step_finishes_before_a_pending_signal_is_raised(install):
    install()
    done = []
    with pytest.raises(signals.Interrupted):
        with signals.deferred():
            signals._handler(signal.SIGHUP, iter(Digests()).gi_frame)   # even in our own code
            signals.check()                                             # not inside the step
            done.append(True)
    assert done == [True]


def test_a_signal_swallowed_where_python_can_only_print_it_is_raised_again(install):
    """A handler that raised inside a `__del__` or a weakref callback: Python prints the exception and
    goes on. The run must not go on to publish as if no signal had come."""
    install()
    signal.raise_signal(signal.SIGUSR1)
    with pytest.raises(signals.Interrupted):
        signals.check()

    class Dropped:
        def __del__(self):
            raise signals.Interrupted(signal.SIGUSR1)   # what the handler raises when it lands here

    Dropped()
    with pytest.raises(signals.Interrupted):
        signals.check()


def test_other_unraisable_errors_still_reach_the_previous_hook(install):
    install()
    seen = []
    signals._state.unraisable = seen.append

    class Dropped:
        def __del__(self):
            raise ValueError("not ours")

    Dropped()
    assert [type(a.exc_value) for a in seen] == [ValueError]


def test_a_signal_pending_at_the_end_of_the_work_stops_the_run_before_it_publishes(install, tmp_path):
    install()
    out = tmp_path / "out"
    with pytest.raises(signals.Interrupted) as e:
        with output.atomic_output(out) as tmp:
            (tmp / "x").write_bytes(b"x")
            signal.raise_signal(signal.SIGTERM)   # outside our code: pending
    assert e.value.published is None
    assert list(tmp_path.iterdir()) == []


def test_a_signal_that_comes_while_publishing_says_the_output_is_complete(install, tmp_path, monkeypatch, capsys):
    """Publishing is not cut in half; the signal is raised after it, and must not claim that nothing
    was published (it did, before this test: exit 128 + n, "no output was published", OUT there)."""
    install()
    publish = output._publish

    def signalled(tmp, out):
        signals._handler(signal.SIGTERM, iter(Digests()).gi_frame)   # in our code, inside the step
        publish(tmp, out)

    monkeypatch.setattr(output, "_publish", signalled)
    out = tmp_path / "out"
    with pytest.raises(signals.Interrupted) as e:
        with output.atomic_output(out) as tmp:
            (tmp / "x").write_bytes(b"x")
    assert e.value.published == out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (out / "x").read_bytes() == b"x"
    with pytest.raises(SystemExit) as code:
        cli_module._interrupted(e.value)
    assert code.value.code == 128 + signal.SIGTERM
    assert capsys.readouterr().err == f"ckptconv: error: interrupted by SIGTERM; {out} was published before it " \
                                      "and is complete\n"
