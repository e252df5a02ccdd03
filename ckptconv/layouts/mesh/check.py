"""A reshard output: its top level (SHA256SUMS, mesh.json, exactly the rank directories it counts, and
what an engine's layout puts beside them: its own check), every rank directory on its own, the ranks' manifests agreeing, and each global tensor
as mesh.json describes it: replicas and shared intervals equal, pieces where it puts them, reassembled
digests right (assembled lazily from the rank pieces, never in memory)."""
import hashlib
import math
import stat
from pathlib import Path

from ... import dtypes
from ...errors import BadInput, brief
from ...readers import mesh as mesh_reader
from ...formats.sums import NAME as SUMS
from ...tp.rules import check_recorded
from ...tensor import sha256_of
from ...storage import files as storage
from ...formats import manifest as manifest_format
from ...formats.manifest import MANIFEST
from ...formats.mesh import MESH, MeshDoc, intervals, outer_cut, parse_mesh, rank_dir, rank_dirs, rank_number
from ..sharded.check import verify_dir
from ..report import Report, _detail
from ..base import engine_of, for_target
from ..scan import _checked_manifest, _kind, _read, _regular, _scan, _sha256_regular, _sums, shard_sizes


def verify_mesh(path: Path, report: Report, progress, mine, plain) -> MeshDoc | None:
    """A reshard output: its top level (SHA256SUMS over mesh.json and every other file, exactly the
    rank directories mesh.json counts, nothing else), then every rank dir on its own. `mine(kind, key)`
    says which rank dirs this process checks and whether it checks the top level (all, in a single
    process). `plain`: the mesh layout, when mesh.json names no engine's. Returns mesh.json,
    validated, or None."""
    found = report if mine("structure", None) else Report()
    entries = _scan(path, found)
    sums = _sums(path, entries, found)
    data = _read(path, MESH, entries, found, MESH)
    dirs = _top_entries(path, entries, sums, found)  # every rank-XXXXX directory on disk
    mesh = None
    if data is not None:
        try:  # its rank count must be the number of rank directories before anything loops over it
            mesh = check_recorded(parse_mesh(data, path / MESH, len(dirs)), path / MESH)
        except BadInput as e:
            found.add(path / MESH, _detail(e, path / MESH), "metadata")
    # the engine's layout mesh.json's target names (by its "engine" alone) says what else is at the
    # top; a record no layout writes is a problem of its own
    engine = engine_of(mesh.target) if mesh is not None else None
    engine = engine if engine is not None and issubclass(engine, plain) else plain
    if mesh is not None and mesh.target is not None and for_target(mesh.target) is None:
        found.add(path / MESH, f"its source.target {brief(mesh.target, 120)} is not a layout ckptconv writes",
                  "metadata")
    parts = engine.top_parts(path, mesh.ranks) if mesh is not None and len(dirs) == mesh.ranks else None
    # a top-level part that is the very inode of its rank shard is hashed with that shard's directory
    # (against its manifest; its SHA256SUMS line is tied to the same digest below): not read twice
    linked = {n for n, (shard, _) in (parts or {}).items() if _same_file(path / n, path / shard)}
    if sums is not None:
        _check_top_sums(path, entries, sums, data, linked, found)
    for r, name in sorted(_ranks_present(path, mesh, dirs, found).items()):
        if mine("rank", r):
            verify_dir(path / name, report, progress)
    if parts is not None and sums is not None:
        engine.check_top(path, parts, entries, sums, found)
    elif sums is not None and mesh is not None and engine is plain:   # (an engine's parts unread: said there)
        check_only_ranks(path, sums, found)
    return mesh


def _top_entries(path: Path, entries: dict, sums, found: Report) -> dict:
    """{rank: name} of the rank directories at the top of a reshard output; any other entry must be a
    regular file SHA256SUMS lists (`sums`: None when it could not be read)."""
    dirs = {}
    for name, st in sorted(entries.items()):
        r = rank_number(name)
        if r is not None and stat.S_ISDIR(st.st_mode):
            dirs[r] = name
        elif not stat.S_ISREG(st.st_mode):
            found.add(path / name, f"is {_kind(st)}; a reshard output holds only its rank directories and regular "
                                   "files (not followed)", "not-regular")
        elif name != SUMS and name not in (sums or {}):
            found.add(path / name, "file is not listed in SHA256SUMS", "unlisted")
    return dirs


