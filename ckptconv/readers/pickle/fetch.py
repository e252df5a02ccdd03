"""The bytes of a pickle the VM reads, fetched from an object store before it runs (storage/files.py):
every byte of the opcode stream but the large BINBYTES/BINBYTES8/BYTEARRAY8 payloads, which stay in
place. vm.py hands those back as `Payload` views of the file and nothing reads them while the
pickle is parsed; the tensors made of them fetch their own ranges when they are read.

A Grok-1 shard is a pickle of one array (or two) whose payload is almost all of its bytes: parsed
from a bucket it costs its opcodes (a few KiB, in a request or two) and never holds the payload,
whatever its size (docs/grok.md, "From an object store"). The walk mirrors the memo pass
(memo.py: the same table of argument sizes); where it cannot step on (an unknown opcode, a stream
shorter than an argument), it stops, and the VM run that follows stops there too with its own
message, as on a local file.
"""
from .memo import _ARG_SIZES, _LINE, _LINES
from .standins import PAYLOAD_MIN

STEP = 16 << 10        # bytes fetched at least per request (the opcodes around a payload, in one)
_STOP = 0x2E
_PAYLOADS = {0x42, 0x8E, 0x96}   # BINBYTES, BINBYTES8, BYTEARRAY8: vm.push_bytes leaves large ones in place


def fetch_opcodes(mapped, step: int = STEP):
    """`need` (storage/files.RemoteFile) every byte of the pickle at the start of `mapped` that the VM
    reads, in ranged reads of at least `step` bytes, skipping large payloads; a no-op for a local
    file, whose mapping is the file."""
    if not mapped.remote:
        return
    _Walk(mapped, step).run()


class _Walk:
    def __init__(self, mapped, step):
        self.m, self.n, self.step = mapped, mapped.size, step
        self.held = 0   # [0, held): fetched, or a payload stepped over

    def want(self, lo: int, hi: int):
        """Have [lo, hi) (within the file) fetched."""
        hi = min(hi, self.n)
        if hi <= self.held:
            return
        start = max(lo, self.held)
        end = min(self.n, max(hi, start + self.step))
        self.m.need(start, end - start)
        self.held = end

    def line_end(self, pos: int):
        """Just past the newline ending the line at `pos`, fetched; None when there is none."""
        k = 256
        while True:
            self.want(pos, pos + k)
            at = bytes(self.m.view[pos:min(self.n, pos + k)]).find(b"\n")
            if at >= 0:
                return pos + at + 1
            if pos + k >= self.n:
                return None
            k *= 4

    def run(self):
        view, sizes, n, pos = self.m.view, _ARG_SIZES, self.n, 0
        while pos < n:
            self.want(pos, pos + 1)
            op = view[pos]
            pos += 1
            size = sizes[op]
            if op == _STOP or size is None:
                return
            if size.__class__ is int:
                self.want(pos, pos + size)
                pos += size
            elif size is _LINE or size is _LINES:
                pos = self.line_end(pos)
                if pos is not None and size is _LINES:
                    pos = self.line_end(pos)
                if pos is None:
                    return
            else:
                self.want(pos, pos + size.size)
                if pos + size.size > n:
                    return
                length = size.unpack_from(view, pos)[0]
                pos += size.size
                if length < 0 or pos + length > n:
                    return
                if op in _PAYLOADS and length >= PAYLOAD_MIN:
                    self.held = max(self.held, pos + length)   # left in place: its tensor fetches it
                else:
                    self.want(pos, pos + length)
                pos += length
