"""Reader for safetensors: one file, or a directory with `model.safetensors.index.json` (or one file).

Headers are validated strictly (offsets in bounds, contiguous, dtype x shape = bytes); every tensor
is a contiguous view of the mapped file. Also reads ckptconv's own outputs.
"""
from pathlib import Path


from .base import Reader, register
from ..errors import BadInput
from ..io.mapped import MappedFile
from ..storage import files as storage
from ..formats.manifest import index_kind, is_index
from ..formats.safetensors import file_header
from ..checkpoint import Checkpoint, SourceFacts
from ..tensor import MappedView
from . import ReadOptions, by_shard, check_listed, model_files, source_root, wanted, weight_map, weights_file

NAME = "safetensors"


def _dir_targets(path: Path) -> list:
    """What a directory offers: its index (`STEM.safetensors.index.json`; without one, a variant's
    `STEM.safetensors.index.VARIANT.json`) if it has one, else every .safetensors file in it (hidden
    files aside)."""
    indexes = sorted(p for p in path.iterdir() if is_index(p.name) and not p.name.startswith("."))
    index = [p for p in indexes if not index_kind(p.name)[1]] or indexes
    return index or sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("."))


def detect(path: Path) -> bool:
    if path.is_dir():
        return bool(_dir_targets(path))
    if is_index(path.name):
        return True
    head = storage.head(path, 9)
    return len(head) == 9 and head[8:9] == b"{"


def load(path: Path, options: ReadOptions) -> Checkpoint:
    """A file, an index, or a directory: its one index, or without one every .safetensors file in it
    (their tensors must have distinct names)."""
    targets = _dir_targets(path) if path.is_dir() else [path]
    if not targets:
        raise BadInput(f"{path}: no safetensors file or index found")
    indexes = [t for t in targets if is_index(t.name)]
    if len(indexes) > 1:
        raise BadInput(f"{path}: holds {len(indexes)} indexes ({', '.join(t.name for t in indexes[:4])}); "
                       "give the one to read as SRC")
    if path.is_dir():
        targets = [weights_file(t, source_root(path)) for t in targets]
    target, files, listed = targets[0], targets, None
    if target.name.endswith(".index.json") or index_kind(target.name) is not None:
        listed = by_shard(weight_map(target, options.only))
        files = [weights_file(target.parent / f, source_root(target)) for f in sorted(listed)]
    tensors, mapped, where = [], [], {}
    for f in files:
        m = storage.open_file(f)
        mapped.append(m)
        held = file_tensors(m)
        if listed is not None:
            check_listed(target, f.name, listed[f.name], {t.name for t in held})
        else:
            _distinct(path, f, held, where)
        tensors += [t for t in held if wanted(t.name, options.only)]
    consumed = files + targets
    source = SourceFacts(format=NAME, path=str(path), files=[p.name for p in files])
    if path.is_dir() and listed is not None:
        source.unindexed = [p.name for p in sorted(path.glob("*.safetensors")) if p not in files]
    return Checkpoint(tensors, {}, source, model_files(path, consumed) if path.is_dir() else [], mapped)


def _distinct(directory: Path, f: Path, held: list, where: dict):
    """Files of a directory without an index are parts of one model: a name in two of them says they
    are not (an ensemble of whole models, two copies): refused naming both files and how to pick."""
    for t in held:
        first = where.setdefault(t.name, f)
        if first is not f:
            common = sum(1 for u in held if where.get(u.name) is first)
            raise BadInput(f"{directory}: {first.name} and {f.name} both hold {t.name!r} ({common} of {len(held)} "
                           f"names in common): separate models, not parts of one; give one file as SRC "
                           f"({f.parent.name}/{first.name}), or an index (*.safetensors.index.json) saying which "
                           "file holds each tensor")


def file_tensors(m: MappedFile) -> list:
    header = file_header(m)
    m.release(0, header.data_start)
    if header.problems:
        raise BadInput(f"{m.path}: {header.problems[0]}")
    return [_source(m, e) for e in header.entries]


def _source(m, e):
    return MappedView(e.name, e.dtype, e.shape, m, e.begin)


READER = register(Reader(NAME, "safetensors files and directories with an index (STEM.safetensors.index.json)",
                         detect, load, priority=30, suffixes=(".safetensors",), fuzz=(("input.safetensors", None),),
                         looks_for="a .safetensors file (by its header), *.safetensors.index.json, or a directory "
                         "holding them"))
