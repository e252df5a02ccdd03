"""Grok-1-style pickle shard directories: names, zero-copy payloads, dequantization, Mixtral export, hosts."""
import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from ckptconv.readers import ReadOptions, grok, open_checkpoint
from tests.fixtures import grok as gf
from tests.fixtures.attacks import Reduce
from tests.helpers import DATA, ROOT, output_files, run



def read_all(out) -> dict:
    weight_map = output_files(out)
    tensors = {}
    for f in sorted(set(weight_map.values())):
        tensors.update(load_file(Path(out) / f))
    assert set(tensors) == set(weight_map)
    return tensors


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module")
def params():
    return gf.make_params(12)


@pytest.fixture(scope="module")
def grok_dir(tmp_path_factory, params):
    d = tmp_path_factory.mktemp("grok")
    gf.write_dir(d, params)
    return d


def test_name_table_matches_the_real_release():
    real = json.loads((DATA / "grok1_tensors.json").read_text())["tensors"]
    assert grok.tree_names(770) == [t["path"] for t in real]
    names = grok.tree_names(2 + 12 * 12)
    assert names[2 + 12 * 2].startswith("transformer/decoder_layer_10/")  # 0, 1, 10, 11, 2, ...
    assert grok.tree_names(771) is None


def convert(src, out, *extra):
    r = run("pickle-to-safetensors", src, out, "--quiet", *extra)
    assert r.exit_code == 0, r.stderr
    return out


def assert_lossless(got, params):
    """Every leaf bit for bit: arrays under their name, quantized weights as NAME.weight + NAME.scales."""
    for path, value in params.items():
        name = path.replace("/", ".")
        if isinstance(value, gf.QuantizedWeight8bit):
            assert same(got[name + ".weight"], value.weight) and same(got[name + ".scales"], value.scales), name
        else:
            assert same(got[name], value), name


def test_lossless_bit_exact(grok_dir, params, tmp_path):
    out = convert(grok_dir, tmp_path / "out")  # the parent of ckpt-0/ is accepted
    assert_lossless(read_all(out), params)
    manifest = json.loads((out / "manifest.json").read_text())
    q = manifest["quantization"]["transformer.decoder_layer_3.moe.linear_1.w"]
    assert q["groups"] == 8 and q["weight"].endswith(".weight") and q["scales"].endswith(".scales")
    assert manifest["source"]["names"].startswith("grok-1 tree order (12 layers)")


def test_large_payloads_are_views_of_the_mapped_file(grok_dir, params):
    ckpt = open_checkpoint(grok_dir, None, ReadOptions())
    by_name = {t.name: t for t in ckpt.tensors}
    emb = by_name["language_model.in_out_embed.embeddings"]
    mapped, offset = emb.file_span()
    raw = Path(mapped.path).read_bytes()
    assert raw[offset:offset + emb.nbytes] == params["language_model/in_out_embed/embeddings"].tobytes()
    assert by_name["transformer.decoder_layer_0.moe.linear.w.weight"].file_span() is not None


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_dequantized_against_numpy_reference(grok_dir, params, tmp_path, dtype):
    np_dtype = ml_dtypes.bfloat16 if dtype == "bf16" else np.float32
    got = read_all(convert(grok_dir, tmp_path / "out", "--dequantize", dtype))
    assert len(got) == len(params)
    for path, value in params.items():
        name = path.replace("/", ".")
        want = gf.dequantize_ref(value, np_dtype) if isinstance(value, gf.QuantizedWeight8bit) \
            else value.astype(np_dtype)
        assert same(got[name], want), name


