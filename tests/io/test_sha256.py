"""The compiled multi-stream SHA-256 against hashlib: random data, random cuts, streams that start
at different offsets (a file's digest includes its header, a tensor's does not)."""
import hashlib

import pytest
from hypothesis import given, settings, strategies as st

from ckptconv.io import sha256

pytestmark = pytest.mark.skipif(not sha256.FAST, reason="no SHA extensions on this CPU, or not compiled")


@settings(max_examples=300, deadline=None)
@given(prefixes=st.lists(st.binary(max_size=200), min_size=1, max_size=3),
       chunks=st.lists(st.binary(max_size=700), max_size=12))
def test_streams_fed_together_equal_hashlib(prefixes, chunks):
    states = [sha256.Sha256() for _ in prefixes]
    for s, prefix in zip(states, prefixes):
        s.update(prefix)
    for chunk in chunks:
        sha256.update_all(chunk, states)
    for s, prefix in zip(states, prefixes):
        assert s.hexdigest() == hashlib.sha256(prefix + b"".join(chunks)).hexdigest()


def test_large_buffers_and_views():
    data = bytes(range(256)) * 40_000 + b"tail"  # 10 MB: many blocks through the interleaved loop
    view = memoryview(data)
    states = [sha256.Sha256() for _ in range(4)]  # four: two calls of the compiled code
    states[1].update(b"x" * 63)
    for i in range(0, len(data), 3_000_001):
        sha256.update_all(view[i:i + 3_000_001], states)
    want = [data, b"x" * 63 + data, data, data]
    assert [s.hexdigest() for s in states] == [hashlib.sha256(w).hexdigest() for w in want]
    assert states[0].digest() == hashlib.sha256(data).digest()


def test_digest_does_not_end_the_stream():
    s = sha256.Sha256()
    s.update(b"abc")
    assert s.hexdigest() == hashlib.sha256(b"abc").hexdigest()
    s.update(b"def")
    assert s.hexdigest() == hashlib.sha256(b"abcdef").hexdigest()


def test_bad_state_refused():
    from ckptconv import _sha256x
    with pytest.raises(ValueError, match="104 bytes"):
        _sha256x.absorb(b"data", bytearray(10))
    with pytest.raises(BufferError):
        _sha256x.absorb(b"data", bytes(104))  # read-only


@pytest.mark.parametrize("binds", [False, True])
def test_every_lane_arrangement_gives_each_stream_its_digest(monkeypatch, binds):
    """Whether a run with taps shares one thread for the file's and the tensor's digests (where the
    CPU binds) or not, each stream is the hashlib digest of exactly what was fed to it."""
    import os
    from ckptconv.io import hashing
    monkeypatch.setattr(hashing, "_cpu_binds", lambda: binds)
    lanes = hashing.HashLanes(taps=True)
    try:
        assert (lanes._lanes["file"] is lanes._lanes["tensor"]) == (binds or sha256.INTERLEAVES)
        file, tensor, tap = sha256.new(), sha256.new(), sha256.new()
        a, b = os.urandom(70_001), os.urandom(65)
        for f in lanes.feed(a, file, tensor, tap) + lanes.feed(b, file, None, tap):
            f.result()
        assert [lanes.digest(lane, h).result() for lane, h in (("file", file), ("tensor", tensor), ("tap", tap))] \
            == [hashlib.sha256(a + b).hexdigest(), hashlib.sha256(a).hexdigest(), hashlib.sha256(a + b).hexdigest()]
    finally:
        lanes.close()
