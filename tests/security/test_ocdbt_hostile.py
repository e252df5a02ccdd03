"""Hostile OCDBT stores (readers/ocdbt.py; docs/security.md, "OCDBT"): each attack is refused with
one BadInput line naming the file and what is wrong, within the stated bounds; mutated real stores
(tests/fixtures/data/ocdbt/) raise BadInput and nothing else.

The stores here are encoded by hand (`enc_*`, test-only, from tensorstore's documented format) with
valid checksums, so each attack reaches the check it aims at rather than the CRC."""
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptconv.errors import BadInput
from ckptconv.io.crc32c import crc32c
from ckptconv.readers import ocdbt, ocdbt_encoding
from ckptconv.readers.ocdbt import MANIFEST, OcdbtStore

DATA = Path(__file__).parent.parent / "fixtures" / "data" / "ocdbt"
MANIFEST_MAGIC, BTREE_MAGIC = 0x0CDB3A2A, 0x0CDB20DE
NONE = (1 << 64) - 1


# --- a minimal encoder (tests only) -------------------------------------------------------------

def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def seal(magic: int, body: bytes, compression: int = 0) -> bytes:
    """Header (magic, length), version 0, compression, body, CRC-32C."""
    if compression == 1:
        import zstandard
        body = zstandard.ZstdCompressor().compress(body)
    head = magic.to_bytes(4, "big") + (12 + 2 + len(body) + 4).to_bytes(8, "little") + varint(0) + varint(compression)
    data = head + body
    return data + crc32c(data).to_bytes(4, "little")


def reseal(data: bytes) -> bytes:
    """`data` (an encoded manifest or node, possibly mutated) with its length and checksum made right."""
    data = bytearray(data)
    data[4:12] = len(data).to_bytes(8, "little")
    data[-4:] = crc32c(bytes(data[:-4])).to_bytes(4, "little")
    return bytes(data)


def table(paths) -> bytes:
    """A data file table, no prefix compression; paths are (base, relative) or a string."""
    paths = [("", p) if isinstance(p, str) else p for p in paths]
    full = [(b + r).encode() for b, r in paths]
    out = varint(len(full)) + b"".join(varint(0) for _ in full[1:])
    out += b"".join(varint(len(f)) for f in full) + b"".join(varint(len(b.encode())) for b, _ in paths)
    return out + b"".join(full)


def keys_columns(keys, common=None) -> bytes:
    out = b"".join(varint(0) for _ in keys[1:]) + b"".join(varint(len(k)) for k in keys)
    if common is not None:
        out += b"".join(varint(c) for c in common)
    return out + b"".join(keys)


def leaf(entries, files=("d/data",), height=0) -> bytes:
    """entries: (key, value bytes) inline or (key, (file id, offset, length)) indirect."""
    keys = [k for k, _ in entries]
    body = bytes([height]) + table(files) + varint(len(entries)) + keys_columns(keys)
    body += b"".join(varint(len(v) if isinstance(v, bytes) else v[2]) for _, v in entries)
    body += bytes(0 if isinstance(v, bytes) else 1 for _, v in entries)
    ind = [v for _, v in entries if not isinstance(v, bytes)]
    body += b"".join(varint(v[0]) for v in ind) + b"".join(varint(v[1]) for v in ind)
    body += b"".join(v for _, v in entries if isinstance(v, bytes))
    return body


def interior(children, height, files=("d/data",)) -> bytes:
    """children: (key, subtree common prefix length, (file id, offset, length), (keys, tree bytes, indirect))."""
    body = bytes([height]) + table(files) + varint(len(children))
    body += keys_columns([c[0] for c in children], [c[1] for c in children])
    for i in range(3):
        body += b"".join(varint(c[2][i]) for c in children)
    for i in range(3):
        body += b"".join(varint(c[3][i]) for c in children)
    return body


def manifest(ref, height, stats, files=("d/data",), compression=0, arity=4, extra=b"") -> bytes:
    body = bytes(16) + bytes([0]) + varint(100) + varint(1 << 20) + bytes([arity]) + varint(0)
    body += table(files) + varint(1) + varint(1) + bytes([height])
    body += varint(ref[0]) + varint(ref[1]) + varint(ref[2])
    body += varint(stats[0]) + varint(stats[1]) + varint(stats[2]) + bytes(8)
    body += varint(0) + extra
    return seal(MANIFEST_MAGIC, body, compression)


