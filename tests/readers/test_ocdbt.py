"""readers/ocdbt.py against tensorstore: OCDBT stores made by real tensorstore and real Orbax
(tests/fixtures/ocdbt.py; committed under tests/fixtures/data/ocdbt/) give every key tensorstore
lists, in order, each with exactly the bytes tensorstore reads (truth.json beside each store)."""
import base64
import json
import shutil
import sys
from pathlib import Path

import pytest

from ckptconv.errors import BadInput, UsageError
from ckptconv.io.crc32c import crc32c
from ckptconv.readers.ocdbt import MANIFEST, OcdbtStore

DATA = Path(__file__).parent.parent / "fixtures" / "data" / "ocdbt"
STORES = ["small", "empty", "deep", "merged", "orbax", "orbax2", "orbax/ocdbt.process_0"]


def truth(path: Path) -> dict:
    return {k: base64.b64decode(v) for k, v in json.loads((path / "truth.json").read_text()).items()}


@pytest.mark.parametrize("name", STORES)
def test_every_key_and_value_as_tensorstore_reads_them(name):
    path = DATA / name
    want = truth(path)
    store = OcdbtStore(path)
    assert store.keys() == sorted(want)
    for key, value in want.items():
        assert bytes(store.read(key)) == value, key
        v = store.get(key)
        assert v.length == len(value)
        if v.inline is None:
            assert v.file in store.files and v.file.size >= v.offset + v.length
    assert store.get("no such key") is None


def test_inline_and_indirect_values_both_occur():
    """small: values up to 8 bytes inline, larger ones in data files (tensorstore's choice)."""
    store = OcdbtStore(DATA / "small")
    kinds = {k: store.get(k).inline is not None for k in store.keys()}
    assert kinds["a"] and kinds["empty"] and kinds["b/0.1"]
    assert not kinds["b/0.0"] and not kinds["a/.zarray"]
    assert "unicode/\u00e9" in kinds


def test_deep_tree_has_interior_nodes():
    """deep: 600 keys under 512-byte zstd nodes: several B+tree levels, several data files."""
    store = OcdbtStore(DATA / "deep")
    assert len(store.keys()) == 600
    assert len(store.files) > 2


def test_orbax_root_reads_the_processes_data_files():
    """Orbax's merged root manifest names the per-process stores' files (ocdbt.process_N/d/...):
    chunks too large to inline are read from them; keys look like `params.dense.kernel/0.0`."""
    store = OcdbtStore(DATA / "orbax2")
    where = {str(store.get(k).file.path).split("orbax2/")[1].split("/")[0]
             for k in store.keys() if store.get(k).inline is None}
    assert where == {"ocdbt.process_0", "ocdbt.process_1"}
    assert "params.dense.kernel/.zarray" in store.keys() and "params.dense.kernel/0.0" in store.keys()
    assert "step/0" in store.keys()


def test_unmerged_processes_are_refused(tmp_path):
    """A save whose per-process stores were never merged (no root manifest) is incomplete."""
    src = tmp_path / "ck"
    shutil.copytree(DATA / "orbax2", src)
    (src / MANIFEST).unlink()
    with pytest.raises(BadInput, match="never merged"):
        OcdbtStore(src)


def test_not_a_store(tmp_path):
    with pytest.raises(BadInput, match="no manifest.ocdbt"):
        OcdbtStore(tmp_path)


def test_zstd_nodes_need_zstandard(monkeypatch):
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(UsageError, match=r"install zstandard: pip install 'ckptconv\[zstd\]'"):
        OcdbtStore(DATA / "deep")
    OcdbtStore(DATA / "small")   # uncompressed nodes need nothing


def test_crc32c_known_answers():
    """RFC 3720's CRC-32C check value, and the empty string."""
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    assert crc32c(bytes(32)) == 0x8A9136AA


def test_merged_tree_reaches_the_processes_values():
    """merged: Orbax's merge with 400-byte nodes: interior nodes in the root's own data file, values
    in the processes' data files, named through base paths."""
    store = OcdbtStore(DATA / "merged")
    dirs = {str(Path(f.path).parent.relative_to(DATA / "merged")) for f in store.files}
    assert dirs == {"d", "ocdbt.process_0/d", "ocdbt.process_1/d"}
    assert len(store.keys()) == 240
