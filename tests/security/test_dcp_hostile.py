"""Hostile and broken PyTorch Distributed Checkpoints: real `dcp.save` output whose `.metadata` (edited
with real pickle) or `.distcp` bytes lie. Each is converted by the real CLI in a fresh process under a
memory cap and a timeout, and must be refused with exit 2 and one line naming the file and what is
wrong - never an "unexpected" error, a traceback, a blown memory cap, or leftovers beside OUT."""
import concurrent.futures
import io
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

from tests import helpers as hostile
from tests.fixtures import attacks
from tests.helpers import cli
from tests.fixtures.dcp import nested_state

BOMB = 2 << 30        # bytes a bomb inflates to (the memory cap of tests/helpers.py is 1.5 GiB)


def convert(src, out, timeout=120):
    """The real CLI in a fresh process, address space capped, its temporary files in OUT's parent/tmp."""
    tmp = out.parent / "tmp"
    tmp.mkdir(exist_ok=True)
    return cli("convert", src, out, timeout=timeout, env={**os.environ, "TMPDIR": str(tmp)})


def assert_refused(r, out, *fragments):
    hostile.assert_refused(r, out, *fragments)
    assert not out.exists()
    assert not any((out.parent / "tmp").iterdir())  # inflated data lives in an unlinked file only


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """Real single-process DCP saves of a model + optimizer state: plain and zstd-compressed."""
    root = tmp_path_factory.mktemp("dcp_hostile")
    dcp.save(nested_state(), checkpoint_id=root / "plain")
    from torch.distributed.checkpoint._extension import ZStandard
    dcp.save(nested_state(), storage_writer=FileSystemWriter(root / "zstd", _extensions=[ZStandard()]))
    return root


@pytest.fixture(scope="session")
def bomb():
    """A zstd frame of 2 GiB of zeros (64 KB: RLE blocks of 128 KiB, attacks.zstd_bomb)."""
    pytest.importorskip("zstandard")
    return attacks.zstd_bomb(BOMB, 17)


def edited(base, tmp_path, edit):
    """A copy of `base` whose unpickled Metadata went through `edit(md, dir)` (which may return a
    replacement object to pickle instead)."""
    src = tmp_path / "src"
    shutil.copytree(base, src)
    md = pickle.loads((src / ".metadata").read_bytes())
    md = edit(md, src) or md
    (src / ".metadata").write_bytes(pickle.dumps(md))
    return src


def key(md, fqn):
    return next(k for k in md.storage_data if k.fqn == fqn)


def info(md, fqn):
    return md.storage_data[key(md, fqn)]


def item(md, fqn="model.0.weight"):
    return md.state_dict_metadata[fqn]


def chunk(md, fqn="model.0.weight"):
    return item(md, fqn).chunks[0]


def _set(obj, **fields):
    for name, value in fields.items():
        setattr(obj, name, value)


def _set_key_offset(md, fqn, offset):
    k = key(md, fqn)
    where = md.storage_data.pop(k)
    object.__setattr__(k, "offset", offset)  # a frozen dataclass
    md.storage_data[k] = where


def _replace_key(md, fqn, new):
    md.storage_data[new] = md.storage_data.pop(key(md, fqn))


