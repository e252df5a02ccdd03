"""Property tests: random and mutated inputs to the unpickler, the zip parser and the safetensors
header parser only ever raise the project's own error (never another exception, never a hang).
The long coverage-guided run is `make fuzz` (atheris, fuzz/fuzz_parsers.py)."""
import io
import os
from pathlib import Path
import pickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.fuzz_parsers import parse_any
import ml_dtypes

from tests.fixtures import attacks, grok as grok_fixtures

# 100 examples of each kind in make test, 300 in make test-slow (the long coverage-guided run is make fuzz)
EXAMPLES = int(os.environ.get("CKPTCONV_FUZZ_EXAMPLES", "100"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=2000, suppress_health_check=list(HealthCheck), derandomize=True)


def _torch_bytes():
    buf = io.BytesIO()
    torch.save({"w": torch.arange(6.0).reshape(2, 3).t(), "n": {"step": 3, "lr": 0.1}}, buf)
    return buf.getvalue()


def _npz_bytes():
    """np.save'd arrays in a zip, one member stored and one deflated (np.savez, np.savez_compressed)."""
    import zipfile
    members = {}
    for name, array in (("a", np.arange(6, dtype=">f4").reshape(2, 3)), ("b", np.asfortranarray(np.eye(3)))):
        buf = io.BytesIO()
        np.save(buf, array)
        members[name] = buf.getvalue()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("a.npy", members["a"], zipfile.ZIP_STORED)
        z.writestr("b.npy", members["b"], zipfile.ZIP_DEFLATED)
    return out.getvalue()


def _safetensors_bytes():
    from safetensors.numpy import save
    return save({"a": np.arange(6, dtype=np.float32), "b": np.ones((2, 2), np.int8)})


SEEDS = {
    # issue 12's hostile pickles (tests/test_trust.py), small enough to mutate quickly
    "deep-tuple-key": b"\x80\x02}N" + b"\x85" * 1000 + b"K\x01s.",
    "shared-tuples": b"\x80\x02}X\x01\x00\x00\x00aN" + b"2\x86" * 64 + b"s.",
    "forged-newline": b"\x80\x04\x8c\x1aos\nwrote out/: 4 tensors x\x8c\x06system\x93.",
    "pickle": pickle.dumps({"a": [1, 2.5, "x", b"y", (None, True)], "b": {1, 2}}, protocol=4),
    "torch-zip": _torch_bytes(),
    "safetensors": _safetensors_bytes(),
    "npz": _npz_bytes(),
    "torch-legacy": attacks.torch_legacy(pickle.dumps({"x": 1.5, "y": [1, 2]}, protocol=2)),
    # an OCDBT manifest of a real tensorstore store (parse_any puts it where readers/ocdbt.py reads it)
    "ocdbt-manifest": (Path(__file__).parent.parent / "fixtures" / "data" / "ocdbt" / "small" / "manifest.ocdbt").read_bytes(),
    "grok": grok_fixtures.dumps(grok_fixtures.QuantizedWeight8bit(np.ones((4, 4), np.int8),
                                                                  np.ones((1, 4), ml_dtypes.bfloat16))),
}


@st.composite
def mutated(draw, seed: bytes):
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 8))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "overwrite"]))
        i = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[i:i + draw(st.integers(1, 64))]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        else:
            n = draw(st.sampled_from([1, 4, 8]))
            data[i:i + n] = draw(st.sampled_from([b"\xff" * n, b"\x00" * n, b"\x7f" + b"\xff" * (n - 1)]))
    return bytes(data)


@pytest.mark.parametrize("kind", sorted(SEEDS))
@SETTINGS
@given(data=st.data())
def test_mutated_inputs_only_raise_clean_errors(kind, data):
    parse_any(data.draw(mutated(SEEDS[kind])))


@SETTINGS
@given(st.binary(max_size=512))
def test_random_bytes_only_raise_clean_errors(blob):
    parse_any(blob)


