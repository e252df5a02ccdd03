"""--distributed is for verify --device across hosts now: several processes on 127.0.0.1 (CPU jax, 4
virtual devices each) place each its ranks, global arrays over all; each checks the files itself, so
every process finds the same problems and exits alike. File work under --distributed is refused
with a line pointing to --workers / --ray (tests/e2e/test_workers.py, tests/ray/ test what replaced
it: input identity, a lost worker or node, a signal to the driver)."""
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


def test_reshard_and_device_verify_across_two_processes(hf_llama, tmp_path):
    assert run("reshard", hf_llama["dir"], tmp_path / "tp8", "--tp", "8", "--quiet").exit_code == 0
    results = wait_all(launch(["verify", tmp_path / "tp8", "--device", "cpu", "--against", hf_llama["dir"],
                               "--quiet"]))
    assert all(rc == 0 for rc, _, _ in results), results
    assert "8 rank(s) on 8 device(s)" in results[0][1] and "global arrays assembled" in results[0][1]
    assert "matches the source" in results[0][1]
    assert "process 1 of 2" in results[1][1]


def test_verify_on_two_processes_reports_problems_everywhere(hf_llama, tmp_path):
    out = tmp_path / "out"
    assert run("convert", hf_llama["dir"], out, "--max-shard-size", "60KB", "--quiet").exit_code == 0
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) >= 2
    for shard in shards:
        data = bytearray(shard.read_bytes())
        data[-3] ^= 1
        shard.write_bytes(bytes(data))
    results = wait_all(launch(["verify", out, "--device", "cpu", "--quiet"]))
    assert [rc for rc, _, _ in results] == [1, 1], results
    for shard in shards:
        assert f"{shard}: sha256 differs" in results[0][1], (shard, results[0][1])


@pytest.mark.parametrize("args", [
    ["convert", "SRC", "OUT", "--distributed"],
    ["convert", "SRC", "OUT", "--coordinator", "127.0.0.1:9", "--num-processes", "2", "--process-id", "1"],
    ["pickle-to-safetensors", "SRC", "OUT", "--distributed"],
    ["reshard", "SRC", "OUT", "--tp", "2", "--distributed"]])
def test_file_work_under_distributed_is_refused_with_where_it_went(hf_llama, tmp_path, args):
    args = [hf_llama["dir"] if a == "SRC" else tmp_path / "out" if a == "OUT" else a for a in args]
    r = run(*args)
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "runs in one driver now" in r.stderr and "--workers" in r.stderr and "--ray" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_verify_without_device_under_distributed_is_refused(hf_llama, tmp_path):
    out = tmp_path / "out"
    assert run("convert", hf_llama["dir"], out, "--quiet").exit_code == 0
    r = run("verify", out, "--distributed", "--coordinator", "127.0.0.1:9", "--num-processes", "2", "--process-id", "1")
    assert r.exit_code == 2 and "--distributed is for verify --device" in r.stderr, r.stderr
    # a launcher's environment alone (a multi-task SLURM job) leaves a file check to this process
    env = {**ENV, "SLURM_JOB_ID": "1", "SLURM_NTASKS": "4"}
    p = subprocess.run([sys.executable, "-m", "ckptconv.cli", "verify", str(out), "--quiet"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_sigterm_while_waiting_for_a_peer_ends_process_0_at_once(tmp_path, hf_llama):
    assert run("reshard", hf_llama["dir"], tmp_path / "tp2", "--tp", "2", "--quiet").exit_code == 0
    p = subprocess.Popen([sys.executable, "-m", "ckptconv.cli", "verify", str(tmp_path / "tp2"), "--device", "cpu",
                          "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2", "--process-id", "0",
                          "--cluster-timeout", "60"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    time.sleep(6)   # (imports, the file checks, then JAX's wait for process 1)
    sent = time.monotonic()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM and time.monotonic() - sent < 10, err[-2000:]
    assert "interrupted by SIGTERM" in err