# (id, edit, fragments the one error line must hold). model.0.weight is a (5, 6) float32 tensor.
TYPE_CASES = [
    ("metadata-is-dict", lambda md, d: {"state_dict_metadata": {}, "storage_data": {}}, ["must be a Metadata"]),
    ("sdm-key-int", lambda md, d: md.state_dict_metadata.update({5: item(md)}), ["not a string"]),
    ("item-plain-dict", lambda md, d: md.state_dict_metadata.update({"model.0.weight": {"size": [5, 6]}}),
     ["item 'model.0.weight' must be a TensorStorageMetadata or BytesStorageMetadata, found a dict"]),
    ("properties-none", lambda md, d: _set(item(md), properties=None), ["TensorStorageMetadata.properties"]),
    ("dtype-str", lambda md, d: _set(item(md).properties, dtype="float32"),
     ["TensorProperties.dtype must be a torch dtype, found a str"]),
    ("size-str", lambda md, d: _set(item(md), size="5x6"), ["TensorStorageMetadata.size", "found a str"]),
    ("size-33-dims", lambda md, d: _set(item(md), size=torch.Size([1] * 33)), ["33 entries", "32"]),
    ("size-beyond-2**63", lambda md, d: (_set(item(md), size=torch.Size([2**40, 2**40])),
                                         _set(chunk(md), sizes=torch.Size([2**40, 2**40]))) and None, ["2**63"]),
    ("chunks-int", lambda md, d: _set(item(md), chunks=3), ["TensorStorageMetadata.chunks"]),
    ("chunk-plain-dict", lambda md, d: _set(item(md), chunks=[{"offsets": [0, 0], "sizes": [5, 6]}]),
     ["chunk 0 must be a ChunkStorageMetadata"]),
    ("chunk-sizes-int", lambda md, d: _set(chunk(md), sizes=30), ["ChunkStorageMetadata.sizes", "found 30"]),
    ("chunk-offsets-int", lambda md, d: _set(chunk(md), offsets=0), ["ChunkStorageMetadata.offsets"]),
    ("chunk-sizes-negative", lambda md, d: _set(chunk(md), sizes=[-5, 6]), ["ChunkStorageMetadata.sizes", "-5"]),
    ("chunk-sizes-float", lambda md, d: _set(chunk(md), sizes=[5.0, 6.0]), ["ChunkStorageMetadata.sizes",
                                                                             "a float"]),
    ("chunk-sizes-rank", lambda md, d: _set(chunk(md), sizes=torch.Size([30])),
     ["has 1 entries for a tensor of 2 dimensions"]),
    ("chunk-outside", lambda md, d: _set(chunk(md), sizes=torch.Size([6, 6])), ["lies outside [5, 6]"]),
    ("index-key-tuple", lambda md, d: _replace_key(md, "model.0.weight", ("model.0.weight", (0, 0))),
     ["a key of Metadata.storage_data must be a MetadataIndex"]),
    ("index-fqn-int", lambda md, d: _replace_key(md, "model.0.weight", MetadataIndex(7, torch.Size([0, 0]))),
     ["MetadataIndex.fqn"]),
    ("index-offset-int", lambda md, d: _set_key_offset(md, "model.0.weight", 3), ["MetadataIndex.offset"]),
    ("storage-info-dict", lambda md, d: md.storage_data.update({key(md, "model.0.weight"): {"offset": 0}}),
     ["storage entry of chunk of 'model.0.weight'", "_StorageInfo"]),
    ("relative-path-escapes", lambda md, d: _set(info(md, "model.0.weight"), relative_path="../plain/__0_0.distcp"),
     ["relative_path", "not a file name"]),
    ("relative-path-absolute", lambda md, d: _set(info(md, "model.0.weight"), relative_path="/etc/passwd"),
     ["relative_path"]),
    ("relative-path-int", lambda md, d: _set(info(md, "model.0.weight"), relative_path=7), ["relative_path"]),
    ("offset-str", lambda md, d: _set(info(md, "model.0.weight"), offset="0"), ["_StorageInfo.offset", "a str"]),
    ("length-negative", lambda md, d: _set(info(md, "step"), length=-1), ["bytes item 'step'",
                                                                          "_StorageInfo.length", "-1"]),
    ("transforms-str", lambda md, d: _set(info(md, "model.0.weight"), transform_descriptors="stream.zstd/1"),
     ["transform_descriptors must be a list of strings"]),
    ("transforms-unknown", lambda md, d: _set(info(md, "model.0.weight"), transform_descriptors=["stream.gzip/1"]),
     ["unsupported transform"]),
    ("chunks-share-bytes", lambda md, d: md.storage_data.update({key(md, "model.0.bias"): info(md, "model.2.bias")}),
     ["share bytes", "'model.0.bias'", "'model.2.bias'"]),
    ("bytes-items-share-bytes",
     lambda md, d: md.storage_data.update({key(md, "step"): info(md, "optim.param_groups.0.lr")}),
     ["share bytes", "'step'"]),
]


