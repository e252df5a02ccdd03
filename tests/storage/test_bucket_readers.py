"""The torch, TorchScript, numpy, DCP, diffusers and mesh readers on sources in a bucket (moto's S3 API):
each format, made by its real producer, converts from the bucket to exactly the output of the same
files on a local disk (every file, the manifest too: it records SRC by name); inspect and verify
--against read the bucket as they read the disk; hostile and broken inputs of tests/security/ are
refused from the bucket with the exit status and the line they get locally (the path shown aside);
an object replaced while it is read stops the run."""
import io
import json
import pickle
import shutil
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.fixtures import attacks, models, pipelines, torchscript, values
from tests.fixtures.attacks import Reduce
from tests.helpers import DATA, run
from tests.storage.test_bucket_sources import same_tree, upload


def _dcp(root: Path):
    """Single-process DCP saves: torch.save chunks, zstd chunks, the SAFETENSORS variant."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from tests.fixtures.dcp import nested_state
    dcp.save(nested_state(), checkpoint_id=root / "dcp")
    dcp.save(nested_state(), storage_writer=FileSystemWriter(root / "dcp-zstd", _extensions=[ZStandard()]))
    dcp.save(nested_state(contiguous=True), storage_writer=FileSystemWriter(
        root / "dcp-safetensors", serialization_format=SerializationFormat.SAFETENSORS))


def _bin_dir(d: Path):
    """A Hugging Face .bin directory: two torch.save shards, their index and a config."""
    rng = np.random.default_rng(2)
    d.mkdir()
    shards = {"pytorch_model-00001-of-00002.bin": {"a.weight": values.floats(rng, 8, 4)},
              "pytorch_model-00002-of-00002.bin": {"b.weight": values.floats(rng, 3, 5), "b.bias": torch.ones(3)}}
    for name, sd in shards.items():
        torch.save(sd, d / name)
    (d / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, sd in shards.items() for k in sd}}))
    (d / "config.json").write_text('{"model_type": "none"}')


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{name: local path} of one small source per format, each written by its real producer."""
    root = tmp_path_factory.mktemp("formats")
    torch.save(models.layout_cases(), root / "zip.pt")
    torch.save(models.layout_cases(), root / "legacy.pt", _use_new_zipfile_serialization=False)
    torch.save(models.training_state(), root / "train.pt")
    _bin_dir(root / "bin")
    torchscript.scripted(root / "scripted.pt")
    rng = np.random.default_rng(0)
    np.save(root / "array.npy", np.asfortranarray(rng.random((4, 3))).astype(">f4"))
    np.savez(root / "stored.npz", a=rng.random((3, 4)), b=np.arange(10, dtype=np.int16))
    np.savez_compressed(root / "deflated.npz", a=rng.random((30, 4)), b=np.arange(10))
    _dcp(root)
    # Lightning's Trainer with the sharded FSDP strategy: DCP items and its meta.pt (tests/fixtures/lightning_dcp.py)
    shutil.copytree(DATA / "training_dcp" / "lightning", root / "lightning-dcp")
    pipelines.ddpm(root / "ddpm")
    split = root / "split.toml"
    split.write_text('layout = "torch"\n[[rule]]\npattern = ".*"\naxis = 0\n')
    torch.save({"a": values.floats(rng, 8, 4), "b": values.floats(rng, 6)}, root / "plain.pt")
    assert run("reshard", root / "plain.pt", root / "mesh", "--tp", "2", "--rules", split, "--quiet").exit_code == 0
    return {p.name: p for p in root.iterdir() if p.name not in ("split.toml", "plain.pt")}


FORMATS = ["zip.pt", "legacy.pt", "train.pt", "bin", "scripted.pt", "array.npy", "stored.npz", "deflated.npz", "dcp",
           "dcp-zstd", "dcp-safetensors", "lightning-dcp", "ddpm", "mesh"]


@pytest.mark.parametrize("name", FORMATS)
def test_each_format_converts_from_a_bucket_as_locally(s3, sources, tmp_path, name):
    src = sources[name]
    url = upload(s3, src, f"src/{name}")
    r = run("convert", url, tmp_path / "remote", "--quiet", "--endpoint-url", s3.endpoint)
    assert r.exit_code == 0, r.stderr
    assert run("convert", src, tmp_path / "local", "--quiet").exit_code == 0
    same_tree(tmp_path / "remote", tmp_path / "local")


