"""Hostile and broken input: refused with exit 2 and one line, nothing executed, no OUT left."""
import io
import os
import pickle
import zipfile

import pytest
import torch

from ckptconv.readers.pickle import unpickler
from ckptconv.errors import BadInput, UnsafePickle
from tests.attacks import Reduce
from tests.conftest import run


def _attacks(canary):
    import builtins
    import subprocess
    cmd = f"touch {canary}"
    return {
        "os.system": Reduce(os.system, (cmd,)),
        "posix.system": Reduce(__import__("posix").system, (cmd,)),
        "subprocess": Reduce(subprocess.call, (["touch", str(canary)],)),
        "builtins.exec": Reduce(builtins.exec, (f"open({str(canary)!r}, 'w')",)),
        "builtins.eval": Reduce(builtins.eval, (f"open({str(canary)!r}, 'w')",)),
    }


@pytest.mark.parametrize("attack", ["os.system", "posix.system", "subprocess", "builtins.exec", "builtins.eval"])
@pytest.mark.parametrize("legacy", [False, True])
def test_malicious_torch_file_refused(tmp_path, attack, legacy):
    canary = tmp_path / "canary"
    src = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(3), "payload": _attacks(canary)[attack]}, src,
               _use_new_zipfile_serialization=not legacy)
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("ckptconv: error: ")
    assert str(src) in r.stderr and "not on the allowlist" in r.stderr and "offset" in r.stderr
    assert not canary.exists()
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.pt"]


def test_truncated_zip_refused_and_no_output(tmp_path):
    src = tmp_path / "w.pt"
    torch.save({"w": torch.arange(100000, dtype=torch.float32)}, src)
    data = src.read_bytes()
    for cut in (len(data) // 2, len(data) - 10, 100):
        bad = tmp_path / f"cut{cut}.pt"
        bad.write_bytes(data[:cut])
        r = run("convert", bad, tmp_path / "out", "--from", "torch")
        assert r.exit_code == 2, r.stderr
        assert str(bad) in r.stderr and r.stderr.count("\n") == 1
        assert not (tmp_path / "out").exists()


def test_compressed_entry_refused(tmp_path):
    src = tmp_path / "w.pt"
    torch.save({"w": torch.ones(10)}, src)
    repacked = tmp_path / "repacked.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(repacked, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            zout.writestr(item.filename, zin.read(item))
    r = run("convert", repacked, tmp_path / "out")
    assert r.exit_code == 2 and "compressed" in r.stderr


def test_tensor_reaching_past_its_storage_refused(tmp_path):
    src = tmp_path / "w.pt"
    torch.save({"w": torch.ones(10)}, src)
    buf = io.BytesIO()
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zout:
        for item in zin.infolist():
            body = zin.read(item)
            if item.filename.endswith("data.pkl"):
                assert body.count(b"K\n\x85") == 1
                body = body.replace(b"K\n\x85", b"K\x64\x85")  # size (10,) -> (100,), storage stays 10
            zout.writestr(item.filename, body)
    bad = tmp_path / "lying.pt"
    bad.write_bytes(buf.getvalue())
    r = run("convert", bad, tmp_path / "out")
    assert r.exit_code == 2 and "beyond its storage" in r.stderr


# --- the unpickler itself


PLAIN = [
    None, True, 1, -7, 2**70, 1.5, "text", "ünï", b"bytes", bytearray(b"ba"), (), (1,), (1, 2), (1, 2, 3),
    [1, [2, 3]], {"a": {"b": [1, 2]}}, {1, 2}, frozenset({3}), {"k": (1.0, "x", None)},
    [[[]], [(), [1, frozenset({(1, "a")})]], {"s": {(2, 3)}, "t": (([],), {})}],  # marks inside marks
]


@pytest.mark.parametrize("protocol", range(0, 6))
def test_plain_values_round_trip_every_protocol(protocol):
    for value in PLAIN:
        got = unpickler.load(pickle.dumps(value, protocol=protocol), unpickler.BENIGN, "<mem>")
        assert got == value and type(got) is type(value), (protocol, value, got)


def test_shared_references_preserved():
    shared = [1, 2]
    got = unpickler.load(pickle.dumps({"a": shared, "b": shared}, protocol=2), {}, "<mem>")
    assert got["a"] is got["b"]


@pytest.mark.parametrize("data, needle", [
    (b"\x80\x02cos\nsystem\nq\x00.", "'os.system' is not on the allowlist"),
    (b"\x80\x04\x8c\x08builtins\x94\x8c\x04exec\x94\x93\x94.", "'builtins.exec'"),
    (b"\x80\x02\x82\x01.", "EXT1"),
    (b"\x80\x02K\x01Q.", "persistent id"),
    (b"\x80\x05\x97.", "out-of-band"),
    (b"\x80\x02(i__main__\nEvil\n.", "'__main__.Evil'"),
    (b"\x80\x02K\x01)R.", "REDUCE on a int"),
    (b"\x80\x02}K\x01b.", "BUILD"),
])
def test_hostile_opcodes_refused(data, needle):
    with pytest.raises(UnsafePickle) as e:
        unpickler.load(data, {}, "evil.pkl")
    assert needle in str(e.value) and "evil.pkl" in str(e.value) and "offset" in str(e.value)


@pytest.mark.parametrize("data", [b"", b"\x80\x02", b"\x80\x02K", b"\x80\x02B\xff\xff\xff\x7f", b"\x80\x02h\x05.",
                                  b"\x80\x02(.", b"\x80\x02e.", b"\x80\x02\x8e\xff\xff\xff\xff\xff\xff\xff\xff."])
def test_malformed_pickles_are_clean_errors(data):
    with pytest.raises(BadInput):
        unpickler.load(data, {}, "bad.pkl")
