"""The typed requests every command takes, built and validated in one place for the command line
(cli.py) and the Python API (api.py): how to read a source (`ReadOptions` in a `Source`), how to
write an output (`WriteOptions`), the target mesh (`MeshSpec`), and the choices their options take.
A value that is not what its option takes is a UsageError naming the option, whichever door it came
in by, spelled as that door spells it (`spell`: `max_shard_size` in Python, `--max-shard-size` on the
command line); click's own types only shape the text a shell gives.
"""
import os
import re

from .dtypes import CAST_TARGETS
from .errors import UsageError, brief
from .formats.manifest import stem_problem
from .readers import ReadOptions, Source
from .sizes import parse_size
from .tp.presets import MeshSpec
from .layouts.base import WriteOptions
from .storage.urls import StorageOptions

DTYPES = ("keep", *CAST_TARGETS)     # --dtype: keep, or what a float is cast to
DEVICES = ("cpu", "cuda", "tpu")     # verify --device
MAX_WORKERS = 64


def python_name(option: str) -> str:
    return option


def flag_name(option: str) -> str:
    """How the command line spells an option: --max-shard-size."""
    return "--" + option.replace("_", "-")


def texts(value, what) -> list:
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


def flag(value, what) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"{what}: expected True or False, not {value!r}")
    return value


def path(value, what) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise UsageError(f"{what}: expected a path, not {type(value).__name__}")
    text = os.fspath(value)
    if not isinstance(text, str) or "\0" in text:
        raise UsageError(f"{what}: {brief(text, 100)} is not a path (a NUL byte, or bytes)")
    return text


def paths(value, what) -> tuple:
    """Paths from one path or an iterable of them (a lone path is one item)."""
    items = [value] if isinstance(value, (str, os.PathLike)) else value
    try:
        return tuple(path(v, what) for v in items)
    except TypeError:
        raise UsageError(f"{what}: expected a path or a list of paths, not {type(value).__name__}") from None


def size(value, what) -> int:
    """A positive number of bytes, or a size like '5GB' (sizes.py)."""
    if isinstance(value, str):
        try:
            return parse_size(value)
        except UsageError as e:
            raise UsageError(f"{what}: {e}") from None
    if type(value) is int and value > 0:
        return value
    raise UsageError(f"{what}: expected a positive number of bytes or a size like '5GB', not {brief(value, 40)}")


def choice(value, choices, what):
    if value not in choices:
        raise UsageError(f"{what}: one of {', '.join(choices)}, not {brief(value, 40)}")
    return value


def optional_text(value, what):
    if value is not None and not isinstance(value, str):
        raise UsageError(f"{what}: expected a string, not {type(value).__name__}")
    return value


def storage_options(value, spell=python_name) -> StorageOptions:
    """How to reach object stores: a StorageOptions, a dict of its fields ({"endpoint_url": ...,
    "concurrency": 16, "part_size": "16MiB", "retries": 10, "stall_seconds": 30}), or None (the defaults)."""
    if value is None:
        return StorageOptions()
    if isinstance(value, StorageOptions):
        return value
    if not isinstance(value, dict):
        raise UsageError(f"{spell('storage')}: expected a StorageOptions or a dict, not {type(value).__name__}")
    fields = {f for f in StorageOptions.__dataclass_fields__}
    unknown = sorted(set(value) - fields)
    if unknown:
        raise UsageError(f"{spell('storage')}: {brief(unknown[0], 40)} is not a storage option ({', '.join(sorted(fields))})")
    given = dict(value)
    if isinstance(given.get("part_size"), str):
        given["part_size"] = size(given["part_size"], "part_size")
    return StorageOptions(**given)


def read_options(*, only=(), allow_globals=(), state_dict="auto", skip_unsupported=False, workers=None,
                 reader_options=None, max_extra_size="256MB", one_shard=False, storage=None,
                 spell=python_name) -> ReadOptions:
    """How to read a source (every command); `reader_options`: the values of the options readers
    declare, by dest ({"dequantize": "bf16"}), None for those not given; `storage`: how to reach an
    object store (storage_options)."""
    if not isinstance(state_dict, str):
        raise UsageError(f"{spell('state_dict')}: expected a string, not {type(state_dict).__name__}")
    if not isinstance(reader_options, (dict, type(None))):
        raise UsageError(f"reader_options: expected a dict, not {type(reader_options).__name__}")
    if workers is not None and (type(workers) is not int or not 1 <= workers <= MAX_WORKERS):
        raise UsageError(f"{spell('workers')}: expected a number from 1 to {MAX_WORKERS}, not {workers!r}")
    return ReadOptions(allow_globals=texts(allow_globals, spell("allow_globals")),
                       skip_unsupported=flag(skip_unsupported, spell("skip_unsupported")),
                       only=texts(only, spell("only")), workers=workers, state_dict=state_dict,
                       declared={k: v for k, v in (reader_options or {}).items() if v is not None},
                       max_extra_size=size(max_extra_size, spell("max_extra_size")),
                       one_shard=flag(one_shard, spell("one_shard")), storage=storage_options(storage, spell))


def source(src, format=None, read: ReadOptions = None) -> Source:
    """What to read: `src`, its format (None: detected) and how."""
    return Source(path(src, "src"), optional_text(format, "format"), read or ReadOptions())


def write_options(*, max_shard_size="5GB", name=None, overwrite=False, fsync=False, buffered_io=False,
                  resume=False, max_extras="1MB", storage=None, spell=python_name) -> WriteOptions:
    """How output files are written and named (convert, reshard)."""
    problem = None if name is None else stem_problem(name) if isinstance(name, str) else "must be a string or None"
    if problem:
        raise UsageError(f"{spell('name')} {brief(name, 80)}: {problem}")
    return WriteOptions(size(max_shard_size, spell("max_shard_size")), flag(fsync, spell("fsync")),
                        not flag(buffered_io, spell("buffered_io")), flag(overwrite, spell("overwrite")),
                        flag(resume, spell("resume")), name, size(max_extras, spell("max_extras")),
                        storage_options(storage, spell))


def mesh(*, tp, ep=1, preset=None, rules=None, heads=None, kv_heads=None, head_dim=None, pad_vocab=False,
         allow_replicate=(), spell=python_name) -> MeshSpec:
    """The target mesh and how tensors are cut over it (reshard, plan --tp)."""
    if any(type(v) is not int or v < 1 for v in (tp, ep)):
        raise UsageError(f"tp and ep: expected whole numbers of at least 1, not {tp!r}, {ep!r}")
    for what, v in (("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        if v is not None and (type(v) is not int or v < 1):
            raise UsageError(f"{spell(what)}: expected a whole number of at least 1, not {brief(v, 40)}")
    patterns = tuple(texts(allow_replicate, spell("allow_replicate")))
    for pattern in patterns:
        try:
            re.compile(pattern)
        except (re.error, OverflowError, RecursionError, ValueError) as e:
            raise UsageError(f"{spell('allow_replicate')} {pattern!r}: {e}") from None
    return MeshSpec(tp, ep, optional_text(preset, spell("preset")), None if rules is None else path(rules, spell("rules")),
                    {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}, flag(pad_vocab, spell("pad_vocab")),
                    patterns)
