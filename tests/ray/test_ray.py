"""The Ray executor (--ray, run/ray_executor.py) on a 2-node local Ray cluster (ray.cluster_utils, one
CPU a node, both on this host): convert, reshard and verify byte-identical to --workers 1; a node
killed mid-run (its tasks rerun elsewhere, the run says so, the output is the same); the driver
killed (nothing published, --resume completes); SRC changed under the tasks (refused); a signal to
the driver (every task cancelled, nothing left). `make test-ray`; skipped where Ray is not installed."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from tests.helpers import ROOT  # noqa: E402

ENV = {**os.environ, "RAY_ADDRESS": ""}   # (RAY_ADDRESS alone never switches executors; --ray=ADDRESS is given)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """192 MiB of float32 in 24 tensors: 24 tasks of 8 MiB, long enough to kill a node or the driver."""
    import torch
    p = tmp_path_factory.mktemp("big") / "big.pt"
    g = torch.Generator().manual_seed(0)
    torch.save({f"w{i}": torch.randn(1024, 2048, generator=g) for i in range(24)}, p)
    return p


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.fixtures import models as fixtures
    return fixtures.make_hf_llama(tmp_path_factory.mktemp("llama"))


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "ckptconv.cli", *map(str, args)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=kw.pop("timeout", 300), **kw)


def start(*args):
    return subprocess.Popen([sys.executable, "-m", "ckptconv.cli", *map(str, args)], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def same_tree(a: Path, b: Path):
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def wait_for_shards(tmp: Path, n: int, proc, timeout=120):
    """Until the run's temporary output holds `n` finished-looking shards (or the run ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if tmp.exists() and len(list(tmp.glob("*.safetensors"))) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not get to {n} shards: {proc.poll()} {proc.stderr.read()[-2000:] if proc.poll() is not None else ''}")


def running_a_task(node, proc, timeout=120):
    """A worker of `node` (a child of its raylet) while it runs one of the run's tasks (its process title)."""
    raylet = node.all_processes["raylet"][0].process.pid
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                title = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == raylet and title.startswith(b"ray::_ray_task"):
                return int(entry)
        time.sleep(0.02)
    raise AssertionError("no task ran on the node to be killed")


def test_convert_reshard_verify_through_ray_are_byte_identical(cluster, llama, tmp_path):
    ray_flag = f"--ray={cluster.address}"
    for name, args in (("convert", ["convert", llama["dir"]]), ("reshard", ["reshard", llama["dir"], "--tp", "2"]),
                       ("vllm", ["reshard", llama["dir"], "--tp", "2", "--target", "vllm"])):
        one, on_ray = tmp_path / f"{name}-1", tmp_path / f"{name}-ray"
        r = cli(*args[:2], one, *args[2:], "--max-shard-size", "60KB", "--quiet", "--workers", "1")
        assert r.returncode == 0, r.stderr
        r = cli(*args[:2], on_ray, *args[2:], "--max-shard-size", "60KB", "--quiet", ray_flag)
        assert r.returncode == 0, r.stderr
        assert "ran 2 times" not in r.stderr
        same_tree(one, on_ray)
        # verify through the cluster: the same report as on this host
        here, there = cli("verify", one, "--against", llama["dir"]), cli("verify", one, "--against", llama["dir"], ray_flag)
        assert here.returncode == there.returncode == 0, there.stderr
        assert here.stdout == there.stdout
    shards = sorted((tmp_path / "convert-ray").glob("*.safetensors"))
    assert len(shards) > 2
    for shard in shards[1:3]:
        data = bytearray(shard.read_bytes())
        data[-3] ^= 1
        shard.write_bytes(bytes(data))
    here, there = cli("verify", tmp_path / "convert-ray"), cli("verify", tmp_path / "convert-ray", ray_flag)
    assert here.returncode == there.returncode == 1
    assert sorted(here.stdout.splitlines()) == sorted(there.stdout.splitlines())
    assert f"{shards[1]}: sha256 differs" in there.stdout