def store(tmp_path, nodes, root_index=0, height=0, stats=None, data_extra=b"", **kw):
    """A store whose data file d/data holds the encoded `nodes` back to back (then `data_extra`);
    the manifest points at nodes[root_index]. Returns (dir, [(offset, length)] of the nodes)."""
    d = tmp_path / "s"
    (d / "d").mkdir(parents=True, exist_ok=True)
    blob, at = b"", []
    for n in nodes:
        at.append((len(blob), len(n)))
        blob += n
    (d / "d" / "data").write_bytes(blob + data_extra)
    off, ln = at[root_index]
    (d / MANIFEST).write_bytes(manifest((0, off, ln), height, stats or (0, 0, 0), **kw))
    return d, at


def refused(path, match):
    with pytest.raises(BadInput, match=match) as e:
        OcdbtStore(path)
    assert "\n" not in str(e.value)
    return str(e.value)


# --- a well-formed hand-made store first: the encoder is right ------------------------------------

def test_hand_made_store_reads(tmp_path):
    node = seal(BTREE_MAGIC, leaf([(b"a", b"xy"), (b"b", (0, 0, 3))]))
    d, at = store(tmp_path, [node], stats=(2, len(node), 3), data_extra=b"")
    (d / "d" / "data").write_bytes(b"abc" + node)
    (d / MANIFEST).write_bytes(manifest((0, 3, len(node)), 0, (2, len(node), 3)))
    s = OcdbtStore(d)
    assert s.keys() == ["a", "b"] and s.read("a") == b"xy" and bytes(s.read("b")) == b"abc"


def two_level(tmp_path, child_refs, child_stats=None, keys=(b"a", b"m")):
    """Leaves L0 (a, b) and L1 (m, n) then an interior root whose children are `child_refs`."""
    l0 = seal(BTREE_MAGIC, leaf([(b"a", b"1"), (b"b", b"2")]))
    l1 = seal(BTREE_MAGIC, leaf([(b"m", b"3"), (b"n", b"4")]))
    refs = child_refs(len(l0), len(l1))
    stats = child_stats or [(2, len(l0), 0), (2, len(l1), 0)]
    root = seal(BTREE_MAGIC, interior([(k, 0, r, s) for k, r, s in zip(keys, refs, stats)], 1))
    total = (4, len(root) + len(l0) + len(l1), 0)
    return store(tmp_path, [l0, l1, root], root_index=2, height=1, stats=total)


def test_hand_made_two_levels(tmp_path):
    d, _ = two_level(tmp_path, lambda a, b: [(0, 0, a), (0, a, b)])
    assert OcdbtStore(d).keys() == ["a", "b", "m", "n"]


# --- loops, depth, shared nodes -----------------------------------------------------------------

def test_node_referenced_twice(tmp_path):
    d, _ = two_level(tmp_path, lambda a, b: [(0, 0, a), (0, 0, a)],
                     child_stats=None)
    refused(d, "read a second time|out of order|below")


def test_node_referenced_twice_keys_in_order(tmp_path):
    """Two children pointing at one leaf whose keys would still fit both places: the second visit is
    refused as a node read twice (a DAG could otherwise multiply the work exponentially)."""
    l0 = seal(BTREE_MAGIC, leaf([(b"a", b"1")]))
    root = seal(BTREE_MAGIC, interior([(b"", 0, (0, 0, len(l0)), (1, len(l0), 0)),
                                       (b"a", 0, (0, 0, len(l0)), (1, len(l0), 0))], 1))
    d, _ = store(tmp_path, [l0, root], root_index=1, height=1, stats=(2, len(root) + 2 * len(l0), 0))
    refused(d, "read a second time")


