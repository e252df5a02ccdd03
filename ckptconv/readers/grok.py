"""Reader for Grok-1-style pickle shard directories: `ckpt-0/tensor{i:05d}_{h:03d}`.

Each file is a raw numpy pickle of one leaf of the JAX parameter tree (a float32 array, or a
`QuantizedWeight8bit(weight int8, scales bf16)`), run through the allowlisting unpickler with exactly
the globals the real files use. Payloads of 64 KiB and more are BINBYTES outside the pickle frame:
the unpickler hands them back as views of the mapped file, so nothing is copied. Names come from the
flatten order of the tree (no names are stored); several hosts' files are joined along the axis the
Grok-1 partition rules shard over "model". The format: docs/grok-1-format.md.

Files are reached through storage/files.py: in an object store a shard's opcodes are fetched to
parse it (pickle/fetch.py), never its payloads, which its tensors fetch as they are read.
"""
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np

from .base import Reader, ReaderOption, register
from .. import dtypes, signals
from .pickle import unpickler
from ..errors import BadInput, UsageError
from ..storage import files as storage
from .pickle.numpy_globals import NUMPY_OWNED, NumpyArray, numpy_globals, numpy_source
from ..checkpoint import Checkpoint, SourceFacts
from ..tensor import Computed, Concat, cast
from .pickle.fetch import fetch_opcodes
from .pickle.unpickler import StandIn
from . import ReadOptions, confined, first_missing, model_files, source_root, wanted

NAME = "grok"

FILE_RE = re.compile(r"tensor([0-9]{5})_([0-9]{3})")  # ASCII digits: "\d" also matches "٠"
LAYER_PARAMS = ["moe/linear/w", "moe/linear_1/w", "moe/linear_v/w", "multi_head_attention/key/w",
                "multi_head_attention/linear/w", "multi_head_attention/query/w", "multi_head_attention/value/w",
                "rms_norm/scale", "rms_norm_1/scale", "rms_norm_2/scale", "rms_norm_3/scale", "router/w"]
F32, BF16, I8 = np.dtype("<f4"), np.dtype(ml_dtypes.bfloat16), np.dtype("i1")


