"""SHA-256 states that can absorb the same bytes together.

The writer digests every byte two or three times (the shard file, the tensor, and for reshard the
global tensor). With the x86 SHA extensions, `_sha256x` runs those streams interleaved in one pass
at nearly twice the bytes per cycle of hashlib's one stream (the round instruction's latency, not
its throughput, limits a single stream). Without them, or without the compiled module, `new()`
is hashlib's and `update_all` feeds each state in turn. `FAST` says which; the module checks
itself against hashlib before it is trusted. Not every CPU overlaps the rounds: on some (measured:
an Intel Xeon with SHA-NI, 2026-11-30) two interleaved streams take twice as long as one, and
then two streams are better hashed on two threads; `INTERLEAVES` says whether the overlap pays here.
"""
import hashlib
import struct

try:
    from .. import _sha256x
except ImportError:  # built without a compiler: hashlib only
    _sha256x = None

_INIT = struct.pack("=8I", 0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                    0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19) + bytes(64) + struct.pack("=Q", 0)


class Sha256:
    """One stream: hash words, pending block and length in a 104-byte buffer the C code updates."""

    __slots__ = ("state",)

    def __init__(self, state=_INIT):
        self.state = bytearray(state)

    def update(self, data):
        _sha256x.absorb(data, self.state)

    def digest(self) -> bytes:
        final = Sha256(self.state)
        total = struct.unpack_from("=Q", self.state, 96)[0]
        final.update(b"\x80" + bytes((55 - total) % 64) + struct.pack(">Q", total * 8))
        return struct.pack(">8I", *struct.unpack_from("=8I", final.state))

    def hexdigest(self) -> str:
        return self.digest().hex()


def _self_test() -> bool:
    """The compiled streams against hashlib: lengths around block edges, three streams that start
    at different offsets, as the writer feeds them."""
    import os
    data = os.urandom(4099)
    for cut in (0, 1, 55, 56, 63, 64, 65, 127, 128, 1000, 4099):
        hs = [Sha256(), Sha256(), Sha256()]
        hs[1].update(data[:7])
        hs[2].update(data[:64])
        _sha256x.absorb(data[:cut], *[h.state for h in hs])
        _sha256x.absorb(data[cut:], *[h.state for h in hs])
        want = [data, data[:7] + data, data[:64] + data]
        if [h.hexdigest() for h in hs] != [hashlib.sha256(w).hexdigest() for w in want]:
            return False
    return True


FAST = _sha256x is not None and _sha256x.supported() and _self_test()


def _interleave_pays() -> bool:
    """Whether two interleaved streams cost clearly less than two passes of one (< 1.5x one stream),
    timed on 1 MiB (a few milliseconds; the best of three, so a preempted run does not decide)."""
    import time
    data = bytes(1 << 20)

    def best(k):
        times = []
        for _ in range(3):
            states = [Sha256() for _ in range(k)]
            start = time.perf_counter()
            _sha256x.absorb(data, *[s.state for s in states])
            times.append(time.perf_counter() - start)
        return min(times)

    return best(2) < 1.5 * best(1)


INTERLEAVES = FAST and _interleave_pays()


def new():
    return Sha256() if FAST else hashlib.sha256()


def update_all(data, states):
    """Feed `data` to every state (at most three per call with the compiled module)."""
    if FAST:
        for i in range(0, len(states), 3):
            _sha256x.absorb(data, *[s.state for s in states[i:i + 3]])
    else:
        for s in states:
            s.update(data)