def _check_top_sums(path: Path, entries: dict, sums: dict, data, linked: set, found: Report):
    """Every file the top-level SHA256SUMS lists is there with that digest (mesh.json's from `data`,
    the bytes already read; a `linked` part is checked with its rank directory)."""
    if MESH not in sums:
        found.add(path / SUMS, "does not list mesh.json", "unlisted")
    for name in sorted(sums):
        if name not in entries:
            found.add(path / name, "listed in SHA256SUMS but missing", "missing")
        elif stat.S_ISDIR(entries[name].st_mode):
            found.add(path / name, "listed in SHA256SUMS but is a directory", "not-regular")
        elif _regular(entries, name) and name not in linked:
            digest = hashlib.sha256(data).hexdigest() if name == MESH and data is not None \
                else _sha256_regular(path / name)
            if digest is not None and digest != sums[name]:
                found.add(path / name, "sha256 differs from SHA256SUMS", "digest")


def _ranks_present(path: Path, mesh: MeshDoc | None, dirs: dict, found: Report) -> dict:
    """The rank directories to check, {rank: name}: all of them without a valid mesh.json, else those of
    its ranks; with one, as many directories as ranks (checked): rank-00000 … exactly, or some are off."""
    present = dirs
    if mesh is not None:
        ranks = mesh.ranks
        present = {r: n for r, n in dirs.items() if r < ranks}
        for r, name in sorted(dirs.items()):
            if r >= ranks:
                found.add(path / name, f"rank directory beyond the {ranks} ranks of mesh.json", "unlisted")
        for r in range(ranks):
            if r not in dirs:
                found.add(path / rank_dir(r), "rank directory is missing", "missing")
    return present


def check_only_ranks(path: Path, sums: dict, report: Report):
    """A mesh output holds mesh.json and rank directories only: SHA256SUMS lists nothing else."""
    for name in sorted(set(sums) - {MESH}):
        if rank_number(name) is None:
            report.add(path / name, "is listed in SHA256SUMS, but reshard writes no such file here", "unlisted")


def check_units(path: Path) -> dict:
    """What a check of several processes shares out: the rank directories of a valid mesh.json by
    the bytes of their shards, and its global tensors by bytes (anything else is process 0's)."""
    try:
        mesh = mesh_reader.read_mesh(path)
    except BadInput:
        return {}
    ranks = sorted(r for r in rank_dirs(path) if r < mesh.ranks)
    return {"rank": [(r, sum(shard_sizes(path / rank_dir(r)).values())) for r in ranks],
            "tensor": [(n, math.prod(e.shape) * dtypes.from_code(e.dtype).itemsize) for n, e in mesh.tensors.items()]}


def _same_file(a: Path, b: Path) -> bool:
    """Both regular files (no link followed) and one inode (never two objects: storage.files.same_file)."""
    return storage.same_file(a, b)


def _ranks_agree(path: Path, mesh: MeshDoc, documents: list, report: Report):
    """Every rank's manifest says what rank 0's says of the source (its description but the rank it
    holds, its extras and other facts) and carries the same model files, and mesh.json's target is
    the one they record: verify --against compares rank 0's with the source, so none may differ."""
    def facts(doc):
        source = {k: v for k, v in doc.get("source", {}).items() if k != "resharded"} \
            if isinstance(doc.get("source"), dict) else doc.get("source")
        files = doc.get("files") if isinstance(doc.get("files"), dict) else {}
        carried = {n: f for n, f in files.items() if not n.endswith((".safetensors", manifest_format.INDEX_SUFFIX))}
        rest = {k: v for k, v in doc.items() if k not in ("source", "files", "tensors")}
        return {"source": source, "model files": carried, **rest}
    first = facts(documents[0])
    for r, doc in enumerate(documents[1:], 1):
        mine = facts(doc)
        differs = next((k for k in sorted(set(first) | set(mine)) if first.get(k) != mine.get(k)), None)
        if differs is not None:
            report.add(path / rank_dir(r) / MANIFEST, f"{differs}: not what {rank_dir(0)}'s manifest records (every "
                                                      "rank records the same source)", "mesh")
    target = mesh.target
    recorded = first["source"].get("target") if isinstance(first["source"], dict) else None
    if target != recorded:
        report.add(path / MESH, f"its source.target is {brief(target, 80)}, the ranks' manifests record "
                                f"{brief(recorded, 80)}", "mesh")


