"""Where a terminating signal becomes an exception (ckptconv/signals.py): at once in ckptconv's own
code, and otherwise only at a checkpoint, so that it never lands inside the standard library's locks."""
import signal
import sys
import threading

import click
import pytest
import torch

from ckptconv import cli_options, signals
from ckptconv.io import output
from ckptconv.io.hashing import Digests
from ckptconv.rowview import RowView
from tests.helpers import run


@pytest.fixture
def restored():
    """The process's own handlers and unraisable hook after the test, whatever it did."""
    saved = {sig: signal.getsignal(sig) for sig in signals.terminating()}
    hook = sys.unraisablehook
    yield
    for sig, h in saved.items():
        signal.signal(sig, h)
    sys.unraisablehook = hook


@pytest.fixture
def signal_on_first_echo(monkeypatch):
    """Call it, and the next line click prints first raises SIGTERM, in click's code (not ours)."""
    def arm():
        echo, sent = click.echo, []

        def echo_signalled(*a, **k):
            if not sent:
                sent.append(signal.raise_signal(signal.SIGTERM))
            return echo(*a, **k)

        monkeypatch.setattr(click, "echo", echo_signalled)
    return arm


def _frame_in_threading():
    """A live frame of the standard library's threading.py (Condition.wait_for calling us back)."""
    cond, frames = threading.Condition(), []
    with cond:
        cond.wait_for(lambda: frames.append(sys._getframe(1)) or True)
    assert frames[0].f_code.co_filename == threading.__file__
    return frames[0]


def test_a_signal_inside_the_standard_library_waits_for_a_checkpoint(restored):
    """Raised just after `Condition.__enter__` took its lock, the exception would leave the lock held and
    the thread that next notifies it (a hash or write thread finishing a future) blocked forever
    (bpo-42340): the hang a signal test met twice. There, the handler only records the signal."""
    with signals.handled():
        signals._handler(signal.SIGUSR1, _frame_in_threading())
        assert signals.received().signum == signal.SIGUSR1
        with pytest.raises(signals.Interrupted) as e:
            signals.check()
        assert e.value.signum == signal.SIGUSR1
        signals.check()   # raised once


def test_a_signal_in_our_own_code_is_raised_at_once(restored):
    with signals.handled():
        ours = iter(Digests()).gi_frame          # a frame of ckptconv/io/hashing.py
        with pytest.raises(signals.Interrupted):
            signals._handler(signal.SIGTERM, ours)
        signals.check()   # already raised: nothing pending


def test_a_real_signal_outside_our_code_is_pending_until_checked(restored):
    with signals.handled():
        signal.raise_signal(signal.SIGUSR2)   # lands in this test's frame: not ckptconv's
        with pytest.raises(signals.Interrupted) as e:
            signals.check()
        assert e.value.exit_code == 128 + signal.SIGUSR2


def test_a_deferred_step_finishes_before_a_pending_signal_is_raised(restored):
    with signals.handled():
        done = []
        with pytest.raises(signals.Interrupted):
            with signals.deferred():
                signals._handler(signal.SIGHUP, iter(Digests()).gi_frame)   # even in our own code
                signals.check()                                             # not inside the step
                done.append(True)
        assert done == [True]


def test_a_signal_swallowed_where_python_can_only_print_it_is_raised_again(restored):
    """A handler that raised inside a `__del__` or a weakref callback: Python prints the exception and
    goes on. The run must not go on to publish as if no signal had come."""
    with signals.handled():
        signal.raise_signal(signal.SIGUSR1)
        with pytest.raises(signals.Interrupted):
            signals.check()

        class Dropped:
            def __del__(self):
                raise signals.Interrupted(signal.SIGUSR1)   # what the handler raises when it lands here

        Dropped()
        with pytest.raises(signals.Interrupted):
            signals.check()


def test_other_unraisable_errors_still_reach_the_previous_hook(restored):
    seen = []
    sys.unraisablehook = seen.append

    class Dropped:
        def __del__(self):
            raise ValueError("not ours")

    with signals.handled():
        Dropped()
    assert [type(a.exc_value) for a in seen] == [ValueError]
    assert sys.unraisablehook == seen.append


def test_after_a_command_the_process_handles_signals_as_before(restored):
    """An in-process run (a test suite, a program using the CLI) must not leave our handlers behind:
    they would only record a signal raised outside our code, and a later SIGTERM would not stop it."""
    before = {sig: signal.getsignal(sig) for sig in signals.terminating()}
    with signals.handled():
        signal.raise_signal(signal.SIGUSR1)   # received, pending
    assert {sig: signal.getsignal(sig) for sig in signals.terminating()} == before
    assert signals.received() is None
    signals.check()   # nothing of that run is raised in a later one


def test_generated_code_called_from_ours_counts_as_ours(restored):
    """A dataclass's or namedtuple's `__init__` is compiled from a string ("<string>"): a signal landing
    in one (a zip entry record, made once per tensor) is raised there, not held until the next chunk.
    (importlib's "<frozen ...>" modules are not ours, wherever they are called from: module locks.)"""
    namespace = {}
    exec(compile("import sys\ndef row(_x):\n    return sys._getframe()\n", "<string>", "exec"), namespace)
    generated = RowView([0], namespace["row"])[0]           # called from ckptconv/rowview.py
    assert generated.f_code.co_filename == "<string>"
    with signals.handled():
        with pytest.raises(signals.Interrupted):
            signals._handler(signal.SIGTERM, generated)


