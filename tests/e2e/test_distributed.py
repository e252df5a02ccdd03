"""Several processes on 127.0.0.1 (CPU jax, 4 virtual devices each): the same output as one
process, byte for byte; verify with the device check across both; failures stop everyone."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, run

ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, n=2, extra=()):
    port = free_port()
    return [subprocess.Popen([sys.executable, "-m", "ckptconv.cli", *map(str, args), "--coordinator",
                              f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(i),
                              "--cluster-timeout", "30", *extra],
                             cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(n)]


def wait_all(procs, timeout=120):
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


def same_tree(a: Path, b: Path):
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_convert_on_two_processes_is_byte_identical(hf_llama, tmp_path):
    results = wait_all(launch(["convert", hf_llama["dir"], tmp_path / "two", "--max-shard-size", "60KB", "--quiet"]))
    assert all(rc == 0 for rc, _, _ in results), results
    assert "process 1 of 2" in results[1][1]
    assert run("convert", hf_llama["dir"], tmp_path / "one", "--max-shard-size", "60KB", "--quiet").exit_code == 0
    same_tree(tmp_path / "two", tmp_path / "one")
    # a cluster of one process still sends its results through the coordination service (as JSON)
    results = wait_all(launch(["convert", hf_llama["dir"], tmp_path / "solo", "--max-shard-size", "60KB", "--quiet"],
                              n=1))
    assert results[0][0] == 0, results
    same_tree(tmp_path / "solo", tmp_path / "one")


def test_reshard_and_device_verify_across_two_processes(hf_llama, tmp_path):
    results = wait_all(launch(["reshard", hf_llama["dir"], tmp_path / "two", "--tp", "8", "--quiet"]))
    assert all(rc == 0 for rc, _, _ in results), results
    assert run("reshard", hf_llama["dir"], tmp_path / "one", "--tp", "8", "--quiet").exit_code == 0
    same_tree(tmp_path / "two", tmp_path / "one")
    # three processes, two ranks: one writes no rank directory and hashes only its share of the global
    # tensors; process 0 puts mesh.json together from the rows each process had
    results = wait_all(launch(["reshard", hf_llama["dir"], tmp_path / "three", "--tp", "2", "--quiet"], n=3))
    assert all(rc == 0 for rc, _, _ in results), results
    assert run("reshard", hf_llama["dir"], tmp_path / "solo", "--tp", "2", "--quiet").exit_code == 0
    same_tree(tmp_path / "three", tmp_path / "solo")
    results = wait_all(launch(["verify", tmp_path / "two", "--device", "cpu", "--against", hf_llama["dir"],
                               "--quiet"]))
    assert all(rc == 0 for rc, _, _ in results), results
    assert "8 rank(s) on 8 device(s)" in results[0][1] and "global arrays assembled" in results[0][1]
    assert "matches the source" in results[0][1]


def test_verify_on_two_processes_reports_problems_everywhere(hf_llama, tmp_path):
    out = tmp_path / "out"
    assert run("convert", hf_llama["dir"], out, "--max-shard-size", "60KB", "--quiet").exit_code == 0
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) >= 2
    for shard in shards:   # (every shard: each process's share of the hashing must find its own)
        data = bytearray(shard.read_bytes())
        data[-3] ^= 1
        shard.write_bytes(bytes(data))
    results = wait_all(launch(["verify", out, "--quiet"]))
    assert [rc for rc, _, _ in results] == [1, 1], results
    for shard in shards:
        assert f"{shard}: sha256 differs" in results[0][1], (shard, results[0][1])


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    p = tmp_path_factory.mktemp("big") / "big.pt"
    torch.save({f"w{i}": torch.randn(1024, 2048) for i in range(40)}, p)  # 320 MiB
    return p


def test_a_killed_process_stops_the_run(big, tmp_path):
    out = tmp_path / "out"
    procs = launch(["convert", big, out, "--max-shard-size", "8MiB", "--quiet"], extra=["--heartbeat-timeout", "2"])
    tmp = tmp_path / ".out.ckptconv-tmp"
    deadline = time.monotonic() + 60
    while not (tmp.exists() and any(tmp.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.005)
    procs[1].send_signal(signal.SIGKILL)
    rc0, _, err0 = wait_all(procs[:1], timeout=90)[0]
    procs[1].wait()
    assert rc0 != 0
    assert "1" in err0 and ("unhealthy" in err0 or "process 1" in err0), err0[-2000:]
    assert not out.exists()
    # the leftovers are recognised and cleaned by the next run
    assert run("convert", big, out, "--max-shard-size", "64MiB", "--quiet").exit_code == 0


def test_coordinator_that_never_comes(tmp_path, hf_llama):
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "ckptconv.cli", "convert", hf_llama["dir"], tmp_path / "out",
                        "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2", "--process-id", "1",
                        "--cluster-timeout", "2"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "did not answer within 2 s" in r.stderr and r.stderr.count("\n") == 1
    assert time.monotonic() - start < 20


def test_process_0_failing_to_start_stops_the_others(hf_llama, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("not ours")  # an empty directory would be accepted
    results = wait_all(launch(["convert", hf_llama["dir"], tmp_path / "out"]))
    assert [rc for rc, _, _ in results] == [2, 2], results
    assert "already exists" in results[0][2]
    assert "process 0 could not start the run" in results[1][2]


# --- issue 28, rule 5: the processes agree on one job before anything is written, and a process that
# never comes or goes silent is one line within the timeouts, never a C++ abort

def launch_each(argv_of, n=2, extra=()):
    """Like `launch`, with each process's own arguments (`argv_of(i)`)."""
    port = free_port()
    return [subprocess.Popen([sys.executable, "-m", "ckptconv.cli", *map(str, argv_of(i)), "--coordinator",
                              f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(i), *extra],
                             cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(n)]


def _process_0(args, timeout: str):
    """Process 0 of a job of two whose process 1 never starts."""
    return subprocess.Popen([sys.executable, "-m", "ckptconv.cli", *map(str, args), "--coordinator",
                             f"127.0.0.1:{free_port()}", "--num-processes", "2", "--process-id", "0",
                             "--cluster-timeout", timeout], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptconv: error: "), err[-2000:]
    assert "Traceback" not in err and "Check failure" not in err
    return lines[0]


@pytest.mark.parametrize("differs,expected", [
    ("source", "inputs"), ("--strip-prefix", "--strip-prefix"), ("--dtype", "--dtype"), ("--only", "--only"),
    ("--max-shard-size", "--max-shard-size")])
def test_processes_that_run_different_jobs_stop_before_writing(tmp_path, differs, expected):
    for name, seed in (("a", 0), ("b", 1)):   # the same file names, sizes and shapes; other values
        g = torch.Generator().manual_seed(seed)
        (tmp_path / name).mkdir()
        torch.save({"model.w": torch.rand(8, 4, generator=g), "model.b": torch.rand(4, generator=g)},
                   tmp_path / name / "m.pt")
        os.utime(tmp_path / name / "m.pt", ns=(10**18 + seed, 10**18 + seed))
    out = tmp_path / "out"

    def argv(i):
        other = i == 1
        src = tmp_path / ("b" if other and differs == "source" else "a") / "m.pt"
        extra = {"--strip-prefix": ["--strip-prefix", "model."], "--dtype": ["--dtype", "bf16"],
                 "--only": ["--only", "model.w"], "--max-shard-size": ["--max-shard-size", "100B"]}.get(differs, [])
        return ["convert", src, out, "--quiet", *(extra if other else [])]

    results = wait_all(launch_each(argv, extra=["--cluster-timeout", "30"]))
    assert [rc for rc, _, _ in results] == [2, 2], results
    for _, _, err in results:
        line = _one_line(err)
        assert "process 1 runs another job than process 0" in line and expected in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_a_peer_that_never_comes_is_one_line_within_the_timeout(tmp_path, hf_llama):
    start = time.monotonic()
    p = _process_0(["convert", hf_llama["dir"], tmp_path / "out"], "3")
    rc, _, err = wait_all([p], timeout=60)[0]
    assert rc == 2 and "process(es) 1 did not join within 3 s" in _one_line(err)
    assert time.monotonic() - start < 20
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("stopped", [0, 1])
def test_a_process_that_goes_silent_stops_the_others_and_sigterm_is_honoured_meanwhile(big, tmp_path, stopped):
    out = tmp_path / "out"
    procs = launch(["convert", big, out, "--max-shard-size", "8MiB", "--quiet"],
                   extra=["--heartbeat-timeout", "3", "--cluster-timeout", "120"])
    tmp = tmp_path / ".out.ckptconv-tmp"
    deadline = time.monotonic() + 60
    while not (tmp.exists() and any(tmp.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.005)
    procs[stopped].send_signal(signal.SIGSTOP)
    other = procs[1 - stopped]
    try:
        started = time.monotonic()
        rc, _, err = wait_all([other], timeout=90)[0]
        assert rc == 2, err[-2000:]
        assert f"process {stopped} stopped answering" in _one_line(err)
        assert time.monotonic() - started < 60
    finally:
        procs[stopped].send_signal(signal.SIGCONT)
        procs[stopped].kill()
        procs[stopped].wait()


def test_sigterm_while_waiting_for_a_peer_ends_process_0_at_once(tmp_path, hf_llama):
    p = _process_0(["convert", hf_llama["dir"], tmp_path / "out"], "60")
    time.sleep(3)   # (imports, then the wait for process 1)
    sent = time.monotonic()
    p.send_signal(signal.SIGTERM)
    rc, _, err = wait_all([p], timeout=30)[0]
    assert rc == 128 + signal.SIGTERM and time.monotonic() - sent < 5
    assert "interrupted by SIGTERM" in _one_line(err)