def test_dequantize_in_small_blocks_matches(params):
    """Regions that cut K mid-group and N anywhere still use the right scales."""
    q = params["transformer/decoder_layer_0/moe/linear_1/w"]
    from ckptconv.tensor import ArraySource, iter_blocks
    from ckptconv import dtypes
    w = ArraySource("w", dtypes.BY_CODE["I8"], q.weight.shape, lambda: q.weight)
    s = ArraySource("s", dtypes.BY_CODE["BF16"], q.scales.shape, lambda: q.scales)
    dq = grok.dequantized("x", w, s, dtypes.BY_CODE["F32"])
    blocks = np.concatenate([b.reshape(-1) for b in iter_blocks(dq, 4 * 100)])
    assert np.array_equal(blocks, gf.dequantize_ref(q, np.float32).reshape(-1))
    region = dq.region((slice(1, 3), slice(5, 77), slice(3, 40)))
    assert np.array_equal(region, gf.dequantize_ref(q, np.float32)[1:3, 5:77, 3:40])


def mixtral_reference(params, np_dtype) -> dict:
    ref = {}
    norms = dict(zip(["rms_norm", "rms_norm_1", "rms_norm_2", "rms_norm_3"],
                     ["input_layernorm", "post_attention_layernorm", "pre_moe_layernorm", "post_moe_layernorm"]))
    attn = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "linear": "o_proj"}
    for path, v in params.items():
        dense = gf.dequantize_ref(v, np_dtype) if isinstance(v, gf.QuantizedWeight8bit) else v.astype(np_dtype)
        if path.endswith("embeddings"):
            ref["model.embed_tokens.weight"] = dense
            continue
        if path == "language_model/rms_norm/scale":
            ref["model.norm.weight"] = dense
            continue
        _, layer, *rest = path.split("/")
        p = f"model.layers.{layer.split('_')[-1]}."
        if rest[-1] == "scale":
            ref[p + norms[rest[0]] + ".weight"] = dense
        elif rest[0] == "multi_head_attention":
            ref[p + f"self_attn.{attn[rest[1]]}.weight"] = np.ascontiguousarray(dense.T)
        elif rest[0] == "router":
            ref[p + "block_sparse_moe.gate.weight"] = np.ascontiguousarray(dense.T)
        else:
            w = {"linear": "w1", "linear_1": "w2", "linear_v": "w3"}[rest[1]]
            for e in range(dense.shape[0]):
                ref[p + f"block_sparse_moe.experts.{e}.{w}.weight"] = np.ascontiguousarray(dense[e].T)
    return ref


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_mixtral_export(grok_dir, params, tmp_path, dtype):
    extra = ["--dequantize", "f32"] if dtype == "f32" else []
    got = read_all(convert(grok_dir, tmp_path / "out", "--layout", "mixtral", *extra))
    ref = mixtral_reference(params, ml_dtypes.bfloat16 if dtype == "bf16" else np.float32)
    assert set(got) == set(ref)
    for name, want in ref.items():
        assert same(got[name], want), name
    d = gf.Dims()
    assert got["model.layers.3.block_sparse_moe.experts.1.w1.weight"].shape == (d.ffn, d.emb)
    assert got["model.layers.3.block_sparse_moe.experts.1.w2.weight"].shape == (d.emb, d.ffn)
    assert got["model.layers.3.block_sparse_moe.gate.weight"].shape == (d.experts, d.emb)


@pytest.mark.parametrize("variant", [dict(protocol=2), dict(protocol=5), dict(protocol=4, numpy2=True),
                                     dict(protocol=4, hosts=2)])
def test_variants(tmp_path, variant):
    params = gf.make_params(1, seed=1)
    hosts = variant.get("hosts", 1)
    gf.write_dir(tmp_path / "src", params, variant["protocol"], variant.get("numpy2", False), hosts, grok.model_axis)
    assert_lossless(read_all(convert(tmp_path / "src" / "ckpt-0", tmp_path / "out")), params)


def test_missing_host_file_named(tmp_path):
    params = gf.make_params(1, seed=1)
    src = gf.write_dir(tmp_path / "src", params, hosts=2, axes=grok.model_axis)
    (src / "tensor00005_001").unlink()
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 2 and "index 5" in r.stderr and not (tmp_path / "out").exists()


