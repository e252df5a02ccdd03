"""zstd, decompressed one way for every reader (the optional `zstandard` package, imported when a
zstd stream is met: without it, one line saying how to install it), always bounded:
- `Stream`: one frame decompressed front to back from a buffer, or from pieces (`Pieces`:
  storage.pieces as the file-like a decoder reads), never more than `limit` bytes out (one byte more
  is the caller's `too_big(limit)`); a corrupt stream is one line naming what it is. DCP's zstd items
  (readers/dcp_chunks.py, inflated into io/spill.py's temporary file) and Orbax's zstd chunks
  (readers/zarr_codecs.py, inflated as their rows are asked for) read through it.
- `FrameEnd`: where a frame ends, from its headers as its bytes stream by, nothing inflated (a zarr
  chunk is one frame: bytes after it are refused).
- `inflate`: one frame that is the whole of a small body, in memory, fed in pieces none of which can
  inflate past what is left of its bound (OCDBT's nodes: readers/ocdbt_encoding.py).
"""
from ..errors import BadInput, UsageError

# The most a zstd stream can inflate per byte: one 4-byte RLE block (3-byte header, 1 byte) per
# 128 KiB block of output. A chunk that declares more data than this times its stream is refused
# before anything is read or planned.
ZSTD_MAX_RATIO = 32768
# The decoder's window, which a frame header chooses: libzstd's own default limit, made explicit.
ZSTD_MAX_WINDOW = 1 << 27


def module(what: str):
    """The zstandard module; without it, UsageError "{what} is zstd-compressed; install zstandard: ..."."""
    try:
        import zstandard
    except ImportError:
        raise UsageError(f"{what} is zstd-compressed; install zstandard: pip install 'ckptconv[zstd]'") from None
    return zstandard


class Stream:
    """One zstd frame of `source` (a buffer, or a file-like such as `Pieces`) decompressed front to
    back as it is read, at most `limit` bytes of it: a read that would pass them raises
    `too_big(limit)`. `what` names the stream in its errors ("PATH: chunk ..."); `window` is the most
    the decoder may hold (a frame asking for more is refused as corrupt)."""

    def __init__(self, source, what: str, limit: int, too_big, window: int = ZSTD_MAX_WINDOW):
        zstandard = module(what)
        self.what, self.limit, self.too_big, self.pos = what, limit, too_big, 0
        self._error = zstandard.ZstdError
        self._reader = zstandard.ZstdDecompressor(max_window_size=window).stream_reader(
            source, read_across_frames=False, closefd=False)

    def read(self, n: int) -> bytes:
        """Up to `n` more bytes; b"" where the frame ends."""
        try:
            piece = self._reader.read(n)
        except self._error as e:
            raise BadInput(f"{self.what}: corrupt or unsupported zstd stream: {e}") from None
        self.pos += len(piece)
        if self.pos > self.limit:
            raise self.too_big(self.limit)
        return piece

    def close(self):
        self._reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Pieces:
    """Pieces of bytes (files.pieces) as the file-like source a zstd stream reader reads from."""

    def __init__(self, pieces):
        self._pieces, self._left = pieces, memoryview(b"")

    def read(self, n: int = -1) -> bytes:
        while not self._left:
            piece = next(self._pieces, None)
            if piece is None:
                return b""
            self._left = memoryview(piece)
        n = len(self._left) if n < 0 else n
        out, self._left = bytes(self._left[:n]), self._left[n:]
        return out


class FrameEnd:
    """Where a zstd frame ends, from its frame header and block headers as its bytes stream by (RFC
    8878, 3.1.1): blocks are skipped by their sizes, nothing is inflated; a second frame after the
    first is then seen as bytes past `end`."""

    def __init__(self):
        self.at, self.want, self.head = 0, 5, bytearray()   # the header being read: where, how long, its bytes
        self.stage, self.checksum, self.end, self.seen = "frame", False, None, 0

    def feed(self, piece, where: str):
        start = self.seen
        self.seen += len(piece)
        while self.end is None:
            lo = self.at + len(self.head)
            if lo >= self.seen:
                return
            take = min(self.want - len(self.head), self.seen - lo)
            self.head += piece[lo - start:lo - start + take]
            if len(self.head) < self.want:
                return
            self._parse(where)

    def _parse(self, where: str):
        head = bytes(self.head)
        if self.stage == "frame":
            if head[:4] != b"\x28\xb5\x2f\xfd":
                raise BadInput(f"{where}: not a zstd frame (its magic is {head[:4].hex()})")
            fhd = head[4]
            single = fhd >> 5 & 1
            self.checksum = bool(fhd >> 2 & 1)
            self.want = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3] + (single, 2, 4, 8)[fhd >> 6]
            self.stage = "header"
            if len(head) < self.want:
                return
        if self.stage == "header":
            self.stage, self.at, self.want, self.head = "block", self.want, 3, bytearray()
            return
        bits = int.from_bytes(head, "little")
        kind, size = bits >> 1 & 3, bits >> 3
        if kind == 3:
            raise BadInput(f"{where}: a zstd block of the reserved type at byte {self.at}; corrupt stream")
        self.at += 3 + (1 if kind == 1 else size)
        self.head = bytearray()
        if bits & 1:
            self.end = self.at + (4 if self.checksum else 0)


def inflate(body, where: str, limit: int, too_big) -> bytes:
    """One zstd frame making up the whole of `body`, inflated to at most `limit` bytes (past them:
    `too_big(limit)`). The input is fed in pieces small enough that no piece can inflate past what is
    still allowed (by more than 64 x ZSTD_MAX_RATIO), so a bomb is stopped after at most that much
    work; bytes after the frame, or a frame cut short, are refused."""
    zstandard = module(f"{where}:")
    out, pos, body = bytearray(), 0, bytes(body)
    try:
        d = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW).decompressobj(read_across_frames=False)
        while pos < len(body) and not d.eof:
            step = max(64, (limit - len(out)) // ZSTD_MAX_RATIO)
            out += d.decompress(body[pos:pos + step])
            pos += step
            if len(out) > limit:
                raise too_big(limit)
        if not d.eof:
            raise BadInput(f"{where}: zstd body ends inside its frame (truncated or corrupt)")
        if d.unused_data:
            raise BadInput(f"{where}: {len(d.unused_data) + max(0, len(body) - pos)} bytes after the zstd frame")
    except zstandard.ZstdError as e:
        raise BadInput(f"{where}: corrupt zstd body: {e}") from None
    return bytes(out)
