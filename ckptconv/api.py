"""The Python API: the commands as functions with keyword options, typed results and the
project's exceptions (docs/api.md). The command line is a thin layer over the same functions.

    import ckptconv
    result = ckptconv.convert("model.ckpt", "model.safetensors", dtype="bf16")
    report = ckptconv.verify("model.safetensors", against="model.ckpt")
    assert report.ok
"""
import functools
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from . import convert as _convert, reshard as _reshard, verify as _verify
from .dtypes import CAST_TARGETS
from .errors import BadInput, UsageError, brief, printable
from .formats.manifest import stem_problem
from .readers import ReadOptions, Source, open_source
from .readers.wrappers import Layout
from .rowview import RowView
from .sizes import parse_size
from .tp.presets import MeshSpec
from .writers.base import WriteOptions

ConvertResult, ReshardResult, Report, Problem = _convert.ConvertResult, _reshard.ReshardResult, _verify.Report, _verify.Problem

__all__ = ["convert", "reshard", "verify", "inspect", "Inspection", "ConvertResult", "ReshardResult", "Report"]


def _texts(value, what) -> list:
    """A list of strings from one string or an iterable of them (a lone string is one item, not its
    characters)."""
    items = [value] if isinstance(value, str) else value
    try:
        items = list(items)
    except TypeError:
        raise UsageError(f"{what}: expected a string or a list of strings, not {type(value).__name__}") from None
    if not all(isinstance(i, str) for i in items):
        raise UsageError(f"{what}: expected strings, got {[type(i).__name__ for i in items][:4]}")
    return items


def _flag(value, what) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"{what}: expected True or False, not {value!r}")
    return value


def _path(value, what) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise UsageError(f"{what}: expected a path, not {type(value).__name__}")
    path = os.fspath(value)
    if not isinstance(path, str) or "\0" in path:
        raise UsageError(f"{what}: {brief(path, 100)} is not a path (a NUL byte, or bytes)")
    return path


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


def _paths(value, what) -> tuple:
    """Paths from one path or an iterable of them (a lone path is one item)."""
    items = [value] if isinstance(value, (str, os.PathLike)) else value
    try:
        return tuple(_path(v, what) for v in items)
    except TypeError:
        raise UsageError(f"{what}: expected a path or a list of paths, not {type(value).__name__}") from None


def _source(src, format, only, allow_globals, state_dict, skip_unsupported, workers, reader_options,
            max_extra_size="256MB") -> Source:
    if not isinstance(state_dict, str) or (format is not None and not isinstance(format, str)):
        raise UsageError("state_dict and format are strings")
    if not isinstance(reader_options, (dict, type(None))):
        raise UsageError(f"reader_options: expected a dict, not {type(reader_options).__name__}")
    if type(workers) is not int or not 1 <= workers <= 64:
        raise UsageError(f"workers: expected a number from 1 to 64, not {workers!r}")
    return Source(_path(src, "src"), format, ReadOptions(
        allow_globals=_texts(allow_globals, "allow_globals"), skip_unsupported=_flag(skip_unsupported,
                                                                                     "skip_unsupported"),
        only=_texts(only, "only"), workers=workers, state_dict=state_dict, declared=dict(reader_options or {}),
        max_extra_size=_size(max_extra_size, "max_extra_size")))


def _size(value, what) -> int:
    if isinstance(value, str):
        return parse_size(value)
    if type(value) is int and value > 0:
        return value
    raise UsageError(f"{what}: expected a positive number of bytes or a size like '5GB', not {brief(value, 40)}")


def _write(max_shard_size, name, overwrite, fsync, buffered_io, resume=False) -> WriteOptions:
    if isinstance(max_shard_size, str):
        size = parse_size(max_shard_size)
    elif type(max_shard_size) is int and max_shard_size > 0:
        size = max_shard_size
    else:
        raise UsageError(f"max_shard_size: expected a positive number of bytes or a size like '5GB', not "
                         f"{max_shard_size!r}")
    problem = None if name is None else stem_problem(name) if isinstance(name, str) else "must be a string or None"
    if problem:
        raise UsageError(f"name {name!r}: {problem}")
    return WriteOptions(size, _flag(fsync, "fsync"), not _flag(buffered_io, "buffered_io"),
                        _flag(overwrite, "overwrite"), _flag(resume, "resume"), name)


@_ours
def convert(src, out, *, format=None, only=(), strip_prefix=None, dtype="keep", state_dict="auto",
            allow_globals=(), skip_unsupported=False, max_shard_size="5GB", name=None, overwrite=False,
            resume=False, fsync=False, buffered_io=False, copy_extras=True, with_files=(), workers=2,
            reader_options=None, max_extra_size="256MB", progress=None) -> _convert.ConvertResult:
    """`ckptconv convert SRC OUT` (docs/convert.md): OUT ending in .safetensors is one file, anything
    else a sharded directory. `reader_options` are the options a reader declares ({"dequantize":
    "bf16"} for Grok-1 directories); `progress(total_bytes)` may return a context manager yielding
    an update(nbytes) callable. Raises CkptError (BadInput, UsageError, OutputError)."""
    if dtype not in ("keep", *CAST_TARGETS) or (strip_prefix is not None and not isinstance(strip_prefix, str)):
        raise UsageError(f"dtype is one of keep, {', '.join(CAST_TARGETS)}; strip_prefix a string")
    return _convert.convert(_source(src, format, only, allow_globals, state_dict, skip_unsupported, workers,
                                    reader_options, max_extra_size),
                            _path(out, "out"), _convert.ConvertOptions(strip_prefix, dtype, _flag(copy_extras,
                                                                                                  "copy_extras"),
                                                                       _paths(with_files, "with_files")),
                            _write(max_shard_size, name, overwrite, fsync, buffered_io, resume),
                            progress=_progress(progress))


