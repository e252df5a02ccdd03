"""torch.save (zip and legacy) and HF .bin directories -> safetensors, checked by the real consumers."""
import json
import subprocess

import pytest
import torch

from tests.helpers import assert_same, bits, load_output, run
from tests.fixtures import models as fixtures


def convert(src, out, *extra):
    r = run("convert", src, out, "--quiet", *extra)
    assert r.exit_code == 0, r.stderr
    return out


def test_dtype_matrix_bit_exact(torch_fixtures, tmp_path):
    out = convert(torch_fixtures["dtypes"], tmp_path / "out")
    got = load_output(out)
    want = fixtures.dtype_matrix()
    assert set(got) == set(want)
    for name, t in want.items():
        assert_same(got[name], t, name)


@pytest.mark.parametrize("kind", ["layouts", "legacy"])
def test_views_transposes_offsets_shared_storage(torch_fixtures, tmp_path, kind):
    out = convert(torch_fixtures[kind], tmp_path / "out")
    got = load_output(out)
    want = fixtures.layout_cases()
    assert set(got) == set(want)
    for name, t in want.items():
        assert_same(got[name], t.detach().contiguous(), name)
    assert got["transposed"][0, 5] == 5 * 8  # logical values, not the base's order


def test_legacy_dtype_matrix(torch_fixtures, tmp_path):
    got = load_output(convert(torch_fixtures["legacy_dtypes"], tmp_path / "out"))
    for name, t in fixtures.dtype_matrix().items():
        assert_same(got[name], t, name)


def test_nested_training_state_names_and_extras(torch_fixtures, tmp_path):
    out = convert(torch_fixtures["train"], tmp_path / "out")
    got = load_output(out)
    state = fixtures.training_state()
    assert_same(got["model.0.weight"], state["model"]["0.weight"])
    assert_same(got["optim.state.0.exp_avg"], state["optim"]["state"][0]["exp_avg"])
    assert_same(got["optim.state.3.exp_avg_sq"], state["optim"]["state"][3]["exp_avg_sq"])
    assert_same(got["nested.a.1.b"], state["nested"]["a"][1]["b"])
    manifest = json.loads((out / "manifest.json").read_text())
    extras = manifest["extras"]
    assert extras["epoch"] == 3 and extras["loss"] == 0.25 and extras["version"] == torch.__version__
    assert extras["args"] == {"__class__": "argparse.Namespace", "lr": 1e-3, "name": "run1"}
    assert extras["optim.param_groups.0.betas"] == [0.9, 0.999]
    assert extras["optim.param_groups.0.params"] == [0, 1, 2, 3]


def test_hf_sharded_bin_loads_in_transformers_with_identical_logits(hf_llama, tmp_path):
    from transformers import LlamaForCausalLM
    out = convert(hf_llama["dir"], tmp_path / "out", "--max-shard-size", "100KB")
    names = sorted(p.name for p in out.iterdir())
    assert "config.json" in names and "README.md" in names
    assert sum(n.endswith(".safetensors") for n in names) > 1
    got = load_output(out)
    for name, t in hf_llama["state"].items():
        assert_same(got[name], t, name)
    model = LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(hf_llama["ids"]).logits
    assert torch.equal(logits, hf_llama["logits"])


def test_sha256sums_passes_coreutils(torch_fixtures, tmp_path):
    out = convert(torch_fixtures["train"], tmp_path / "out")
    r = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=out, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    listed = {line.split("  ", 1)[1] for line in (out / "SHA256SUMS").read_text().splitlines()}
    assert listed == {p.name for p in out.iterdir()} - {"SHA256SUMS"}


def test_manifest_contract(torch_fixtures, tmp_path):
    import hashlib
    out = convert(torch_fixtures["layouts"], tmp_path / "out")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "ckptconv.manifest/1"
    assert manifest["source"]["format"] == "torch"
    got = load_output(out)
    for name, info in manifest["tensors"].items():
        assert info["sha256"] == hashlib.sha256(bits(got[name])).hexdigest()
        assert info["dtype"] in ("F32", "F64", "F16", "BF16", "I32")
        assert info["shape"] == list(got[name].shape)
    for file, info in manifest["files"].items():
        data = (out / file).read_bytes()
        assert info == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    from safetensors import safe_open
    with safe_open(out / "model.safetensors", framework="np") as f:
        assert f.metadata() == {"format": "pt"}