def test_self_loop(tmp_path):
    """An interior node naming itself: its height cannot be its own height - 1."""
    body = interior([(b"a", 0, (0, 0, 0), (1, 1, 0))], 1)
    node = seal(BTREE_MAGIC, body)
    node = seal(BTREE_MAGIC, interior([(b"a", 0, (0, 0, len(node)), (1, 1, 0))], 1))
    d, _ = store(tmp_path, [node], height=1, stats=(1, 1, 0))
    refused(d, "node height 1, but its parent says 0|read a second time")


def test_overlapping_nodes(tmp_path):
    d, _ = two_level(tmp_path, lambda a, b: [(0, 0, a), (0, 1, b)])
    refused(d, "overlaps|magic|CRC")


def test_height_over_limit(tmp_path):
    node = seal(BTREE_MAGIC, leaf([(b"a", b"1")]))
    d, _ = store(tmp_path, [node], height=200, stats=(1, len(node), 0))
    refused(d, "height 200 exceeds 32")


def test_manifest_height_lies(tmp_path):
    node = seal(BTREE_MAGIC, leaf([(b"a", b"1")]))
    d, _ = store(tmp_path, [node], height=3, stats=(1, len(node), 0))
    refused(d, "node height 0, but its parent says 3")


# --- ranges past the end of their file ------------------------------------------------------------

def test_node_past_end_of_file(tmp_path):
    node = seal(BTREE_MAGIC, leaf([(b"a", b"1")]))
    d, _ = store(tmp_path, [node], stats=(1, len(node), 0))
    (d / MANIFEST).write_bytes(manifest((0, 10, len(node)), 0, (1, len(node), 0)))
    msg = refused(d, "truncated or corrupt")
    assert "d/data" in msg


def test_node_offset_overflow(tmp_path):
    node = seal(BTREE_MAGIC, leaf([(b"a", b"1")]))
    d, _ = store(tmp_path, [node], stats=(1, len(node), 0))
    (d / MANIFEST).write_bytes(manifest((0, (1 << 64) - 2, 5), 0, (1, len(node), 0)))
    refused(d, "overflows 64 bits")


def test_value_past_end_of_file(tmp_path):
    node = seal(BTREE_MAGIC, leaf([(b"a", (0, 0, 1 << 40))]))
    d, _ = store(tmp_path, [node], stats=(1, len(node), 1 << 40))
    refused(d, "value of key 'a'.*truncated or corrupt")


def test_value_names_missing_table_entry(tmp_path):
    node = seal(BTREE_MAGIC, leaf([(b"a", (7, 0, 1))]))
    d, _ = store(tmp_path, [node], stats=(1, len(node), 1))
    refused(d, "names data file 7 of a table of 1")


# --- a manifest (or node) that lies ---------------------------------------------------------------

def test_length_lies(tmp_path):
    node = seal(BTREE_MAGIC, leaf([(b"a", b"1")]))
    d, _ = store(tmp_path, [node], stats=(1, len(node), 0))
    m = bytearray((d / MANIFEST).read_bytes())
    m[4:12] = (len(m) + 1).to_bytes(8, "little")
    (d / MANIFEST).write_bytes(bytes(m))
    refused(d, r"manifest header says \d+ bytes but it has")


def test_checksum_lies(tmp_path):
    node = seal(BTREE_MAGIC, leaf([(b"a", b"1")]))
    d, _ = store(tmp_path, [node], stats=(1, len(node), 0))
    m = bytearray((d / MANIFEST).read_bytes())
    m[-5] ^= 1
    (d / MANIFEST).write_bytes(bytes(m))
    refused(d, "CRC-32C")


def test_node_checksum_lies(tmp_path):
    node = bytearray(seal(BTREE_MAGIC, leaf([(b"a", b"1")])))
    node[-5] ^= 1
    d, _ = store(tmp_path, [bytes(node)], stats=(1, len(node), 0))
    msg = refused(d, "b-tree node fails its CRC-32C")
    assert "d/data at offset 0" in msg


def test_key_count_lies(tmp_path):
    node = seal(BTREE_MAGIC, leaf([(b"a", b"1")]))
    d, _ = store(tmp_path, [node], stats=(5, len(node), 0))
    refused(d, "records 5 keys.*holds 1 keys")