@pytest.fixture(scope="session")
def type_results(saved, tmp_path_factory):
    """Every TYPE_CASES conversion, run side by side (each is its own capped process)."""
    runs = {}
    for name, edit, _ in TYPE_CASES:
        tmp = tmp_path_factory.mktemp(name)
        runs[name] = (edited(saved / "plain", tmp, edit), tmp / "out")
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        done = {name: pool.submit(convert, src, out) for name, (src, out) in runs.items()}
        return {name: (future.result(), *runs[name]) for name, future in done.items()}


@pytest.mark.parametrize("name, fragments", [(c[0], c[2]) for c in TYPE_CASES], ids=[c[0] for c in TYPE_CASES])
def test_metadata_fields_checked_before_use(type_results, name, fragments):
    r, src, out = type_results[name]
    assert_refused(r, out, *fragments)
    assert f"{src}/.metadata: " in r.stderr or f"{src}/__0_0.distcp: " in r.stderr  # names the file


def test_overlapping_chunks_refused(saved, tmp_path):
    def edit(md, d):
        second = ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([3, 6]))
        item(md).chunks.append(second)
        md.storage_data[MetadataIndex("model.0.weight", second.offsets)] = info(md, "model.2.weight")
    src = edited(saved / "plain", tmp_path, edit)
    out = tmp_path / "out"
    assert_refused(convert(src, out), out, ".metadata: tensor 'model.0.weight': chunks at [0, 0] and [2, 0] overlap")