def test_output_is_deterministic(torch_fixtures, tmp_path):
    a = convert(torch_fixtures["train"], tmp_path / "a", "--max-shard-size", "200")
    b = convert(torch_fixtures["train"], tmp_path / "b", "--max-shard-size", "200")
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir()) and len(files) > 4
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_only_strip_prefix_and_cast(torch_fixtures, tmp_path):
    import ml_dtypes
    import numpy as np
    out = convert(torch_fixtures["train"], tmp_path / "out", "--only", "model", "--strip-prefix", "model.",
                  "--dtype", "bf16")
    got = load_output(out)
    state = fixtures.training_state()["model"]
    assert set(got) == set(state)
    for name, t in state.items():
        want = t.numpy().astype(ml_dtypes.bfloat16).view(np.uint16)
        assert got[name].dtype == torch.bfloat16
        assert np.array_equal(got[name].view(torch.int16).numpy().view(np.uint16), want), name


def test_unsupported_dtype_named_or_skipped(torch_fixtures, tmp_path):
    r = run("convert", torch_fixtures["complex"], tmp_path / "out")
    assert r.exit_code == 2
    assert "'z'" in r.stderr and "complex64" in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()
    out = convert(torch_fixtures["complex"], tmp_path / "out2", "--skip-unsupported")
    assert set(load_output(out)) == {"w"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["skipped"] == [{"name": "z", "reason": "complex64"}]


def test_existing_output_refused_unless_overwrite(torch_fixtures, tmp_path):
    out = convert(torch_fixtures["dtypes"], tmp_path / "out")
    r = run("convert", torch_fixtures["dtypes"], out)
    assert r.exit_code == 2 and "already exists" in r.stderr
    convert(torch_fixtures["layouts"], out, "--overwrite")
    assert "transposed" in load_output(out)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp dir or lock left


def test_inspect_json(torch_fixtures):
    r = run("inspect", torch_fixtures["train"], "--json")
    assert r.exit_code == 0
    info = json.loads(r.stdout)
    assert info["format"] == "torch"
    names = {t["name"]: t for t in info["tensors"]}
    assert names["model.0.weight"] == {"name": "model.0.weight", "dtype": "F32", "shape": [3, 4], "bytes": 48}
    assert info["extras"]["epoch"] == 3


def test_safetensors_source_roundtrip(torch_fixtures, tmp_path):
    first = convert(torch_fixtures["dtypes"], tmp_path / "a", "--max-shard-size", "100")
    second = convert(first, tmp_path / "b")
    got = load_output(second)
    for name, t in fixtures.dtype_matrix().items():
        assert_same(got[name], t, name)
    r = run("pickle-to-safetensors", first, tmp_path / "c")
    assert r.exit_code == 2 and "not a pickle-based" in r.stderr


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_pickle_protocols_torch_writes(tmp_path, protocol):
    """torch.save with pickle_protocol 4 and 5 (torch's own weights_only loader rejects some)."""
    state = fixtures.layout_cases()
    src = tmp_path / "p.pt"
    torch.save(state, src, pickle_protocol=protocol)
    got = load_output(convert(src, tmp_path / "out"))
    for name, t in state.items():
        assert_same(got[name], t.detach().contiguous(), name)


def test_big_endian_archive(tmp_path):
    """A zip whose `byteorder` says big: storages are byte-swapped into little-endian output."""
    import io
    import zipfile
    import numpy as np
    state = {"f": torch.linspace(-3, 3, 12).reshape(3, 4), "i": torch.arange(-5, 5, dtype=torch.int16).t()}
    src = tmp_path / "le.pt"
    torch.save(state, src)
    buf = io.BytesIO()
    itemsize = {"0": 4, "1": 2}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zout:
        for item in zin.infolist():
            body = zin.read(item)
            key = item.filename.rsplit("/", 1)[-1]
            if item.filename.endswith("/byteorder"):
                body = b"big"
            elif "/data/" in item.filename:
                body = np.frombuffer(body, f"<u{itemsize[key]}").astype(f">u{itemsize[key]}").tobytes()
            zout.writestr(item.filename, body)
    (tmp_path / "be.pt").write_bytes(buf.getvalue())
    got = load_output(convert(tmp_path / "be.pt", tmp_path / "out"))
    for name, t in state.items():
        assert_same(got[name], t.contiguous(), name)


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])   # transformers 4 and 5 spell it differently
def test_after_a_cast_the_carried_config_says_the_new_dtype(hf_llama, tmp_path, key):
    import shutil
    src = tmp_path / "src"
    shutil.copytree(hf_llama["dir"], src)
    before = {**json.loads((src / "config.json").read_text()), key: "float32"}
    (src / "config.json").write_text(json.dumps(before))
    out = tmp_path / "bf16"
    assert run("convert", src, out, "--dtype", "bf16", "--quiet").exit_code == 0
    config = json.loads((out / "config.json").read_text())
    assert config[key] == "bfloat16" and {k: v for k, v in config.items() if k != key} == \
        {k: v for k, v in before.items() if k != key}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["config_edits"] == {key: [before[key], "bfloat16"]}
    assert run("verify", out, "--against", src).exit_code == 0
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype="auto")
    assert model.dtype == torch.bfloat16