def test_child_statistics_lie(tmp_path):
    d, _ = two_level(tmp_path, lambda a, b: [(0, 0, a), (0, a, b)],
                     child_stats=[(2, 1, 0), (2, 1, 0)])
    refused(d, "child 0 is recorded with")


def test_entry_count_lies(tmp_path):
    body = bytearray(leaf([(b"a", b"1")]))
    body[1 + len(table(["d/data"]))] = 100      # the entry count
    node = seal(BTREE_MAGIC, bytes(body))
    d, _ = store(tmp_path, [node], stats=(1, len(node), 0))
    refused(d, "ends inside|needs|claims")


def test_wrong_magic_and_version(tmp_path):
    d, _ = store(tmp_path, [seal(0x12345678, leaf([(b"a", b"1")]))], stats=(1, 1, 0))
    refused(d, "not an OCDBT b-tree node")
    m = bytearray(manifest((0, 0, 1), 0, (0, 0, 0)))
    m[12] = 3
    (d / MANIFEST).write_bytes(reseal(bytes(m)))
    refused(d, "format version 3 is not supported")


def test_unknown_compression(tmp_path):
    node = bytearray(seal(BTREE_MAGIC, leaf([(b"a", b"1")])))
    node[13] = 9
    d, _ = store(tmp_path, [reseal(bytes(node))], stats=(1, len(node), 0))
    refused(d, "unknown compression format 9")


def test_trailing_bytes(tmp_path):
    node = seal(BTREE_MAGIC, leaf([(b"a", b"1")]) + b"junk")
    d, _ = store(tmp_path, [node], stats=(1, len(node), 0))
    refused(d, "4 bytes after the last field")


# --- keys -------------------------------------------------------------------------------------

def test_keys_not_sorted(tmp_path):
    node = seal(BTREE_MAGIC, leaf([(b"b", b"1"), (b"a", b"2")]))
    d, _ = store(tmp_path, [node], stats=(2, len(node), 0))
    refused(d, "keys out of order")


def test_keys_duplicated(tmp_path):
    node = seal(BTREE_MAGIC, leaf([(b"a", b"1"), (b"a", b"2")]))
    d, _ = store(tmp_path, [node], stats=(2, len(node), 0))
    refused(d, "keys out of order")


def test_keys_out_of_order_across_nodes(tmp_path):
    """The root's keys are in order, but the second leaf holds keys before the first's."""
    l0 = seal(BTREE_MAGIC, leaf([(b"m", b"1"), (b"n", b"2")]))
    l1 = seal(BTREE_MAGIC, leaf([(b"c", b"3")]))
    root = seal(BTREE_MAGIC, interior([(b"", 0, (0, 0, len(l0)), (2, len(l0), 0)),
                                       (b"b", 0, (0, len(l0), len(l1)), (1, len(l1), 0))], 1))
    d, _ = store(tmp_path, [l0, l1, root], root_index=2, height=1,
                 stats=(3, len(root) + len(l0) + len(l1), 0))
    refused(d, r"key b'c' does not follow b'n' \(keys out of order across nodes\)")


def test_child_below_its_parent_key(tmp_path):
    l0 = seal(BTREE_MAGIC, leaf([(b"a", b"1")]))
    root = seal(BTREE_MAGIC, interior([(b"k", 0, (0, 0, len(l0)), (1, len(l0), 0))], 1))
    d, _ = store(tmp_path, [l0, root], root_index=1, height=1, stats=(1, len(root) + len(l0), 0))
    refused(d, "is below b'k', where its parent puts it")


def test_prefix_longer_than_previous_key(tmp_path):
    body = bytes([0]) + table(["d/data"]) + varint(2) + varint(5) + varint(1) + varint(1) + b"ab"
    body += varint(0) + varint(0) + bytes(2)
    node = seal(BTREE_MAGIC, body)
    d, _ = store(tmp_path, [node], stats=(2, len(node), 0))
    refused(d, "shares 5 bytes with a previous key of 1")


