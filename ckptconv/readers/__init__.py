"""Reader plugins and the registry that detects which one a path belongs to.

A reader module defines NAME, PICKLE (whether it parses pickles), DESCRIPTION, `detect(path)` and
`load(path, options) -> Checkpoint` (and DATA = False when it describes shapes only). Adding a
format means adding a module to `_modules()`.
"""
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BadInput, UsageError


@dataclass
class ReadOptions:
    allow_globals: list = field(default_factory=list)   # --allow-global MODULE.NAME
    skip_unsupported: bool = False
    only: list = field(default_factory=list)            # name prefixes to keep (items skipped unread)
    names: str | None = None                            # Grok: --names FILE
    dequantize: str | None = None                       # Grok: bf16 | f32
    layout: str | None = None                           # Grok: mixtral
    host_axis: int | None = None                        # Grok: axis to join host files on
    workers: int = 2


def wanted(name: str, only) -> bool:
    """--only PREFIX (repeatable): keep names that start with any prefix; no prefix keeps all."""
    return not only or any(name.startswith(p) for p in only)


def _modules():
    from . import dcp, grok, mesh, safetensors, shapes, torch_pickle
    return [mesh, dcp, torch_pickle, safetensors, grok, shapes]


def readers() -> dict:
    return {m.NAME: m for m in _modules()}


def detect(path) -> object:
    path = Path(path)
    if not path.exists():
        raise BadInput(f"{path}: no such file or directory")
    if not path.is_dir() and not path.is_file():
        raise BadInput(f"{path}: not a regular file or a directory")
    for mod in _modules():
        if mod.detect(path):
            return mod
    raise BadInput(f"{path}: not a checkpoint format ckptconv knows "
                   f"(known: {', '.join(readers())}; use --from to force one)")


def open_checkpoint(path, fmt=None, options=None):
    options = options or ReadOptions()
    if fmt:
        mods = readers()
        if fmt not in mods:
            raise UsageError(f"--from {fmt!r}: unknown format (known: {', '.join(mods)})")
        mod = mods[fmt]
        if not Path(path).exists():
            raise BadInput(f"{path}: no such file or directory")
    else:
        mod = detect(path)
    return mod.load(Path(path), options)


WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".safetensors", ".distcp", ".index.json", ".msgpack", ".h5")


def model_files(directory: Path, consumed=()) -> list:
    """Files beside the weights (config.json, tokenizer, README...) to carry into OUT unchanged."""
    consumed = {os.path.abspath(p) for p in consumed}
    out = []
    for p in sorted(directory.iterdir()):
        if (p.is_file() and not p.name.startswith(".") and os.path.abspath(p) not in consumed
                and not p.name.endswith(WEIGHT_SUFFIXES) and p.name not in ("manifest.json", "SHA256SUMS", "mesh.json")):
            out.append((p.name, p))
    return out
