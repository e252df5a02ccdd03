"""Reading objects from a real S3 API (moto's server) through the fault proxy: ranged streaming gives
the object's bytes exactly, transient failures are retried within the budget, and an object that
changes while it is read stops the read."""
import json
import os
import random
import subprocess
import sys
import threading

import pytest

from ckptconv.errors import BadInput
from ckptconv.storage.objects import SourceObject, listing
from ckptconv.storage.urls import parse
from tests.helpers import ROOT
from tests.storage.proxy import Fault

MIB = 1 << 20


def put(s3, key: str, data: bytes):
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=data)


def joined(pieces, ranges) -> list:
    """The bytes of each range from the Pieces, checking they come in order and each exactly once."""
    out = [bytearray() for _ in ranges]
    last = (-1, 0)
    for p in pieces:
        assert (p.index, p.offset) > last and p.offset == len(out[p.index])
        out[p.index] += p.data
        last = (p.index, p.offset)
    return [bytes(b) for b in out]


def test_ranged_streaming_gives_the_object_s_bytes(s3):
    data = random.Random(0).randbytes(23 * MIB + 12345)
    put(s3, "ckpt/model.safetensors", data)
    obj = SourceObject.open(parse(s3.url("ckpt/model.safetensors")), s3.options(part_size=1 * MIB))
    assert obj.size == len(data) and obj.identity.etag
    assert obj.read(0, 8) == data[:8] and obj.read(len(data) - 3, 3) == data[-3:] and obj.read(5, 0) == b""
    # a header, then tensors: long ones cut into parts, short neighbours sharing a GET, gaps, one out of order
    ranges = [(0, 8), (8, 1000), (1008, 3 * MIB), (1008 + 3 * MIB, 17), (1008 + 3 * MIB + 40, 5), (0, 0),
              (4 * MIB, 12 * MIB + 7), (len(data) - 100, 100), (100, 200)]
    got = joined(obj.stream(ranges, concurrency=3), ranges)
    assert got == [data[o:o + n] for o, n in ranges]
    assert b"".join(bytes(p.data) for p in obj.stream([(0, len(data))])) == data
    gets = [s for s in s3.proxy.seen if s[0] == "GET"]
    assert len(gets) < 2 + 2 + 25 + 25   # the short ranges shared GETs
    with pytest.raises(BadInput, match="lies outside its"):
        list(obj.stream([(len(data) - 1, 2)]))


@pytest.mark.parametrize("fault, options, done", [
    (dict(kind="cut", after=300_000, times=2), dict(part_size=1 * MIB), 2),          # a connection cut mid-GET
    (dict(kind="status", times=4), dict(part_size=1 * MIB, retries=5), 4),             # 503 SlowDown, four times
    (dict(kind="stall", after=1000, seconds=30), dict(part_size=1 * MIB, stall_seconds=0.5), 1)])   # a stall
def test_a_transient_fault_is_retried_and_the_bytes_are_the_same(s3, fault, options, done):
    data = os.urandom(3 * MIB)
    name = f"{fault['kind']}.bin"
    put(s3, name, data)
    obj = SourceObject.open(parse(s3.url(name)), s3.options(**options))
    s3.proxy.add(Fault(fault.pop("kind"), method="GET", **fault))
    assert b"".join(bytes(p.data) for p in obj.stream([(0, len(data))])) == data
    assert s3.proxy.done(name.removesuffix(".bin")) == done


def test_a_failure_past_the_budget_is_one_line(s3):
    put(s3, "down.bin", b"x" * 1000)
    obj = SourceObject.open(parse(s3.url("down.bin")), s3.options(retries=2))
    s3.proxy.add(Fault("status", method="GET", times=-1))
    with pytest.raises(BadInput) as e:
        obj.read(0, 10)
    seconds = str(e.value).split(" attempts in ", 1)[1].split(" s: ", 1)[0]
    assert str(e.value) == (f"{s3.url('down.bin')}: GET of bytes 0-10 failed after 3 attempts in {seconds} s: "
                            "the server answered HTTP 503 Service Unavailable (SlowDown)")
    assert s3.proxy.done("status") == 3   # the first try and two retries


