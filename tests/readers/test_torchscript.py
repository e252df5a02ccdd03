"""TorchScript archives (torch.jit.save) -> safetensors: the state dict torch.jit.load gives, bit for
bit, from the module tree alone; code is never read as code, and a hostile archive is refused."""
import json
import warnings
import zipfile

import pytest

from tests.fixtures import torchscript
from tests.helpers import assert_same, bits, load_output, run


@pytest.fixture(scope="module")
def archives(tmp_path_factory):
    d = tmp_path_factory.mktemp("torchscript")
    return {"scripted": (d / "net.pt", torchscript.scripted(d / "net.pt")),
            "traced": (d / "traced.pt", torchscript.traced(d / "traced.pt"))}


@pytest.mark.parametrize("kind", ["scripted", "traced"])
def test_state_dict_bit_exact(archives, tmp_path, kind):
    src, want = archives[kind]
    with zipfile.ZipFile(src) as z:   # what makes this a real TorchScript archive
        assert any(i.compress_type == zipfile.ZIP_DEFLATED for i in z.infolist() if "/code/" in i.filename)
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 0, r.stderr
    got = load_output(tmp_path / "out")
    assert set(got) == set(want)
    for name, t in want.items():
        assert_same(got[name], t, name)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["source"]["format"] == "torchscript"
    assert list(manifest["tensors"]) == sorted(want) and list(want) == [
        t["name"] for t in json.loads(run("inspect", src, "--json").stdout)["tensors"]]   # state-dict order


def test_attributes_outside_the_state_dict(archives, tmp_path):
    src, _ = archives["scripted"]
    r = run("convert", src, tmp_path / "out")
    assert "left out: blocks.0.lookup (a tensor attribute, not a parameter or buffer)" in r.stdout and "blocks.1.many" in r.stdout
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert {d["name"] for d in manifest["source"]["dropped"]} == {
        "blocks.0.lookup", "blocks.0.many", "blocks.1.lookup", "blocks.1.many"}
    extras = manifest["extras"]
    assert extras["scale"] == 2.0 and extras["blocks.1.sizes"] == [1, 2, 3] and extras["blocks.0.table.a"] == 1
    assert not any(k.endswith(("training", "_is_full_backward_hook")) for k in extras)


def test_one_file_only_and_verify(archives, tmp_path):
    src, want = archives["scripted"]
    out = tmp_path / "net.safetensors"
    assert run("convert", src, out, "--only", "blocks.1.", "--quiet").exit_code == 0
    from safetensors.torch import load_file
    got = load_file(out)
    assert set(got) == {k for k in want if k.startswith("blocks.1.")}
    assert all(bits(got[k]) == bits(want[k]) for k in got)
    r = run("verify", out, "--against", src)
    assert r.exit_code == 0 and "matches the source" in r.stdout, r.stdout + r.stderr


def test_detected_before_the_torch_reader(archives):
    r = run("inspect", archives["traced"][0], "--json")
    assert json.loads(r.stdout)["format"] == "torchscript"


# --- hostile archives: every one refused with one line, nothing compiled or run

def repack(src, dst, replace=None, compress=zipfile.ZIP_STORED, drop=()):
    """`src` rewritten with some entries replaced (name suffix -> bytes) or left out; `code/` entries
    stay deflated, as torch.jit.save writes them."""
    replace = replace or {}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            if any(item.filename.endswith(s) for s in drop):
                continue
            body = next((v for k, v in replace.items() if item.filename.endswith(k)), None)
            body = zin.read(item) if body is None else body
            kind = zipfile.ZIP_DEFLATED if "/code/" in item.filename else compress
            zout.writestr(item.filename, body, kind)
    return dst


def test_entries_never_read_do_not_stop_the_run(archives, tmp_path):
    src, want = archives["traced"]
    bomb = b"#" + b" " * (32 << 20)   # deflates about 1000 to 1: refused if it were read
    r = run("convert", repack(src, tmp_path / "a.pt", {".debug_pkl": bomb}), tmp_path / "out", "--quiet")
    assert r.exit_code == 0, r.stderr
    assert set(load_output(tmp_path / "out")) == set(want)


