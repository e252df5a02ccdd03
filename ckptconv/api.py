"""The Python API: the commands as functions with keyword options, typed results and the
project's exceptions (docs/api.md). The command line is a thin layer over the same functions.

    import ckptconv
    result = ckptconv.convert("model.ckpt", "model.safetensors", dtype="bf16")
    report = ckptconv.verify("model.safetensors", against="model.ckpt")
    assert report.ok
"""
import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from .jobs import convert as _convert, reshard as _reshard, verify as _verify
from . import requests
from .run import executors as _executors
from .layouts import target_choices
from .errors import BadInput, UsageError, brief, printable
from .readers import Source, open_source
from .readers.wrappers import TrainingParts
from .rowview import RowView

ConvertResult, ReshardResult, Report, Problem = _convert.ConvertResult, _reshard.ReshardResult, _verify.Report, _verify.Problem

from .storage.urls import StorageOptions

__all__ = ["convert", "reshard", "verify", "inspect", "Inspection", "ConvertResult", "ReshardResult", "Report",
           "StorageOptions"]


def _progress(value, what="progress"):
    if value is not None and not callable(value):
        raise UsageError(f"{what}: expected a callable or None, not {type(value).__name__}")
    return value


def _ours(fn):
    """Only CkptError leaves the API: an OSError from the system (a name too long, a disk that
    fails) becomes a BadInput naming the file, as the command line says it."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OSError as e:
            raise BadInput(f"{printable(e.filename or '', 300)}: {e.strerror or e}".lstrip(": ")) from None
    return wrapper


def _source(src, format, only, allow_globals, state_dict, skip_unsupported, workers, reader_options,
            max_extra_size="256MB", one_shard=False, storage=None) -> Source:
    return requests.source(src, format, requests.read_options(
        only=only, allow_globals=allow_globals, state_dict=state_dict, skip_unsupported=skip_unsupported,
        workers=workers, reader_options=reader_options, max_extra_size=max_extra_size, one_shard=one_shard,
        storage=storage))


@_ours
def convert(src, out, *, format=None, only=(), strip_prefix=None, dtype="keep", state_dict="auto",
            allow_globals=(), skip_unsupported=False, max_shard_size="5GB", name=None, overwrite=False,
            resume=False, fsync=False, buffered_io=False, copy_extras=True, with_files=(), workers=None,
            reader_options=None, max_extra_size="256MB", one_shard=False, max_extras="1MB",
            progress=None, ray=None, ray_runtime_env=None, storage=None) -> _convert.ConvertResult:
    """`ckptconv convert SRC OUT` (docs/convert.md): OUT ending in .safetensors is one file, anything
    else a sharded directory. `reader_options` are the options a reader declares ({"dequantize":
    "bf16"} for Grok-1 directories); `progress(total_bytes)` may return a context manager yielding
    an update(nbytes) callable. `workers`: tasks in flight on this host (--workers); `ray`: the tasks
    on a Ray cluster instead (--ray: an address, or True for RAY_ADDRESS, else auto), with
    `ray_runtime_env` (--ray-runtime-env: Ray's runtime_env, a dict) for its tasks. `storage`: how
    to reach an object store, a StorageOptions or a dict of its fields ({"endpoint_url": ...};
    --endpoint-url, --concurrency, --part-size, --retries, --stall-timeout). Raises CkptError
    (BadInput, UsageError, OutputError)."""
    options = _convert.ConvertOptions(requests.optional_text(strip_prefix, "strip_prefix"),
                                      requests.choice(dtype, requests.DTYPES, "dtype"),
                                      requests.flag(copy_extras, "copy_extras"), requests.paths(with_files, "with_files"))
    return _convert.convert(_source(src, format, only, allow_globals, state_dict, skip_unsupported, workers,
                                    reader_options, max_extra_size, one_shard, storage),
                            requests.path(out, "out"), options,
                            requests.write_options(max_shard_size=max_shard_size, name=name, overwrite=overwrite,
                                                   fsync=fsync, buffered_io=buffered_io, resume=resume,
                                                   max_extras=max_extras, storage=storage),
                            progress=_progress(progress), executor=_executors.chosen(ray, workers, ray_runtime_env))


@_ours
def reshard(src, out, tp, *, ep=1, preset=None, rules=None, heads=None, kv_heads=None, head_dim=None,
            pad_vocab=False, dry_run=False, format=None, only=(), strip_prefix=None, state_dict="auto",
            allow_globals=(), skip_unsupported=False, max_shard_size="5GB", name=None, overwrite=False,
            fsync=False, buffered_io=False, workers=None, reader_options=None, max_extra_size="256MB", progress=None,
            target="mesh",
            dtype="keep", allow_replicate=(), with_files=(), one_shard=False, max_extras="1MB",
            ray=None, ray_runtime_env=None, storage=None) -> _reshard.ReshardResult:
    """`ckptconv reshard SRC OUT --tp N` (docs/reshard.md); with `dry_run`, the plan only (OUT may
    be None). `target="vllm"`: vLLM's pre-sharded layout as well. `workers`, `ray`, `ray_runtime_env`,
    `storage` as for convert."""
    mesh = requests.mesh(tp=tp, ep=ep, preset=preset, rules=rules, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                         pad_vocab=pad_vocab, allow_replicate=allow_replicate)
    return _reshard.reshard(_source(src, format, only, allow_globals, state_dict, skip_unsupported, workers,
                                    reader_options, max_extra_size, one_shard, storage),
                            None if out is None else requests.path(out, "out"), mesh,
                            _reshard.ReshardOptions(requests.optional_text(strip_prefix, "strip_prefix"),
                                                    requests.choice(target, tuple(target_choices()), "target"),
                                                    requests.choice(dtype, requests.DTYPES, "dtype"),
                                                    requests.paths(with_files, "with_files")),
                            requests.write_options(max_shard_size=max_shard_size, name=name, overwrite=overwrite,
                                                   fsync=fsync, buffered_io=buffered_io, max_extras=max_extras,
                                                   storage=storage),
                            requests.flag(dry_run, "dry_run"), progress=_progress(progress),
                            executor=_executors.chosen(ray, workers, ray_runtime_env))


@_ours
def verify(path, against=None, *, device=None, allow_fewer_devices=False, format=None, allow_globals=(),
           state_dict="auto", workers=None, reader_options=None, max_extra_size="256MB", progress=None,
           expect=None, ray=None, ray_runtime_env=None, storage=None) -> _verify.Report:
    """`ckptconv verify PATH [--against SRC] [--device ...]` (docs/verify.md). The report lists every
    problem (`report.problems`: `Problem`s with a kind, file, tensor and detail; `str()` of one is the
    line the command prints); `report.ok` is True when there is none.
    `progress(nbytes)` is called as bytes are hashed. `expect`: the output's identity as convert or
    reshard printed it (`sha256:…`): the output must be exactly that one. `workers`: shares of the
    checks in flight on this host (and --against's parse threads); `ray`: the shares on a Ray
    cluster instead, with `ray_runtime_env`, as for convert; `storage` as for convert (PATH's and
    SRC's store)."""
    read = _source(path, format, (), allow_globals, state_dict, False, workers, reader_options, max_extra_size,
                   storage=storage).options
    if device is not None:
        requests.choice(device, requests.DEVICES, "device")
    return _verify.verify(_verify.VerifyRequest(
        requests.path(path, "path"), None if against is None else requests.path(against, "against"), read, format,
        device, requests.flag(allow_fewer_devices, "allow_fewer_devices"), expected_identity(expect)),
        _progress(progress), executor=_executors.chosen(ray, workers, ray_runtime_env))


def expected_identity(value) -> str | None:
    """`sha256:HEX` from `--expect` (that, or the 64 hex digits alone); UsageError otherwise."""
    if value is None:
        return None
    text = value.lower().removeprefix("sha256:") if isinstance(value, str) else ""
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise UsageError(f"--expect {brief(value, 80)}: expected an identity as convert prints it, sha256: and 64 "
                         "hex digits")
    return "sha256:" + text


@dataclass
class Inspection:
    """What `ckptconv inspect` shows: the reader, every tensor, dtypes, extras and files."""

    path: str
    format: str
    tensors: Sequence              # {"name", "dtype", "shape", "bytes"} in source order (made when read)
    total_bytes: int
    dtypes: dict                   # dtype code -> bytes
    extras: dict
    source: dict                   # what the manifest would record as "source"
    model_files: list = field(default_factory=list)
    skipped_files: list = field(default_factory=list)
    also: list = field(default_factory=list)
    layout: TrainingParts | None = None   # a training checkpoint's parts and which convert writes (readers/wrappers.py)
    placeholders: list = field(default_factory=list)   # classes on no allowlist, recorded as inert data
    components: list = field(default_factory=list)     # a diffusers pipeline's: {"name", "library", "class",
                                                       # "format" (None: no weights), "variant", "tensor_count",
                                                       # "bytes", "files" (carried)}


def _tensor_row(fact) -> dict:
    name, dtype, shape, nbytes = fact
    return {"name": name, "dtype": dtype, "shape": list(shape), "bytes": nbytes}


@_ours
def inspect(path, *, format=None, only=(), allow_globals=(), state_dict="auto", skip_unsupported=False, workers=None,
            reader_options=None, max_extra_size="256MB", one_shard=False, storage=None) -> Inspection:
    """`ckptconv inspect PATH` (docs/inspect.md): reads headers and pickles, never tensor data;
    `storage` as for convert."""
    return inspection(_source(path, format, only, allow_globals, state_dict, skip_unsupported, workers,
                              reader_options, max_extra_size, one_shard, storage))


@_ours
def inspection(source: Source) -> Inspection:
    """inspect of a typed request (the command line's: its options are built once, requests.py)."""
    ckpt = open_source(source)
    path = source.path
    hist = Counter()
    for t in ckpt.tensors:
        hist[t.dtype.code] += t.nbytes
    # the rows come from plain facts, not from the sources: a result kept must not keep files mapped
    facts = [(t.name, t.dtype.code, t.shape, t.nbytes) for t in ckpt.tensors]
    return Inspection(str(path), ckpt.format, RowView(facts, _tensor_row),
                      ckpt.total_bytes, dict(sorted(hist.items())), ckpt.extras, ckpt.source.to_json(),
                      [rel for rel, _ in ckpt.out_files()[0]], ckpt.skipped_files, ckpt.also, ckpt.layout,
                      ckpt.source.placeholders, [_component(p) for p in ckpt.parts])


def _component(part) -> dict:
    """A part of a source made of parts (a diffusers pipeline's component), as inspect shows it."""
    weights = part.ckpt
    return {"name": part.name, "library": part.facts.get("library"), "class": part.facts.get("class"),
            "format": weights.format if weights else None, "variant": part.variant,
            "tensor_count": len(weights.tensors) if weights else 0, "bytes": weights.total_bytes if weights else 0,
            "files": [rel for rel, _ in part.files]}
