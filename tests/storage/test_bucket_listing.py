"""A listing is paged and bounded (issue 47): a server that answers every ListObjectsV2 page with
1,000 new keys and "more follow" (or a real prefix of millions of objects) stops the run at the
documented bound in one line, in bounded memory; and a store's own failure becomes our line: the
URL, the operation, the attempts and the time, the server's answer."""
import os
import re
import subprocess
import sys

import pytest

from ckptconv.storage import bucket
from tests.helpers import run
from tests.storage.proxy import Fault


def endless(s3, prefix):
    s3.proxy.add(Fault("endless", method="GET", match=lambda p: "list-type=2" in p, times=-1, code=prefix))


def test_a_listing_that_never_ends_stops_at_the_bound(s3, tmp_path, monkeypatch):
    monkeypatch.setattr(bucket, "MAX_ENTRIES", 20_000)
    endless(s3, "src")
    r = run("inspect", s3.url("src"), "--endpoint-url", s3.proxy.endpoint)
    assert r.exit_code == 2
    assert r.stderr == f"ckptconv: error: {s3.url('src')}: holds more than 20,000 objects; not a checkpoint to list\n"
    pages = [p for m, p, _ in s3.proxy.seen if m == "GET" and "list-type=2" in p]
    assert 20 <= len(pages) <= 22   # page by page, stopped at the bound: not collected whole first


def test_a_failing_listing_is_our_one_line(s3, tmp_path):
    s3.proxy.add(Fault("status", method="GET", match=lambda p: "list-type=2" in p, times=-1))
    r = run("inspect", s3.url("gone"), "--endpoint-url", s3.proxy.endpoint, "--retries", "2")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
    head, _, answer = r.stderr.partition(" s: ")
    assert head.startswith(f"ckptconv: error: {s3.url('gone')}: listing failed after 3 attempts in ")
    assert answer == "the server answered HTTP 503 Service Unavailable (SlowDown)\n"
    assert "Generic S3 error" not in r.stderr and "Debug" not in r.stderr


def test_a_store_that_cannot_be_reached_is_one_line(s3):
    r = run("inspect", s3.url("x/m.pt"), "--endpoint-url", "http://127.0.0.1:9", "--retries", "0")
    assert r.exit_code == 2
    assert re.fullmatch(f"ckptconv: error: {re.escape(s3.url('x/m.pt'))}: HEAD failed after 1 attempt in "
                        r"\d+\.\d s: cannot connect \(Connection refused\)\n", r.stderr), r.stderr


MEMORY = r"""
import resource, sys
from ckptconv.cli import main
sys.argv = ["ckptconv", "inspect", sys.argv[1], "--endpoint-url", sys.argv[2]]
try:
    main()
finally:
    print("PEAK", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


@pytest.mark.slow   # (make test-slow: a million names through a Python proxy, about a minute)
def test_the_real_bound_holds_memory_flat(s3, tmp_path):
    endless(s3, "src")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    r = subprocess.run([sys.executable, "-c", MEMORY, s3.url("src"), s3.proxy.endpoint], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 2
    assert f"{s3.url('src')}: holds more than 1,000,000 objects; not a checkpoint to list" in r.stderr
    peak_mb = int(r.stderr.rsplit("PEAK", 1)[1]) / 1024
    assert peak_mb < 600, peak_mb