def test_key_bytes_bomb(tmp_path, monkeypatch):
    """Prefix compression lets 5 bytes name a 64 KiB key; all keys together are bounded."""
    monkeypatch.setattr(ocdbt, "KEY_BYTES_LIMIT", 4 << 20)
    n = 200
    first = b"k" * 65533
    body = bytes([0]) + table(["d/data"]) + varint(n)
    body += b"".join(varint(65533) for _ in range(n - 1))
    body += varint(65533) + b"".join(varint(2) for _ in range(n - 1))
    body += first + b"".join(i.to_bytes(2, "big") for i in range(1, n))
    body += b"".join(varint(0) for _ in range(n)) + bytes(n)
    node = seal(BTREE_MAGIC, body)
    d, _ = store(tmp_path, [node], stats=(n, len(node), 0))
    refused(d, "keys add up to more than 4194304 bytes")


def test_enormous_entry_count(tmp_path):
    body = bytes([0]) + table(["d/data"]) + varint(1 << 20) + b"\0" * 10
    node = seal(BTREE_MAGIC, body)
    d, _ = store(tmp_path, [node], stats=(1 << 20, len(node), 0))
    refused(d, "claims 1048576 entries")


def test_varint_too_long(tmp_path):
    body = bytes([0]) + table(["d/data"]) + b"\xff" * 11 + b"\x01"
    node = seal(BTREE_MAGIC, body)
    d, _ = store(tmp_path, [node], stats=(1, len(node), 0))
    refused(d, "varint longer than 5 bytes")
    body = bytes([0]) + table(["d/data"]) + varint(1) + varint(1) + b"a" + b"\xff" * 10 + b"\x01" + bytes(1)
    node = seal(BTREE_MAGIC, body)
    d, _ = store(tmp_path, [node], stats=(1, len(node), 0))
    refused(d, "varint longer than 10 bytes|does not fit in 64 bits")


# --- zstd -------------------------------------------------------------------------------------

def test_zstd_node_bomb(tmp_path):
    """A node whose zstd body inflates past NODE_MAX_RATIO x its size (and the 64 KiB floor)."""
    body = leaf([(b"a", bytes(8 << 20))])
    node = seal(BTREE_MAGIC, body, compression=1)
    assert len(node) < 4096
    d, _ = store(tmp_path, [node], stats=(1, len(node), 0))
    refused(d, "inflates beyond")


def test_zstd_node_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(ocdbt, "NODE_MAX_DECODED", 1000)
    body = leaf([(b"a", os.urandom(2000))])
    node = seal(BTREE_MAGIC, body, compression=1)
    d, _ = store(tmp_path, [node], stats=(1, len(node), 0))
    refused(d, "inflates beyond 1000 bytes")


def test_zstd_garbage(tmp_path):
    node = reseal(seal(BTREE_MAGIC, b"\x28\xb5\x2f\xfd" + b"\xff" * 40))
    node = bytearray(node)
    node[13] = 1
    d, _ = store(tmp_path, [reseal(bytes(node))], stats=(1, len(node), 0))
    refused(d, "corrupt zstd body")


def test_tree_decoded_total(tmp_path, monkeypatch):
    monkeypatch.setattr(ocdbt, "TREE_DECODED_LIMIT", 30)
    d, _ = two_level(tmp_path, lambda a, b: [(0, 0, a), (0, a, b)])
    refused(d, "inflate to more than 30 bytes together")


# --- data file paths --------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["../outside", "/etc/passwd", "d/../../x", "d//data", "./d/data", "", "d/a\nb",
                                  "d\\..\\x"])
def test_path_escapes(tmp_path, path):
    node = seal(BTREE_MAGIC, leaf([(b"a", b"1")]))
    d, _ = store(tmp_path, [node], stats=(1, len(node), 0))
    (d / MANIFEST).write_bytes(manifest((0, 0, len(node)), 0, (1, len(node), 0), files=[path]))
    refused(d, "not a plain relative path")


def test_base_path_escape_in_a_node(tmp_path):
    """A node's table builds on its own base path: ('..', '/x') is still refused whole."""
    node = seal(BTREE_MAGIC, leaf([(b"a", (0, 0, 1))], files=[("../", "x")]))
    d, _ = store(tmp_path, [node], stats=(1, len(node), 1))
    refused(d, "not a plain relative path")


