"""The shard plan on plain data (Hugging Face's rule): shards filled in order up to the limit, a
tensor never split, one larger than the limit alone; one shard is STEM.safetensors, several are
STEM-0000k-of-0000n (test_hub_naming.py compares them with huggingface_hub's)."""
import hashlib
import json
import struct
from types import SimpleNamespace

import pytest

from ckptconv import dtypes
from ckptconv.run.share import assign
from ckptconv.layouts.files import plan_shards

U8 = dtypes.BY_CODE["U8"]


def tensors(*sizes):
    return [SimpleNamespace(name=f"t{i}", dtype=U8, shape=(n,), nbytes=n) for i, n in enumerate(sizes)]


def layout(shards):
    return [(s.name, [t.name for t in s.tensors]) for s in shards]


def dumped_header(entries, metadata=None) -> bytes:
    """A safetensors header as json.dumps gives it for the whole object (the oracle)."""
    doc, at = {"__metadata__": metadata or {"format": "pt"}}, 0
    for name, dt, shape, nbytes in entries:
        doc[name] = {"dtype": dt.code, "shape": list(shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text


def test_a_shard_closes_before_its_header_passes_8_mib():
    """Issue 33: whatever --max-shard-size allows, a shard of ours holds at most an 8 MiB header
    (about 100,000 tensors), so the safetensors library (~1 KB per entry) opens any of them in about
    100 MB; 300,000 one-byte tensors make 3 or 4 shards, each under the bound, in name order."""
    from ckptconv.formats import safetensors
    many = [SimpleNamespace(name=f"model.layers.{i:06d}.w", dtype=U8, shape=(1,), nbytes=1) for i in range(300_000)]
    shards = plan_shards(many, 10**12)
    assert 3 <= len(shards) <= 4
    assert all(s.header_size <= safetensors.SHARD_HEADER + 8 for s in shards)
    assert shards[0].header_size > safetensors.SHARD_HEADER - 200   # (filled up to the bound)
    assert [t.name for s in shards for t in s.tensors] == [t.name for t in many]


def test_filled_in_order_up_to_the_limit():
    assert layout(plan_shards(tensors(3, 3, 3), 6)) == [("model-00001-of-00002.safetensors", ["t0", "t1"]),
                                                         ("model-00002-of-00002.safetensors", ["t2"])]


def test_a_tensor_over_the_limit_gets_a_shard_of_its_own():
    assert layout(plan_shards(tensors(2, 10, 2), 4)) == [("model-00001-of-00003.safetensors", ["t0"]),
                                                          ("model-00002-of-00003.safetensors", ["t1"]),
                                                          ("model-00003-of-00003.safetensors", ["t2"])]


def test_one_shard_is_not_numbered_and_the_stem_names_it():
    (shard,) = plan_shards(tensors(1, 1), 100, "adapter_model")
    assert shard.name == "adapter_model.safetensors"
    assert shard.size == shard.header_size + 2


def test_a_shard_is_closed_before_its_header_passes_what_readers_accept(monkeypatch):
    """A million small tensors with long names do not fit one safetensors header (the library's
    100 MB): the plan starts another shard, where a too-long header used to stop the run. (The plan
    closes at SHARD_HEADER, 8 MiB, below what readers accept: the next test.)"""
    from ckptconv.errors import BadInput
    from ckptconv.formats import safetensors
    many = tensors(*[1] * 10)
    (one,) = plan_shards(many, 100)
    empty = len(dumped_header([]))
    per_entry = (one.header_size - empty) // 10 + 8
    monkeypatch.setattr(safetensors, "MAX_HEADER", empty + 4 * per_entry - 8)
    monkeypatch.setattr(safetensors, "SHARD_HEADER", 1 << 30)
    split = plan_shards(many, 100)
    assert [len(s.tensors) for s in split] in ([3, 3, 3, 1], [4, 4, 2])
    for s in split:   # every shard's header within the bound, and the bytes json.dumps gives
        header = b"".join(s.header())
        assert len(header) == s.header_size <= safetensors.MAX_HEADER + 8
        assert header == dumped_header([(t.name, t.dtype, t.shape, t.nbytes) for t in s.tensors])
    assert [t.name for s in split for t in s.tensors] == [t.name for t in many]
    # a tensor whose entry alone does not fit is refused, named, wherever it is
    for at in (0, 5, 9):
        odd = tensors(*[1] * 10)
        odd[at].name = "x" * (4 * per_entry)
        with pytest.raises(BadInput, match=r"^a safetensors header of \d+ bytes would be needed, more than the \d+ "
                                            r"bytes safetensors readers accept, for tensor 'x{80}'\.\.\. alone$"):
            plan_shards(odd, 100)


def test_a_header_written_in_pieces_is_the_whole_documents_bytes():
    """Headers are written entry by entry, in pieces (a million tensors' is never held whole, nor
    built as a million dicts first): the bytes are exactly json.dumps' of the whole object."""
    from ckptconv.formats.safetensors import header_pieces, header_size
    entries = [(f"w{i}\u00e9\"\\\t", dtypes.from_code("BF16"), (i, 3) if i % 2 else (), 6 * i or 2) for i in range(300)]
    for metadata in (None, {"format": "pt", "k": "\u00fc" * 9}):
        size = header_size(entries, metadata)
        pieces = list(header_pieces(entries, size, metadata, piece=64))
        assert len(pieces) > 10 and max(map(len, pieces)) < 200   # (a piece: at least 64 bytes, or the last)
        assert b"".join(pieces) == dumped_header(entries, metadata) and len(b"".join(pieces)) == size
    with pytest.raises(AssertionError):   # entries that changed between the size and the bytes
        b"".join(header_pieces(entries[:-1], header_size(entries)))


def test_nothing_to_write_is_one_empty_shard():
    assert layout(plan_shards([], 10)) == [("model.safetensors", [])]


def test_units_are_balanced_by_bytes_deterministically():
    assert assign([5, 4, 3, 3, 1], 2) == [0, 1, 1, 0, 1]
    assert assign([1, 1], 3) == [0, 1]
    assert assign([], 2) == []


def test_json_written_piece_by_piece_is_the_whole_documents_bytes():
    """Manifests stream in chunks (a million tensors must not be built as one text or one dict
    first): the bytes are exactly json.dumps' of the whole."""
    from ckptconv.formats.manifest import Rows, dump_chunks
    obj = {"tensors": {f"t{i}\u00fc\"\\\n": {"shape": [i, 0], "sha256": "x" * 64} for i in range(500)},
           "odd": "\udcff", "empty": {}, "list": []}
    whole = (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8", "backslashreplace")
    assert b"".join(dump_chunks(obj, size=100)) == whole and b"".join(dump_chunks(obj)) == whole
    # top-level members made row by row (a manifest's tensors, an index's weight map) give the same text
    for rows in ({}, {"only": [1]}, obj["tensors"]):
        doc = {**obj, "tensors": rows, "zz": {"after": [1, {"a": "b"}]}}
        lazy = {**doc, "tensors": Rows(len(rows), lambda rows=rows: iter(sorted(rows.items())))}
        whole = (json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8",
                                                                                            "backslashreplace")
        assert b"".join(dump_chunks(lazy, size=100)) == whole and b"".join(dump_chunks(lazy)) == whole


def test_digests_swap_finished_futures_and_keep_order():
    """Finished futures become their 32 bytes as soon as those before them are done (none is held
    past that); iteration gives every digest in order, a late one too."""
    from concurrent.futures import Future
    from ckptconv.io.hashing import Digests
    d, futures = Digests(), []
    for i in range(5000):
        f = Future()
        if i != 4500:
            f.set_result(hashlib.sha256(str(i).encode()).hexdigest())
        futures.append(f)
        d.append(f)
        if i == 4998:   # one already computed, in its place behind the late one
            d.append_done(hashlib.sha256(b"done").digest())
    assert len(d._done) == 32 * 4500 and len(d._pending) == 501 and len(d) == 5001   # bytes up to the late one
    futures[4500].set_result("ab" * 32)
    want = ["ab" * 32 if i == 4500 else hashlib.sha256(str(i).encode()).hexdigest() for i in range(4999)]
    want += [hashlib.sha256(b"done").hexdigest(), hashlib.sha256(b"4999").hexdigest()]
    assert list(d) == want and d.packed().hex() == "".join(want)


def test_resume_rehash_gives_each_tensors_digest_from_the_bytes(tmp_path, monkeypatch):
    """--resume believes a journal's digests only where one read of the shard gives them again:
    tensors across read chunks, empty ones (first, between, last), and a short file gives none."""
    from ckptconv.layouts.sharded import resume as sharded
    sizes = [0, 5, 13, 0, 1, 30, 0]
    blobs = [bytes((i * 7 + j) % 251 for j in range(n)) for i, n in enumerate(sizes)]
    header = b"H" * 11
    shard = SimpleNamespace(header_size=len(header), tensors=[SimpleNamespace(nbytes=n) for n in sizes])
    path = tmp_path / "s.safetensors"
    path.write_bytes(header + b"".join(blobs))
    want = b"".join(hashlib.sha256(b).digest() for b in blobs)
    for chunk in (1, 4, 7, 64, 1 << 20):
        monkeypatch.setattr(sharded, "CHUNK", chunk)
        assert sharded._rehash(path, shard) == (hashlib.sha256(path.read_bytes()).hexdigest(), want)
    path.write_bytes(header + b"".join(blobs)[:-3])
    assert sharded._rehash(path, shard)[1] is None


def test_output_files_are_never_opened_through_a_link(tmp_path):
    """A link put in the temporary directory under a shard's name (a --resume, a race) is refused,
    not written through: the file it points to, outside OUT, is untouched."""
    from ckptconv.errors import OutputError
    from ckptconv.io.outfile import OutFile, StagingPool
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep me")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").symlink_to(outside)
    pool = StagingPool()
    try:
        with pytest.raises(OutputError, match="cannot write"):
            OutFile(tmp_path / "out" / "model.safetensors", pool)
    finally:
        pool.close()
    assert outside.read_bytes() == b"keep me"


def test_the_journal_reads_back_as_written(tmp_path):
    """The resume journal is written piece by piece (its packed digests as hex, in slices): it must
    read back as the one JSON document json.dump would have made of their hex, for digests longer
    than a slice, no shard, and a shard name JSON must escape."""
    from ckptconv.formats import manifest as fmt
    job = {"plan": "p" * 64, "source": "s" * 64}
    files = {"a-00001.safetensors": {"sha256": "0" * 64, "size": 7}, 'we"ird\u00e9.safetensors': {"size": 1}}
    for digests in ({}, {"a-00001.safetensors": bytes(range(256)) * 8192, 'we"ird\u00e9.safetensors': b"",
                         "c": bytearray(b"\x0f" * 32)}):
        fmt.write_journal(tmp_path, job, files, digests)
        assert fmt.read_journal(tmp_path) == {**job, "files": files, "digests": {k: v.hex() for k, v in digests.items()}}
        assert not (tmp_path / (fmt.JOURNAL + ".tmp")).exists()


def test_more_tensors_than_one_header_holds_convert_and_reshard_into_shards_readers_open(tmp_path, monkeypatch):
    """End to end, with the header bound lowered to hold a few tensors: convert and reshard split
    shards on it where the run used to stop, and verify, sha256sum and the safetensors library
    (with the real bound) accept every file."""
    import subprocess
    import numpy as np
    import torch
    from safetensors import safe_open
    from ckptconv import api
    from ckptconv.formats import safetensors
    from tests.helpers import cli, split_all_rules
    state = {f"layer.{i:03d}.weight": torch.arange(8 * i, 8 * i + 8, dtype=torch.float32).reshape(2, 4)
             for i in range(40)}
    torch.save(state, tmp_path / "m.pt")
    monkeypatch.setattr(safetensors, "MAX_HEADER", 800)
    api.convert(str(tmp_path / "m.pt"), str(tmp_path / "out"))
    api.reshard(str(tmp_path / "m.pt"), str(tmp_path / "tp2"), 2, rules=str(split_all_rules(tmp_path)))
    for out in (tmp_path / "out", tmp_path / "tp2" / "rank-00001"):
        shards = sorted(out.glob("*.safetensors"))
        assert len(shards) > 3, shards
        seen = {}
        for path in shards:
            assert int.from_bytes(path.read_bytes()[:8], "little") <= 800
            with safe_open(str(path), "numpy") as f:
                seen.update({k: f.get_tensor(k) for k in f.keys()})
        assert sorted(seen) == sorted(state)
        half = slice(None) if out.name == "out" else slice(1, 2)
        assert all(np.array_equal(seen[k], v.numpy()[half]) for k, v in state.items())
        assert subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=out).returncode == 0
    for out in ("out", "tp2"):
        run = cli("verify", str(tmp_path / out))
        assert run.returncode == 0, run.stderr


def test_a_piece_is_written_only_as_the_plan_has_it(tmp_path):
    """Shards are planned from rows (a reshard's pieces are made as they are written): a tensor out
    of the plan's order, or of another size than its header entry says, stops the write."""
    import numpy as np
    from ckptconv.io.hashing import Pipeline
    from ckptconv.tensor import Computed
    from ckptconv.layouts.files import OutputStream
    F32 = dtypes.BY_CODE["F32"]

    def source(name, n):
        return Computed(name, F32, (n,), lambda index: np.zeros(n, np.float32)[index])

    shards = plan_shards([SimpleNamespace(name=n, dtype=F32, shape=(4,), nbytes=16) for n in ("a", "b")], 10**9)
    for wrong, message in ((source("b", 4), "'b' was not written in plan order"),
                           (source("a", 5), "'a': 20 bytes to write where the plan has 16")):
        pipeline = Pipeline()
        stream = OutputStream(tmp_path, shards, pipeline)
        try:
            with pytest.raises(AssertionError, match=message):
                stream.add(wrong)
        finally:
            stream.abandon()
            pipeline.close()
        (tmp_path / shards[0].name).unlink(missing_ok=True)
