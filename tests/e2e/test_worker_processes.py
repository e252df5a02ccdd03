"""Every process a run of the local executor starts (its spawned workers, and multiprocessing's
resource tracker that spawning starts beside them) is ended and reaped by the driver before it
exits, however the run ends: a normal end, a task's bad input, a signal to the driver or to the whole
process group, a worker's death. A driver killed with SIGKILL cannot reap: its workers die with it
(the parent-death signal) and the tracker follows them.

Each run is held at a state it cannot leave (processes.HeldRun: a worker stopped at the first file of
the source it opens), so a signal always finds it mid-run; and the test process adopts what the run
leaves (processes.adopting), so a process the driver did not reap is seen, alive or a zombie."""
import json
import os
import signal
import subprocess
import sys

import pytest

from tests.e2e.processes import HeldRun, adopting, reaped, session, workers_of
from tests.helpers import ROOT, run

SHARDS = ("--max-shard-size", "60KB")


def _nothing_left(out):
    assert not out.exists()
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


def _one_line(err: str, *fragments):
    assert err.count("\n") == 1 and err.startswith("ckptconv: error: "), err
    for fragment in fragments:
        assert fragment in err, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_to_the_driver_mid_run_ends_every_process_of_the_run_before_it_exits(hf_llama, tmp_path, sig):
    out = tmp_path / "out"
    with adopting():
        r = HeldRun(tmp_path, hf_llama["dir"], out, *SHARDS, "--workers", 2)
        r.held()
        assert len(workers_of(r.sid)) == 2 and (tmp_path / ".out.ckptconv-tmp").is_dir()
        os.kill(r.p.pid, sig)
        code, err = r.ended()
        left = session(r.sid)
    assert code == 128 + sig, err
    _one_line(err, f"interrupted by {sig.name}; no output was published")
    assert left == []   # (before: multiprocessing's resource tracker, never reaped)
    _nothing_left(out)


def test_sighup_to_the_whole_process_group_is_one_line(hf_llama, tmp_path):
    """A closed terminal signals the whole group: the driver, its workers and multiprocessing's own
    helper alike. One line, exit 129, nothing left, no process left (the tracker, ended by the
    signal before the driver, is reaped by it)."""
    out = tmp_path / "out"
    with adopting():
        r = HeldRun(tmp_path, hf_llama["dir"], out, *SHARDS, "--workers", 2)
        r.held()
        os.killpg(r.sid, signal.SIGHUP)
        code, err = r.ended()
        left = session(r.sid)
    assert code == 128 + signal.SIGHUP, err
    _one_line(err, "interrupted by SIGHUP; no output was published")
    assert left == []
    _nothing_left(out)


def test_a_worker_killed_mid_run_fails_the_run_and_the_others_are_reaped(hf_llama, tmp_path):
    out = tmp_path / "out"
    with adopting():
        r = HeldRun(tmp_path, hf_llama["dir"], out, *SHARDS, "--workers", 2)
        os.kill(r.held()[0], signal.SIGKILL)
        code, err = r.ended()
        left = session(r.sid)
    assert code == 2, err
    _one_line(err, "a worker process ended (killed by SIGKILL) before its task answered; nothing was published")
    assert left == []
    _nothing_left(out)


def test_a_driver_killed_with_sigkill_takes_its_workers_with_it(hf_llama, tmp_path):
    """The driver cannot reap anything: each worker dies by its parent-death signal (SIGKILL), and the
    resource tracker ends once no process holds its pipe. The temporary output stays for the next run
    to recognise (docs/security.md)."""
    out = tmp_path / "out"
    with adopting():
        r = HeldRun(tmp_path, hf_llama["dir"], out, *SHARDS, "--workers", 2)
        workers = sorted(r.held(2))   # (both past _die_with: a worker still starting would exit 1 instead)
        others = [pid for pid, state, cmd in session(r.sid) if pid != r.sid]
        assert workers == workers_of(r.sid) and len(others) == 3   # (and the tracker)
        r.p.kill()
        code, _ = r.ended()
        statuses = {pid: reaped(pid) for pid in others}   # (adopted by this test when the driver died)
    assert code == -signal.SIGKILL
    assert all(os.WIFSIGNALED(statuses[w]) and os.WTERMSIG(statuses[w]) == signal.SIGKILL for w in workers), statuses
    tracker = [pid for pid in others if pid not in workers]
    assert os.WIFEXITED(statuses[tracker[0]]) and os.WEXITSTATUS(statuses[tracker[0]]) == 0
    assert not out.exists() and (tmp_path / ".out.ckptconv-tmp").is_dir()


def test_a_run_that_ends_well_leaves_no_process(hf_llama, tmp_path):
    out = tmp_path / "out"
    with adopting():
        p = subprocess.Popen([sys.executable, "-m", "ckptconv.cli", "convert", str(hf_llama["dir"]), str(out), *SHARDS,
                              "--quiet", "--workers", "2"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
        _, err = p.communicate(timeout=300)
        left = session(p.pid)
    assert p.returncode == 0, err
    assert left == []
    assert run("verify", out).exit_code == 0


_IN_PROCESS = """
import json, os, sys
from pathlib import Path
from tests.e2e.test_workers import _run, planted
from tests.e2e.test_worker_processes import joined
from ckptconv.errors import BadInput
from ckptconv.run import executors
def children():
    mine = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                mine.append(int(entry))
        except OSError:
            pass
    return mine
found = {}
try:
    _run((planted, "bad"), sys.argv[1], Path(sys.argv[2]))
except BadInput as e:
    found["bad"] = [str(e), children()]
answers = executors.make("local", workers=2).map(joined, [("a", "b"), ("c", "d")])
found["map"] = [answers, children()]
print(json.dumps(found))
"""


def joined(*parts, progress=None):
    """A call of `map` (module-level: a worker imports it)."""
    return os.path.join(*parts)


def test_a_program_using_the_pool_keeps_no_process_of_it(hf_llama, tmp_path):
    """A fresh interpreter (nothing of multiprocessing running before): after a run a task's bad input
    stopped, and after verify's kind of pool (`map`) ended well, it has no child process left."""
    r = subprocess.run([sys.executable, "-c", _IN_PROCESS, str(hf_llama["dir"]), str(tmp_path / "out")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    assert "planted bad input" in found["bad"][0] and found["bad"][1] == []
    assert found["map"] == [["a/b", "c/d"], []]
    _nothing_left(tmp_path / "out")