def test_a_signal_while_the_summary_is_printed_is_not_lost(restored, tmp_path, signal_on_first_echo):
    """After publishing, the summary is printed by click (not our code): a signal there is pending, and
    was dropped (exit 0, nothing said). It ends the run, and says OUT is complete."""
    torch.save({"w": torch.ones(4)}, tmp_path / "m.pt")
    signal_on_first_echo()
    r = run("convert", tmp_path / "m.pt", tmp_path / "out")
    assert r.exit_code == 128 + signal.SIGTERM, r.stderr
    assert r.stderr == f"ckptconv: error: interrupted by SIGTERM; {tmp_path / 'out'} was published before it " \
                       "and is complete\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt", "out"]


def test_a_signal_pending_at_the_end_of_the_work_stops_the_run_before_it_publishes(restored, tmp_path):
    with signals.handled():
        out = tmp_path / "out"
        with pytest.raises(signals.Interrupted) as e:
            with output.atomic_output(out) as tmp:
                (tmp / "x").write_bytes(b"x")
                signal.raise_signal(signal.SIGTERM)   # outside our code: pending
        assert e.value.published is None
        assert list(tmp_path.iterdir()) == []


def test_a_signal_that_comes_while_publishing_says_the_output_is_complete(restored, tmp_path, monkeypatch, capsys):
    """Publishing is not cut in half; the signal is raised after it, and must not claim that nothing
    was published (it did, before this test: exit 128 + n, "no output was published", OUT there)."""
    with signals.handled():
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
            cli_options._interrupted(e.value)
        assert code.value.code == 128 + signal.SIGTERM
        assert capsys.readouterr().err == f"ckptconv: error: interrupted by SIGTERM; {out} was published before it " \
                                          "and is complete\n"


def test_a_signal_while_verify_reports_problems_is_not_lost(restored, tmp_path, signal_on_first_echo):
    """verify with problems ends in sys.exit(1) inside the command: a signal that came while its
    problems were printed must still end the run as a signal."""
    torch.save({"w": torch.ones(4)}, tmp_path / "m.pt")
    assert run("convert", tmp_path / "m.pt", tmp_path / "out", "--quiet").exit_code == 0
    (tmp_path / "out" / "stray.txt").write_text("x")   # a problem: a file nothing lists
    signal_on_first_echo()
    r = run("verify", tmp_path / "out")
    assert r.exit_code == 128 + signal.SIGTERM, (r.exit_code, r.stdout, r.stderr)
    assert "interrupted by SIGTERM" in r.stderr


def test_a_second_signal_while_the_first_waits_is_raised_wherever_it_lands(restored):
    """The first waits for a checkpoint; if the run never reaches one (a wait that never ends), the
    user's second Ctrl-C or SIGTERM must still end it."""
    with signals.handled():
        signals._handler(signal.SIGTERM, _frame_in_threading())
        with pytest.raises(signals.Interrupted) as e:
            signals._handler(signal.SIGINT, _frame_in_threading())
        assert e.value.signum == signal.SIGTERM
        signals.check()   # raised: nothing pending


def test_nested_handling_changes_nothing(restored):
    seen = []
    sys.unraisablehook = seen.append
    with signals.handled():
        outer = sys.unraisablehook
        signal.raise_signal(signal.SIGUSR1)   # pending in the outer block
        with signals.handled():
            assert sys.unraisablehook is outer
        with pytest.raises(signals.Interrupted):
            signals.check()

    class Dropped:
        def __del__(self):
            raise ValueError("not ours")

    Dropped()
    assert sys.unraisablehook == seen.append and [type(a.exc_value) for a in seen] == [ValueError]


_CTRL_C_WHILE_IMPORTING = """
import os, signal, sys
import ckptconv_entry
assert "ckptconv" not in sys.modules, "the entry point imported the package before its own step"


class CtrlC:   # a Ctrl-C that lands while the package imports numpy
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            os.kill(os.getpid(), signal.SIGINT)


sys.meta_path.insert(0, CtrlC())
sys.argv = ["ckptconv", "--version"]
ckptconv_entry.main()
"""


def test_a_ctrl_c_while_the_command_starts_ends_it_without_a_traceback():
    """The command's entry point (ckptconv_entry.py, outside the package) gives SIGINT its default
    action before the package's imports, so a Ctrl-C then ends the process as the signal does (exit
    130 in a shell), not with a KeyboardInterrupt traceback and exit 1; the command's own handlers
    come when it starts."""
    from importlib.metadata import entry_points
    import subprocess

    assert [e.value for e in entry_points(group="console_scripts", name="ckptconv")] == ["ckptconv_entry:main"]
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_WHILE_IMPORTING], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGINT, proc.stderr
    assert proc.stderr == "" and proc.stdout == ""


def test_a_signal_that_finds_no_checkpoint_still_ends_and_reaps_the_workers(tmp_path):
    """The watcher's way out (os._exit after GRACE_S) runs the pool's cleanup first: every worker and
    multiprocessing's resource tracker are ended and reaped before the process exits."""
    import os
    import subprocess
    from tests.e2e.processes import STUCK_DRIVER, adopting, session
    from tests.helpers import ROOT
    with adopting():
        p = subprocess.Popen([sys.executable, "-c", STUCK_DRIVER], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert p.stdout.readline() == "stuck\n", p.communicate()
        assert len([pid for pid, _, _ in session(p.pid)]) == 4   # (the driver, 2 workers, the tracker)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=300)
        left = session(p.pid)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert err == "ckptconv: error: interrupted by SIGTERM while waiting outside ckptconv's code; no output was " \
                  "published\n"
    assert left == []