@_ours
def reshard(src, out, tp, *, ep=1, preset=None, rules=None, heads=None, kv_heads=None, head_dim=None,
            pad_vocab=False, dry_run=False, format=None, only=(), strip_prefix=None, state_dict="auto",
            allow_globals=(), skip_unsupported=False, max_shard_size="5GB", name=None, overwrite=False,
            fsync=False, buffered_io=False, workers=2, reader_options=None, max_extra_size="256MB", progress=None,
            target="mesh",
            dtype="keep", allow_replicate=(), with_files=()) -> _reshard.ReshardResult:
    """`ckptconv reshard SRC OUT --tp N` (docs/reshard.md); with `dry_run`, the plan only (OUT may
    be None). `target="vllm"`: vLLM's pre-sharded layout as well."""
    if any(type(v) is not int or v < 1 for v in (tp, ep)):
        raise UsageError(f"tp and ep: expected whole numbers of at least 1, not {tp!r}, {ep!r}")
    if strip_prefix is not None and not isinstance(strip_prefix, str):
        raise UsageError(f"strip_prefix: expected a string, not {type(strip_prefix).__name__}")
    if target not in _reshard.TARGETS or dtype not in ("keep", "bf16", "f16", "f32"):
        raise UsageError(f"target: one of {', '.join(_reshard.TARGETS)}; dtype: keep, bf16, f16 or f32 "
                         f"(not {target!r}, {dtype!r})")
    if preset is not None and not isinstance(preset, str):
        raise UsageError(f"preset: expected a preset's name, not {type(preset).__name__}")
    mesh = MeshSpec(tp, ep, preset, None if rules is None else _path(rules, "rules"),
                    {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}, pad_vocab,
                    tuple(_texts(allow_replicate, "allow_replicate")))
    return _reshard.reshard(_source(src, format, only, allow_globals, state_dict, skip_unsupported, workers,
                                    reader_options, max_extra_size),
                            None if out is None else _path(out, "out"), mesh,
                            _write(max_shard_size, name, overwrite, fsync, buffered_io), dry_run,
                            progress=_progress(progress), strip_prefix=strip_prefix, target=target, dtype=dtype,
                            with_files=_paths(with_files, "with_files"))


@_ours
def verify(path, against=None, *, device=None, allow_fewer_devices=False, format=None, allow_globals=(),
           state_dict="auto", workers=2, reader_options=None, max_extra_size="256MB", progress=None,
           expect=None) -> _verify.Report:
    """`ckptconv verify PATH [--against SRC] [--device ...]` (docs/verify.md). The report lists every
    problem (`report.problems`: `Problem`s with a kind, file, tensor and detail; `str()` of one is the
    line the command prints); `report.ok` is True when there is none.
    `progress(nbytes)` is called as bytes are hashed. `expect`: the output's identity as convert or
    reshard printed it (`sha256:…`): the output must be exactly that one."""
    read = _source(path, format, (), allow_globals, state_dict, False, workers, reader_options, max_extra_size).options
    if device not in (None, "cpu", "cuda", "tpu"):
        raise UsageError(f"device: one of cpu, cuda, tpu, not {device!r}")
    return _verify.verify(_path(path, "path"), None if against is None else _path(against, "against"), read, format,
                          device, _flag(allow_fewer_devices, "allow_fewer_devices"), _progress(progress),
                          expect=expected_identity(expect))


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
    layout: Layout | None = None   # a training checkpoint's parts and which convert writes (readers/wrappers.py)
    placeholders: list = field(default_factory=list)   # classes on no allowlist, recorded as inert data


def _tensor_row(fact) -> dict:
    name, dtype, shape, nbytes = fact
    return {"name": name, "dtype": dtype, "shape": list(shape), "bytes": nbytes}


@_ours
def inspect(path, *, format=None, only=(), allow_globals=(), state_dict="auto", skip_unsupported=False, workers=2,
            reader_options=None, max_extra_size="256MB") -> Inspection:
    """`ckptconv inspect PATH` (docs/inspect.md): reads headers and pickles, never tensor data."""
    ckpt = open_source(_source(path, format, only, allow_globals, state_dict, skip_unsupported, workers,
                               reader_options, max_extra_size))
    hist = Counter()
    for t in ckpt.tensors:
        hist[t.dtype.code] += t.nbytes
    # the rows come from plain facts, not from the sources: a result kept must not keep files mapped
    facts = [(t.name, t.dtype.code, t.shape, t.nbytes) for t in ckpt.tensors]
    return Inspection(str(path), ckpt.format, RowView(facts, _tensor_row),
                      ckpt.total_bytes, dict(sorted(hist.items())), ckpt.extras, ckpt.source,
                      [rel for rel, _ in ckpt.out_files()[0]], ckpt.skipped_files, ckpt.also, ckpt.layout,
                      ckpt.source.get("placeholders", []))
