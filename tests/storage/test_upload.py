"""Writing outputs to a real S3 API (moto's server) through the fault proxy: objects uploaded as they
are written and hashed in the same pass; a failed upload leaves no object and no pending upload; one
OUT is claimed by one run, published pointer last, rolled back whole."""
import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from ckptconv.errors import BadInput, OutputError, UsageError
from ckptconv.storage.objects import SourceObject
from ckptconv.storage.publisher import Publisher
from ckptconv.storage.writer import MAX_PARTS, MIN_PART, ObjectWriter, PointerWriter, part_size_for
from ckptconv.storage.urls import open_store, parse
from tests.helpers import ROOT
from tests.storage.conftest import CREDENTIALS
from tests.storage.proxy import Fault

MIB = 1 << 20


def test_parts_are_chosen_so_that_any_size_fits_in_10000():
    assert part_size_for(None, 16 * MIB) == 16 * MIB
    assert part_size_for(1, 1 * MIB) == MIN_PART
    for size in (0, 5, 160 * 10**9, 16 * MIB * MAX_PARTS, 16 * MIB * MAX_PARTS + 1, 2 * 10**12, 5 * 2**40):
        part = part_size_for(size, 16 * MIB)
        assert part >= 16 * MIB and part % MIB == 0 and -(-size // part) <= MAX_PARTS
    with pytest.raises(OutputError, match="parts over 5 GiB"):
        part_size_for(6 * 2**40 * 10, 16 * MIB)


def test_an_object_is_uploaded_as_written_and_hashed_in_the_same_pass(s3):
    store = open_store(parse(s3.url("x")), s3.options())
    data = os.urandom(17 * MIB + 3)
    w = ObjectWriter(store, parse(s3.url("out/big.safetensors")), expected_size=len(data))
    for at in range(0, len(data), 1_000_003):
        w.write(data[at:at + 1_000_003])
    done = w.commit()
    assert done.size == len(data) and done.sha256 == hashlib.sha256(data).hexdigest()
    assert done.etag.endswith('-4"')   # four parts of 5 MiB
    assert s3.client.get_object(Bucket=s3.bucket, Key="out/big.safetensors")["Body"].read() == data
    small = ObjectWriter(store, parse(s3.url("out/small.json")))
    small.write(memoryview(b'{"a": 1}'))
    assert small.commit().sha256 == hashlib.sha256(b'{"a": 1}').hexdigest()
    assert [p[0] for p in s3.proxy.seen if "small.json" in p[1]] == ["PUT"]   # one PUT, no multipart


def test_an_upload_failing_at_part_3_of_5_leaves_nothing(s3):
    store = open_store(parse(s3.url("x")), s3.options(retries=1))
    s3.proxy.add(Fault("status", method="PUT", match=lambda target: "partNumber=3&" in target, times=-1,
                       status=500, code="InternalError"))
    w = ObjectWriter(store, parse(s3.url("out/model.safetensors")), expected_size=25 * MIB)
    with pytest.raises(OutputError, match=r"out/model.safetensors: upload failed: the server answered HTTP 500 .*InternalError"):
        for _ in range(25):
            w.write(os.urandom(MIB))
        w.commit()
    w.abort()
    assert s3.proxy.done("status") == 2   # part 3, tried twice
    assert s3.keys() == [] and s3.uploads() == []


def test_an_aborted_writer_leaves_nothing(s3):
    store = open_store(parse(s3.url("x")), s3.options())
    w = ObjectWriter(store, parse(s3.url("out/a.bin")))
    w.write(os.urandom(12 * MIB))   # two parts sent, the upload open
    w.abort()
    assert s3.keys() == [] and s3.uploads() == []
    w = ObjectWriter(store, parse(s3.url("out/b.bin")))
    w.write(b"x")
    w.commit()
    w.abort()                       # committed, then the run failed: deleted
    assert s3.keys() == [] and s3.uploads() == []
    with pytest.raises(OutputError, match="after it was aborted"):
        w.write(b"y")


def test_racing_claimers_one_wins_and_the_other_deletes_nothing(s3):
    out = parse(s3.url("runs/out"))
    publishers = [Publisher(out, s3.options()) for _ in range(4)]
    start, outcome = threading.Barrier(len(publishers)), {}

    def run(i, p):
        start.wait()
        try:
            with p:
                p.claim()
                p.put(f"model-0000{i}.safetensors", b"weights")
                p.publish("model.safetensors.index.json", b"{}")
            outcome[i] = "published"
        except OutputError as e:
            outcome[i] = str(e)
    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(publishers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, o in outcome.items() if o == "published"]
    assert len(winners) == 1, outcome
    # a loser refuses at its claim, or (when it came after the winner let the lock go) at its pointer
    refusals = re.compile(r"another ckptconv run \(pid \d+ on .*\) is writing it|another run is claiming it|"
                          r"index.json: already exists \(another run published it\)")
    assert all(refusals.search(o) for i, o in outcome.items() if i not in winners), outcome
    assert s3.keys("runs/") == [f"runs/out/model-0000{winners[0]}.safetensors", "runs/out/model.safetensors.index.json"]


def test_the_pointer_is_written_last(s3):
    """A lister polling OUT while a run writes it never sees the pointer before every other object."""
    out = parse(s3.url("runs/out"))
    names = [f"model-{i:05d}-of-00006.safetensors" for i in range(1, 7)] + ["manifest.json", "SHA256SUMS"]
    seen, stop = [], threading.Event()

    def lister():
        while not stop.is_set():
            seen.append(set(s3.keys("runs/out/")))
    watcher = threading.Thread(target=lister)
    watcher.start()
    try:
        with Publisher(out, s3.options()) as p:
            p.claim()
            for name in names[:6]:
                w = p.writer(name, 6 * MIB)
                w.write(os.urandom(6 * MIB))
                w.commit()
            p.put("manifest.json", b"{}")
            p.put("SHA256SUMS", b"")
            with pytest.raises(OutputError, match="still being written"):
                early = p.writer("extra.bin")
                p.publish("model.safetensors.index.json", b"{}")
            early.abort()
            p.publish("model.safetensors.index.json", b'{"weight_map": {}}')
        time.sleep(0.2)
    finally:
        stop.set()
        watcher.join()
    everything = {f"runs/out/{n}" for n in names}
    pointer = "runs/out/model.safetensors.index.json"
    assert any(pointer in s for s in seen) and any(s and pointer not in s for s in seen)
    assert all(everything <= s for s in seen if pointer in s)
    assert set(s3.keys("runs/")) == everything | {pointer}   # the lock is gone


def test_a_run_that_fails_is_rolled_back_whole(s3):
    out = parse(s3.url("runs/out"))
    with pytest.raises(BadInput, match="the reader failed"):
        with Publisher(out, s3.options()) as p:
            p.claim()
            p.put("model-00001-of-00002.safetensors", os.urandom(100))
            w = p.writer("model-00002-of-00002.safetensors")
            w.write(os.urandom(11 * MIB))     # an upload in flight
            raise BadInput("the reader failed")
    assert s3.keys() == [] and s3.uploads() == []


KILLED = r"""
import os, sys, time
from ckptconv.storage.publisher import Publisher
from ckptconv.storage.urls import StorageOptions, parse
from ckptconv.signals import Interrupted, handled
options = StorageOptions(endpoint_url=sys.argv[2], part_size=5 << 20, upload_concurrency=2, retries=1)
try:
    with handled(), Publisher(parse(sys.argv[1]), options) as p:
        p.claim()
        p.put("model-00001-of-00002.safetensors", b"w" * 100)
        w = p.writer("model-00002-of-00002.safetensors")
        w.write(os.urandom(11 << 20))
        print("writing", flush=True)
        while True:
            w.write(os.urandom(1 << 20))
            time.sleep(0.05)
except Interrupted as e:
    sys.exit(e.exit_code)
"""


def _start(s3, out: str):
    child = subprocess.Popen([sys.executable, "-c", KILLED, s3.url(out), s3.endpoint], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "writing\n", child.stderr.read()
    return child


def test_a_signal_rolls_the_run_back(s3):
    child = _start(s3, "runs/out")
    child.send_signal(signal.SIGTERM)
    assert child.wait(60) == 128 + signal.SIGTERM
    assert s3.keys() == [] and s3.uploads() == []


def test_a_killed_run_s_lock_is_taken_over_by_resume_or_overwrite(s3):
    child = _start(s3, "runs/out")
    child.kill()
    child.wait(60)
    assert s3.keys() == ["runs/.out.ckptconv-lock", "runs/out/model-00001-of-00002.safetensors"]
    assert s3.uploads() == ["runs/out/model-00002-of-00002.safetensors"]   # pending, billed, invisible
    out = parse(s3.url("runs/out"))
    gone = rf"a run that is gone \(pid {child.pid} on .*--resume or --overwrite takes it over"
    with pytest.raises(OutputError, match=gone):
        Publisher(out, s3.options()).claim()
    p = Publisher(out, s3.options())
    assert p.claim(take_over=True).pid == child.pid
    assert s3.uploads() == []
    p.release()


def test_a_lock_without_a_heartbeat_goes_stale_and_its_run_cannot_publish(s3):
    out = parse(s3.url("runs/out"))
    first = Publisher(out, s3.options(), heartbeat_seconds=0.2, stale_seconds=2.5)
    first.claim()
    second = Publisher(out, s3.options(), heartbeat_seconds=0.2, stale_seconds=2.5)
    time.sleep(1.5)                          # beats keep it live
    with pytest.raises(OutputError, match="another ckptconv run .* is writing it"):
        second.claim(take_over=True)
    first.lease._stop.set()                        # as if its host went away (another host: no pid to look at)
    first.lease._beater.join()
    time.sleep(3.5)
    taken = second.claim(take_over=True)
    assert taken.run == first.me["run"]
    first.lease._stop.clear()
    first.lease._beat_start()                # it comes back, and finds its lock gone
    time.sleep(0.6)
    with pytest.raises(OutputError, match="another run took over its lock"):
        first.put("late.bin", b"x")
    assert first.rollback() == []
    assert s3.keys() == ["runs/.out.ckptconv-lock"]   # the taker's, untouched
    second.release()
    assert s3.keys() == []


def test_no_message_or_repr_holds_a_credential(s3, monkeypatch):
    """Every failure this layer reports, and every object it shows, with credentials in the environment."""
    monkeypatch.setenv("AWS_SESSION_TOKEN", "IQoJb3JpZ2luX2VjEXAMPLEtokenvalue")
    secrets = [CREDENTIALS["AWS_SECRET_ACCESS_KEY"], CREDENTIALS["AWS_ACCESS_KEY_ID"],
               "IQoJb3JpZ2luX2VjEXAMPLEtokenvalue"]
    s3.client.put_object(Bucket=s3.bucket, Key="in.bin", Body=b"x" * 100)
    options = s3.options(retries=1)
    shown = [repr(options), repr(parse(s3.url("in.bin"))), repr(open_store(parse(s3.url("x")), options))]
    obj = SourceObject.open(parse(s3.url("in.bin")), options)
    shown.append(repr(obj))
    messages = []

    def failing(call):
        try:
            call()
        except (BadInput, OutputError, UsageError) as e:
            messages.append(str(e))
        else:
            raise AssertionError("did not fail")
    s3.proxy.add(Fault("status", method="GET", times=-1, status=403, code="AccessDenied"))
    failing(lambda: obj.read(0, 1))
    s3.proxy.faults.clear()
    s3.proxy.add(Fault("status", method="GET", times=-1))
    failing(lambda: obj.read(0, 1))
    s3.proxy.faults.clear()
    s3.client.put_object(Bucket=s3.bucket, Key="in.bin", Body=b"y" * 100)
    failing(lambda: obj.read(0, 1))
    failing(lambda: SourceObject.open(parse(s3.url("nothing")), options))
    failing(lambda: parse(f"s3://{CREDENTIALS['AWS_ACCESS_KEY_ID']}:{CREDENTIALS['AWS_SECRET_ACCESS_KEY']}@b/k"))
    s3.proxy.add(Fault("status", method="PUT", times=-1, status=400, code="InvalidRequest"))
    p = Publisher(parse(s3.url("runs/out")), options)
    failing(p.claim)
    s3.proxy.faults.clear()
    p.claim()
    shown += [repr(p), repr(p.writer("a.bin"))]
    failing(lambda: Publisher(parse(s3.url("runs/out")), options).claim())
    s3.proxy.add(Fault("status", method="PUT", times=-1, status=500, code="InternalError"))
    w = p.writer("b.bin")
    failing(lambda: (w.write(os.urandom(6 * MIB)), w.commit()))
    s3.proxy.faults.clear()
    messages += p.rollback()
    assert len(messages) == 8
    for text in messages + shown:
        assert "\n" not in text
        for secret in secrets:
            assert secret not in text, text


def test_the_pointer_is_created_only_where_nothing_is(s3):
    """S3 (and moto) take `If-None-Match: *` on CompleteMultipartUpload: a pointer larger than a part,
    completed where an object appeared meanwhile, is refused and leaves no pending upload."""
    store_ = open_store(parse(s3.url("x")), s3.options())
    w = PointerWriter(store_, parse(s3.url("runs/out/model.safetensors")), 12 * MIB, head=100)
    w.write(os.urandom(12 * MIB))
    w.patch(0, b"h" * 100)
    w.finish()
    assert s3.uploads() == ["runs/out/model.safetensors"] and s3.keys() == []   # parts sent, nothing visible
    s3.client.put_object(Bucket=s3.bucket, Key="runs/out/model.safetensors", Body=b"another run's")
    with pytest.raises(OutputError, match="model.safetensors: already exists \\(another run published it\\)"):
        w.commit()
    assert s3.uploads() == [] and s3.client.get_object(Bucket=s3.bucket, Key="runs/out/model.safetensors")[
        "Body"].read() == b"another run's"
    w = PointerWriter(store_, parse(s3.url("runs/out/other.safetensors")), 12 * MIB, head=100)
    data = bytearray(os.urandom(12 * MIB))
    w.write(data)
    w.patch(10, b"x" * 90)
    w.finish()
    w.commit()
    data[10:100] = b"x" * 90
    assert s3.client.get_object(Bucket=s3.bucket, Key="runs/out/other.safetensors")["Body"].read() == data


def test_a_stop_between_a_put_and_its_bookkeeping_leaves_nothing(s3, monkeypatch):
    """A signal that lands after the store answered a PUT but before the run recorded the object (the
    outside attack found shards left under OUT after SIGTERM): the rollback deletes every key a writer
    of the run was given, written or not."""
    import obstore
    real = obstore.put

    def stopped_after_the_put(store, key, *args, **kwargs):
        answer = real(store, key, *args, **kwargs)   # the object is there now ...
        if key.endswith(".safetensors"):
            raise KeyboardInterrupt                  # ... and the run stops before it is recorded
        return answer
    monkeypatch.setattr(obstore, "put", stopped_after_the_put)
    out = parse(s3.url("runs/out"))
    with pytest.raises(KeyboardInterrupt):
        with Publisher(out, s3.options()) as p:
            p.claim()
            p.put("model-00001-of-00002.safetensors", b"x" * 1000)
    assert s3.keys("runs/") == [] and s3.uploads() == []