@pytest.mark.parametrize("case,fragment", [
    ("bomb", "claims to inflate"),
    ("missing source", "is missing"),
    ("ghost parameter", "declares 'ghost' a parameter or buffer"),
    ("undeclared", "does not declare its parameters"),
    ("self", "contains itself"),
    ("os.system", "names a code-running entry point"),
    ("declared twice", "declares a parameter or buffer name twice"),
    ("declaration line twice", "declares __parameters__ twice"),
    ("deflated storage", "is compressed"),
])
def test_hostile_archive_refused(archives, tmp_path, case, fragment):
    src, _ = archives["traced"]
    with zipfile.ZipFile(src) as z:   # the Sequential's source (its name is mangled when compiled twice)
        name = next(n for n in z.namelist() if "/container" in n and n.endswith(".py"))
        container = z.read(name)
    module = name.split("/code/")[1][:-3].replace("/", ".").encode()
    pickles = {"self": b"\x80\x02c" + module + b"\nSequential\nq\x00)\x81q\x01}q\x02X\x01\x00\x00\x00ah\x01sb.",
               "os.system": b"\x80\x02c__torch__.os\nsystem\n)\x81}b."}
    changes = {
        "bomb": dict(replace={name: container + b"#" + b" " * (12 << 20)}),   # under the size cap, over the ratio
        "missing source": dict(drop=(name,)),
        "ghost parameter": dict(replace={name: container.replace(b"__parameters__ = []", b'__parameters__ = ["ghost", ]')}),
        "undeclared": dict(replace={name: container.replace(b"  __buffers__ = []\n", b"")}),
        "declared twice": dict(replace={name: container.replace(b"__parameters__ = []",
                                                                b'__parameters__ = ["a", "a", ]')}),
        "declaration line twice": dict(replace={name: container.replace(b"  __parameters__ = []\n",
                                                                        b"  __parameters__ = []\n" * 2)}),
        "self": dict(replace={"data.pkl": pickles["self"]}),
        "os.system": dict(replace={"data.pkl": pickles["os.system"]}),
        "deflated storage": dict(compress=zipfile.ZIP_DEFLATED),
    }[case]
    bad = repack(src, tmp_path / "bad.pt", **changes)
    r = run("convert", bad, tmp_path / "out", "--from", "torchscript")
    assert r.exit_code == 2, (r.exit_code, r.stderr)
    assert r.stderr.count("\n") == 1 and str(bad) in r.stderr and fragment in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_each_source_file_is_scanned_once(archives, tmp_path, monkeypatch):
    """However many modules share a class file, its text is inflated and scanned once (the run stays
    linear in the archive's bytes)."""
    from ckptconv.readers import torchscript as reader
    scanned = []
    real = reader._classes
    found = {}
    monkeypatch.setattr(reader, "_classes", lambda text, where: scanned.append(where) or found.setdefault(
        where, real(text, where)))
    assert run("convert", archives["scripted"][0], tmp_path / "out", "--quiet").exit_code == 0
    assert len(scanned) == len(set(scanned))
    # the fixtures' own module defines Net, Block and Input: three classes, one scan
    own = next(w for w in scanned if w.endswith("fixtures/torchscript.py"))
    assert {"Net", "Block", "Input"} <= set(found[own])


def test_the_torch_reader_names_a_torchscript_archive(archives, tmp_path):
    r = run("convert", archives["traced"][0], tmp_path / "out", "--from", "torch")
    assert r.exit_code == 2 and "is a TorchScript archive" in r.stderr and "--from torchscript" in r.stderr


@pytest.mark.parametrize("case,fragment", [("escaping name", "is absolute or escapes the archive"),
                                           ("name twice", "appears twice")])
def test_a_damaged_archive_is_refused_by_the_reader_that_recognised_it_saying_why(archives, tmp_path, case, fragment):
    """Detection reads the names alone; the full check at load must then say what is wrong, not
    "not a TorchScript archive" (it is one)."""
    src, _ = archives["traced"]
    with zipfile.ZipFile(src) as z:
        code = next(n for n in z.namelist() if "/code/__torch__/" in n and n.endswith(".py"))
    bad = tmp_path / "bad.pt"
    if case == "escaping name":   # the same length, in the local header and the central directory
        bad.write_bytes(src.read_bytes().replace(code.encode(), code.replace("/__torch__/", "/../orch__/", 1).encode()))
    else:
        with zipfile.ZipFile(src) as zin, zipfile.ZipFile(bad, "w") as zout, warnings.catch_warnings():
            warnings.simplefilter("ignore")   # zipfile warns about the duplicate name it is asked to write
            for item in zin.infolist():
                zout.writestr(item.filename, zin.read(item), zipfile.ZIP_STORED)
            zout.writestr(code, b"pass\n", zipfile.ZIP_DEFLATED)
    r = run("inspect", bad)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and fragment in r.stderr, r.stderr
