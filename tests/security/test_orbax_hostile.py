"""Hostile and broken Orbax checkpoints: the real Orbax output committed under tests/fixtures/data/orbax/
with its _METADATA, zarr metadata or chunk bytes edited to lie. Each is converted by the real CLI in
a fresh process under a memory cap and a timeout, and must be refused with exit 2 and one line naming
the file and what is wrong — never an "unexpected" error, a traceback, a blown memory cap, or
leftovers beside OUT. (OCDBT's own attacks — a b-tree that loops, offsets past a file, a manifest
that lies — are tests/security/test_ocdbt_hostile.py's.)"""
import json
import os
import shutil
import struct

import pytest

from tests import helpers as hostile
from tests.helpers import DATA, cli

FIXTURES = DATA / "orbax"
BOMB = 2 << 30        # bytes a bomb inflates to (the memory cap of tests/helpers.py is 1.5 GiB)


def convert(src, out, *args, timeout=120):
    return cli("convert", src, out, *args, timeout=timeout)


def refused(src, tmp_path, *fragments, args=()):
    out = tmp_path / "out"
    r = convert(src, out, *args)
    hostile.assert_refused(r, out, *fragments, src=src)
    assert not out.exists()
    return r


def copy(tmp_path, name="flax-zarr2"):
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def edit_json(path, edit):
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def test_a_zstd_bomb_is_refused_at_its_declared_chunk_size(tmp_path):
    import zstandard
    src = copy(tmp_path)
    chunk = src / "params.up.kernel" / "0.0"   # declares 8 x 6 bf16: 96 bytes
    params = zstandard.ZstdCompressionParameters.from_level(19, window_log=10)   # a 1 KiB window
    cctx = zstandard.ZstdCompressor(compression_params=params)
    with open(chunk, "wb") as f, cctx.stream_writer(f, closefd=False) as w:
        block = bytes(16 << 20)
        for _ in range(BOMB // len(block)):
            w.write(block)
    assert chunk.stat().st_size < 16 << 20
    refused(src, tmp_path, str(chunk), "inflates past its declared 96 bytes")


def test_a_zstd_frame_asking_for_a_window_far_beyond_its_chunk_is_refused(tmp_path):
    import zstandard
    src = copy(tmp_path)
    chunk = src / "params.up.kernel" / "0.1"
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=27, write_content_size=False)
    chunk.write_bytes(zstandard.ZstdCompressor(compression_params=params).compress(bytes(64 << 20)))
    refused(src, tmp_path, str(chunk), "zstd")


def test_a_chunk_declaring_more_than_its_stream_can_inflate_to_is_refused(tmp_path):
    src = copy(tmp_path)
    # every chunk one huge edge chunk: the stored chunk is 2**40 elements, its stream 41 bytes
    edit_json(src / "params.down.bias" / ".zarray", lambda d: d.update(chunks=[1 << 40]))
    for p in (src / "params.down.bias").iterdir():
        if p.name != ".zarray" and p.name != "0":
            p.unlink()
    refused(src, tmp_path, "params.down.bias", "more than its zstd stream")


def test_a_truncated_zstd_chunk_is_refused(tmp_path):
    src = copy(tmp_path)
    chunk = src / "params.up.kernel" / "1.2"
    chunk.write_bytes(chunk.read_bytes()[:-6])
    refused(src, tmp_path, str(chunk), "zstd")


def test_an_uncompressed_chunk_of_the_wrong_size_is_refused(tmp_path):
    src = copy(tmp_path, "flax-raw")
    chunk = src / "params.up.kernel" / "1.3"
    chunk.write_bytes(chunk.read_bytes() + b"\0" * 8)
    refused(src, tmp_path, str(chunk), "holds 104 bytes", "96 bytes")


def test_a_chunk_grid_past_the_bound_is_refused_before_anything_is_read(tmp_path):
    src = copy(tmp_path)
    edit_json(src / "params.down.bias" / ".zarray", lambda d: d.update(shape=[1 << 40], chunks=[1]))
    refused(src, tmp_path, "params.down.bias", "chunks", "more than the 1048576 accepted")


@pytest.mark.parametrize("field,value,fragment", [
    ("dtype", "<c8", "is not one ckptconv reads"),
    ("dtype", "|O", "is not one ckptconv reads"),
    ("compressor", {"id": "blosc"}, "compressor 'blosc' is not supported"),
    ("filters", [{"id": "delta"}], "filters are not supported"),
    ("order", "K", "order 'K'"),
    ("shape", [-1, 8], "non-negative"),
    ("chunks", [8], "entries for an array of 2 dimensions"),
    ("fill_value", "hello", "fill_value"),
    ("dimension_separator", "..", "dimension_separator"),
    ("zarr_format", 3, "zarr_format must be 2"),
])
def test_zarr_metadata_that_lies_is_refused(tmp_path, field, value, fragment):
    src = copy(tmp_path)
    meta = src / "params.down.kernel" / ".zarray"
    edit_json(meta, lambda d: d.update({field: value}))
    refused(src, tmp_path, str(meta), fragment)


def test_array_metadata_too_large_is_refused(tmp_path):
    src = copy(tmp_path)
    meta = src / "params.down.kernel" / ".zarray"
    doc = json.loads(meta.read_text())
    doc["padding"] = "x" * (2 << 20)
    meta.write_text(json.dumps(doc))
    refused(src, tmp_path, str(meta), "more than the 1048576 accepted")


def test_a_metadata_json_nested_too_deep_is_refused(tmp_path):
    src = copy(tmp_path)
    (src / "_METADATA").write_text("[" * 100_000 + "]" * 100_000)
    refused(src, tmp_path, "_METADATA")


