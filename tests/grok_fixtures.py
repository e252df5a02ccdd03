"""A generator of small Grok-1-style checkpoint directories, pickled the way the real files were.

The real files were written by numpy 1.x's default pickler (protocol 4): `numpy.core.multiarray.
_reconstruct` + BUILD for arrays, `__main__.QuantizedWeight8bit` (a dataclass) for int8 weights with
bf16 scales, payloads of 64 KiB and more as BINBYTES outside the frame. Under numpy 2 we produce the
same bytes by pickling with the numpy-1 module name for `_reconstruct` (the reduce is otherwise
identical); `numpy2=True` keeps numpy 2's own spelling.
"""
import contextlib
import dataclasses
import io
import pickle
import sys
import types
from pathlib import Path

import ml_dtypes
import numpy as np

from ckptconv.readers.grok import tree_names


@dataclasses.dataclass
class QuantizedWeight8bit:
    weight: np.ndarray
    scales: np.ndarray


QuantizedWeight8bit.__module__ = "__main__"


@contextlib.contextmanager
def _main_class():
    main = sys.modules["__main__"]
    had = getattr(main, "QuantizedWeight8bit", None)
    main.QuantizedWeight8bit = QuantizedWeight8bit
    try:
        yield
    finally:
        if had is None:
            del main.QuantizedWeight8bit
        else:
            main.QuantizedWeight8bit = had


@contextlib.contextmanager
def _numpy1_spelling():
    """Make pickle spell `numpy._core.multiarray._reconstruct` as numpy 1.x did."""
    real = np._core.multiarray._reconstruct

    def _reconstruct(*args):
        return real(*args)

    _reconstruct.__module__, _reconstruct.__qualname__ = "numpy.core.multiarray", "_reconstruct"
    fake = types.ModuleType("numpy.core.multiarray")
    fake._reconstruct = _reconstruct
    saved = sys.modules.get("numpy.core.multiarray")
    sys.modules["numpy.core.multiarray"] = fake
    try:
        yield _reconstruct
    finally:
        if saved is None:
            del sys.modules["numpy.core.multiarray"]
        else:
            sys.modules["numpy.core.multiarray"] = saved


class _Numpy1Pickler(pickle.Pickler):
    reconstruct = None

    def reducer_override(self, obj):
        if type(obj) is np.ndarray:
            _fn, args, state = obj.__reduce__()
            return self.reconstruct, args, state
        return NotImplemented


def dumps(obj, protocol=4, numpy2=False) -> bytes:
    buf = io.BytesIO()
    with _main_class():
        if numpy2 or protocol >= 5:
            pickle.dump(obj, buf, protocol=protocol)
        else:
            with _numpy1_spelling() as reconstruct:
                p = _Numpy1Pickler(buf, protocol=protocol)
                p.reconstruct = reconstruct
                p.dump(obj)
    return buf.getvalue()


@dataclasses.dataclass
class Dims:
    vocab: int = 512
    emb: int = 64
    q_heads: int = 4
    kv_heads: int = 2
    head: int = 32
    ffn: int = 256
    experts: int = 4


def make_params(layers=12, dims=Dims(), seed=0) -> dict:
    """{tree path: np.ndarray or QuantizedWeight8bit}, shaped like Grok-1's leaves."""
    rng = np.random.default_rng(seed)
    d = dims
    q, kv = d.q_heads * d.head, d.kv_heads * d.head

    def f32(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    def quant(shape, groups):
        weight = rng.integers(-128, 128, size=shape, dtype=np.int8)
        sshape = shape[:-2] + (groups, shape[-1])
        scales = (rng.random(sshape, dtype=np.float32) * 0.02 + 0.001).astype(ml_dtypes.bfloat16)
        return QuantizedWeight8bit(weight, scales)

    shapes = {
        "moe/linear/w": ((d.experts, d.emb, d.ffn), 1), "moe/linear_1/w": ((d.experts, d.ffn, d.emb), 8),
        "moe/linear_v/w": ((d.experts, d.emb, d.ffn), 1), "multi_head_attention/key/w": ((d.emb, kv), 1),
        "multi_head_attention/linear/w": ((q, d.emb), 8), "multi_head_attention/query/w": ((d.emb, q), 1),
        "multi_head_attention/value/w": ((d.emb, kv), 1),
    }
    params = {}
    for path in tree_names(2 + 12 * layers):
        if path.endswith("embeddings"):
            params[path] = f32(d.vocab, d.emb)
        elif path.endswith("/scale"):
            params[path] = f32(d.emb)
        elif path.endswith("router/w"):
            params[path] = f32(d.emb, d.experts)
        else:
            shape, groups = shapes[path.split("/", 2)[2]]
            params[path] = quant(shape, groups)
    return params


def write_dir(d: Path, params: dict, protocol=4, numpy2=False, hosts=1, axes=None):
    """Write `ckpt-0/tensor{i:05d}_{h:03d}` files; with hosts > 1 each holds its slice along axes[path]."""
    out = Path(d) / "ckpt-0"
    out.mkdir(parents=True, exist_ok=True)
    for i, (path, value) in enumerate(params.items()):
        for h in range(hosts):
            part = value if hosts == 1 else _host_slice(value, h, hosts, axes(path))
            (out / f"tensor{i:05d}_{h:03d}").write_bytes(dumps(part, protocol, numpy2))
    return out


def _host_slice(value, h, hosts, axis):
    if axis is None:
        return value

    def cut(a):
        n = a.shape[axis] // hosts
        return np.ascontiguousarray(np.take(a, range(h * n, (h + 1) * n), axis=axis))

    if isinstance(value, QuantizedWeight8bit):
        scales = value.scales if value.scales.shape[axis] == 1 else cut(value.scales)
        return QuantizedWeight8bit(cut(value.weight), scales)
    return cut(value)


def dequantize_ref(q: QuantizedWeight8bit, dtype) -> np.ndarray:
    """docs/grok-1-format.md's formula, straight."""
    w, s = q.weight, q.scales
    *lead, k, n = w.shape
    g = s.shape[-2]
    full = (w.reshape(*lead, g, k // g, n).astype(np.float32) * s.astype(np.float32)[..., :, None, :])
    return full.reshape(*lead, k, n).astype(dtype)