def tree_names(count: int):
    """Tree paths in jax flatten order for a Grok-1 tree with (count - 2) / 12 layers, else None."""
    if count < 2 or (count - 2) % 12:
        return None
    layers = sorted(f"decoder_layer_{i}" for i in range((count - 2) // 12))  # string order: 0, 1, 10, 11, ...
    names = ["language_model/in_out_embed/embeddings", "language_model/rms_norm/scale"]
    for layer in layers:
        names += [f"transformer/{layer}/{p}" for p in LAYER_PARAMS]
    return names


def model_axis(path: str):
    """The axis Grok-1's partition rules shard over the "model" mesh axis (None: replicated)."""
    rules = [(r".*/in_out_embed/embeddings", 1), (r".*/multi_head_attention/(query|key|value)/w", 1),
             (r".*/multi_head_attention/linear/w", 0), (r".*/moe/(linear|linear_v)/w", 2),
             (r".*/moe/linear_1/w", 1)]
    for pattern, axis in rules:
        if re.fullmatch(pattern, path):
            return axis
    return None


class Quantized:
    """A QuantizedWeight8bit instance: BUILD state must be exactly {weight, scales}."""

    def __init__(self):
        self.weight = self.scales = None

    def build(self, state, ctx):
        if not isinstance(state, dict) or set(state) != {"weight", "scales"}:
            raise ctx.unsafe(f"QuantizedWeight8bit state must be exactly {{weight, scales}}, got "
                             f"{sorted(state) if isinstance(state, dict) else type(state).__name__}")
        if not all(isinstance(v, NumpyArray) for v in state.values()):
            raise ctx.unsafe("QuantizedWeight8bit fields must be numpy arrays")
        self.weight, self.scales = state["weight"], state["scales"]


class _QuantizedClass(StandIn):
    def __init__(self, qualname):
        self.qualname = qualname

    def new(self, args, kwargs, ctx):
        if args or kwargs:
            raise ctx.unsafe(f"{self.qualname} constructed with arguments")
        return Quantized()

    def call(self, args, ctx):
        return self.new(args, None, ctx)


def allowlist(extra=()) -> dict:
    """Exactly the globals the real files (and their re-pickled variants) use."""
    np_all = numpy_globals()
    allow = {k: v for k, v in np_all.items()
             if k in {("numpy", "ndarray"), ("numpy", "dtype"), ("ml_dtypes", "bfloat16")}
             or k[1] in ("_reconstruct", "_frombuffer")}
    allow[("_codecs", "encode")] = unpickler.BENIGN[("_codecs", "encode")]
    allow[("__main__", "QuantizedWeight8bit")] = _QuantizedClass("__main__.QuantizedWeight8bit")
    allow[("model", "QuantizedWeight8bit")] = _QuantizedClass("model.QuantizedWeight8bit")
    return unpickler.allowing(allow, extra, NUMPY_OWNED)


def _shard_dir(path: Path):
    for d in (path, path / "ckpt-0"):
        if d.is_dir() and any(FILE_RE.fullmatch(p.name) for p in d.iterdir()):
            return d
    return None


def detect(path: Path) -> bool:
    return path.is_dir() and _shard_dir(path) is not None


def _inventory(d: Path, root: str) -> dict:
    files = {}
    for p in d.iterdir():
        m = FILE_RE.fullmatch(p.name)
        if m:
            files.setdefault(int(m.group(1)), {})[int(m.group(2))] = confined(p, root)
    count = max(files) + 1   # (numbers from names: looked at only as far as the files go)
    missing = first_missing(files, count)
    if missing is not None:
        raise BadInput(f"{d}: tensor files for index {missing} are missing (expected 0..{count - 1})")
    hosts = len(files[0])
    for i in range(count):
        if sorted(files[i]) != list(range(hosts)):
            raise BadInput(f"{d}: index {i} has host files {sorted(files[i])}, expected 0..{hosts - 1}")
    return files


def _names(count, names_file):
    if names_file:
        try:
            raw = storage.load_json(names_file, "--names file", limit=64 << 20)
        except BadInput as e:
            raise UsageError(str(e)) from None
        names = raw if isinstance(raw, list) else [raw.get(str(i)) for i in range(count)] if isinstance(raw, dict) else None
        if not names or len(names) != count or not all(isinstance(n, str) and n for n in names):
            raise UsageError(f"--names {names_file}: needs {count} names (a list, or an object keyed 0..{count - 1})")
        return names, "names file"
    names = tree_names(count)
    if names is not None:
        return names, f"grok-1 tree order ({(count - 2) // 12} layers)"
    return [f"tensor{i:05d}" for i in range(count)], f"positional: {count} files match no known layout"


def _parse(path: Path, allow):
    m = storage.open_file(path)
    try:
        fetch_opcodes(m)   # (in an object store: the bytes the VM reads, not the payloads)
        obj = unpickler.load(m.view, allow, m.path)
    finally:
        m.release(0, m.size)  # the opcodes around the payloads were read; the payloads are views
    if isinstance(obj, NumpyArray):
        _check_dtype(m, "array", obj, (F32, BF16))
    elif isinstance(obj, Quantized):
        _check_dtype(m, "QuantizedWeight8bit.weight", obj.weight, (I8,))
        _check_dtype(m, "QuantizedWeight8bit.scales", obj.scales, (BF16, F32))
        w, s = obj.weight.array, obj.scales.array
        if s.ndim != w.ndim or w.ndim < 2 or s.shape[-1] != w.shape[-1] or s.shape[:-2] != w.shape[:-2] \
                or s.shape[-2] == 0 or w.shape[-2] % s.shape[-2]:
            raise BadInput(f"{path}: scales {s.shape} do not fit weight {w.shape} (same rank, N kept, K cut "
                           "into groups)")
    else:
        raise BadInput(f"{path}: holds a {type(obj).__name__}, not an array or a QuantizedWeight8bit")
    return m, obj


def _check_dtype(m, what, arr, allowed):
    if not isinstance(arr, NumpyArray) or arr.array is None:
        raise BadInput(f"{m.path}: {what} is not an array with data (its pickle never set its state)")
    if arr.array.dtype.newbyteorder("<") not in allowed:
        raise BadInput(f"{m.path}: {what} has dtype {arr.array.dtype}, expected "
                       f"{' or '.join(str(a) for a in allowed)}")


def load(path: Path, options: ReadOptions) -> Checkpoint:
    d = _shard_dir(path)
    if d is None:
        raise BadInput(f"{path}: no tensor{{i:05d}}_{{h:03d}} files here or in ckpt-0/")
    files = _inventory(d, source_root(path))
    names, naming = _names(len(files), options.get("names"))
    layout, dequantize, joined_on = options.get("layout"), options.get("dequantize"), options.get("host_axis")
    if layout not in (None, "mixtral"):
        raise UsageError(f"--layout {layout!r}: only 'mixtral' is known")
    if layout == "mixtral" and not naming.startswith("grok-1"):
        raise UsageError("--layout mixtral needs the Grok-1 tree layout (2 + 12 x layers files)")
    keep = [i for i in range(len(files)) if layout or wanted(names[i].replace("/", "."), options.only)]
    allow = allowlist(options.allow_globals)
    jobs = [(i, h, files[i][h]) for i in keep for h in sorted(files[i])]
    pool = ThreadPoolExecutor(max(1, options.workers or 2))
    parsed = {}
    try:
        for (i, h, _), tree in zip(jobs, pool.map(lambda j: _parse(j[2], allow), jobs)):
            parsed[i, h] = tree
            signals.check()  # a signal that came while this thread waited (signals.py)
    finally:
        pool.shutdown(cancel_futures=True)  # on a bad file or a signal, the files not yet parsed are not parsed
    hosts = len(files[0])
    if joined_on is not None:
        def host_axis(_name):
            return joined_on
    elif naming.startswith("grok-1"):
        host_axis = model_axis
    else:
        def host_axis(name):
            raise BadInput(f"{d}: {name} has several host files but no known axis to join them on "
                           "(use --host-axis)")
    leaves = {names[i]: _join(names[i], i, [parsed[(i, h)] for h in range(hosts)], host_axis) for i in keep}
    source = SourceFacts(format=NAME, path=str(path), files=len(files) * hosts, dequantize=dequantize or None,
                         more={"hosts": hosts, "names": naming})
    if layout == "mixtral":
        tensors, quant = _mixtral(d, leaves, dequantize or "bf16"), {}
        source.layout = "mixtral"
    else:
        tensors, quant = _tensors(leaves, dequantize)
    tensors = [t for t in tensors if wanted(t.name, options.only)]
    manifest = {"quantization": quant} if quant else {}
    mapped = [m for m, _ in parsed.values()]
    return Checkpoint(tensors, {}, source, model_files(path) if path != d else [], mapped, manifest)


class _Leaf:
    """One tree leaf after joining hosts: `value` source, plus `scales` and `groups` when quantized."""

    def __init__(self, value, scales=None):
        self.value, self.scales = value, scales

    @property
    def groups(self):
        return self.scales.shape[-2] if self.scales is not None else None


def _join(name, index, parts, host_axis):
    """Join the hosts' slices of one leaf along `host_axis(name)` (None: replicated, host 0's copy)."""
    def src(m, arr, suffix=""):
        return numpy_source(name.replace("/", ".") + suffix, arr, m)

    quantized = isinstance(parts[0][1], Quantized)
    m, obj = parts[0]
    if any(isinstance(o, Quantized) != quantized for _, o in parts):
        raise BadInput(f"{m.path}: index {index} ({name}): hosts disagree on whether the tensor is quantized")
    host0 = _Leaf(src(m, obj.weight), src(m, obj.scales)) if quantized else _Leaf(src(m, obj))
    if len(parts) == 1:
        return host0
    axis = host_axis(name)
    ndim = len(host0.value.shape)
    if axis is not None and not 0 <= axis < ndim:
        raise BadInput(f"{m.path}: index {index} ({name}): cannot join the hosts' {ndim}-d slices on axis {axis}")
    if axis is None:  # replicated by the partition rules: every host holds the whole tensor
        shapes = {tuple(o.array.shape) if not quantized else tuple(o.weight.array.shape) for _, o in parts}
        if len(shapes) != 1:
            raise BadInput(f"{m.path}: index {index} ({name}): replicated tensor has different shapes on different "
                           "hosts")
        return host0
    try:
        if not quantized:
            return _Leaf(Concat(name.replace("/", "."), [src(m, o) for m, o in parts], axis))
        weight = Concat(name.replace("/", "."), [src(m, o.weight) for m, o in parts], axis)
        scale_parts = [src(m, o.scales) for m, o in parts]
        if all(s.shape[axis] == 1 for s in scale_parts) and weight.shape[axis] != len(parts):
            scales = scale_parts[0]  # one group along the joined axis: every host holds the same scales
        else:
            cuts = [(o.weight.array.shape[axis], s.shape[axis]) for (_, o), s in zip(parts, scale_parts)]
            if any(w * cuts[0][1] != cuts[0][0] * g for w, g in cuts):  # rows per group, host by host
                raise BadInput(f"hosts cut axis {axis} into quantization groups of different sizes "
                               f"({cuts}: rows, groups)")
            scales = Concat(name.replace("/", ".") + ".scales", scale_parts, axis)
        return _Leaf(weight, scales)
    except BadInput as e:
        raise BadInput(f"{m.path}: index {index} ({name}): host files do not join on axis {axis}: {e}") from None


def dequantized(name, weight, scales, dtype) -> Computed:
    """weight (int8, [..., K, N]) x scales ([..., G, N]) (docs/grok-1-format.md), region by region in f32.

    The float32 product of an int8 and a bf16 is exact; bf16 output rounds it to nearest even, as
    JAX's bf16 multiply does."""
    k, g = weight.shape[-2], scales.shape[-2]
    rows = k // g

    def compute(index):
        w = weight.region(index).astype(np.float32)
        kr = index[-2]
        groups = np.arange(kr.start, kr.stop) // rows
        sc_index = index[:-2] + (slice(0, g), index[-1])
        sc = scales.region(sc_index).astype(np.float32)
        return (w * np.take(sc, groups, axis=-2)).astype(dtype.numpy)

    return Computed(name, dtype, weight.shape, compute, (weight, scales))


def _tensors(leaves, dequantize):
    tensors, quant = [], {}
    target = {"bf16": dtypes.BY_CODE["BF16"], "f32": dtypes.BY_CODE["F32"], None: None}[dequantize]
    for path, leaf in leaves.items():
        name = path.replace("/", ".")
        if leaf.scales is None:
            value = leaf.value.renamed(name)
            tensors.append(value if target is None else cast(value, target))
        elif target is None:
            tensors += [leaf.value.renamed(name + ".weight"), leaf.scales.renamed(name + ".scales")]
            quant[name] = {"scheme": "int8 weight x scales, K axis cut into groups", "weight": name + ".weight",
                           "scales": name + ".scales", "groups": leaf.groups,
                           "formula": "(weight.reshape(*lead, G, K // G, N) * scales[..., :, None, :])"
                                      ".reshape(*lead, K, N)"}
        else:
            tensors.append(dequantized(name, leaf.value, leaf.scales, target))
    return tensors, quant


_MIXTRAL_NORMS = {"rms_norm": "input_layernorm", "rms_norm_1": "post_attention_layernorm",
                  "rms_norm_2": "pre_moe_layernorm", "rms_norm_3": "post_moe_layernorm"}
_MIXTRAL_ATTN = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "linear": "o_proj"}
_MIXTRAL_EXPERT = {"linear": "w1", "linear_1": "w2", "linear_v": "w3"}


def transposed(name, src) -> Computed:
    """The 2-D transpose of `src` ([in, out] -> torch's [out, in]), gathered region by region."""
    return Computed(name, src.dtype, src.shape[::-1], lambda index: src.region(index[::-1]).T, (src,))


def expert(src, e, name) -> Computed:
    """Expert `e` of an [E, ...] tensor, as a tensor of one rank less."""
    return Computed(name, src.dtype, src.shape[1:], lambda index: src.region((slice(e, e + 1),) + index)[0], (src,))


def _mixtral(d, leaves, dequantize):
    """The `--layout mixtral` table of docs/grok-1-format.md: dense, 2-D weights as [out, in], experts split."""
    dtype = {"bf16": dtypes.BY_CODE["BF16"], "f32": dtypes.BY_CODE["F32"]}[dequantize]
    out = []
    for path, leaf in leaves.items():
        dense = leaf.value if leaf.scales is None else dequantized(path, leaf.value, leaf.scales, dtype)
        dense = cast(dense, dtype)
        if path == "language_model/in_out_embed/embeddings":
            out.append(dense.renamed("model.embed_tokens.weight"))
            continue
        if path == "language_model/rms_norm/scale":
            out.append(dense.renamed("model.norm.weight"))
            continue
        m = re.fullmatch(r"transformer/decoder_layer_(\d+)/(.+)", path)
        layer, rest = m.group(1), m.group(2)
        p = f"model.layers.{layer}."
        if rest.endswith("/scale"):
            out.append(dense.renamed(p + _MIXTRAL_NORMS[rest.split("/")[0]] + ".weight"))
        elif rest.startswith("multi_head_attention/"):
            proj = _MIXTRAL_ATTN[rest.split("/")[1]]
            out.append(transposed(p + f"self_attn.{proj}.weight", dense))
        elif rest == "router/w":
            out.append(transposed(p + "block_sparse_moe.gate.weight", dense))
        elif rest.startswith("moe/"):
            w = _MIXTRAL_EXPERT[rest.split("/")[1]]
            if len(dense.shape) != 3 or not 0 < dense.shape[0] <= max(1, dense.nbytes):
                raise BadInput(f"{d}: {path}: expert weights of shape {list(dense.shape)} cannot be split into "
                               "experts (needs [experts, in, out] holding data)")
            for e in range(dense.shape[0]):
                name = p + f"block_sparse_moe.experts.{e}.{w}.weight"
                out.append(transposed(name, expert(dense, e, name)))
        else:
            raise BadInput(f"{d}: {path}: no Mixtral-style name for this tree path")
    return out


OPTIONS = (
    ReaderOption("--names", "names", "Grok-style directories: JSON list (or {index: name}) naming the tensor files.",
                 path=True),
    ReaderOption("--dequantize", "dequantize", "Grok-style int8 weights: write one dense tensor (bf16 rounds to "
                 "nearest even).", choices=("bf16", "f32")),
    ReaderOption("--layout", "layout", "Grok-style directories: export under Mixtral-style names, dense, [out, in].",
                 choices=("mixtral",)),
    ReaderOption("--host-axis", "host_axis", "Axis to join several hosts' files on, for unknown layouts.", type=int),
)
READER = register(Reader(NAME, "Grok-1-style pickle shard directories (ckpt-0/tensor00000_000 ...)",
                         detect, load, priority=50, parses_pickles=True, options=OPTIONS,
                         fuzz=(("ckpt-0/tensor00000_000", None),),
                         looks_for="a directory of tensorNNNNN_HHH pickle shards, or one holding ckpt-0/"))