def test_an_object_replaced_mid_stream_is_refused(s3):
    data = os.urandom(24 * MIB)
    put(s3, "moving.bin", data)
    obj = SourceObject.open(parse(s3.url("moving.bin")), s3.options(part_size=1 * MIB))
    stream = obj.stream([(0, len(data))], concurrency=2)
    first = next(stream)
    assert bytes(first.data) == data[:len(first.data)]
    put(s3, "moving.bin", os.urandom(len(data)))   # same size, other bytes
    with pytest.raises(BadInput, match="changed while it was being read"):
        for _ in stream:
            pass
    with pytest.raises(BadInput, match="changed while it was being read"):
        obj.read(0, 1)
    s3.client.delete_object(Bucket=s3.bucket, Key="moving.bin")
    with pytest.raises(BadInput, match="changed while it was being read .it is gone."):
        obj.read(0, 1)


def test_a_directory_is_listed(s3):
    for key in ("d/config.json", "d/unet/a.safetensors", "d/model.safetensors", "dx/other"):
        put(s3, key, b"12345")
    assert [(e.name, e.size) for e in listing(parse(s3.url("d")), s3.options())] == [
        ("config.json", 5), ("model.safetensors", 5), ("unet/a.safetensors", 5)]
    with pytest.raises(BadInput, match="no such object"):
        SourceObject.open(parse(s3.url("d/missing")), s3.options())


def test_credentials_come_from_a_profile_when_the_environment_gives_none(s3, tmp_path, monkeypatch):
    """Without AWS_ACCESS_KEY_ID, boto3's chain (when installed) finds a profile in the config files."""
    pytest.importorskip("boto3")
    from ckptconv.storage import s3api
    (tmp_path / "credentials").write_text("[default]\naws_access_key_id = AKIAPROFILEKEY000000\n"
                                          "aws_secret_access_key = profile-secret-value-0123\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    put(s3, "p.bin", b"hello")
    obj = SourceObject.open(parse(s3.url("p.bin")), s3.options())
    assert obj.read(0, 5) == b"hello"
    assert s3.proxy.signers == {"AKIAPROFILEKEY000000"}
    assert s3api.credentials().key_id == "AKIAPROFILEKEY000000"


def test_reads_can_run_from_threads(s3):
    data = os.urandom(4 * MIB)
    put(s3, "shared.bin", data)
    obj = SourceObject.open(parse(s3.url("shared.bin")), s3.options(part_size=256 << 10))
    got = {}

    def read(i):
        got[i] = b"".join(bytes(p.data) for p in obj.stream([(i * MIB, MIB)]))
    threads = [threading.Thread(target=read, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(4)] == [data[i * MIB:(i + 1) * MIB] for i in range(4)]


MEMORY = r"""
import hashlib, json, os, sys
from ckptconv.storage.urls import StorageOptions, parse
from ckptconv.storage.objects import SourceObject
from ckptconv.storage.writer import ObjectWriter
from ckptconv.storage.urls import open_store
url, endpoint, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
options = StorageOptions(endpoint_url=endpoint, concurrency=2, part_size=8 << 20, upload_concurrency=2)
block = os.urandom(1 << 20)


def rss(field):   # kB in /proc/self/status; VmHWM is this process's peak (getrusage's ru_maxrss keeps
    with open("/proc/self/status") as f:   # the parent's size from before exec)
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


base = rss("VmRSS")
w = ObjectWriter(open_store(parse(url), options), parse(url), expected_size=size)
expected = hashlib.sha256()
for i in range(size >> 20):
    chunk = i.to_bytes(8, "little") + block[8:]
    expected.update(chunk)
    w.write(chunk)
written = w.commit()
after_upload = rss("VmHWM")
h = hashlib.sha256()
obj = SourceObject.open(parse(url), options)
for piece in obj.stream([(0, obj.size)]):
    h.update(piece.data)
peak = rss("VmHWM")
print(json.dumps({"base": base, "after_upload": after_upload, "peak": peak, "written": written.sha256,
                  "read": h.hexdigest(), "expected": expected.hexdigest(), "size": obj.size}))
"""


@pytest.mark.slow   # (make test-slow: a check of scale)
def test_streaming_256_mb_holds_a_small_window(s3):
    """Upload and stream back 256 MB with parts of 8 MiB, two at a time: the process's peak resident
    memory grows by far less than the object (generous bound: half of it)."""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("reads peak memory from /proc")
    size = 256 * MIB
    done = subprocess.run([sys.executable, "-c", MEMORY, s3.url("big.bin"), s3.endpoint, str(size)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout)
    assert facts["size"] == size
    assert facts["expected"] == facts["written"] == facts["read"]
    assert facts["after_upload"] - facts["base"] < size // 2, facts
    assert facts["peak"] - facts["base"] < size // 2, facts
