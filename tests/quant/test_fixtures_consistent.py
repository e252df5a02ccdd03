"""The quantized fixtures (tests/fixtures/quant.py) are present and self-consistent: every quantized weight's
parts are there with the shapes and dtypes its format gives them, the producer's reference and the source
have the logical shape, and the config names the scheme the tensors have. No ckptconv decoding here.

Runs on the committed micro set (tests/fixtures/data/quant/); `make test-quant` points
CKPTCONV_QUANT_FIXTURES at the full set it has just made and runs this on it too. Headers are read as the
safetensors format defines them (8-byte length, JSON), values only where numpy has the dtype.
"""
import json
import math
import os
import struct
from pathlib import Path

import numpy as np
import pytest

COMMITTED = Path(__file__).parents[1] / "fixtures" / "data" / "quant"
ROOTS = [COMMITTED] + ([Path(os.environ["CKPTCONV_QUANT_FIXTURES"])] if os.environ.get("CKPTCONV_QUANT_FIXTURES") else [])
EXPECTED = {"ct-fp8-dynamic", "ct-fp8-block", "ct-w8a16", "ct-w4a16", "ct-w4a16-asym", "ct-nvfp4a16", "ct-int8-w8a8",
            "ct-naive-fp8", "fp8-deepseek", "mxfp4-gptoss", "gptq-sym-descact", "gptq-asym", "awq-gemm"}
NP = {"F32": np.float32, "I32": np.int32, "U8": np.uint8, "I64": np.int64, "F16": np.float16}


class St:
    """One safetensors file's header (name -> dtype, shape) and, for numpy dtypes, its values."""

    def __init__(self, path: Path):
        self.path = path
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        header.pop("__metadata__", None)
        self.meta = {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()}
        self._raw, self._base, self._h = raw, 8 + n, header

    def __contains__(self, name):
        return name in self.meta

    def dtype(self, name):
        return self.meta[name][0]

    def shape(self, name):
        return self.meta[name][1]

    def values(self, name):
        a, b = self._h[name]["data_offsets"]
        return np.frombuffer(self._raw[self._base + a:self._base + b], NP[self.dtype(name)]).reshape(self.shape(name))


def fixtures(root: Path):
    return sorted(p.name for p in root.iterdir() if p.is_dir() and (p / "config.json").exists())


def load(root: Path, fixture):
    d = root / fixture
    model = {}
    for f in sorted(d.glob("*.safetensors")):
        st = St(f)
        model.update({k: (st, k) for k in st.meta})
    ref = St(root / f"{fixture}.reference.safetensors")
    (native_path,) = [p for p in root.glob(f"{fixture}.reference-*.safetensors")]
    return json.loads((d / "config.json").read_text()), model, ref, St(native_path), St(root / f"{fixture}.source.safetensors")


def test_committed_set_is_complete():
    assert set(fixtures(COMMITTED)) == EXPECTED
    for fixture in EXPECTED:
        for suffix in ("reference", "source"):
            assert (COMMITTED / f"{fixture}.{suffix}.safetensors").exists()
    assert (COMMITTED / "README.md").exists()


CASES = [(root, f) for root in ROOTS for f in fixtures(root)] if all(r.exists() for r in ROOTS) else []


def _part(model, name):
    st, key = model[name]
    return st.dtype(key), st.shape(key)


