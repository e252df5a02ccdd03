"""tensorstore's OCDBT key-value store, as Orbax writes it (use_ocdbt=True), parsed here from its
documented on-disk format (tensorstore kvstore/ocdbt "Storage format"; docs/formats.md, "OCDBT").
Registers nothing: readers/orbax.py is the reader and asks this module for keys and values.

A store is a directory holding `manifest.ocdbt` and the data files it names (`d/<32 hex>`, or any
relative path: Orbax's merged root manifest names the per-process stores' files,
`ocdbt.process_N/d/<hex>`). The manifest holds the configuration and the latest versions inline;
the latest version's B+tree root is followed down to its leaves, whose entries are the keys with
their values, stored inline or as (data file, offset, length).

Only the latest version is read, and it is always inline in the manifest: version tree nodes (older
versions) are parsed as manifest entries and never followed. Everything else is checked as it is
read, against what is present (docs/security.md, "OCDBT"): every encoded manifest and node by its
magic, length, version and CRC-32C; varints by their width; every node and value range inside its
data file; every data file path relative, without `..`, resolving inside the checkpoint; node
heights strictly decreasing from the manifest's root height (so the walk ends), each node read once
and no two nodes sharing bytes; keys strictly increasing across the whole tree; the statistics a
parent records about a child (keys, node bytes, indirect value bytes) equal to what the child holds;
zstd-compressed nodes one whole frame, inflated to at most NODE_MAX_RATIO x their bytes and
NODE_MAX_DECODED, all nodes together TREE_DECODED_LIMIT; keys at most MAX_KEYS and, beyond KEYS_FREE,
one per stored byte of the nodes read; all keys together at most KEY_BYTES_LIMIT bytes and one
table's paths TABLE_BYTES_LIMIT (prefix compression lets a few bytes name 64 KiB).

A directory with per-process stores (`ocdbt.process_N/`) but no root manifest is a save whose merge
never ran (Orbax merges at commit): refused as unfinished, never pieced together from the parts.
"""
import bisect
from typing import NamedTuple

from ..errors import BadInput, UsageError
from ..storage import files as storage
from . import confined, source_root

MANIFEST = "manifest.ocdbt"

# --- Limits (docs/security.md, "OCDBT") ---------------------------------------------------------
MANIFEST_MAX_BYTES = 16 << 20     # the manifest: a config and a few version references (Orbax's: ~100 B)
NODE_MAX_ENCODED = 256 << 20      # one encoded node as stored (Orbax's nodes: up to ~100 MB, see below)
NODE_MAX_DECODED = 128 << 20      # one node inflated; Orbax configures max_decoded_node_bytes = 100e6
NODE_MAX_RATIO = 1024             # inflated bytes per stored byte of a zstd node (Orbax, 16,500 keys: 14.7)
NODE_MIN_DECODED = 64 << 10       # ...but a small node may always inflate to this much
TREE_DECODED_LIMIT = 1 << 30     # all nodes of the tree together, inflated (each node is read once)
MAX_KEYS = 1 << 24                # keys of a tree (each costs ~200 bytes of memory here)
KEYS_FREE = 1 << 16               # ...and beyond this many, at most this many per stored byte of nodes
KEYS_PER_STORED_BYTE = 1          # read (real trees: 3 to 30 stored bytes per key, see docs/security.md)
KEY_BYTES_LIMIT = 256 << 20       # all keys of the tree, materialised (a key alone: <= MAX_KEY_LENGTH)
MAX_KEY_LENGTH = 65535            # tensorstore's kMaxKeyLength
MAX_PATH_LENGTH = 65535           # tensorstore's kMaxPathLength (a data file's full path)
MAX_HEIGHT = 32                   # B+tree height; real trees: arity in the thousands, height <= 4
MAX_ARITY = 1 << 20               # tensorstore's kMaxNodeArity (entries of one node)
MAX_DATA_FILES = 1 << 16          # data files one table may name
TABLE_BYTES_LIMIT = 16 << 20      # the paths of one data file table, materialised (real: ~100 B)
_ZSTD_MAX_WINDOW = 1 << 27