def _rename_leaf(src, old, new_keys):
    def edit(doc):
        entry = doc["tree_metadata"].pop(old)
        entry["key_metadata"] = [{"key": k, "key_type": 2} for k in new_keys]
        doc["tree_metadata"][str(tuple(new_keys))] = entry
    edit_json(src / "_METADATA", edit)


@pytest.mark.parametrize("keys,fragment", [
    (["params", "../../../etc"], "not a name ckptconv accepts"),
    (["params", "a/b"], "not a name ckptconv accepts"),
    ([".."], "not a name an array can have"),
    (["params", ""], "not a name ckptconv accepts"),
])
def test_tree_paths_that_would_escape_the_array_directory_are_refused(tmp_path, keys, fragment):
    src = copy(tmp_path)
    _rename_leaf(src, "('params', 'down', 'bias')", keys)
    refused(src, tmp_path, "_METADATA", fragment, args=("--state-dict", "none"))


def test_an_array_directory_linked_outside_the_checkpoint_is_refused(tmp_path):
    src = copy(tmp_path)
    outside = tmp_path / "elsewhere"
    shutil.move(src / "params.down.bias", outside)
    os.symlink(outside, src / "params.down.bias")
    refused(src, tmp_path, "leads outside the checkpoint")


def test_a_chunk_linked_outside_the_checkpoint_is_refused(tmp_path):
    src = copy(tmp_path)
    secret = tmp_path / "secret"
    secret.write_bytes(b"\0" * 96)
    (src / "params.up.kernel" / "0.0").unlink()
    os.symlink(secret, src / "params.up.kernel" / "0.0")
    refused(src, tmp_path, "leads outside the checkpoint")


def test_an_array_the_tree_names_but_the_checkpoint_lacks_is_refused(tmp_path):
    src = copy(tmp_path)
    shutil.rmtree(src / "params.norm.scale")
    refused(src, tmp_path, "params.norm.scale", "has no .zarray or zarr.json")


def test_a_shard_index_that_does_not_match_its_crc_is_refused(tmp_path):
    src = copy(tmp_path, "flax-zarr3")
    shard = src / "params.up.kernel" / "c" / "0" / "1"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    refused(src, tmp_path, str(shard), "crc32c does not match")


def _crc32c(data):
    from ckptconv.readers.orbax_zarr import crc32c
    return crc32c(data)


def test_a_shard_index_pointing_past_its_shard_is_refused(tmp_path):
    src = copy(tmp_path, "flax-zarr3")
    shard = src / "params.up.kernel" / "c" / "1" / "0"
    data = shard.read_bytes()
    body, index = data[:-20], bytearray(data[-20:-4])
    struct.pack_into("<QQ", index, 0, 16, 1 << 40)
    shard.write_bytes(body + bytes(index) + struct.pack("<I", _crc32c(bytes(index))))
    refused(src, tmp_path, str(shard), "lies outside the shard's data")


def test_a_shard_too_short_for_its_index_is_refused(tmp_path):
    src = copy(tmp_path, "flax-zarr3")
    shard = src / "params.up.kernel" / "c" / "1" / "1"
    shard.write_bytes(b"\0" * 7)
    refused(src, tmp_path, str(shard), "cannot hold its index")


def test_unknown_zarr3_codecs_are_refused(tmp_path):
    src = copy(tmp_path, "flax-zarr3")
    meta = src / "params.up.kernel" / "zarr.json"
    edit_json(meta, lambda d: d["codecs"][0]["configuration"]["codecs"].append({"name": "gzip"}))
    refused(src, tmp_path, str(meta), "codec 'gzip' is not supported")


def test_a_manager_without_a_complete_step_is_refused(tmp_path):
    src = copy(tmp_path, "manager-zarr")
    for step in ("1", "2"):
        (src / step / "_CHECKPOINT_METADATA").unlink()
    refused(src, tmp_path, "no complete Orbax checkpoint step")


def test_a_missing_chunk_is_refused_where_orbax_stored_every_chunk(tmp_path):
    """As Orbax's own restore refuses it (store_array_data_equal_to_fill_value in _METADATA); where
    _METADATA does not say so, a chunk not stored is the fill value (fixture zarr2-layouts)."""
    src = copy(tmp_path, "flax-raw")
    (src / "params.down.bias" / "0").unlink()
    refused(src, tmp_path, "params.down.bias", "chunk [0]", "is missing", "store_array_data_equal_to_fill_value")
    edit_json(src / "_METADATA", lambda d: d.update(store_array_data_equal_to_fill_value=False))
    edit_json(src / "params.down.bias" / ".zarray", lambda d: d.update(fill_value=1.5))
    out = tmp_path / "out"
    r = convert(src, out, "--quiet")
    assert r.returncode == 0, r.stderr
    from safetensors.numpy import load_file
    got = load_file(str(next(out.glob("*.safetensors"))))["down.bias"]
    want = load_file(str(FIXTURES / "flax-raw.reference.safetensors"))["params.down.bias"]
    assert got[0] == 1.5 and got[1:].tobytes() == want[1:].tobytes()


def test_per_process_stores_never_merged_are_refused(tmp_path):
    src = copy(tmp_path, "flax-2proc")
    (src / "manifest.ocdbt").unlink()
    refused(src, tmp_path, "never merged", "ocdbt.process_0")


def test_an_array_of_missing_chunks_cannot_ask_for_terabytes_of_fill(tmp_path):
    src = copy(tmp_path)
    edit_json(src / "_METADATA", lambda d: d.update(store_array_data_equal_to_fill_value=False))
    edit_json(src / "params.down.bias" / ".zarray", lambda d: d.update(shape=[1 << 40], chunks=[1 << 20]))
    refused(src, tmp_path, "params.down.bias", "bytes of fill value", "more than the 1073741824 accepted")
