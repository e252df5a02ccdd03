"""Output layouts: the protocol and the registry are in base.py; each layout is one module or one
package here that registers itself with `@register(name)` (sharded/, single.py, mesh/, vllm/, and
foreign.py, which ckptconv only checks and reads). Importing this package imports them all; the
commands find a layout only through the functions below, never by its module.

Shared mechanisms, registering nothing: files.py (shard files written and hashed as they stream),
report.py (what verify finds), scan.py (an output directory's entries and metadata files),
shardcheck.py (one shard: header, the safetensors library's view, digests)."""
import importlib
import pkgutil

from ..errors import UsageError
from ..storage import files as storage
from ..formats.manifest import MANIFEST
from ..formats.mesh import MESH
from .base import LAYOUTS, Layout, engine_of, for_target

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def layout(name: str) -> type:
    """The layout registered as `name`."""
    return LAYOUTS[name]


def target_choices() -> dict:
    """{name: help line} of the layouts `reshard --target` writes (rank directories), mesh first."""
    found = {name: cls.target for name, cls in sorted(LAYOUTS.items(), key=lambda kv: (kv[1].order, kv[0]))
             if cls.target}
    return found


def detected(path) -> type:
    """The layout `path` holds (tried in each layout's `order`); UsageError saying what it is not."""
    path = storage.place(path)
    for cls in sorted(LAYOUTS.values(), key=lambda c: (c.order, c.name)):
        if cls.detect(path):
            return cls
    if path.is_dir():
        raise UsageError(f"{path}: holds no safetensors files, index, {MANIFEST} or {MESH}; not a ckptconv "
                         "output nor any other safetensors output")
    raise UsageError(f"{path}: neither an output directory nor a .safetensors file")


__all__ = ["LAYOUTS", "Layout", "layout", "target_choices", "engine_of", "for_target", "detected"]