def test_tied_embeddings_are_written_once_and_load_back_tied(tmp_path):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    src = tmp_path / "src"
    src.mkdir()
    cfg.save_pretrained(src)
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    torch.save(state, src / "pytorch_model.bin")                       # both names, one storage
    out = tmp_path / "out"
    assert run("convert", src, out, "--quiet").exit_code == 0
    written = load_output(out)
    assert "lm_head.weight" not in written and "model.embed_tokens.weight" in written
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[1, 5, 9, 33]])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
    assert run("verify", out, "--against", src).exit_code == 0


@pytest.mark.parametrize("extra", [[], ["--dtype", "bf16"]])
def test_a_config_that_does_not_parse_is_carried_unchanged(tmp_path, extra):
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"w": torch.ones(2)}, src / "pytorch_model.bin")
    (src / "config.json").write_text('{"tie_word_embeddings": true, "torch_dtype": "float32"')   # cut short
    out = tmp_path / "out"
    r = run("convert", src, out, "--quiet", *extra)
    assert r.exit_code == 0, r.stderr
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert "config_edits" not in json.loads((out / "manifest.json").read_text())["source"]


def test_archive_entries_scanned_a_bounded_number_of_times(tmp_path, monkeypatch):
    """Telling a torch.save archive from a TorchScript one looks for data.pkl once per file, not once
    per entry (that was quadratic: 100,000 tensors took over 13 minutes to inspect)."""
    from ckptconv.readers import torch_pickle
    torch.save({f"t{i}": torch.zeros(2) for i in range(300)}, tmp_path / "many.pt")
    calls = []
    real = torch_pickle.archive_prefix
    monkeypatch.setattr(torch_pickle, "archive_prefix", lambda *a: calls.append(1) or real(*a))
    assert run("inspect", tmp_path / "many.pt").exit_code == 0
    assert 1 <= len(calls) <= 2