def verify_mesh_tensors(path: Path, mesh: MeshDoc, report: Report, mine=lambda kind, key: True):
    """With every rank dir intact: the same tensors as mesh.json, replicas equal, shared intervals
    equal, pieces where mesh.json puts them, reassembled digests right."""
    ranks = mesh.ranks
    documents = [_checked_manifest(path / rank_dir(r)) for r in range(ranks)]
    per_rank = [d["tensors"] for d in documents]
    if mine("structure", None):
        _ranks_agree(path, mesh, documents, report)
    del documents   # (their tensors stay, in per_rank)
    held = {}
    for r, tensors in enumerate(per_rank):
        for name in tensors:
            held.setdefault(name, []).append(r)
    if mine("structure", None):
        for name in sorted(set(held) - set(mesh.tensors)):
            report.add(path / MESH, f"tensor {name!r} is on ranks {_ranks(held[name])} but not in mesh.json",
                       "unlisted", tensor=name)
        for name in sorted(set(mesh.tensors) - set(held)):
            report.add(path / MESH, f"tensor {name!r} is in mesh.json but in no rank directory", "missing", tensor=name)
    pieces, _ = mesh_reader.rank_pieces(path, ranks)  # headers parsed once, for every check below
    for name, entry in mesh.tensors.items():
        if not mine("tensor", name) or name not in held:
            continue
        holders = held[name]
        if entry.axis is None:
            digests = {per_rank[r][name]["sha256"] for r in holders}
            if len(holders) != ranks:
                report.add(path / MESH, f"replicated tensor {name!r} is missing on ranks "
                                               f"{_ranks(sorted(set(range(ranks)) - set(holders)))}",
                                               "missing", tensor=name)
            if len(digests) > 1:
                report.add(path / MESH, f"replicated tensor {name!r} differs between ranks", "mesh", tensor=name)
        else:
            expected = [r for r in range(ranks) if intervals(entry, ranks, r, name)]
            if holders != expected:
                report.add(path / MESH, f"tensor {name!r} has pieces on ranks {_ranks(holders)}, mesh.json "
                                               f"puts them on ranks {_ranks(expected)}", "mesh", tensor=name)
                continue
            _check_shared_intervals(name, entry, pieces, path, report)
        try:
            if sha256_of(mesh_reader.assemble(name, entry, pieces, ranks)) != entry.sha256:
                report.add(path / MESH, f"tensor {name!r}: the global tensor reassembled from the rank "
                                               "pieces does not match its sha256 (a piece is on the wrong rank "
                                               "or cut on the wrong axis)", "mesh", tensor=name)
        except BadInput as e:
            report.add(path / MESH, str(e), "mesh")


def _ranks(rs, limit=16) -> str:
    rs = list(rs)
    return str(rs) if len(rs) <= limit else f"{rs[:limit]}... ({len(rs)} ranks)"


def _check_shared_intervals(name, entry, pieces, path, report):
    """Where several ranks hold the same interval (a shared kv head), their bytes must be equal."""
    if entry.ranges is None and entry.boxes is None:
        return
    axis, ranks = entry.axis, len(pieces)
    seen = {}
    for r in range(ranks):
        if name not in pieces[r]:
            continue
        held = intervals(entry, ranks, r, name)
        shape = pieces[r][name].shape
        if len(shape) != len(entry.shape) or shape[axis] != sum(b - a for a, b in held):
            return   # a piece of the wrong shape: reported when the tensor is assembled
        at = 0
        for a, b in held:
            seen.setdefault((outer_cut(entry, r), a, b), []).append((r, at))
            at += b - a
    for (_, a, b), holders in seen.items():
        if len(holders) < 2:
            continue
        digests = {sha256_of(pieces[r][name].sliced(axis, at, at + b - a)) for r, at in holders}
        if len(digests) > 1:
            report.add(path / MESH, f"tensor {name!r}: interval {a}..{b} of axis {axis} differs between "
                                           f"ranks {[r for r, _ in holders]}", "mesh", tensor=name)