def test_claimed_sizes_are_not_allocated():
    """Inputs that claim huge sizes are refused without allocating what they claim."""
    import tracemalloc
    from ckptconv.readers.pickle import unpickler
    from ckptconv.readers import ziparchive
    from ckptconv.errors import BadInput
    from ckptconv.io.mapped import MemoryFile
    zdata = bytearray(SEEDS["torch-zip"])
    cd = zdata.rfind(b"PK\x05\x06")
    zdata[cd + 10:cd + 12] = b"\xff\xfe"  # entry count far beyond what the directory holds
    claims = [
        lambda: unpickler.load(b"\x80\x04\x8e" + (2**63).to_bytes(8, "little") + b".", {}, "<8 EiB bytes>"),
        lambda: unpickler.load(b"\x80\x02\x8b" + (2**31 - 1).to_bytes(4, "little") + b".", {}, "<2 GiB long>"),
        lambda: unpickler.load(b"\x80\x04\x8d" + (2**40).to_bytes(8, "little") + b".", {}, "<1 TiB string>"),
        lambda: ziparchive.read_entries(MemoryFile(bytes(zdata), "<65534 entries>")),
    ]
    for claim in claims:
        tracemalloc.start()
        with pytest.raises(BadInput):
            claim()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 1 << 20, peak


JSON_SEEDS = [b'{"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, "__metadata__": {"k": "v\\"}"}, '
              b'"b\\u00e9": [1, 2.5e3, true, null, "x"], "c": {}}',
              b'{"a": {"x": 1, "x": 2}, "c": {"y": [1], "z": 2}, "a": 3, "d": "e"}']   # (repeated keys)


@pytest.mark.parametrize("seed", JSON_SEEDS)
@SETTINGS
@given(data=st.data())
def test_json_member_stream_agrees_with_the_whole_parse(seed, data):
    """safejson.members (a safetensors header read member by member) accepts exactly what loads
    accepts, gives the same members, and fails with the same message."""
    from ckptconv import safejson
    from ckptconv.errors import BadInput
    text = data.draw(mutated(seed))
    try:
        whole = safejson.loads(text, "f", "doc")
    except BadInput as e:
        whole = e
    for nested in (None, "a", "c"):   # and with a member's object streamed too (a manifest's "tensors")
        try:
            streamed = {k: dict(v) if isinstance(v, safejson.Members) else v
                        for k, v in safejson.members(text, "f", "doc", nested)}
        except BadInput as e:
            streamed = e
        if isinstance(whole, BadInput):
            assert isinstance(streamed, BadInput) and str(streamed) == str(whole)
        elif isinstance(whole, dict):
            assert streamed == whole
        else:
            assert str(streamed) == "f: doc is not a JSON object"
    for nested in ("a", "c"):   # the caller keeping the nested keys (read_manifest): the same outcome
        kept = {}
        try:
            streamed = {}
            for k, v in safejson.members(text, "f", "doc", nested, nested_keys=kept):
                if isinstance(v, safejson.Members):
                    for kk, vv in v:
                        kept[kk] = vv
                    v = dict(kept)
                streamed[k] = v
        except BadInput as e:
            streamed = e
        if isinstance(whole, BadInput):
            assert isinstance(streamed, BadInput) and str(streamed) == str(whole)
        elif isinstance(whole, dict):
            assert streamed == whole


@pytest.mark.parametrize("seed", JSON_SEEDS + [b'[[{"a": "[{\\"}"}, [[]]], {"b": [[[1]]]}]'])
@SETTINGS
@given(data=st.data(), piece=st.integers(1, 9))
def test_nesting_measured_piece_by_piece_is_that_of_the_whole_text(seed, data, piece):
    """safejson.depth carries the quotes' parity and the depth from piece to piece: any piece size
    gives what one piece of the whole text gives, for bytes and for text, and for valid JSON the real
    nesting."""
    import json
    from ckptconv import safejson
    blob = data.draw(mutated(seed))
    whole = safejson.depth(blob, piece=len(blob) + 1)
    assert safejson.depth(blob, piece=piece) == whole
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError:
        return
    assert safejson.depth(text, piece=piece) == whole

    def nesting(v):
        return 1 + max((nesting(x) for x in v), default=0) if isinstance(v, list) else 0
    try:   # (objects as lists of their values: a repeated key's first value counts too)
        parsed = json.loads(text, object_pairs_hook=lambda pairs: [v for _, v in pairs])
    except (ValueError, RecursionError):
        return
    assert whole == nesting(parsed)


def test_every_reader_is_fuzzed():
    """parse_any reaches every registered reader through the minimal source it declares (Reader.fuzz):
    a reader added without one would face untrusted bytes unfuzzed."""
    from ckptconv.readers import readers
    assert [r.name for r in readers().values() if not r.fuzz] == []
    for r in readers().values():
        assert sum(fixed is None for _, fixed in r.fuzz) >= 1, r.name