def test_the_pickle_is_read_with_its_pages_let_go_behind(tmp_path, monkeypatch):
    """A million-tensor data.pkl is ~110 MB of mapped pages: they are dropped after the CRC pass and
    after the memo pass, then a step at a time behind the run, which builds the same objects."""
    import torch
    from ckptconv.io.mapped import MappedFile
    from ckptconv.readers import ziparchive
    from ckptconv.readers.pickle import vm
    from ckptconv.readers.pickle.torch_globals import torch_globals
    from ckptconv.readers.torch_pickle import load_zip
    torch.save({f"w{i}": torch.full((3,), float(i)) for i in range(300)}, tmp_path / "m.pt")
    m = MappedFile(tmp_path / "m.pt")
    entries = ziparchive.read_entries(m)
    pkl = entries[next(n for n in entries if n.endswith("data.pkl"))]
    calls = []
    release = m.release
    monkeypatch.setattr(m, "release", lambda offset, length: calls.append((offset, length)) or release(offset, length))
    monkeypatch.setattr(vm, "RELEASE_STEP", 512)
    stepped = load_zip(m, torch_globals(), entries=entries)
    steps = sorted(calls)
    assert len(steps) > pkl.size // 512 // 2   # (the passes' whole releases are three)
    assert all(pkl.offset <= o and o + n <= pkl.offset + pkl.span for o, n in steps)
    monkeypatch.setattr(vm, "RELEASE_STEP", 16 << 20)
    whole = load_zip(MappedFile(tmp_path / "m.pt"), torch_globals())
    assert [(k, v.shape, v.start) for k, v in stepped.items()] == [(k, v.shape, v.start) for k, v in whole.items()]


def test_detection_names_are_the_archive_names(tmp_path):
    """Detection reads the names alone (ziparchive.names): the same names, in order, as the full
    parse; a directory that is cut short is BadInput there too."""
    from ckptconv.errors import BadInput
    from ckptconv.io.mapped import MappedFile
    from ckptconv.readers import ziparchive
    torch.save({f"w{i}": torch.ones(2) for i in range(5)}, tmp_path / "m.pt")
    m = MappedFile(tmp_path / "m.pt")
    assert list(ziparchive.names(m)) == list(ziparchive.read_entries(m))
    data = (tmp_path / "m.pt").read_bytes()
    eocd = data.rfind(b"PK\x05\x06")
    cd_offset = int.from_bytes(data[eocd + 16:eocd + 20], "little")
    cut = data[:cd_offset + 50] + data[eocd:]   # the directory ends inside its first record
    (tmp_path / "cut.pt").write_bytes(cut)
    with pytest.raises(BadInput, match="not a valid torch zip archive"):
        list(ziparchive.names(MappedFile(tmp_path / "cut.pt")))


def test_archive_entries_are_a_mapping_of_names_in_file_order():
    """ziparchive.Entries keeps torch's numbered storages (PREFIX/data/N) by number and every other
    name in a dict: both read back as the plain {name: Entry} they stand for, in file order, and a
    name given twice is refused whichever way each copy was kept."""
    from ckptconv.readers.ziparchive import Entries, Entry
    names = ["archive/data.pkl", "archive/data/0", "archive/data/7", "archive/data/01", "b/data/3", "data/2",
             "archive/data/99999999999", "archive/version", "archive/data/1", "archive/.data/serialization_id"]
    entries, plain = Entries(), {}
    for i, name in enumerate(names):
        stored = -1 if i % 3 else 10 * i
        entries.add(name, 100 * i, i, 7 * i, 8 if stored >= 0 else 0, stored)
        plain[name] = Entry(name, 100 * i, i, 7 * i, 8 if stored >= 0 else 0, stored)
    assert list(entries) == names and len(entries) == len(names)
    assert dict(entries) == plain
    for absent in ("archive/data/2", "archive/data/00", "archive/data/", "archive/data/x", "b/data/4", 3):
        assert absent not in entries and entries.get(absent) is None
    for name in names:
        with pytest.raises(ValueError):
            entries.add(name, 0, 0, 0)
    late = Entries()   # a number too far ahead to be kept by number at first, then in reach
    late.add("a/data/5000", 0, 1, 0)
    for k in range(2000):
        late.add(f"a/data/{k}", k + 1, 1, 0)
    with pytest.raises(ValueError):
        late.add("a/data/5000", 0, 1, 0)
    assert late["a/data/5000"].offset == 0 and late["a/data/1999"].offset == 2000


