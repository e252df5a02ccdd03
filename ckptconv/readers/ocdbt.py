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
read, against what is present (docs/security.md, "OCDBT"). ocdbt_encoding.py checks the bytes: every
encoded manifest and node by its magic, length, version and CRC-32C; varints by their width; zstd
nodes one whole frame, inflated to at most NODE_MAX_RATIO x their bytes and NODE_MAX_DECODED; one
table's paths at most TABLE_BYTES_LIMIT (prefix compression lets a few bytes name 64 KiB). This
module checks the tree: every node and value range inside its data file; every data file path
relative, without `..`, resolving inside the checkpoint; node heights strictly decreasing from the
manifest's root height (so the walk ends), each node read once and no two nodes sharing bytes; keys
strictly increasing across the whole tree; the statistics a parent records about a child (keys,
node bytes, indirect value bytes) equal to what the child holds; all nodes together inflated to at
most TREE_DECODED_LIMIT; keys at most MAX_KEYS and, beyond KEYS_FREE, one per stored byte of the
nodes read; all keys together at most KEY_BYTES_LIMIT bytes.

A directory with per-process stores (`ocdbt.process_N/`) but no root manifest is a save whose merge
never ran (Orbax merges at commit): refused as unfinished, never pieced together from the parts.
"""
import bisect
from typing import NamedTuple

from ..errors import BadInput
from ..storage import files as storage
from . import confined, source_root
from .ocdbt_encoding import BTREE_MAGIC, MANIFEST_MAGIC, data_file_table, unwrap

MANIFEST = "manifest.ocdbt"

# --- Limits (docs/security.md, "OCDBT"; those of the encoding are ocdbt_encoding.py's) -----------
MANIFEST_MAX_BYTES = 16 << 20     # the manifest: a config and a few version references (Orbax's: ~100 B)
NODE_MAX_ENCODED = 256 << 20      # one encoded node as stored (Orbax's nodes: up to ~100 MB, see below)
NODE_MAX_DECODED = 128 << 20      # one node inflated; Orbax configures max_decoded_node_bytes = 100e6
TREE_DECODED_LIMIT = 1 << 30     # all nodes of the tree together, inflated (each node is read once)
MAX_KEYS = 1 << 24                # keys of a tree (each costs ~200 bytes of memory here)
KEYS_FREE = 1 << 16               # ...and beyond this many, at most this many per stored byte of nodes
KEYS_PER_STORED_BYTE = 1          # read (real trees: 3 to 30 stored bytes per key, see docs/security.md)
KEY_BYTES_LIMIT = 256 << 20       # all keys of the tree, materialised (a key alone: <= MAX_KEY_LENGTH)
MAX_KEY_LENGTH = 65535            # tensorstore's kMaxKeyLength
MAX_HEIGHT = 32                   # B+tree height; real trees: arity in the thousands, height <= 4
MAX_ARITY = 1 << 20               # tensorstore's kMaxNodeArity (entries of one node)


class _Ref(NamedTuple):
    path: str        # the data file, relative to the store's directory
    base: str        # its transitive base path, for the data file tables of the node it leads to
    offset: int
    length: int


class Value(NamedTuple):
    """Where a value is, as a store's `get(key)` answers: OcdbtStore's, and readers/orbax_zarr.py's
    DirStore (a directory, one file a value) answers the same."""

    file: object          # the storage file holding the value; None when inline
    offset: int
    length: int
    inline: bytes | None  # the value itself when the store holds it inline

    def data(self):
        """The value's bytes: inline, or a view of its file (storage.buffer)."""
        if self.inline is not None:
            return self.inline
        return storage.buffer(self.file, self.offset, self.length)


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
        return v.data()

    # -- the manifest

    def _manifest(self, data, where):
        r = unwrap(data, MANIFEST_MAGIC, "manifest", where, NODE_MAX_DECODED)
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
        table = data_file_table(r, "")
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
        r = unwrap(data, BTREE_MAGIC, "b-tree node", here, NODE_MAX_DECODED)
        self._decoded += len(r.data)
        self._stored += ref.length
        if self._decoded > TREE_DECODED_LIMIT:
            r.fail(f"the tree's nodes inflate to more than {TREE_DECODED_LIMIT} bytes together; refused")
        got = r.byte("the node height")
        if got != height:
            r.fail(f"node height {got}, but its parent says {height}")
        table = data_file_table(r, ref.base)
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
