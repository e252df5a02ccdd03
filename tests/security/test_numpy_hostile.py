"""Hostile .npy and .npz files (issue 30): the header is a Python literal, parsed by a strict bounded
grammar and never evaluated; sizes are checked against the bytes present; deflated members inflate to
exactly their declared size and no further than the file's allowance. Each refusal is exit 2 and one
line naming the file, nothing executed, nothing written."""
import struct
import zipfile
import zlib

import numpy as np
import pytest

from tests.helpers import assert_clean, cli, run


def npy(header: str, data: bytes = b"", version=(1, 0), pad=True) -> bytes:
    """An .npy file with this header text (padded and ended as numpy does when `pad`)."""
    text = header.encode("latin1")
    prefix = 10 if version[0] == 1 else 12
    if pad:
        text += b" " * ((-(prefix + len(text) + 1)) % 64) + b"\n"
    size = struct.pack("<H" if version[0] == 1 else "<I", len(text))
    return b"\x93NUMPY" + bytes(version) + size + text + data


F4 = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }"


def refused(r, out, *fragments):
    lines = r.stderr.splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("ckptconv: error: "), r.stderr
    assert_clean(r.stderr)
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert not out.exists() and not (out.parent / f".{out.name}.ckptconv-tmp").exists()


HEADERS = {
    "eval bait": ("{'descr': __import__('os').system('touch CANARY'), 'fortran_order': False, 'shape': (2,), }",
                  b"\0" * 8, "is not the dict numpy writes"),
    "a call in the shape": ("{'descr': '<f4', 'fortran_order': False, 'shape': eval('2'), }", b"", "not the dict"),
    "a missing key": ("{'descr': '<f4', 'shape': (2,), }", b"\0" * 8, "needs exactly the keys"),
    "an unknown key": ("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1, }", b"\0" * 8,
                       "an unknown key 'x'"),
    "a key twice": ("{'descr': '<f4', 'descr': '<f8', 'fortran_order': False, 'shape': (2,), }", b"\0" * 8,
                    "a second key 'descr'"),
    "a number for a shape": ("{'descr': '<f4', 'fortran_order': False, 'shape': (2), }", b"\0" * 8, "is a number"),
    "a negative size": ("{'descr': '<f4', 'fortran_order': False, 'shape': (-2,), }", b"\0" * 8, "not the dict"),
    "True as a size": ("{'descr': '<f4', 'fortran_order': False, 'shape': (True,), }", b"\0" * 8, "not a size"),
    "a 21-digit size": ("{'descr': '<f4', 'fortran_order': False, 'shape': (" + "9" * 21 + ",), }", b"",
                        "not a tuple of sizes"),
    "a shape beyond 2**63 bytes": ("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }",
                                   b"", "more than 2**63 bytes"),
    "33 axes": ("{'descr': '<f4', 'fortran_order': False, 'shape': (" + "1, " * 33 + "), }", b"\0" * 4, "33 axes"),
    "a structured dtype": ("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }", b"\0" * 8,
                           "not the dict"),
    "fortran_order a string": ("{'descr': '<f4', 'fortran_order': 'no', 'shape': (2,), }", b"\0" * 8, "wrong types"),
    "a descr with a unit": ("{'descr': '<M8[ns]', 'fortran_order': False, 'shape': (1,), }", b"\0" * 8,
                            "cannot be stored in safetensors"),
    "a strange descr": ("{'descr': 'float32; rm -rf /', 'fortran_order': False, 'shape': (2,), }", b"\0" * 8,
                        "is not one numpy writes"),
    "data cut short": (F4, b"\0" * 7, "needs 8 bytes after its header, the member holds 7"),
    "data left over": (F4, b"\0" * 9, "needs 8 bytes after its header, the member holds 9"),
    "a huge shape in a small file": ("{'descr': '<f8', 'fortran_order': False, 'shape': (1000000, 1000000), }",
                                     b"\0" * 8, "needs 8000000000000 bytes"),
    "text outside the dict": ("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), } + 1", b"\0" * 8, "not end"),
    "not ASCII": ("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), '\xe9': 1}", b"\0" * 8, "not ASCII"),
}


@pytest.mark.parametrize("case", sorted(HEADERS))
def test_malformed_npy_headers_are_refused_without_evaluating_them(tmp_path, case):
    header, data, fragment = HEADERS[case]
    canary = tmp_path / "canary"
    src = tmp_path / "bad.npy"
    src.write_bytes(npy(header.replace("CANARY", str(canary)), data))
    refused(run("convert", src, tmp_path / "out"), tmp_path / "out", "bad.npy", fragment)
    assert not canary.exists()


@pytest.mark.parametrize("raw, fragment", [
    (npy(F4, b"\0" * 8, version=(4, 0)), "version 4.0"),
    (npy(F4, b"\0" * 8)[:40], "is truncated"),
    (b"\x93NUMPY\x01\x00" + struct.pack("<H", 60000) + b"{" + b" " * 59998 + b"\n", "more than the 10000 numpy reads"),
    (npy(F4, b"\0" * 8, pad=False), "does not end with '}' and a newline"),
    (b"\x93NUMPY\x02\x00" + struct.pack("<I", 2**31) + b"{}", "more than the 10000"),
])
def test_malformed_npy_preambles_are_refused(tmp_path, raw, fragment):
    src = tmp_path / "bad.npy"
    src.write_bytes(raw)
    refused(run("convert", src, tmp_path / "out"), tmp_path / "out", fragment)


