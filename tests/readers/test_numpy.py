"""The numpy reader (issue 30, failure 6): files written by numpy itself (np.save, np.savez,
np.savez_compressed) and the g2p-en checkpoint's layout (an .npz of named float32 arrays), each
tensor compared byte for byte with what np.load gives for the same file."""
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from ckptconv.readers import ReadOptions, open_checkpoint, reader_for
from tests.fixtures.attacks import Reduce
from tests.helpers import run

G2P = {"enc_emb": (29, 16), "enc_w_ih": (48, 16), "enc_w_hh": (48, 16), "enc_b_ih": (48,), "enc_b_hh": (48,),
       "dec_emb": (74, 16), "dec_w_ih": (48, 16), "dec_w_hh": (48, 16), "dec_b_ih": (48,), "dec_b_hh": (48,),
       "fc_w": (74, 16), "fc_b": (74,)}


def g2p_arrays() -> dict:
    """g2p-en's checkpoint20.npz layout, small: a GRU encoder-decoder's float32 arrays by name."""
    rng = np.random.default_rng(0)
    return {name: (rng.random(shape, dtype=np.float32) - np.float32(0.5)) for name, shape in G2P.items()}


ARRAYS = {   # one .npy each: the layouts and dtypes np.save writes
    "c_f32": lambda rng: rng.random((3, 5), dtype=np.float32),
    "fortran_f64": lambda rng: np.asfortranarray(rng.random((4, 3, 2))),
    "big_endian_i32": lambda rng: rng.integers(-2**31, 2**31, (2, 3)).astype(">i4"),
    "big_endian_fortran_f2": lambda rng: np.asfortranarray(rng.random((3, 4)).astype(">f2")),
    "scalar": lambda rng: np.float64(3.25),
    "empty": lambda rng: np.zeros((0, 4), np.float16),
    "bool": lambda rng: rng.random(7) > 0.5,
    "u8": lambda rng: rng.integers(0, 256, (2, 2, 2)).astype(np.uint8),
    "i64": lambda rng: rng.integers(-2**62, 2**62, 5),
}


def output(out) -> dict:
    got = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            got.update(load_file(os.path.join(out, name)))
    return got


def same(ref: np.ndarray, got: np.ndarray, name=""):
    """Equal logical values: the same shape, the dtype little-endian, the same bytes in C order."""
    ref = np.array(ref, order="C")
    ref = ref.astype(ref.dtype.newbyteorder("<")) if ref.dtype.byteorder == ">" else ref
    assert got.dtype == ref.dtype and got.shape == ref.shape and got.tobytes() == ref.tobytes(), name


@pytest.mark.parametrize("kind", sorted(ARRAYS))
def test_an_npy_file_converts_as_np_load_reads_it(tmp_path, kind):
    src = tmp_path / f"{kind}.npy"
    np.save(src, ARRAYS[kind](np.random.default_rng(1)))
    out = tmp_path / "out"
    r = run("convert", src, out)
    assert r.exit_code == 0, r.stderr
    got = output(out)
    assert list(got) == [kind]                                  # named by the file's stem
    same(np.load(src), got[kind], kind)
    assert run("verify", out, "--against", src).exit_code == 0


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_the_g2p_en_layout_converts_stored_or_deflated(tmp_path, save):
    src = tmp_path / "checkpoint20.npz"
    save(src, **g2p_arrays())
    out = tmp_path / "out"
    r = run("convert", src, out)
    assert r.exit_code == 0, r.stderr
    got, ref = output(out), np.load(src)
    assert sorted(got) == sorted(ref.files) == sorted(G2P)
    for name in ref.files:
        same(ref[name], got[name], name)
    r = run("verify", out, "--against", src)
    assert r.exit_code == 0, r.stdout
    order = list(json.loads((out / "manifest.json").read_text())["tensors"])
    assert sorted(order) == sorted(G2P)
    assert reader_for(src)[0].name == "numpy"


def test_stored_members_are_views_of_the_mapping_and_deflated_ones_inflate_when_read(tmp_path):
    arrays = g2p_arrays()
    np.savez(tmp_path / "s.npz", **arrays)
    stored = open_checkpoint(tmp_path / "s.npz")
    t = stored.tensors[0]
    assert t.file_span() is not None and t.file_span()[0].path == str(tmp_path / "s.npz")   # zero-copy
    np.savez_compressed(tmp_path / "c.npz", **arrays)
    deflated = open_checkpoint(tmp_path / "c.npz")
    t = deflated.tensors[0]
    assert t._base is None                                       # nothing inflated at load
    same(arrays[t.name], t.region())
    assert t._base is not None


def test_object_arrays_are_refused_unread_and_never_unpickled(tmp_path):
    canary = tmp_path / "canary"
    src = tmp_path / "mixed.npz"
    np.savez(src, w=np.ones(3, np.float32), config=np.array([Reduce(os.system, (f"touch {canary}",))], dtype=object))
    out = tmp_path / "out"
    r = run("convert", src, out)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1
    assert "member 'config.npy': an object array (saved with allow_pickle)" in r.stderr
    assert "never runs; --skip-unsupported leaves it out unread" in r.stderr
    assert not out.exists()
    r = run("convert", src, out, "--skip-unsupported")
    assert r.exit_code == 0, r.stderr
    assert list(output(out)) == ["w"]
    assert json.loads((out / "manifest.json").read_text())["source"]["skipped"][0]["name"] == "config"
    assert not canary.exists()


def test_only_leaves_members_unread(tmp_path):
    src = tmp_path / "c.npz"
    np.savez_compressed(src, keep=np.arange(4.0), drop=np.arange(9.0))
    ckpt = open_checkpoint(src, options=ReadOptions(only=["keep"]))
    assert [t.name for t in ckpt.tensors] == ["keep"]


def test_directories_of_npy_files_or_one_npz(tmp_path):
    d = tmp_path / "arrays"
    d.mkdir()
    arrays = g2p_arrays()
    for name in ("enc_emb", "fc_b"):
        np.save(d / f"{name}.npy", arrays[name])
    (d / "README.md").write_text("g2p\n")
    r = run("convert", d, tmp_path / "out")
    assert r.exit_code == 0, r.stderr
    got = output(tmp_path / "out")
    assert sorted(got) == ["enc_emb", "fc_b"] and (tmp_path / "out" / "README.md").exists()
    same(arrays["fc_b"], got["fc_b"])
    d2 = tmp_path / "npz"
    d2.mkdir()
    np.savez(d2 / "a.npz", x=np.ones(2))
    assert run("convert", d2, tmp_path / "o2").exit_code == 0
    np.savez(d2 / "b.npz", x=np.ones(2))
    r = run("convert", d2, tmp_path / "o3")
    assert r.exit_code == 2 and "holds 2 .npz files (a.npz, b.npz)" in r.stderr
