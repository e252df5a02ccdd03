"""Stream transforms between reader and writer: rename (strip a prefix) and cast floating dtypes."""
import json

from .errors import UsageError
from .tensor import Renamed, cast


def strip_prefix(tensors, prefix: str | None, where="the source"):
    """Drop `prefix` from the names that start with it (`model.` is the common case). A prefix
    without its trailing dot takes the dot too: `model` turns `model.w` into `w`, never `.w`.
    UsageError naming `where` (SRC) when two names become one, or one the safetensors format reserves."""
    if not prefix:
        return tensors
    out, seen = [], {}
    for t in tensors:
        cut = prefix if prefix.endswith(".") or not t.name.startswith(prefix + ".") else prefix + "."
        name = t.name[len(cut):] if t.name.startswith(cut) and len(t.name) > len(cut) else t.name
        if name in seen:
            raise UsageError(f"{where}: --strip-prefix {prefix!r} makes {seen[name]!r} and {t.name!r} both {name!r}")
        if name == "__metadata__":
            raise UsageError(f"{where}: --strip-prefix {prefix!r} makes {t.name!r} '__metadata__', a name the "
                             "safetensors format reserves")
        seen[name] = t.name
        out.append(t if name == t.name else t.renamed(name))
    return out


def untie(tensors, same_bytes: bool = True) -> tuple:
    """(tensors, {alias: kept name}): of tensors that are one tensor under two names, the first is kept
    and the others become aliases, as huggingface_hub's save_torch_state_dict writes them;
    from_pretrained ties them back. One tensor is the same source under another name (a reader that
    knows two names are tied: DeepSpeed's shared_params), always; or, with `same_bytes` (config.json
    says tie_word_embeddings), the same bytes of the same file (the embeddings and the output head)."""
    kept, aliases, first = [], {}, {}
    for t in tensors:
        base = t
        while isinstance(base, Renamed):
            base = base.base
        span = t.file_span() if same_bytes else None
        key = ("source", id(base)) if span is None else \
            (id(span[0]), span[1], t.nbytes, t.dtype.code, tuple(t.shape))
        if key in first:
            aliases[t.name] = first[key]
            continue
        first[key] = t.name
        kept.append(t)
    return kept, aliases


def cast_floats(tensors, dtype):
    """Cast floating tensors to `dtype` (a DType), rounding to nearest even; integers are untouched."""
    if dtype is None:
        return tensors
    return [cast(t, dtype) if t.dtype.is_float else t for t in tensors]


TORCH_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def config_with_dtype(config: dict, target, described) -> dict:
    """After --dtype, the carried config.json says the new dtype (`torch_dtype`, and `dtype` as newer
    transformers write it); the edit is recorded as source.config_edits. Other files, and a
    config.json without those keys, are carried unchanged. Returns {file name: new bytes}."""
    new = TORCH_DTYPE_NAMES[target.code]
    keys = [k for k in ("torch_dtype", "dtype") if isinstance(config.get(k), str) and config[k] != new]
    if not keys:
        return {}
    described["config_edits"] = {k: [config[k], new] for k in keys}
    edited = {**config, **{k: new for k in keys}}
    return {"config.json": (json.dumps(edited, indent=2, ensure_ascii=False) + "\n").encode("utf-8")}
