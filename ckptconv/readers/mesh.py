"""Reader for ckptconv reshard outputs (`mesh.json` + `rank-XXXXX/`): presents the global tensors.

Each global tensor is a lazy join of slices of the rank pieces that cover it, following mesh.json
(even blocks, `ranges` or `boxes`); replicated tensors are rank 0's copy. Nothing is assembled in memory,
so a tp 8 output reshards to tp 4 (or merges back to tp 1) slice by slice. An output in an object store
is read the same way: mesh.json and the rank directories from its listing, each rank's files by the
safetensors reader (storage/files.py).
"""
from pathlib import Path

from .base import Reader, register
from .. import dtypes
from ..errors import BadInput
from ..formats.mesh import (MAX_METADATA, MESH, MeshDoc, MeshEntry, intervals, outer_cut, parse_mesh, rank_dir, rank_dirs,
                            rank_number, read_regular)
from ..storage import files as storage
from ..tp.rules import check_recorded
from ..checkpoint import Checkpoint, SourceFacts
from ..tensor import Concat
from . import ReadOptions, model_files, wanted
from . import safetensors as st

NAME = "mesh"


def detect(path: Path) -> bool:
    return path.is_dir() and (path / MESH).is_file()


def read_mesh(path: Path) -> MeshDoc:
    """mesh.json of a reshard output, read (a regular file only) and validated (`parse_mesh`), with
    exactly its ranks' directories rank-00000 … beside it."""
    present = _rank_dirs(path)
    mesh = check_recorded(parse_mesh(_mesh_json(path), path / MESH, len(present)), path / MESH)
    if max(present) != mesh.ranks - 1:  # as many distinct ranks as mesh.json says: 0..ranks-1 or not
        raise BadInput(f"{path}: its rank directories are not {rank_dir(0)} to {rank_dir(mesh.ranks - 1)}")
    return mesh


def _rank_dirs(path) -> dict:
    """formats.mesh.rank_dirs, or for an output in an object store, from its listing (no links there)."""
    if not storage.is_url(str(path)):
        return rank_dirs(path)
    return {r: e.name for e in storage.entries(path) if e.is_dir and (r := rank_number(e.name)) is not None}


def _mesh_json(path) -> bytes:
    if not storage.is_url(str(path)):
        return read_regular(path / MESH)
    return storage.read_bytes(path / MESH, MESH, MAX_METADATA)


def rank_pieces(path: Path, ranks: int, only=()):
    """Every rank directory's tensors ({name: source} per rank), and the files they map."""
    pieces, mapped = [], []
    for r in range(ranks):
        ckpt = st.load(path / rank_dir(r), ReadOptions(only=list(only)))
        pieces.append({t.name: t for t in ckpt.tensors})
        mapped += ckpt.mapped
    return pieces, mapped


def load(path: Path, options: ReadOptions) -> Checkpoint:
    mesh = read_mesh(path)
    ranks = mesh.ranks
    pieces, mapped = rank_pieces(path, ranks, options.only)
    # mesh.json is sorted by name; the rank files keep the source's order, so use that
    order = {}
    for r in range(ranks):
        for name in pieces[r]:
            order.setdefault(name, (r, len(order)))
    names = sorted((n for n in mesh.tensors if wanted(n, options.only)), key=lambda n: order.get(n, (ranks, 0)))
    try:
        tensors = [assemble(name, mesh.tensors[name], pieces, ranks) for name in names]
    except BadInput as e:
        raise BadInput(f"{path / MESH}: {e}") from None
    source = SourceFacts(format=NAME, path=str(path), more={"tp": mesh.tp, "ep": mesh.ep, "rules": mesh.rules})
    files = model_files(path / rank_dir(0)) if (path / rank_dir(0)).is_dir() else []
    return Checkpoint(tensors, {}, source, files, mapped, recorded_rules=mesh.rules)


def assemble(name, entry: MeshEntry, pieces, ranks):
    """A lazy global tensor from the rank pieces, checked against mesh.json's shape and dtype
    (assembled at `padded_shape`, then cut back to `shape`, for a --pad-vocab split; for `boxes`,
    each interval of the other axis from its ranks, then those joined)."""
    axis, dt = entry.axis, dtypes.from_code(entry.dtype)
    shape = tuple(entry.full_shape)
    holders = [r for r in range(ranks) if name in pieces[r]]
    if not holders:
        raise BadInput(f"tensor {name!r} is in mesh.json but in no rank directory")
    if axis is None:
        src = pieces[holders[0]][name]
        if src.shape != shape or src.dtype != dt:
            raise BadInput(f"tensor {name!r}: rank {holders[0]} holds {src.shape}/{src.dtype.code}, "
                           f"mesh.json says {shape}/{dt.code}")
        return src
    if entry.boxes is None:
        whole = _join(name, entry, axis, shape, dt, holders, pieces, ranks)
        n = entry.shape[axis]
        return whole if n == shape[axis] else whole.sliced(axis, 0, n).renamed(name)
    groups = {}   # interval of the other axis -> the ranks holding it
    for r in holders:
        cut = outer_cut(entry, r)
        if cut is None:
            raise BadInput(f"tensor {name!r}: rank {r} holds a piece, its boxes in mesh.json are empty")
        groups.setdefault(cut, []).append(r)
    parts, pos = [], 0
    for (outer, (a, b)), rs in sorted(groups.items()):
        if a != pos:
            raise BadInput(f"tensor {name!r}: the ranks' boxes do not tile axis {outer} (at {pos}: {a}..{b})")
        parts.append(_join(name, entry, axis, shape[:outer] + (b - a,) + shape[outer + 1:], dt, rs, pieces, ranks))
        pos = b
    if pos != shape[outer]:
        raise BadInput(f"tensor {name!r}: no rank holds indices {pos}..{shape[outer]} of axis {outer}")
    return parts[0].renamed(name) if len(parts) == 1 else Concat(name, parts, outer)


def _join(name, entry, axis, shape, dt, holders, pieces, ranks):
    """The tensor of `shape` the holders' intervals along `axis` make up (each interval once)."""
    segments = []  # (global start, global stop, rank, offset in the rank's piece)
    for r in holders:
        at = 0
        for a, b in intervals(entry, ranks, r, name):
            segments.append((a, b, r, at))
            at += b - a
        piece = pieces[r][name]
        expect = shape[:axis] + (at,) + shape[axis + 1:]
        if piece.shape != expect or piece.dtype != dt:
            raise BadInput(f"tensor {name!r}: rank {r} holds {piece.shape}/{piece.dtype.code}, expected "
                           f"{expect}/{dt.code} from mesh.json")
    parts, pos = [], 0
    for a, b, r, off in sorted(segments):
        if b <= pos:
            continue  # an interval another rank already supplied (a shared kv head)
        if a > pos:
            raise BadInput(f"tensor {name!r}: no rank holds indices {pos}..{a} of axis {axis}")
        start = off + (pos - a)
        parts.append(pieces[r][name].sliced(axis, start, off + (b - a)))
        pos = b
    if pos != shape[axis]:
        raise BadInput(f"tensor {name!r}: no rank holds indices {pos}..{shape[axis]} of axis {axis}")
    return parts[0].renamed(name) if len(parts) == 1 else Concat(name, parts, axis)


READER = register(Reader(NAME, "ckptconv reshard outputs (mesh.json + rank-XXXXX/ directories)",
                         detect, load, priority=10, fuzz=(("mesh.json", None), ("rank-00000/model.safetensors", None)),
                         looks_for="a directory holding mesh.json"))
