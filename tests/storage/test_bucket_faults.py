"""A conversion from a bucket survives what networks do (faults injected by tests/storage/proxy.py
between ckptconv and moto's S3 API) and refuses an object replaced while it is read: the output is
then either identical to the local conversion of the same bytes, or absent."""
import numpy as np
import pytest

from tests.helpers import run
from tests.storage.proxy import Fault
from tests.storage.test_bucket_sources import same_tree, upload


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from safetensors.numpy import save_file
    d = tmp_path_factory.mktemp("src")
    rng = np.random.default_rng(3)
    save_file({f"w{i}": rng.standard_normal((256, 1024)).astype(np.float32) for i in range(6)}, d / "model.safetensors")
    local = d / "local"
    assert run("convert", d / "model.safetensors", local, "--quiet").exit_code == 0
    return d / "model.safetensors", local


def data_get(target: str) -> bool:
    """A GET of the object itself (not a LIST of its bucket)."""
    return "model.safetensors" in target and "list-type" not in target and "delimiter" not in target


@pytest.mark.parametrize("fault, more", [
    (dict(kind="cut", after=200_000, times=2), []),                       # a connection cut mid-GET, twice
    (dict(kind="status", times=4), []),                                  # 503 SlowDown, four in a row
    (dict(kind="status", status=500, code="InternalError", times=2), []),
    (dict(kind="stall", after=1000, seconds=20), ["--stall-timeout", "0.5"])])   # a read that stops
def test_transient_faults_mid_conversion_are_retried(s3, model, tmp_path, fault, more):
    src, local = model
    url = upload(s3, src, "f/model.safetensors")
    kind = fault.pop("kind")
    s3.proxy.add(Fault(kind, method="GET", match=data_get, **fault))
    r = run("convert", url, tmp_path / "out", "--quiet", "--part-size", "256KiB", "--concurrency", "4",
            "--endpoint-url", s3.proxy.endpoint, *more)
    assert r.exit_code == 0, r.stderr
    assert s3.proxy.done(kind) == fault.get("times", 1)
    same_tree(tmp_path / "out", local)


def test_a_failure_past_the_retries_is_one_line_and_no_output(s3, model, tmp_path):
    src, _ = model
    url = upload(s3, src, "g/model.safetensors")
    s3.proxy.add(Fault("status", method="GET", match=data_get, times=-1))
    r = run("convert", url, tmp_path / "out", "--quiet", "--retries", "1", "--endpoint-url", s3.proxy.endpoint)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "SlowDown" in r.stderr and "GET of bytes 0-4096 failed after 2 attempts in " in r.stderr and "g/model.safetensors" in r.stderr
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_an_object_replaced_while_it_is_read_stops_the_run(s3, model, tmp_path):
    src, _ = model
    url = upload(s3, src, "h/model.safetensors")
    other = np.random.default_rng(9).bytes(src.stat().st_size)
    state = {"gets": 0}

    def replace_on_a_data_read(target):
        """After the header was read: the object is replaced (straight at moto) before this GET goes on."""
        if data_get(target):
            state["gets"] += 1
            if state["gets"] == 3:
                s3.client.put_object(Bucket=s3.bucket, Key="h/model.safetensors", Body=other)
        return False
    s3.proxy.add(Fault("status", method="GET", match=replace_on_a_data_read, times=-1))
    r = run("convert", url, tmp_path / "out", "--quiet", "--part-size", "256KiB", "--concurrency", "2",
            "--endpoint-url", s3.proxy.endpoint)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "h/model.safetensors" in r.stderr and "changed while it was being read" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_server_that_trickles_cannot_hold_a_read(s3, model, tmp_path):
    """One byte every 0.1 s never stalls for --stall-timeout; a ranged GET still ends, at what its part
    takes at 256 KiB/s more than the stall timeout (64 KiB parts: 1.25 s), and is retried."""
    src, local = model
    url = upload(s3, src, "t/model.safetensors")
    s3.proxy.add(Fault("trickle", method="GET", match=data_get, after=1000, seconds=0.1))
    r = run("convert", url, tmp_path / "out", "--quiet", "--part-size", "64KiB", "--stall-timeout", "1",
            "--endpoint-url", s3.proxy.endpoint)
    assert r.exit_code == 0, r.stderr
    assert s3.proxy.done("trickle") == 1
    same_tree(tmp_path / "out", local)