def test_the_api_runs_through_ray_as_the_command_does(cluster, llama, tmp_path):
    script = ("import sys\nfrom ckptconv import api\n"
              "api.convert(sys.argv[1], sys.argv[2], max_shard_size='60KB', ray=sys.argv[3])\n"
              "assert api.verify(sys.argv[2], against=sys.argv[1], ray=sys.argv[3]).ok\n")
    r = subprocess.run([sys.executable, "-c", script, str(llama["dir"]), str(tmp_path / "api"), cluster.address],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert cli("convert", llama["dir"], tmp_path / "one", "--max-shard-size", "60KB", "--workers", "1").returncode == 0
    same_tree(tmp_path / "one", tmp_path / "api")


def test_a_ray_address_with_a_credential_and_no_cluster_is_one_line_without_it(llama, tmp_path):
    r = cli("convert", llama["dir"], tmp_path / "out", "--ray=127.0.0.1:1?token=hunter2", timeout=60)
    assert r.returncode == 2 and "hunter2" not in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert "no Ray cluster could be joined" in r.stderr


def test_a_node_killed_mid_run_its_tasks_rerun_elsewhere(cluster, big, tmp_path):
    node = cluster.add_node(num_cpus=1)   # (a third node, killed: the cluster keeps its two)
    cluster.wait_for_nodes()
    out = tmp_path / "out"
    proc = start("convert", big, out, "--max-shard-size", "8MiB", "--quiet", f"--ray={cluster.address}")
    wait_for_shards(tmp_path / ".out.ckptconv-tmp", 2, proc)
    worker = running_a_task(node, proc)
    os.kill(worker, signal.SIGKILL)   # (the node's end, all of it at once: its task cannot finish first)
    cluster.remove_node(node, allow_graceful=False)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "its task ran 2 times (a worker or node was lost" in err, err[-3000:]
    r = cli("convert", big, tmp_path / "one", "--max-shard-size", "8MiB", "--quiet", "--workers", "1")
    assert r.returncode == 0, r.stderr
    same_tree(out, tmp_path / "one")


def test_the_driver_killed_publishes_nothing_and_resume_completes(cluster, big, tmp_path):
    out, tmp = tmp_path / "out", tmp_path / ".out.ckptconv-tmp"
    proc = start("convert", big, out, "--max-shard-size", "8MiB", "--quiet", f"--ray={cluster.address}", "--resume")
    wait_for_shards(tmp, 6, proc)
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    assert list((tmp / ".ckptconv-tasks").glob("*.json"))   # (what the finished tasks kept)
    r = cli("convert", big, out, "--max-shard-size", "8MiB", f"--ray={cluster.address}", "--resume")
    assert r.returncode == 0, r.stderr
    assert "were kept" in r.stdout + r.stderr, r.stdout + r.stderr
    assert not tmp.exists() and not (out / ".ckptconv-tasks").exists()
    r = cli("convert", big, tmp_path / "one", "--max-shard-size", "8MiB", "--quiet", "--workers", "1")
    assert r.returncode == 0, r.stderr
    same_tree(out, tmp_path / "one")


def test_src_changed_under_the_tasks_is_refused(cluster, big, tmp_path):
    import shutil
    src = tmp_path / "src.pt"
    shutil.copyfile(big, src)
    out = tmp_path / "out"
    proc = start("convert", src, out, "--max-shard-size", "8MiB", "--quiet", f"--ray={cluster.address}")
    wait_for_shards(tmp_path / ".out.ckptconv-tmp", 2, proc)
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # (another copy, as a node would see it)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "src.pt" in lines[0], err[-3000:]
    assert not out.exists() and not (tmp_path / ".out.ckptconv-tmp").exists()


def test_sigterm_to_the_driver_cancels_every_task_and_leaves_nothing(cluster, big, tmp_path):
    out = tmp_path / "out"
    proc = start("convert", big, out, "--max-shard-size", "8MiB", "--quiet", f"--ray={cluster.address}")
    wait_for_shards(tmp_path / ".out.ckptconv-tmp", 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "interrupted by SIGTERM" in err
    time.sleep(1)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_ray_address_alone_never_switches_executors_and_a_missing_cluster_is_one_line(llama, tmp_path):
    env = {**ENV, "RAY_ADDRESS": "127.0.0.1:1"}
    r = subprocess.run([sys.executable, "-m", "ckptconv.cli", "convert", llama["dir"], tmp_path / "a", "--quiet"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "ckptconv.cli", "convert", llama["dir"], tmp_path / "b", "--ray"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--ray '127.0.0.1:1': no Ray cluster could be joined" in r.stderr, r.stderr
    assert not (tmp_path / "b").exists()
