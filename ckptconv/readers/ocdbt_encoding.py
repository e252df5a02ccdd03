"""The byte encoding of tensorstore's OCDBT manifests and B+tree nodes (tensorstore kvstore/ocdbt
"Storage format"; docs/formats.md, "OCDBT"), which readers/ocdbt.py's store parses with it: the
envelope every encoded manifest and node has (magic, length, format version, compression, body,
CRC-32C), checked whole before its body is read, a zstd body one frame inflated within its bounds;
a cursor over a body whose every read is checked against its end, with riegeli's varints checked
by their width; and the prefix-compressed data file tables, their paths bounded (docs/security.md,
"OCDBT"). Registers nothing.
"""
from ..errors import BadInput
from ..io import zstd
from ..io.crc32c import crc32c

# --- Limits (docs/security.md, "OCDBT"; the store's own are readers/ocdbt.py's) -------------------
NODE_MAX_RATIO = 1024             # inflated bytes per stored byte of a zstd node (Orbax, 16,500 keys: 14.7)
NODE_MIN_DECODED = 64 << 10       # ...but a small node may always inflate to this much
MAX_PATH_LENGTH = 65535           # tensorstore's kMaxPathLength (a data file's full path)
MAX_DATA_FILES = 1 << 16          # data files one table may name
TABLE_BYTES_LIMIT = 16 << 20      # the paths of one data file table, materialised (real: ~100 B)

MANIFEST_MAGIC = 0x0CDB3A2A
BTREE_MAGIC = 0x0CDB20DE


class Cursor:
    """A cursor over a decoded body; every read is checked against its end (BadInput naming `where`)."""

    def __init__(self, data, where: str):
        self.data, self.pos, self.where = memoryview(data), 0, where

    def fail(self, what: str):
        raise BadInput(f"{self.where}: {what}")

    def left(self) -> int:
        return len(self.data) - self.pos

    def byte(self, what: str) -> int:
        if self.pos >= len(self.data):
            self.fail(f"ends inside {what} (truncated or corrupt)")
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self, what: str, bits: int = 64) -> int:
        """An unsigned LEB128 varint of at most `bits` bits: at most ceil(bits/7) bytes, the last
        one's unused high bits clear (riegeli's ReadVarint32/64)."""
        value, shift, most = 0, 0, (bits + 6) // 7
        for i in range(most):
            b = self.byte(what)
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                if value >> bits:
                    self.fail(f"{what}: varint {value} does not fit in {bits} bits")
                return value
            shift += 7
        self.fail(f"{what}: varint longer than {most} bytes")

    def take(self, n: int, what: str):
        if n > self.left():
            self.fail(f"{what} needs {n} bytes but {self.left()} remain (truncated or corrupt)")
        self.pos += n
        return self.data[self.pos - n:self.pos]

    def u32le(self, what: str) -> int:
        return int.from_bytes(self.take(4, what), "little")

    def u64le(self, what: str) -> int:
        return int.from_bytes(self.take(8, what), "little")

    def end(self):
        if self.left():
            self.fail(f"{self.left()} bytes after the last field (corrupt)")



def unwrap(data, magic: int, what: str, where: str, limit: int):
    """The decoded body of an encoded manifest or node: magic (uint32be), length (uint64le) equal to
    the bytes present, version varint 0, compression varint (0 none, 1 zstd), body, CRC-32C
    (uint32le) of everything before it. A zstd body inflates to at most `limit` bytes (the store's
    NODE_MAX_DECODED), NODE_MAX_RATIO x its own (at least NODE_MIN_DECODED)."""
    data = memoryview(data)
    if len(data) < 16:
        raise BadInput(f"{where}: {what} of {len(data)} bytes is shorter than its 16-byte header and checksum")
    got = int.from_bytes(data[:4], "big")
    if got != magic:
        raise BadInput(f"{where}: not an OCDBT {what} (magic {got:#010x}, expected {magic:#010x})")
    length = int.from_bytes(data[4:12], "little")
    if length != len(data):
        raise BadInput(f"{where}: {what} header says {length} bytes but it has {len(data)}")
    stored, actual = int.from_bytes(data[-4:], "little"), crc32c(data[:-4])
    if stored != actual:
        raise BadInput(f"{where}: {what} fails its CRC-32C check (stored {stored:#010x}, computed {actual:#010x})")
    r = Cursor(data[:-4], where)
    r.pos = 12
    version = r.varint(f"the {what} format version", 32)
    if version != 0:
        r.fail(f"{what} format version {version} is not supported (only 0)")
    compression = r.varint(f"the {what} compression format", 32)
    if compression == 0:
        return Cursor(data[r.pos:-4], where)
    if compression == 1:
        body = data[r.pos:-4]
        cap = min(limit, max(NODE_MIN_DECODED, NODE_MAX_RATIO * len(body)))

        def too_big(cap):
            return BadInput(f"{where}: zstd body inflates beyond {cap} bytes ({NODE_MAX_RATIO} x its {len(body)} "
                            f"bytes, at most {limit}); refused")
        return Cursor(zstd.inflate(body, where, cap, too_big), where + " (inflated)")
    r.fail(f"unknown compression format {compression} (0: none, 1: zstd)")


def data_file_table(r: Cursor, transitive: str):
    """[(full path, base path)] of a data file table: prefix-compressed `base_path + relative_path`
    strings, each resolved below `transitive` (the base paths of the nodes above)."""
    n = r.varint("the data file count")
    if n > MAX_DATA_FILES or n > r.left():
        r.fail(f"data file table claims {n} files (at most {min(MAX_DATA_FILES, r.left())} fit)")
    prefix = [0] + [r.varint(f"data file {i}'s path prefix length", 16) for i in range(1, n)]
    suffix = [r.varint(f"data file {i}'s path suffix length", 16) for i in range(n)]
    base = [r.varint(f"data file {i}'s base path length", 16) for i in range(n)]
    out, prev, total = [], b"", 0
    for i in range(n):
        total += prefix[i] + suffix[i] + len(transitive)
        if total > TABLE_BYTES_LIMIT:
            r.fail(f"data file table's paths add up to more than {TABLE_BYTES_LIMIT} bytes; refused")
        if prefix[i] > len(prev):
            r.fail(f"data file {i}'s path shares {prefix[i]} bytes with a previous path of {len(prev)}")
        path = prev[:prefix[i]] + bytes(r.take(suffix[i], f"data file {i}'s path"))
        if len(path) + len(transitive) > MAX_PATH_LENGTH:
            r.fail(f"data file {i}'s path is longer than {MAX_PATH_LENGTH} bytes")
        if base[i] > len(path):
            r.fail(f"data file {i}'s base path length {base[i]} exceeds its path length {len(path)}")
        try:
            text, base_text = path.decode("utf-8"), path[:base[i]].decode("utf-8")
        except UnicodeDecodeError:
            r.fail(f"data file {i}'s path {path[:200]!r} is not UTF-8 (or its base path splits a character)")
        out.append((transitive + text, transitive + base_text))
        prev = path
    return out