@pytest.mark.slow   # (make test-slow: a check of scale)
def test_archive_entries_hold_no_object_per_storage():
    """A million-storage archive's entries cost a few columns, not a record, a name and a dict slot
    each (docs/benchmarks.md, "Fourth pass")."""
    import tracemalloc
    from ckptconv.readers.ziparchive import Entries
    tracemalloc.start()
    try:
        entries = Entries()
        for k in range(100_000):
            entries.add(f"archive/data/{k}", 64 * k, 64, k)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 100 * 100_000, held
    assert entries["archive/data/99999"].offset == 64 * 99999


def test_a_storage_is_what_its_first_reference_says(tmp_path):
    """Two references to one storage that disagree (a forged pickle): the first says its dtype and
    size, as for torch.load; a view beyond that size is refused, a second dtype ignored."""
    import collections
    import io
    import pickle
    import zipfile
    from ckptconv.errors import BadInput
    from ckptconv.readers import Source, open_source

    class Ref:
        def __init__(self, stype, numel):
            self.pid = ("storage", stype, "0", "cpu", numel)

    class View:
        def __init__(self, ref, size):
            self.args = (ref, 0, (size,), (1,), False, collections.OrderedDict())

        def __reduce__(self):
            return torch._utils._rebuild_tensor_v2, self.args

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return obj.pid if isinstance(obj, Ref) else None

    def write(name, first, second):
        buf = io.BytesIO()
        Pickler(buf, protocol=2).dump({"a": View(Ref(*first), first[1]), "b": View(Ref(*second), second[1])})
        with zipfile.ZipFile(tmp_path / name, "w", zipfile.ZIP_STORED) as z:
            z.writestr("archive/data.pkl", buf.getvalue())
            z.writestr("archive/byteorder", "little")
            z.writestr("archive/version", "3\n")
            z.writestr("archive/data/0", torch.arange(100, dtype=torch.float32).numpy().tobytes())
        return tmp_path / name

    with pytest.raises(BadInput, match="beyond its storage '0' of 4 bytes"):
        open_source(Source(str(write("numel.pt", (torch.FloatStorage, 1), (torch.FloatStorage, 100)))))
    with pytest.raises(BadInput, match="beyond its storage '0' of 400 bytes"):
        open_source(Source(str(write("half.pt", (torch.FloatStorage, 100), (torch.HalfStorage, 200)))))
    with pytest.raises(BadInput, match="storage type outside the allowlist"):   # every reference is checked
        open_source(Source(str(write("evil.pt", (torch.FloatStorage, 100), ("evil", 100)))))
    path = write("int.pt", (torch.FloatStorage, 100), (torch.IntStorage, 100))
    got = {t.name: t.dtype.code for t in open_source(Source(str(path))).tensors}
    want = {k: str(v.dtype) for k, v in torch.load(path, weights_only=True).items()}
    assert got == {"a": "F32", "b": "F32"} and want == {"a": "torch.float32", "b": "torch.float32"}


@pytest.mark.parametrize("kind", ["train", "layouts", "legacy"])
def test_records_share_shapes_and_carry_strides_only_where_strided(torch_fixtures, kind):
    """What a million-tensor optimizer state is held as (docs/benchmarks.md, sixth pass): one tuple
    per distinct shape, strided fields only on a view that is not its own row-major bytes, and no
    storage left unplaced once a legacy file is read."""
    from ckptconv.readers import open_checkpoint
    from ckptconv.tensor import MappedView

    tensors = open_checkpoint(torch_fixtures[kind]).tensors
    kept = {}
    for t in tensors:
        assert kept.setdefault(t.shape, t.shape) is t.shape, t.name
    assert len(kept) < len(tensors)   # (each of these files repeats a shape)
    assert all(isinstance(t, MappedView) and getattr(t, "pending", None) is None for t in tensors)
    strided = {t.name for t in tensors if t.strided is not None}
    if kind == "train":
        assert not strided
    else:   # (layout_cases, in the zip and the legacy format)
        assert strided == {"view_cols", "transposed", "strided", "channels_last", "expanded"}
        assert all(t.strided.held is not None for t in tensors if t.strided is not None)
