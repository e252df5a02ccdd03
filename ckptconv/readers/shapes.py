"""A shapes-only description of a checkpoint (names, shapes, dtypes; no data), for `ckptconv plan`.

Accepts a JSON file with a "tensors" list whose entries have a name (`name`, or a tree `path` whose
`/` become `.`), a `shape` and a `dtype` (numpy names like "float32", or safetensors codes); entries
marked `"quantized": true` with `weight` and `scales` descriptions become `NAME.weight` and
`NAME.scales`, as the Grok-1 reader names them (../shared/reference/grok-1/tensors.json is one).
"""
import math
from pathlib import Path

import ml_dtypes
import numpy as np

from .. import dtypes
from .. import safejson
from ..errors import BadInput
from ..tensor import Checkpoint, TensorSource
from . import ReadOptions, wanted

NAME = "shapes"
PICKLE = False
DATA = False
DESCRIPTION = "shapes-only JSON descriptions (for plan; they hold no data)"


class ShapeOnly(TensorSource):
    def __init__(self, name, dtype, shape):
        self.name, self.dtype, self.shape = name, dtype, tuple(shape)

    def _region(self, index):
        raise BadInput(f"tensor {self.name!r} comes from a shapes-only description and has no data")


def _dtype(text):
    if text in dtypes.BY_CODE:
        return dtypes.BY_CODE[text]
    try:
        return dtypes.from_numpy(np.dtype(getattr(ml_dtypes, text, text)))
    except TypeError:
        raise BadInput(f"unknown dtype {text!r} in a shapes description") from None


def detect(path: Path) -> bool:
    if not (path.is_file() and path.suffix == ".json" and path.stat().st_size < 64 << 20):
        return False
    try:
        data = safejson.load_file(path, "shapes description")
    except BadInput:
        return False
    return isinstance(data, dict) and isinstance(data.get("tensors"), list) and \
        all(isinstance(t, dict) and "shape" in t for t in data["tensors"][:5])


def load(path: Path, options: ReadOptions) -> Checkpoint:
    data = safejson.load_file(path, "shapes description", limit=64 << 20)
    try:
        tensors = []
        for t in data["tensors"]:
            name = t.get("name") or t["path"].replace("/", ".")
            if t.get("quantized"):
                tensors.append(ShapeOnly(name + ".weight", _dtype(t["weight"]["dtype"]), t["weight"]["shape"]))
                tensors.append(ShapeOnly(name + ".scales", _dtype(t["scales"]["dtype"]), t["scales"]["shape"]))
            else:
                tensors.append(ShapeOnly(name, _dtype(t["dtype"]), t["shape"]))
    except (KeyError, TypeError, AttributeError) as e:
        raise BadInput(f"{path}: not a shapes description (each tensor needs name/path, shape, dtype): {e}") \
            from None
    tensors = [t for t in tensors if wanted(t.name, options.only)]
    source = {"format": NAME, "path": str(path), "config": data.get("config", {}),
              "bytes": sum(math.prod(t.shape) * t.dtype.itemsize for t in tensors)}
    return Checkpoint(tensors, {}, source, [], [])
