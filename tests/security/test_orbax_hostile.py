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
from tests.fixtures import attacks
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
    src = copy(tmp_path)
    chunk = src / "params.up.kernel" / "0.0"   # declares 8 x 6 bf16: 96 bytes
    chunk.write_bytes(attacks.zstd_bomb(BOMB, 10))   # a 1 KiB window
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
    from ckptconv.io.crc32c import crc32c
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


# --- The outside attack on issue 40's reader (each finding, fixed) ------------------------------------

def test_an_ocdbt_save_that_did_not_store_every_chunk_converts(tmp_path):
    """store_array_data_equal_to_fill_value false (or absent) in an OCDBT save: chunks counted from the
    store's keys; it converts to what the reference holds (a regression the attack found)."""
    from safetensors.numpy import load_file
    for edit in (lambda d: d.update(store_array_data_equal_to_fill_value=False),
                 lambda d: d.pop("store_array_data_equal_to_fill_value", None)):
        src = copy(tmp_path / str(id(edit)), "flax-ocdbt")
        edit_json(src / "_METADATA", edit)
        out = tmp_path / str(id(edit)) / "out"
        r = convert(src, out, "--quiet")
        assert r.returncode == 0, r.stderr
        want = load_file(FIXTURES / "flax-ocdbt.reference.safetensors")
        got = load_file(out / "model.safetensors")
        want = {k.removeprefix("params."): v for k, v in want.items()}
        assert sorted(got) == sorted(want) and all((got[k].view("u1") == want[k].view("u1")).all() for k in want)


@pytest.mark.parametrize("what", ["step", "item", "_METADATA", "manifest.ocdbt"])
def test_a_step_item_or_metadata_linked_out_of_the_checkpoint_is_refused(tmp_path, what):
    outside = copy(tmp_path / "elsewhere", "manager")
    src = copy(tmp_path, "manager")
    if what == "step":
        shutil.copytree(src / "2", src / "1b")
        os.symlink(outside / "2", src / "3")
    elif what == "item":
        shutil.rmtree(src / "2" / "default")
        os.symlink(outside / "2" / "default", src / "2" / "default")
    else:
        item = src / "2" / "default"
        if not (item / what).exists():
            pytest.skip(f"the fixture's item has no {what}")
        (item / what).unlink()
        os.symlink(outside / "2" / "default" / what, item / what)
    refused(src, tmp_path, "leads outside the checkpoint")


def test_a_grid_of_a_million_chunks_with_one_stored_is_refused_before_any_is_looked_up(tmp_path):
    for every in (True, False):
        src = copy(tmp_path / str(every))
        edit_json(src / "_METADATA", lambda d: d.update(store_array_data_equal_to_fill_value=every))
        edit_json(src / "params.down.bias" / ".zarray", lambda d: d.update(shape=[1040000], chunks=[1]))
        r = refused(src, tmp_path / str(every), "params.down.bias",
                    "are stored" if every else "chunks not stored in the checkpoint so far")
        assert r.returncode == 2


def test_an_edge_chunk_whose_stream_ends_short_is_refused(tmp_path):
    """An edge chunk is stored whole: its stream must inflate to the whole chunk, though the array
    uses only its first rows (tensorstore refuses the same: "Not enough data")."""
    src = copy(tmp_path)
    edit_json(src / "params.up.kernel" / ".zarray", lambda d: d.update(chunks=[16, 6]))   # 16 rows, 8 stored
    for name in ("1.0", "1.1", "1.2", "1.3"):
        (src / "params.up.kernel" / name).unlink()
    refused(src, tmp_path, "params.up.kernel", "zstd stream ends after 96 of its declared 192 bytes")


def test_a_chunk_of_two_zstd_frames_is_refused(tmp_path):
    import zstandard
    src = copy(tmp_path)
    chunk = src / "params.up.kernel" / "0.0"   # 96 bytes: two frames of 48
    whole = zstandard.ZstdDecompressor().decompressobj().decompress(chunk.read_bytes())
    cctx = zstandard.ZstdCompressor()
    chunk.write_bytes(cctx.compress(whole[:48]) + cctx.compress(whole[48:]))
    refused(src, tmp_path, str(chunk), "follow its zstd frame")


def test_a_fill_value_too_large_for_any_float_is_refused_naming_the_file(tmp_path):
    src = copy(tmp_path)
    edit_json(src / "params.up.kernel" / ".zarray", lambda d: d.update(fill_value=10**400))
    refused(src, tmp_path, "params.up.kernel/.zarray", "does not fit BF16")


def test_steps_are_numbered_by_ascii_digits_as_orbax_names_them(tmp_path):
    src = copy(tmp_path, "manager")
    shutil.copytree(src / "2", src / "\u0663")       # ARABIC-INDIC DIGIT THREE: not a step
    shutil.copytree(src / "2", src / ("9" * 30))     # a step, however large
    r = cli("inspect", src)
    assert r.returncode == 0, r.stderr
    assert f"read: step {'9' * 30}," in r.stdout