def test_a_missing_index_is_found_as_far_as_the_files_go(tmp_path):
    """tensor99999_000 beside tensor00000_000: index 1 is missing, found in as many steps as there
    are files (the number in a name sizes nothing)."""
    src = gf.write_dir(tmp_path / "src", {"p0": np.zeros(3, np.float32)})
    (src / "tensor99999_000").write_bytes((src / "tensor00000_000").read_bytes())
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 2 and "index 1 are missing (expected 0..99999)" in r.stderr, r.stderr


def test_names_file_and_positional_names(tmp_path):
    arrays = {f"p{i}": np.full((3,), i, np.float32) for i in range(5)}
    src = gf.write_dir(tmp_path / "src", arrays)
    out = convert(src, tmp_path / "pos")
    assert sorted(read_all(out)) == [f"tensor{i:05d}" for i in range(5)]
    assert "positional" in json.loads((out / "manifest.json").read_text())["source"]["names"]
    names = tmp_path / "names.json"
    names.write_text(json.dumps({str(i): f"layer.{i}.w" for i in range(5)}))
    got = read_all(convert(src, tmp_path / "named", "--names", names))
    assert got["layer.3.w"].tolist() == [3, 3, 3]


def _evil_dirs(tmp_path, canary):
    q = gf.QuantizedWeight8bit(np.zeros((4, 4), np.int8), np.ones((1, 4), ml_dtypes.bfloat16))
    cases = {
        "canary-in-quantized": gf.QuantizedWeight8bit(q.weight, Reduce(os.system, (f"touch {canary}",))),
        "unknown-class": Reduce(os.path.join, ("a", "b")),
        "object-dtype": np.array([1, "x"], dtype=object),
    }
    out = {}
    for name, obj in cases.items():
        d = tmp_path / name / "ckpt-0"
        d.mkdir(parents=True)
        (d / "tensor00000_000").write_bytes(gf.dumps(obj))
        out[name] = d
    trunc = tmp_path / "truncated" / "ckpt-0"
    trunc.mkdir(parents=True)
    (trunc / "tensor00000_000").write_bytes(gf.dumps(np.ones(100000, np.float32))[:-5000])
    out["truncated"] = trunc
    return out


@pytest.mark.parametrize("case, needle", [("canary-in-quantized", "'posix.system'"),
                                          ("unknown-class", "'posixpath.join'"),
                                          ("object-dtype", "numpy dtype 'O8'"),
                                          ("truncated", "truncated")])
def test_malicious_and_broken_files_refused(tmp_path, case, needle):
    canary = tmp_path / "canary"
    src = _evil_dirs(tmp_path, canary)[case]
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 2 and needle in r.stderr, r.stderr
    assert "tensor00000_000" in r.stderr and r.stderr.count("\n") == 1
    assert not canary.exists() and not (tmp_path / "out").exists()


@pytest.mark.slow   # (make test-slow: a check of scale)
def test_more_files_than_the_soft_open_file_limit(grok_dir, params, tmp_path):
    """Every mapped file holds a descriptor (Python's mmap before 3.13): with a soft limit below the
    directory's 146 files the CLI raises it to the hard limit; with a hard limit that low too, the
    error is one line naming the file and what to do."""
    import resource
    import subprocess
    import sys
    soft_only = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    both = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    for limit, out in ((soft_only, tmp_path / "ok"), (both, tmp_path / "refused")):
        r = subprocess.run([sys.executable, "-m", "ckptconv.cli", "pickle-to-safetensors", grok_dir, out, "--quiet"],
                           capture_output=True, text=True, preexec_fn=limit, cwd=ROOT)
        if limit is soft_only:
            assert r.returncode == 0, r.stderr
            assert_lossless(read_all(out), params)
        else:
            assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
            assert "Too many open files (every mapped input holds a descriptor: raise `ulimit -n`)" in r.stderr
            assert str(grok_dir) in r.stderr
            assert not out.exists()