def test_symlink_out(tmp_path):
    outside = tmp_path / "secret"
    node = seal(BTREE_MAGIC, leaf([(b"a", b"1")]))
    outside.write_bytes(node)
    d, _ = store(tmp_path, [node], stats=(1, len(node), 0))
    (d / "d" / "link").symlink_to(outside)
    (d / MANIFEST).write_bytes(manifest((0, 0, len(node)), 0, (1, len(node), 0), files=["d/link"]))
    refused(d, "leads outside the checkpoint")


def test_missing_data_file(tmp_path):
    node = seal(BTREE_MAGIC, leaf([(b"a", b"1")]))
    d, _ = store(tmp_path, [node], stats=(1, len(node), 0))
    (d / MANIFEST).write_bytes(manifest((0, 0, len(node)), 0, (1, len(node), 0), files=["d/gone"]))
    refused(d, "is missing")


def test_manifest_too_large(tmp_path, monkeypatch):
    monkeypatch.setattr(ocdbt, "MANIFEST_MAX_BYTES", 10)
    refused(DATA / "small", "more than the 10 accepted|10")


# --- mutated real stores: BadInput, nothing else ----------------------------------------------------

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def _copy(src: Path, dst: Path) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def _mutate(data: bytes, edits) -> bytes:
    data = bytearray(data)
    for pos, val in edits:
        if data:
            data[pos % len(data)] = val
    return bytes(data)


EDITS = st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=6)


def _only_bad_input(path):
    try:
        s = OcdbtStore(path)
        for k in s.keys():
            s.read(k)
    except BadInput as e:
        assert "\n" not in str(e)


@FUZZ
@given(EDITS, st.booleans())
def test_fuzz_manifest(tmp_path_factory, edits, fix):
    d = _copy(DATA / "deep", tmp_path_factory.getbasetemp() / "fuzz-manifest")
    m = _mutate((d / MANIFEST).read_bytes(), edits)
    (d / MANIFEST).write_bytes(reseal(m) if fix and len(m) >= 16 else m)
    _only_bad_input(d)


@FUZZ
@given(EDITS, st.booleans())
def test_fuzz_nodes(tmp_path_factory, edits, fix):
    """The small store's uncompressed nodes, mutated and (half the time) resealed so the parser
    behind the checksum sees the mutation."""
    d = _copy(DATA / "small", tmp_path_factory.getbasetemp() / "fuzz-nodes")
    s = OcdbtStore(d)
    node_file = Path(s.files[0].path)
    raw = node_file.read_bytes()
    # the root node: the manifest names it; mutate within it and reseal it in place
    root = _root_range(d)
    off, ln = root
    node = _mutate(raw[off:off + ln], [(12 + p % max(1, ln - 16), v) for p, v in edits])
    if fix:
        node = reseal(node)
    node_file.write_bytes(raw[:off] + node + raw[off + ln:])
    _only_bad_input(d)


def _root_range(d: Path):
    """(offset, length) of the root node, read back through the parser's own manifest decoding."""
    store = OcdbtStore.__new__(OcdbtStore)
    store.root, store.confine, store.files, store._open, store._claimed = d, str(d), [], {}, {}
    ref, _, _ = store._manifest((d / MANIFEST).read_bytes(), "m")
    return ref.offset, ref.length


@FUZZ
@given(st.binary(min_size=0, max_size=300))
def test_fuzz_random_manifest_bodies(tmp_path_factory, body):
    """Random bodies behind a valid header and checksum: only BadInput."""
    d = tmp_path_factory.getbasetemp() / "fuzz-random"
    d.mkdir(exist_ok=True)
    (d / MANIFEST).write_bytes(seal(MANIFEST_MAGIC, body))
    _only_bad_input(d)


def test_zstd_frame_cut_short_or_followed(tmp_path):
    import zstandard
    frame = zstandard.ZstdCompressor().compress(leaf([(b"a", b"1")]))
    for body, match in ((frame[:-3], "ends inside its frame"), (frame + b"junk", "4 bytes after the zstd frame")):
        node = bytearray(seal(BTREE_MAGIC, body))
        node[13] = 1
        node = reseal(bytes(node))
        d, _ = store(tmp_path, [node], stats=(1, len(node), 0))
        refused(d, match)