def _check_ct(qc, model, ref):
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    (group,) = qc["config_groups"].values()
    fmt, w = group.get("format") or qc["format"], group["weights"]
    assert fmt == qc["format"]
    for name, (rows, cols) in ((n, ref.shape(n)) for n in ref.meta):
        p = name[: -len("weight")]
        if fmt in ("float-quantized", "naive-quantized", "int-quantized"):
            code_dtype = "F8_E4M3" if w["type"] == "float" else "I8"
            assert _part(model, name) == (code_dtype, (rows, cols))
            dtype, shape = _part(model, p + "weight_scale")
            assert dtype == "BF16"
            if w["strategy"] == "channel":
                assert shape == (rows, 1)
            elif w["strategy"] == "block":
                br, bc = w["block_structure"]
                assert shape == (math.ceil(rows / br), math.ceil(cols / bc))
        elif fmt == "pack-quantized":
            bits, gs = w["num_bits"], w["group_size"]
            assert _part(model, p + "weight_packed") == ("I32", (rows, math.ceil(cols * bits / 32)))
            assert _part(model, p + "weight_scale") == ("BF16", (rows, math.ceil(cols / gs)))
            st, key = model[p + "weight_shape"]
            assert st.values(key).tolist() == [rows, cols]
            if not w["symmetric"]:   # packed along the output dimension
                assert _part(model, p + "weight_zero_point") == ("I32", (math.ceil(rows * bits / 32), math.ceil(cols / gs)))
            else:
                assert p + "weight_zero_point" not in model
        elif fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
            gs = w["group_size"]
            assert _part(model, p + "weight_packed") == ("U8", (rows, cols // 2))
            assert _part(model, p + "weight_scale") == ("F8_E4M3" if gs == 16 else "U8", (rows, cols // gs))
            if gs == 16:
                assert _part(model, p + "weight_global_scale") == ("F32", (1,))
        else:
            pytest.fail(f"unexpected format {fmt}")
    if fmt == "nvfp4-pack-quantized":   # q/k/v share one global scale, as the engines require
        for name in ref.meta:
            if name.endswith("q_proj.weight"):
                gss = {model[name.replace("q_proj.weight", f"{x}_proj.weight_global_scale")][0].values(
                    name.replace("q_proj.weight", f"{x}_proj.weight_global_scale")).tobytes() for x in "qkv"}
                assert len(gss) == 1


def _check_deepseek(qc, model, ref):
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    for name in ref.meta:
        rows, cols = ref.shape(name)
        assert _part(model, name) == ("F8_E4M3", (rows, cols))
        assert _part(model, name + "_scale_inv") == ("F32", (math.ceil(rows / 128), math.ceil(cols / 128)))


def _check_mxfp4(qc, model, ref):
    assert qc["quant_method"] == "mxfp4"
    for name in ref.meta:
        e, inner, outer = ref.shape(name)   # parameter layout [E, in, out]
        assert _part(model, name + "_blocks") == ("U8", (e, outer, inner // 32, 16))
        assert _part(model, name + "_scales") == ("U8", (e, outer, inner // 32))


def _check_gptq(qc, model, ref):
    assert qc["quant_method"] == "gptq" and qc["bits"] == 4 and qc["checkpoint_format"] == "gptq"
    gs = qc["group_size"]
    for name in ref.meta:
        rows, cols = ref.shape(name)   # [out, in]
        p = name[: -len("weight")]
        assert _part(model, p + "qweight") == ("I32", (cols // 8, rows))
        assert _part(model, p + "qzeros") == ("I32", (cols // gs, rows // 8))
        assert _part(model, p + "scales") == ("F16", (cols // gs, rows))
        st, key = model[p + "g_idx"]
        g = st.values(key)
        assert g.shape == (cols,)
        assert sorted(g.tolist()) == sorted((np.arange(cols) // gs).tolist())   # each group gs columns
        if not qc["desc_act"]:
            assert g.tolist() == (np.arange(cols) // gs).tolist()


def _check_awq(qc, model, ref):
    assert {k: qc[k] for k in ("quant_method", "bits", "version", "zero_point")} == {
        "quant_method": "awq", "bits": 4, "version": "gemm", "zero_point": True}
    gs = qc["group_size"]
    for name in ref.meta:
        rows, cols = ref.shape(name)
        p = name[: -len("weight")]
        assert _part(model, p + "qweight") == ("I32", (cols, rows // 8))   # packed along out, AWQ order
        assert _part(model, p + "qzeros") == ("I32", (cols // gs, rows // 8))
        assert _part(model, p + "scales") == ("F16", (cols // gs, rows))


@pytest.mark.parametrize("root,fixture", CASES, ids=[f"{r.name}-{f}" for r, f in CASES])
def test_fixture_is_self_consistent(root, fixture):
    config, model, ref, native, source = load(root, fixture)
    qc = config["quantization_config"]
    assert ref.meta and set(ref.meta) == set(native.meta) == set(source.meta)
    for name in ref.meta:
        assert ref.dtype(name) == "F32"
        assert native.dtype(name) in ("BF16", "F16") and native.shape(name) == ref.shape(name)
        assert source.shape(name) == ref.shape(name)
        assert np.isfinite(ref.values(name)).all()
    {"compressed-tensors": _check_ct, "fp8": _check_deepseek, "mxfp4": _check_mxfp4, "gptq": _check_gptq,
     "awq": _check_awq}[qc["quant_method"]](qc, model, ref)