@pytest.mark.parametrize("name", ["legacy.pt", "dcp", "lightning-dcp", "deflated.npz"])
def test_inspect_and_verify_against_read_the_bucket(s3, sources, tmp_path, name):
    src = sources[name]
    url = upload(s3, src, f"src/{name}")
    remote = run("inspect", url, "--json", "--endpoint-url", s3.endpoint)
    local = run("inspect", src, "--json")
    assert remote.exit_code == local.exit_code == 0, remote.stderr
    assert remote.stdout.replace(url, str(src)) == local.stdout
    assert run("convert", src, tmp_path / "out", "--quiet").exit_code == 0
    r = run("verify", tmp_path / "out", "--against", url, "--endpoint-url", s3.endpoint)
    assert r.exit_code == 0 and "matches the source" in r.stdout, r.stdout + r.stderr


# --- hostile and broken inputs: the same refusal from a bucket as from a disk

def _torch_bytes(obj, **kw) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, **kw)
    return buf.getvalue()


def _evil(legacy: bool) -> bytes:
    import os
    return _torch_bytes({"w": torch.ones(3), "payload": Reduce(os.system, ("touch /nonexistent/canary",))},
                        _use_new_zipfile_serialization=not legacy)


def _cut(data: bytes, at) -> bytes:
    return data[:at if at >= 0 else len(data) + at]


def _lying_directory(data: bytes) -> bytes:
    """The central directory's last record pointed at the first local header."""
    data = bytearray(data)
    struct.pack_into("<I", data, data.rfind(b"PK\x01\x02") + 42, 0)
    return bytes(data)


def _beyond(data: bytes) -> bytes:
    """An entry claiming a gigabyte of data."""
    data = bytearray(data)
    struct.pack_into("<II", data, data.rfind(b"PK\x01\x02") + 20, 10**9, 10**9)
    return bytes(data)


def _deflated_pickle() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(_torch_bytes({"w": torch.arange(10.0)}))) as zin, zipfile.ZipFile(buf, "w") as zout:
        for item in zin.infolist():
            zout.writestr(item.filename, zin.read(item),
                          zipfile.ZIP_DEFLATED if item.filename.endswith("data.pkl") else zipfile.ZIP_STORED)
    return buf.getvalue()


def _npz_bomb() -> bytes:
    """A member declaring 1 GiB of zeros (tests/security/test_numpy_hostile.py)."""
    header = b"\x93NUMPY\x01\x00" + struct.pack("<H", 70) + \
        b"{'descr': '|u1', 'fortran_order': False, 'shape': (1073741824,), }".ljust(69) + b"\n"
    zeros = zlib.compressobj(1, zlib.DEFLATED, -15)
    stream = zeros.compress(header) + b"".join(zeros.compress(bytes(1 << 20)) for _ in range(4)) + zeros.flush()
    head = struct.pack("<HHHHHIII", 20, 0, 8, 0, 0, 0, len(stream), len(header) + (1 << 30))
    local = b"PK\x03\x04" + head + struct.pack("<HH", 5, 0) + b"w.npy"
    central = b"PK\x01\x02" + struct.pack("<H", 20) + head + struct.pack("<HHHHHII", 5, 0, 0, 0, 0, 0, 0) + b"w.npy"
    data = local + stream
    return data + central + b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, 1, 1, len(central), len(data), 0)


def _dcp_attack(d: Path, kind: str):
    pkl = attacks.attacks(Path("/nonexistent/canary"))["os.system"]
    if kind == "dcp-metadata":
        return attacks.write_container(kind, pkl, d)
    import torch.distributed.checkpoint as dcp
    template = d.parent / "template"
    dcp.save({"w": torch.ones(4), "step": 5}, checkpoint_id=template)
    return attacks.write_container(kind, pkl, d, template)