def zip_of(members, lie=None) -> bytes:
    """A zip of (name, data, method) members written by hand, so that a field may lie: `lie` maps a
    member's name to {"size": declared inflated size, "crc": declared CRC, "cut": bytes of the deflated
    stream left out at its end}."""
    out, central = b"", b""
    for name, data, method in members:
        raw = name.encode()
        fields = {"size": len(data), "crc": zlib.crc32(data), "cut": 0, **(lie or {}).get(name, {})}
        body = zlib.compress(data)[2:-4 - fields["cut"]] if method == 8 else data
        head = struct.pack("<HHHHHIII", 20, 0, method, 0, 0, fields["crc"], len(body), fields["size"])
        central += (b"PK\x01\x02" + struct.pack("<H", 20) + head + struct.pack("<HHHHHII", len(raw), 0, 0, 0, 0, 0,
                                                                             len(out)) + raw)
        out += b"PK\x03\x04" + head + struct.pack("<HH", len(raw), 0) + raw + body
    return out + central + b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, len(members), len(members), len(central),
                                                        len(out), 0)


GOOD = npy(F4, b"\0" * 8)


@pytest.mark.parametrize("case, members, lie, fragment", [
    ("a member that is no array", [("w.npy", GOOD, 0), ("notes.txt", b"hi", 0)], None, "member 'notes.txt' is not an .npy"),
    ("bzip2", [("w.npy", GOOD, 12)], None, "zip method 12"),
    ("a deflated member declaring 3 GiB", [("w.npy", GOOD, 8)], {"w.npy": {"size": 3 << 30}},
     "would inflate to more than 64x"),
    ("a deflated member declaring more than its header", [("w.npy", GOOD, 8)], {"w.npy": {"size": len(GOOD) + 4}},
     "needs 8 bytes after its header, the member holds 12"),
    ("a deflated stream cut short", [("w.npy", GOOD, 8)], {"w.npy": {"cut": 3}}, "does not inflate to exactly"),
    ("a deflated member inflating beyond its size", [("w.npy", npy(F4, b"\0" * 12), 8)], {"w.npy": {"size": len(GOOD)}},
     "inflates beyond the"),
    ("a deflated member failing its CRC", [("w.npy", GOOD, 8)], {"w.npy": {"crc": 1}}, "fails its CRC check"),
    ("a stored member whose header lies", [("w.npy", npy(F4, b"\0" * 4), 0)], None, "needs 8 bytes"),
    ("a deflated header that is eval bait", [("w.npy", npy("{'descr': __import__('os'), }"), 8)], None,
     "not the dict numpy writes"),
    ("a member named twice", [("w.npy", GOOD, 0), ("w.npy", GOOD, 0)], None, "appears twice"),
])
def test_hostile_npz_archives_are_refused(tmp_path, case, members, lie, fragment):
    src = tmp_path / "bad.npz"
    src.write_bytes(zip_of(members, lie))
    refused(run("convert", src, tmp_path / "out"), tmp_path / "out", "bad.npz", fragment)


def test_the_hand_written_archive_is_one_numpy_reads(tmp_path):
    """(the writer above, without lies, makes archives numpy and ckptconv both read)"""
    src = tmp_path / "ok.npz"
    src.write_bytes(zip_of([("w.npy", GOOD, 0), ("v.npy", npy(F4, b"\0\0\x80\x3f" * 2), 8)]))
    assert np.load(src)["v"].tolist() == [1.0, 1.0] and zipfile.ZipFile(src).testzip() is None
    assert run("convert", src, tmp_path / "out").exit_code == 0


def test_a_deflate_bomb_is_refused_before_anything_is_inflated(tmp_path):
    """A member declaring 1 GiB of zeros (deflate makes that from 1 MB; here its first 64 MiB, 64 KB):
    no more than 64x the file's bytes (+64 MiB) may be inflated. Refused from the declared sizes, before
    anything is inflated, in a fresh process under the test's memory cap."""
    header = npy("{'descr': '|u1', 'fortran_order': False, 'shape': (1073741824,), }")
    zeros = zlib.compressobj(1, zlib.DEFLATED, -15)
    stream = zeros.compress(header) + b"".join(zeros.compress(bytes(1 << 20)) for _ in range(64))
    name = b"w.npy"
    head = struct.pack("<HHHHHIII", 20, 0, 8, 0, 0, 0, len(stream), len(header) + (1 << 30))
    local = b"PK\x03\x04" + head + struct.pack("<HH", len(name), 0) + name
    central = b"PK\x01\x02" + struct.pack("<H", 20) + head + struct.pack("<HHHHHII", len(name), 0, 0, 0, 0, 0, 0) + name
    data = local + stream
    src = tmp_path / "bomb.npz"
    src.write_bytes(data + central + b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, 1, 1, len(central), len(data), 0))
    r = cli("convert", src, tmp_path / "out", timeout=60)
    assert r.returncode == 2 and "would inflate to more than 64x" in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()