def _many(md, fqn, shape, chunks):
    """Give tensor `fqn` the layout `chunks` [(offsets, sizes)], every chunk with the first chunk's bytes."""
    where = info(md, fqn)
    md.state_dict_metadata[fqn] = TensorStorageMetadata(item(md, fqn).properties, torch.Size(shape), [
        ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
    for o, _ in chunks:
        md.storage_data[MetadataIndex(fqn, torch.Size(o))] = where


def test_8000_chunks_checked_in_n_log_n(saved, tmp_path):
    """8,000 one-element chunks, the last one overlapping its neighbour: the all-pairs check took 50 s
    here; the grid check takes well under a second (the subprocess timeout is the only clock)."""
    n = 8000
    layout = [((i,), (1,)) for i in range(n - 1)] + [((n - 2,), (2,))]
    src = edited(saved / "plain", tmp_path, lambda md, d: _many(md, "model.0.bias", (n,), layout))
    out = tmp_path / "out"
    assert_refused(convert(src, out, timeout=30), out, f"chunks at [{n - 2}] and [{n - 2}] overlap")


def test_layout_beyond_the_grid_budget_refused(saved, tmp_path):
    """A valid but irregular layout (row i split at column i: 600 chunks, 90,000 grid cells) is refused
    with a message, not worked through."""
    k = 300
    layout = [((i, 0), (1, i)) for i in range(1, k)] + [((i, i), (1, k - i)) for i in range(k)]
    src = edited(saved / "plain", tmp_path, lambda md, d: _many(md, "model.0.weight", (k, k), layout))
    out = tmp_path / "out"
    assert_refused(convert(src, out, timeout=30), out, "tensor 'model.0.weight'", "do not form a grid")


@pytest.mark.slow   # (make test-slow: a check of scale)
def test_8000_real_chunks_assemble(saved, tmp_path):
    """8,000 one-element chunks, each its own torch.save archive, in an 80 x 100 grid (no axis is tiled
    whole: the region-filling path): converted exactly, regions found through the grid."""
    rows, cols = 80, 100
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)

    def edit(md, d):
        blob, chunks = io.BytesIO(), []
        for i in range(rows):
            for j in range(cols):
                at = blob.tell()
                torch.save(full[i:i + 1, j:j + 1].clone(), blob)
                chunks.append(ChunkStorageMetadata(torch.Size([i, j]), torch.Size([1, 1])))
                md.storage_data[MetadataIndex("grid", torch.Size([i, j]))] = _StorageInfo("grid.distcp", at,
                                                                                          blob.tell() - at)
        (d / "grid.distcp").write_bytes(blob.getvalue())
        md.state_dict_metadata["grid"] = TensorStorageMetadata(item(md).properties, torch.Size([rows, cols]), chunks)
    src = edited(saved / "plain", tmp_path, edit)
    out = tmp_path / "out"
    r = convert(src, out)
    assert r.returncode == 0, r.stderr[-2000:]
    from tests.helpers import load_output
    assert torch.equal(load_output(out)["grid"], full)


# --- zstd ---------------------------------------------------------------------------------------

def _stream(md, d, fqn, data):
    """Append `data` to the .distcp file of `fqn`'s (first) storage entry and point the entry at it."""
    where = info(md, fqn)
    with open(d / where.relative_path, "ab") as f:
        where.offset = f.tell()
        f.write(data)
    where.length = len(data)


def test_zstd_chunk_bomb_refused_at_its_declared_size(saved, bomb, tmp_path):
    """A 120-byte chunk whose 64 KB stream inflates to 2 GiB: streamed, stopped just past 120 bytes +
    the archive allowance, under a 1.5 GiB address-space cap."""
    src = edited(saved / "zstd", tmp_path, lambda md, d: _stream(md, d, "model.0.weight", bomb))
    out = tmp_path / "out"
    assert_refused(convert(src, out), out, "__0_0.distcp", "chunk of 'model.0.weight' at [0, 0]",
                   "inflates beyond its declared 120 bytes")


def test_zstd_bytes_item_bomb_refused(saved, bomb, tmp_path):
    """A BYTE_IO item declares no size: all zstd ones together may inflate to ZSTD_BYTES_LIMIT."""
    src = edited(saved / "zstd", tmp_path, lambda md, d: _stream(md, d, "step", bomb))
    out = tmp_path / "out"
    assert_refused(convert(src, out), out, "bytes item 'step'", "inflates beyond what zstd bytes items may take")


def test_zstd_chunk_declaring_more_than_its_stream_can_hold(saved, tmp_path):
    """A chunk that claims 4 GiB from a stream of a few hundred bytes is refused before anything is read."""
    def edit(md, d):
        _set(item(md), size=torch.Size([2**20, 2**10]))
        _set(chunk(md), sizes=torch.Size([2**20, 2**10]))
    src = edited(saved / "zstd", tmp_path, edit)
    out = tmp_path / "out"
    assert_refused(convert(src, out), out, "chunk of 'model.0.weight' at [0, 0] declares 4294967296 bytes",
                   "more than its zstd stream")


def test_zstd_corrupt_stream(saved, tmp_path):
    garbage = b"\x28\xb5\x2f\xfd" + b"\xff" * 64  # a zstd magic number, then nothing valid
    src = edited(saved / "zstd", tmp_path, lambda md, d: _stream(md, d, "model.0.weight", garbage))
    out = tmp_path / "out"
    assert_refused(convert(src, out), out, "chunk of 'model.0.weight' at [0, 0]",
                   "corrupt or unsupported zstd stream")


@pytest.mark.parametrize("case", ["os.system", "not-a-dict", "cut-short"])
def test_a_hostile_lightning_meta_pt_is_refused(tmp_path, case):
    """Lightning's meta.pt beside `.metadata` (the Trainer's fixture) runs through the allowlisting
    unpickler like any torch file: a code entry point stops the run though its state would go to the
    extras, as does a meta.pt that is no dict or is cut short; each in one line naming it."""
    src = tmp_path / "src"
    shutil.copytree(hostile.DATA / "training_dcp" / "lightning", src)
    canary, meta = tmp_path / "canary", src / "meta.pt"
    if case == "os.system":
        meta.write_bytes(attacks.torch_zip(attacks.attacks(canary)["os.system"]))
    elif case == "not-a-dict":
        torch.save([1, 2], meta)
    else:
        meta.write_bytes(meta.read_bytes()[:meta.stat().st_size // 2])
    out = tmp_path / "out"
    assert_refused(convert(src, out), out, "meta.pt")
    assert not canary.exists()