def _dcp_zstd_corrupt(d: Path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard
    dcp.save({"w": torch.arange(6.0)}, storage_writer=FileSystemWriter(d, _extensions=[ZStandard()]))
    md = pickle.loads((d / ".metadata").read_bytes())
    where = next(v for k, v in md.storage_data.items() if k.fqn == "w")
    garbage = b"\x28\xb5\x2f\xfd" + b"\xff" * 64
    with open(d / where.relative_path, "ab") as f:
        where.offset = f.tell()
        f.write(garbage)
    where.length = len(garbage)
    (d / ".metadata").write_bytes(pickle.dumps(md))
    return d


def _file(name, make):
    def write(d: Path) -> Path:
        d.mkdir()
        (d / name).write_bytes(make())
        return d / name
    return write


ZIP = _torch_bytes({"w": torch.arange(100000, dtype=torch.float32)})
LEGACY = _torch_bytes({"w": torch.arange(1000, dtype=torch.float32), "v": torch.ones(3)},
                      _use_new_zipfile_serialization=False)
HOSTILE = {
    "zip pickle calling os.system": _file("evil.pt", lambda: _evil(False)),
    "legacy pickle calling os.system": _file("evil.pt", lambda: _evil(True)),
    "zip cut in half": _file("w.pt", lambda: _cut(ZIP, len(ZIP) // 2)),
    "zip cut 10 bytes short": _file("w.pt", lambda: _cut(ZIP, -10)),
    "zip cut at 100 bytes": _file("w.pt", lambda: _cut(ZIP, 100)),
    "legacy cut in its pickle": _file("w.pt", lambda: _cut(LEGACY, 300)),
    "legacy cut in its storages": _file("w.pt", lambda: _cut(LEGACY, -100)),
    "central directory lying about a local header": _file("w.pt", lambda: _lying_directory(ZIP)),
    "entry claiming bytes beyond the file": _file("w.pt", lambda: _beyond(ZIP)),
    "deflated data.pkl": _file("w.pt", _deflated_pickle),
    "npz deflate bomb": _file("bomb.npz", _npz_bomb),
    "npy header that is eval bait": _file("x.npy", lambda: b"\x93NUMPY\x01\x00" + struct.pack("<H", 38)
                                          + b"{'descr': __import__('os'), }".ljust(37) + b"\n"),
    "dcp .metadata calling os.system": lambda d: _dcp_attack(d, "dcp-metadata"),
    "dcp bytes item calling os.system": lambda d: _dcp_attack(d / "src", "dcp-bytes-item"),
    "dcp corrupt zstd chunk": _dcp_zstd_corrupt,
    "a .pt file no reader recognises": _file("w.pt", lambda: b"\x00\x01 not a checkpoint"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_input_from_a_bucket_is_refused_as_locally(s3, tmp_path, case):
    src = HOSTILE[case](tmp_path / "in")
    url = upload(s3, src, f"in/{src.name}")
    local = run("convert", src, tmp_path / "out")
    remote = run("convert", url, tmp_path / "out", "--endpoint-url", s3.endpoint)
    assert local.exit_code == 2 and local.stderr.count("\n") == 1, local.stderr
    assert not (tmp_path / "out").exists()
    # the same line, but for the path, and what holds the bytes: a file on a disk, an object in a bucket
    assert (remote.exit_code, remote.stderr.replace(url, str(src))) == \
        (local.exit_code, local.stderr.replace("the file has", "the object has"))


# --- an object replaced while it is read

def test_an_object_replaced_while_it_is_read_stops_the_run(s3, sources, tmp_path, monkeypatch):
    """The torch reader has opened the object and read its metadata; its tensors are read after
    another writer replaced it (the same size, other bytes): the run stops, and leaves no OUT."""
    from ckptconv.readers import torch_pickle
    src = sources["zip.pt"]
    url = upload(s3, src, "moving.pt")
    checked = torch_pickle.justified

    def replaced_then_checked(m, tensors):
        s3.client.put_object(Bucket=s3.bucket, Key="moving.pt", Body=bytes(m.size))
        return checked(m, tensors)

    monkeypatch.setattr(torch_pickle, "justified", replaced_then_checked)
    r = run("convert", url, tmp_path / "out", "--endpoint-url", s3.endpoint)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "moving.pt" in r.stderr and "changed while it was being read" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