def test_data_file_table_bomb(tmp_path, monkeypatch):
    """Prefix compression lets 3 bytes name a 64 KiB path; a table's paths together are bounded."""
    monkeypatch.setattr(ocdbt_encoding, "TABLE_BYTES_LIMIT", 1 << 20)
    n = 100
    first = b"d/" + b"x" * 60000
    tbl = varint(n) + b"".join(varint(len(first)) for _ in range(n - 1))
    tbl += varint(len(first)) + b"".join(varint(0) for _ in range(n - 1)) + b"".join(varint(0) for _ in range(n))
    tbl += first
    body = bytes([0]) + tbl + varint(1) + keys_columns([b"a"]) + varint(1) + bytes(1) + b"1"
    node = seal(BTREE_MAGIC, body)
    d, _ = store(tmp_path, [node], stats=(1, len(node), 0))
    refused(d, "paths add up to more than 1048576 bytes")


@pytest.mark.parametrize("bound", ["per stored byte", "in all"])
def test_keys_bounded_by_stored_bytes(tmp_path, monkeypatch, bound):
    """More keys than the bytes of the nodes that hold them justify (beyond KEYS_FREE), or than
    MAX_KEYS, are refused before they are built (the ratio is lowered here: 3,000 distinct 2-byte
    keys still take about 5 KB as a zstd leaf)."""
    monkeypatch.setattr(ocdbt, "KEYS_FREE", 100)
    if bound == "in all":
        monkeypatch.setattr(ocdbt, "MAX_KEYS", 1000)
    else:
        monkeypatch.setattr(ocdbt, "KEYS_PER_STORED_BYTE", 0.1)
    n = 3000
    node = seal(BTREE_MAGIC, leaf([(i.to_bytes(2, "big"), b"") for i in range(1, n + 1)]), compression=1)
    d, _ = store(tmp_path, [node], stats=(n, len(node), 0))
    allowed = 1000 if bound == "in all" else len(node) // 10
    refused(d, f"more than {allowed} keys")


def test_manifest_kind_and_version_nodes(tmp_path):
    """A config-only (numbered) manifest is refused; so are more version tree node references than
    there are heights, and a missing root that claims keys."""
    node = seal(BTREE_MAGIC, leaf([(b"a", b"1")]))
    d, _ = store(tmp_path, [node], stats=(1, len(node), 0))
    m = bytearray(manifest((0, 0, len(node)), 0, (1, len(node), 0)))
    m[14 + 16] = 1                                  # manifest_kind: numbered
    (d / MANIFEST).write_bytes(reseal(bytes(m)))
    refused(d, "config-only manifest")
    m = manifest((0, 0, len(node)), 0, (1, len(node), 0))
    body = m[14:-4]
    (d / MANIFEST).write_bytes(seal(MANIFEST_MAGIC, body[:-1] + varint(65)))
    refused(d, "65 version tree node references")
    (d / MANIFEST).write_bytes(manifest((0, NONE, NONE), 0, (3, 0, 0)))
    refused(d, "has no root but height 0 and 3 keys")


def test_base_paths_carry_down_the_tree(tmp_path):
    """A reference through ("sub/", "d/node") makes "sub/" the prefix of every path in the node it
    leads to: its value ("", "d/val") is read from sub/d/val (tensorstore's transitive base path)."""
    d = tmp_path / "s"
    (d / "sub" / "d").mkdir(parents=True)
    (d / "sub" / "d" / "val").write_bytes(b"hello")
    node = seal(BTREE_MAGIC, leaf([(b"k", (0, 0, 5))], files=["d/val"]))
    (d / "sub" / "d" / "node").write_bytes(node)
    (d / MANIFEST).write_bytes(manifest((0, 0, len(node)), 0, (1, len(node), 5), files=[("sub/", "d/node")]))
    s = OcdbtStore(d)
    assert bytes(s.read("k")) == b"hello"
    assert Path(s.get("k").file.path) == d / "sub" / "d" / "val"