_MANIFEST_MAGIC = 0x0CDB3A2A
_BTREE_MAGIC = 0x0CDB20DE


# --- CRC-32C (Castagnoli, reflected, as absl/riegeli compute it) ----------------------------------

def _crc_table():
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC = _crc_table()


def _crc_bytes(crc: int, data) -> int:
    table = _CRC
    for b in bytes(data):
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc


def _shift_columns(n: int):
    """The linear map "feed n zero bytes" on a CRC register, as the images of its 32 unit vectors."""
    def apply(cols, v):
        out = 0
        for i in range(32):
            if v >> i & 1:
                out ^= cols[i]
        return out
    result = [1 << i for i in range(32)]                       # identity
    step = [_crc_bytes(1 << i, b"\0") for i in range(32)]      # one zero byte
    while n:
        if n & 1:
            result = [apply(step, c) for c in result]
        step = [apply(step, c) for c in step]
        n >>= 1
    return result


_LANE = 1024           # bytes each numpy lane feeds before the lanes are combined
_SMALL = 16 << 10      # below this, the plain byte loop


def crc32c(data) -> int:
    """CRC-32C of `data`. Long inputs are split into 2**k lanes of about _LANE bytes fed side by side with
    numpy (the register update is linear, so a lane starting from 0 contributes independently of the
    others), then combined pairwise: (left shifted by len(right) zero bytes) ^ right."""
    data = memoryview(data).cast("B")
    if len(data) < _SMALL:
        return _crc_bytes(0xFFFFFFFF, data) ^ 0xFFFFFFFF
    import numpy as np
    lanes = 1 << ((len(data) // _LANE).bit_length() - 1)
    width = len(data) // lanes                 # _LANE .. 2 * _LANE - 1; fewer than `lanes` bytes left over
    body = lanes * width
    grid = np.frombuffer(data[:body], dtype=np.uint8).reshape(lanes, width).T.copy()
    table = np.array(_CRC, dtype=np.uint32)
    state = np.zeros(lanes, dtype=np.uint32)
    state[0] = 0xFFFFFFFF
    for row in grid:
        state = table[(state ^ row) & 0xFF] ^ (state >> 8)
    while len(state) > 1:
        cols = _shift_columns(width)
        left, right = state[0::2], state[1::2]
        shifted = np.zeros_like(left)
        for i in range(32):
            shifted ^= np.where(left >> i & 1, np.uint32(cols[i]), np.uint32(0))
        state = shifted ^ right
        width *= 2
    return _crc_bytes(int(state[0]), data[body:]) ^ 0xFFFFFFFF


# --- Decoding ---------------------------------------------------------------------------------

class _Reader:
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


_ZSTD_MAX_RATIO = 32768   # the most one zstd block can inflate per input byte (4 bytes -> 128 KiB)


def _inflate(body, where: str, limit: int):
    """One zstd frame making up the whole of `body`, inflated to at most `limit` bytes. The input is
    fed in pieces small enough that no piece can inflate past what is still allowed (by more than
    64 x _ZSTD_MAX_RATIO), so a bomb is stopped after at most that much work; bytes after the frame,
    or a frame cut short, are refused."""
    try:
        import zstandard
    except ImportError:
        raise UsageError(f"{where}: is zstd-compressed; install zstandard: pip install 'ckptconv[zstd]'") from None
    out, pos, body = bytearray(), 0, bytes(body)
    try:
        d = zstandard.ZstdDecompressor(max_window_size=_ZSTD_MAX_WINDOW).decompressobj(read_across_frames=False)
        while pos < len(body) and not d.eof:
            step = max(64, (limit - len(out)) // _ZSTD_MAX_RATIO)
            out += d.decompress(body[pos:pos + step])
            pos += step
            if len(out) > limit:
                raise BadInput(f"{where}: zstd body inflates beyond {limit} bytes "
                               f"({NODE_MAX_RATIO} x its {len(body)} bytes, at most {NODE_MAX_DECODED}); refused")
        if not d.eof:
            raise BadInput(f"{where}: zstd body ends inside its frame (truncated or corrupt)")
        if d.unused_data:
            raise BadInput(f"{where}: {len(d.unused_data) + max(0, len(body) - pos)} bytes after the zstd frame")
    except zstandard.ZstdError as e:
        raise BadInput(f"{where}: corrupt zstd body: {e}") from None
    return bytes(out)


def _unwrap(data, magic: int, what: str, where: str, limit: int):
    """The decoded body of an encoded manifest or node: magic (uint32be), length (uint64le) equal to
    the bytes present, version varint 0, compression varint (0 none, 1 zstd), body, CRC-32C
    (uint32le) of everything before it."""
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
    r = _Reader(data[:-4], where)
    r.pos = 12
    version = r.varint(f"the {what} format version", 32)
    if version != 0:
        r.fail(f"{what} format version {version} is not supported (only 0)")
    compression = r.varint(f"the {what} compression format", 32)
    if compression == 0:
        return _Reader(data[r.pos:-4], where)
    if compression == 1:
        body = data[r.pos:-4]
        cap = min(limit, max(NODE_MIN_DECODED, NODE_MAX_RATIO * len(body)))
        return _Reader(_inflate(body, where, cap), where + " (inflated)")
    r.fail(f"unknown compression format {compression} (0: none, 1: zstd)")


def _data_file_table(r: _Reader, transitive: str):
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


class _Ref(NamedTuple):
    path: str        # the data file, relative to the store's directory
    base: str        # its transitive base path, for the data file tables of the node it leads to
    offset: int
    length: int


class Value(NamedTuple):
    file: object          # the storage file holding the value; None when inline
    offset: int
    length: int
    inline: bytes | None  # the value itself when the tree stores it inline


class _Stats(NamedTuple):
    keys: int
    tree_bytes: int
    indirect_bytes: int


class OcdbtStore:
    """The latest version of an OCDBT store under `root` (a directory: Path or storage RemotePath),
    read whole when made: every key, each with its Value. `confine` is the directory every data file
    must resolve into (source_root(root) by default)."""

    def __init__(self, root, confine: str | None = None):
        self.root = root
        self.confine = confine if confine is not None else source_root(root)
        self.files = []
        self._open = {}        # relative path -> storage file
        self._claimed = {}     # relative path -> [(offset, end)] of the nodes read from it
        self._key_bytes = 0
        self._decoded = 0      # bytes of node bodies parsed so far
        self._stored = 0       # bytes of encoded nodes read so far
        self._entries = {}     # key -> Value
        self._order = []
        manifest = root / MANIFEST
        if not storage.is_file(manifest):
            procs = [n for n in _listdir(root) if n.startswith("ocdbt.process_")]
            extra = (f"; it holds {len(procs)} per-process stores ({', '.join(sorted(procs)[:4])}) that were "
                     "never merged into one: an unfinished Orbax save, refused") if procs else ""
            raise BadInput(f"{root}: no {MANIFEST}: not an OCDBT store{extra}")
        where = str(manifest)
        data = storage.read_bytes(manifest, "the OCDBT manifest", MANIFEST_MAX_BYTES)
        root_ref, height, stats = self._manifest(data, where)
        if root_ref is not None:
            got = self._node(root_ref, height, b"", None, where + " (the latest version's root)")
            if got != stats:
                raise BadInput(f"{where}: the latest version records {_said(stats)} but its tree holds {_said(got)}")

    # -- the interface readers/orbax.py uses

    def keys(self) -> list:
        return list(self._order)

    def get(self, key: str):
        return self._entries.get(key)

    def read(self, key: str):
        v = self._entries.get(key)
        if v is None:
            raise KeyError(key)
        if v.inline is not None:
            return v.inline
        return storage.buffer(v.file, v.offset, v.length)

    # -- the manifest

    def _manifest(self, data, where):
        r = _unwrap(data, _MANIFEST_MAGIC, "manifest", where, NODE_MAX_DECODED)
        r.take(16, "the database uuid")
        kind = r.byte("the manifest kind")
        if kind == 1:
            r.fail("is a config-only manifest (manifest_kind numbered: versions in manifest.<generation> files), "
                   "which Orbax does not write; not supported")
        if kind != 0:
            r.fail(f"unknown manifest kind {kind}")
        r.varint("max_inline_value_bytes", 32)
        r.varint("max_decoded_node_bytes", 32)
        arity = r.byte("version_tree_arity_log2")
        if not 1 <= arity <= 16:
            r.fail(f"version_tree_arity_log2 {arity} outside 1..16")
        method = r.varint("the compression method", 32)
        if method == 1:
            r.take(4, "the zstd level")
        elif method != 0:
            r.fail(f"unknown compression method {method} (0: none, 1: zstd)")
        table = _data_file_table(r, "")
        n = r.varint("the number of inline versions")
        if not 1 <= n <= (1 << arity):
            r.fail(f"{n} inline versions; 1..{1 << arity} allowed by version_tree_arity_log2 {arity}")
        gens = [r.varint(f"version {i}'s generation number") for i in range(n)]
        if gens[0] == 0 or any(b <= a for a, b in zip(gens, gens[1:])):
            r.fail(f"generation numbers {gens[:8]} are not positive and strictly increasing")
        heights = [r.byte(f"version {i}'s root height") for i in range(n)]
        refs = self._refs(r, table, n, "version", missing_ok=True)
        stats = self._stats(r, n)
        for i in range(n):
            r.u64le(f"version {i}'s commit time")
        # References to older versions' version tree nodes: parsed, never followed.
        m = r.varint("the number of version tree node references")
        if m > 64:
            r.fail(f"{m} version tree node references; at most {64} heights exist")
        self._refs(r, table, m, "version node")
        for i in range(m):
            r.varint(f"version node {i}'s generation count")
        for i in range(m):
            r.u64le(f"version node {i}'s commit time")
        for i in range(m):
            r.byte(f"version node {i}'s height")
        r.end()
        ref, height = refs[-1], heights[-1]
        if height > MAX_HEIGHT:
            r.fail(f"the latest root's height {height} exceeds {MAX_HEIGHT}")
        if ref is None:
            if height or stats[-1] != (0, 0, 0):
                r.fail(f"the latest version has no root but height {height} and {_said(stats[-1])}")
            return None, 0, stats[-1]
        return ref, height, stats[-1]

    def _refs(self, r, table, n, what, missing_ok=False):
        """Columns of (data file id, offset, length) references; with `missing_ok`, a reference with
        offset and length both 2**64-1 is "no node" (an empty tree's root): None."""
        ids = [r.varint(f"{what} {i}'s data file id") for i in range(n)]
        offsets = [r.varint(f"{what} {i}'s offset") for i in range(n)]
        lengths = [r.varint(f"{what} {i}'s length") for i in range(n)]
        out = []
        for i in range(n):
            if missing_ok and offsets[i] == lengths[i] == (1 << 64) - 1:
                out.append(None)
                continue
            if ids[i] >= len(table):
                r.fail(f"{what} {i} names data file {ids[i]} of a table of {len(table)}")
            if offsets[i] + lengths[i] >= 1 << 64:
                r.fail(f"{what} {i}'s offset {offsets[i]} + length {lengths[i]} overflows 64 bits")
            path, base = table[ids[i]]
            out.append(_Ref(path, base, offsets[i], lengths[i]))
        return out

    def _stats(self, r, n):
        keys = [r.varint("a key count statistic") for _ in range(n)]
        tree = [r.varint("a tree bytes statistic") for _ in range(n)]
        ind = [r.varint("an indirect value bytes statistic") for _ in range(n)]
        return [_Stats(*t) for t in zip(keys, tree, ind)]

    # -- data files

    def _file(self, rel: str, where: str):
        if rel not in self._open:
            parts = rel.split("/")
            if (not rel or rel.startswith("/") or "\\" in rel or any(ord(c) < 0x20 or ord(c) == 0x7F for c in rel)
                    or any(p in ("", ".", "..") for p in parts)):
                raise BadInput(f"{where}: data file path {rel[:300]!r} is not a plain relative path "
                               "(absolute, empty, '.' or '..' parts, a backslash or a control character); refused")
            p = self.root
            for part in parts:
                p = p / part
            try:
                if not storage.is_file(p):
                    raise BadInput(f"{p}: data file named by {where} is missing")
                f = storage.open_file(confined(p, self.confine))
            except OSError as e:
                raise BadInput(f"{p}: data file named by {where} cannot be opened: {e.strerror or e}") from None
            self._open[rel] = f
            self.files.append(f)
        return self._open[rel]

    def _claim(self, ref: _Ref, f, where: str):
        """A node's bytes: not read before, not overlapping another node's."""
        spans = self._claimed.setdefault(ref.path, [])   # sorted, disjoint (start, end)
        lo, hi = ref.offset, ref.offset + ref.length
        i = bisect.bisect_left(spans, (lo, hi))
        for a, b in spans[max(0, i - 1):i + 1]:           # only the neighbours can overlap
            if a < hi and lo < b or (a, b) == (lo, hi):
                again = "is read a second time (the tree loops or shares a node)" if (a, b) == (lo, hi) \
                    else f"overlaps the node at bytes {a}..{b}"
                raise BadInput(f"{f.path}: node at bytes {lo}..{hi} (named by {where}) {again}; refused")
        spans.insert(i, (lo, hi))

    # -- the B+tree

    def _node(self, ref: _Ref, height: int, prefix: bytes, low, where: str) -> _Stats:
        """Read the node `ref` points at, expected at `height`, its keys all prefixed by `prefix` and
        the first one >= `low` (the key its parent records for it); return what it holds."""
        f = self._file(ref.path, where)
        if ref.length > NODE_MAX_ENCODED:
            raise BadInput(f"{f.path}: node at offset {ref.offset} (named by {where}) has {ref.length} bytes, "
                           f"more than {NODE_MAX_ENCODED}")
        f.check(ref.offset, ref.length, f"the node named by {where}")
        self._claim(ref, f, where)
        here = f"{f.path} at offset {ref.offset}"
        data = storage.buffer(f, ref.offset, ref.length)
        r = _unwrap(data, _BTREE_MAGIC, "b-tree node", here, NODE_MAX_DECODED)
        self._decoded += len(r.data)
        self._stored += ref.length
        if self._decoded > TREE_DECODED_LIMIT:
            r.fail(f"the tree's nodes inflate to more than {TREE_DECODED_LIMIT} bytes together; refused")
        got = r.byte("the node height")
        if got != height:
            r.fail(f"node height {got}, but its parent says {height}")
        table = _data_file_table(r, ref.base)
        n = r.varint("the entry count", 32)
        if n == 0 or n > MAX_ARITY or n > r.left():
            r.fail(f"node claims {n} entries ({min(MAX_ARITY, r.left())} at most fit; 0 is not allowed)")
        if height == 0:
            allowed = min(MAX_KEYS, max(KEYS_FREE, int(KEYS_PER_STORED_BYTE * self._stored)))
            if len(self._order) + n > allowed:
                r.fail(f"the tree holds more than {allowed} keys (beyond {KEYS_FREE}, at most "
                       f"{KEYS_PER_STORED_BYTE} per stored byte of its nodes, and {MAX_KEYS} in all); refused")
        keys = self._keys(r, n, height > 0)
        if height == 0:
            return self._leaf(r, n, keys, table, prefix, low, here, ref.length)
        keys, common = keys
        for i, k in enumerate(keys):
            if common[i] > len(k):
                r.fail(f"child {i}'s subtree prefix length {common[i]} exceeds its key's {len(k)}")
        first = prefix + keys[0]
        if low is not None and first < low:
            r.fail(f"first key {_show(first)} is below {_show(low)}, where its parent puts it")
        refs = self._refs(r, table, n, "child")
        stats = self._stats(r, n)
        r.end()
        total = [0, ref.length, 0]
        for i in range(n):
            sub = self._node(refs[i], height - 1, prefix + keys[i][:common[i]], prefix + keys[i], f"{here}: child {i}")
            if sub != stats[i]:
                r.fail(f"child {i} is recorded with {_said(stats[i])} but holds {_said(sub)}")
            total[0] += sub.keys
            total[1] += sub.tree_bytes
            total[2] += sub.indirect_bytes
        return _Stats(*total)

    def _keys(self, r, n, interior):
        """The prefix-compressed key columns of a node: relative keys (bytes), strictly increasing,
        and for an interior node the subtree common prefix lengths."""
        prefixes = [0] + [r.varint(f"key {i}'s prefix length", 32) for i in range(1, n)]
        suffixes = [r.varint(f"key {i}'s suffix length", 32) for i in range(n)]
        common = [r.varint(f"child {i}'s subtree prefix length", 32) for i in range(n)] if interior else None
        keys, prev = [], b""
        for i in range(n):
            if prefixes[i] > len(prev):
                r.fail(f"key {i} shares {prefixes[i]} bytes with a previous key of {len(prev)}")
            if prefixes[i] + suffixes[i] > MAX_KEY_LENGTH:
                r.fail(f"key {i} is {prefixes[i] + suffixes[i]} bytes, more than {MAX_KEY_LENGTH}")
            key = prev[:prefixes[i]] + bytes(r.take(suffixes[i], f"key {i}'s suffix"))
            self._key_bytes += len(key)
            if self._key_bytes > KEY_BYTES_LIMIT:
                r.fail(f"keys add up to more than {KEY_BYTES_LIMIT} bytes; refused")
            if i and key <= prev:
                r.fail(f"keys out of order: {_show(key)} after {_show(prev)}")
            keys.append(key)
            prev = key
        return (keys, common) if interior else keys

    def _leaf(self, r, n, keys, table, prefix, low, here, own) -> _Stats:
        lengths = [r.varint(f"value {i}'s length") for i in range(n)]
        kinds = [r.byte(f"value {i}'s kind") for i in range(n)]
        if any(k > 1 for k in kinds):
            r.fail(f"value kind {max(kinds)} is neither 0 (inline) nor 1 (in a data file)")
        indirect = [i for i in range(n) if kinds[i]]
        ids = [r.varint(f"value {i}'s data file id") for i in indirect]
        offsets = [r.varint(f"value {i}'s offset") for i in indirect]
        at = dict(zip(indirect, zip(ids, offsets)))
        first = prefix + keys[0]
        if low is not None and first < low:
            r.fail(f"first key {_show(first)} is below {_show(low)}, where its parent puts it")
        last = self._order_last
        if last is not None and first <= last:
            r.fail(f"key {_show(first)} does not follow {_show(last)} (keys out of order across nodes)")
        indirect_bytes = 0
        for i in range(n):
            full = prefix + keys[i]
            if len(full) > MAX_KEY_LENGTH:
                r.fail(f"key {_show(full)} is longer than {MAX_KEY_LENGTH} bytes")
            try:
                name = full.decode("utf-8")
            except UnicodeDecodeError:
                r.fail(f"key {_show(full)} is not UTF-8")
            if kinds[i] == 0:
                value = Value(None, 0, lengths[i], bytes(r.take(lengths[i], f"value of {name!r}")))
            else:
                fid, off = at[i]
                if fid >= len(table):
                    r.fail(f"value of {name!r} names data file {fid} of a table of {len(table)}")
                path = table[fid][0]
                f = self._file(path, here)
                f.check(off, lengths[i], f"value of key {name!r} (named by {here})")
                value = Value(f, off, lengths[i], None)
                indirect_bytes += lengths[i]
            self._entries[name] = value
            self._order.append(name)
        self._order_last = prefix + keys[-1]
        r.end()
        return _Stats(n, own, indirect_bytes)

    _order_last = None


def _listdir(root):
    try:
        return storage.listdir(root)
    except (OSError, BadInput):
        return []


def _said(s: _Stats) -> str:
    return f"{s.keys} keys, {s.tree_bytes} node bytes, {s.indirect_bytes} indirect value bytes"


def _show(key: bytes) -> str:
    return repr(bytes(key[:120])) + ("..." if len(key) > 120 else "")
