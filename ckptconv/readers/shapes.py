"""A shapes-only description of a checkpoint (names, shapes, dtypes; no data), for `ckptconv plan`.

Accepts a JSON file with a "tensors" list whose entries have a name (`name`, or a tree `path` whose
`/` become `.`), a `shape` and a `dtype` (numpy names like "float32", or safetensors codes); entries
marked `"quantized": true` with `weight` and `scales` descriptions become `NAME.weight` and
`NAME.scales`, as the Grok-1 reader names them (tests/data/grok1_tensors.json is one).
"""
import math
from pathlib import Path

import ml_dtypes
import numpy as np

from .base import Reader, register
from ..storage import files as storage
from .. import dtypes
from ..errors import BadInput, brief
from ..limits import shape_problem
from ..checkpoint import Checkpoint, SourceFacts
from ..tensor import TensorSource
from . import ReadOptions, wanted

NAME = "shapes"


class ShapeOnly(TensorSource):
    def __init__(self, name, dtype, shape):
        self.name, self.dtype, self.shape = name, dtype, tuple(shape)

    def _region(self, index):
        raise BadInput(f"tensor {self.name!r} comes from a shapes-only description and has no data")


def _dtype(text, path):
    if not isinstance(text, str) or not text.isidentifier():  # a name like "float32" or "BF16", not a spec
        raise BadInput(f"{path}: dtype {brief(text, 60)} is not a dtype name")
    if text in dtypes.BY_CODE:
        return dtypes.BY_CODE[text]
    try:
        return dtypes.from_numpy(np.dtype(getattr(ml_dtypes, text, text)))
    except (TypeError, ValueError, BadInput):
        raise BadInput(f"{path}: unknown dtype {text!r} in a shapes description") from None


def _tensor(name, dtype, shape, path) -> "ShapeOnly":
    if not isinstance(name, str) or not name:
        raise BadInput(f"{path}: a tensor name {brief(name, 60)} is not text")
    dt = _dtype(dtype, path)
    problem = shape_problem(shape, dt.itemsize)  # before anything multiplies its sizes
    if problem:
        raise BadInput(f"{path}: tensor {name!r}: {problem}")
    return ShapeOnly(name, dt, shape)


def detect(path: Path) -> bool:
    if not (path.is_file() and path.suffix == ".json" and path.stat().st_size < 64 << 20):
        return False
    try:
        data = storage.load_json(path, "shapes description")
    except BadInput:
        return False
    return isinstance(data, dict) and isinstance(data.get("tensors"), list) and \
        all(isinstance(t, dict) and "shape" in t for t in data["tensors"][:5])


def load(path: Path, options: ReadOptions) -> Checkpoint:
    data = storage.load_json(path, "shapes description", limit=64 << 20)
    config = data.get("config", {}) if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(data.get("tensors"), list) or not isinstance(config, dict):
        raise BadInput(f"{path}: not a shapes description (an object with a 'tensors' list and an optional "
                       "'config' object)")
    try:
        tensors = []
        for t in data["tensors"]:
            name = t.get("name") or (t["path"].replace("/", ".") if isinstance(t["path"], str) else t["path"])
            if t.get("quantized"):
                tensors.append(_tensor(f"{name}.weight", t["weight"]["dtype"], t["weight"]["shape"], path))
                tensors.append(_tensor(f"{name}.scales", t["scales"]["dtype"], t["scales"]["shape"], path))
            else:
                tensors.append(_tensor(name, t["dtype"], t["shape"], path))
    except (KeyError, TypeError, AttributeError) as e:
        raise BadInput(f"{path}: not a shapes description (each tensor needs name/path, shape, dtype): "
                       f"{type(e).__name__}") from None
    tensors = [t for t in tensors if wanted(t.name, options.only)]
    source = SourceFacts(format=NAME, path=str(path), more={
        "config": config, "bytes": sum(math.prod(t.shape) * t.dtype.itemsize for t in tensors)})
    return Checkpoint(tensors, {}, source, [], [], config=config)


READER = register(Reader(NAME, "shapes-only JSON descriptions (for plan; they hold no data)",
                         detect, load, priority=60, holds_data=False, fuzz=(("shapes.json", None),),
                         looks_for='a .json file with a "tensors" list of shapes'))
