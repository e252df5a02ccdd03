"""Reader for ckptconv reshard outputs (`mesh.json` + `rank-XXXXX/`): presents the global tensors.

Each global tensor is a lazy join of slices of the rank pieces that cover it, following mesh.json
(even blocks, or `ranges`); replicated tensors are rank 0's copy. Nothing is assembled in memory,
so a tp 8 output reshards to tp 4 (or merges back to tp 1) slice by slice.
"""
import os
import re
from pathlib import Path

from .. import dtypes, safejson
from ..errors import BadInput, UsageError
from ..rules import from_json
from ..sha256sums import is_digest
from ..tensor import Checkpoint, Concat
from . import ReadOptions, model_files, wanted
from . import safetensors as st

NAME = "mesh"
PICKLE = False
DESCRIPTION = "ckptconv reshard outputs (mesh.json + rank-XXXXX/ directories)"


def detect(path: Path) -> bool:
    return path.is_dir() and (path / "mesh.json").is_file()


MAX_METADATA = 256 * 2**20  # mesh.json, manifests, indexes, SHA256SUMS: read whole, so bounded
_RANK_DIR = re.compile(r"rank-(\d{5,})")
_RULE_KEYS = {"pattern": str, "kind": str, "axis": int, "heads": int, "kv_heads": int, "head_dim": int,
              "experts": bool}


def read_regular(path, limit=MAX_METADATA) -> bytes:
    """The bytes of `path` in an output: a regular file, not followed if it is a link (safejson.read)."""
    return safejson.read(path, limit=limit, follow=False)


def read_mesh(path: Path) -> dict:
    """mesh.json of a reshard output, read (a regular file only) and validated (`parse_mesh`), with
    exactly its ranks' directories rank-00000 … beside it."""
    present = rank_dirs(path)
    mesh = parse_mesh(read_regular(path / "mesh.json"), path / "mesh.json", len(present))
    if max(present) != mesh["ranks"] - 1:  # as many distinct ranks as mesh.json says: 0..ranks-1 or not
        raise BadInput(f"{path}: its rank directories are not rank-00000 to rank-{mesh['ranks'] - 1:05d}")
    return mesh


def parse_mesh(data: bytes, where, on_disk: int | None = None) -> dict:
    """Validate everything the readers, reshard and verify rely on (types, ranges, sizes); any fault
    is a BadInput naming mesh.json and what is wrong, never a crash later on. With `on_disk` (how
    many rank directories are on disk), the rank count must be that: a count read from a file is
    never looped over unchecked."""
    mesh = safejson.loads(data, where, "mesh.json")
    if not isinstance(mesh, dict) or mesh.get("format") != "ckptconv.mesh/1":
        raise BadInput(f"{where}: not a ckptconv.mesh/1 description")

    def bad(what):
        return BadInput(f"{where}: {what}")

    for key in ("ranks", "tp", "ep"):
        if not _count(mesh.get(key)):
            raise bad(f"{key!r} must be a whole number of at least 1, not {mesh.get(key)!r}")
    ranks = mesh["ranks"]
    if on_disk is not None and ranks != on_disk:
        raise bad(f"mesh.json says {ranks} ranks, {Path(where).parent} holds {on_disk} rank directories")
    if mesh["tp"] * mesh["ep"] != ranks:
        raise bad(f"ranks is {ranks}, not tp x ep = {mesh['tp']} x {mesh['ep']}")
    _check_rules(mesh.get("rules"), bad)
    if not isinstance(mesh.get("tensors"), dict):
        raise bad("'tensors' must be an object")
    for name, entry in mesh["tensors"].items():
        _check_entry(name, entry, ranks, bad)
    return mesh


def _count(v) -> bool:
    return type(v) is int and v >= 1


def _dims(v) -> bool:
    return isinstance(v, list) and all(type(d) is int and 0 <= d < 2**62 for d in v)


def _check_rules(rules, bad):
    if not (isinstance(rules, dict) and isinstance(rules.get("name"), str) and rules.get("layout") in ("torch", "jax")
            and isinstance(rules.get("rules"), list) and isinstance(rules.get("params", {}), dict)):
        raise bad("'rules' must be {name, layout: torch|jax, rules: [...], params: {...}}")
    for i, rule in enumerate(rules["rules"]):
        if not isinstance(rule, dict) or not isinstance(rule.get("pattern"), str):
            raise bad(f"rule {i} must be an object with a 'pattern' string")
        for key, value in rule.items():
            want = _RULE_KEYS.get(key)
            if want is None or type(value) is not want:
                raise bad(f"rule {i}: {key!r} = {value!r} is not a valid rule field")
    try:
        from_json(rules)
    except UsageError as e:
        raise bad(f"its rules: {e}") from None


def _check_entry(name, e, ranks, bad):
    if not isinstance(e, dict):
        raise bad(f"tensor {name!r}: entry must be an object")
    if not _dims(e.get("shape")):
        raise bad(f"tensor {name!r}: shape {e.get('shape')!r} is not a list of sizes")
    if not isinstance(e.get("dtype"), str) or e["dtype"] not in dtypes.BY_CODE:
        raise bad(f"tensor {name!r}: dtype {e.get('dtype')!r} is not a safetensors dtype code")
    if not is_digest(e.get("sha256")):
        raise bad(f"tensor {name!r}: sha256 {e.get('sha256')!r} is not a SHA-256 hex digest")
    if "rule" in e and not isinstance(e["rule"], str):
        raise bad(f"tensor {name!r}: rule must be a string")
    if "axis" not in e:
        raise bad(f"tensor {name!r}: no axis (null for a replicated tensor)")
    shape, axis = e["shape"], e["axis"]
    if axis is None:
        if "ranges" in e or "padded_shape" in e:
            raise bad(f"tensor {name!r}: a replicated tensor (axis null) has no ranges or padded_shape")
        return
    if type(axis) is not int or not 0 <= axis < len(shape):
        raise bad(f"tensor {name!r}: axis {axis!r} is not null or an axis of its {len(shape)}-d shape")
    full = shape
    if "padded_shape" in e:
        full = e["padded_shape"]
        if not (_dims(full) and len(full) == len(shape) and full[axis] >= shape[axis]
                and all(a == b for i, (a, b) in enumerate(zip(full, shape)) if i != axis)):
            raise bad(f"tensor {name!r}: padded_shape {full!r} is not its shape {shape} padded along axis {axis}")
    n = full[axis]
    if "ranges" not in e:
        if n % ranks:
            raise bad(f"tensor {name!r}: recorded as an even split of {n} over {ranks} ranks")
        return
    ranges = e["ranges"]
    if not isinstance(ranges, list) or len(ranges) != ranks:
        raise bad(f"tensor {name!r}: ranges must list the intervals of each of the {ranks} ranks")
    for r, ivs in enumerate(ranges):
        if not isinstance(ivs, list) or not all(
                isinstance(iv, list) and len(iv) == 2 and all(type(x) is int for x in iv) and 0 <= iv[0] < iv[1] <= n
                for iv in ivs):
            raise bad(f"tensor {name!r}: ranges of rank {r} are not [start, stop) intervals within 0..{n}")


def rank_number(name: str):
    """r for a directory name `rank-{r:05d}` (exactly that spelling), else None."""
    m = _RANK_DIR.fullmatch(name)
    return int(m.group(1)) if m and name == f"rank-{int(m.group(1)):05d}" else None


def rank_dirs(path: Path) -> dict:
    """{rank: name} of the `rank-XXXXX` directories in `path` (real directories, not symlinks)."""
    found = {}
    with os.scandir(path) as it:
        for entry in it:
            r = rank_number(entry.name)
            if r is not None and entry.is_dir(follow_symlinks=False):
                found[r] = entry.name
    return found


def intervals(entry: dict, ranks: int, rank: int, name: str):
    """The [start, stop) intervals along the split axis that rank `rank` holds (DESIGN.md)."""
    if "ranges" in entry:
        return [tuple(iv) for iv in entry["ranges"][rank]]
    n = entry.get("padded_shape", entry["shape"])[entry["axis"]]
    if n % ranks:
        raise BadInput(f"mesh.json: tensor {name!r} is recorded as an even split of {n} over {ranks} ranks")
    k = n // ranks
    return [(rank * k, (rank + 1) * k)]


def rank_pieces(path: Path, ranks: int, only=()):
    """Every rank directory's tensors ({name: source} per rank), and the files they map."""
    pieces, mapped = [], []
    for r in range(ranks):
        ckpt = st.load(path / f"rank-{r:05d}", ReadOptions(only=list(only)))
        pieces.append({t.name: t for t in ckpt.tensors})
        mapped += ckpt.mapped
    return pieces, mapped


def load(path: Path, options: ReadOptions) -> Checkpoint:
    mesh = read_mesh(path)
    ranks = mesh["ranks"]
    pieces, mapped = rank_pieces(path, ranks, options.only)
    # mesh.json is sorted by name; the rank files keep the source's order, so use that
    order = {}
    for r in range(ranks):
        for name in pieces[r]:
            order.setdefault(name, (r, len(order)))
    names = sorted((n for n in mesh["tensors"] if wanted(n, options.only)), key=lambda n: order.get(n, (ranks, 0)))
    tensors = [assemble(name, mesh["tensors"][name], pieces, ranks) for name in names]
    source = {"format": NAME, "path": str(path), "tp": mesh.get("tp"), "ep": mesh.get("ep"), "rules": mesh["rules"]}
    files = model_files(path / "rank-00000") if (path / "rank-00000").is_dir() else []
    return Checkpoint(tensors, {}, source, files, mapped)


def assemble(name, entry, pieces, ranks):
    """A lazy global tensor from the rank pieces, checked against mesh.json's shape and dtype
    (assembled at `padded_shape`, then cut back to `shape`, for a --pad-vocab split)."""
    axis, dt = entry["axis"], dtypes.from_code(entry["dtype"])
    shape = tuple(entry.get("padded_shape", entry["shape"]))
    holders = [r for r in range(ranks) if name in pieces[r]]
    if not holders:
        raise BadInput(f"tensor {name!r} is in mesh.json but in no rank directory")
    if axis is None:
        src = pieces[holders[0]][name]
        if src.shape != shape or src.dtype != dt:
            raise BadInput(f"tensor {name!r}: rank {holders[0]} holds {src.shape}/{src.dtype.code}, "
                           f"mesh.json says {shape}/{dt.code}")
        return src
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
    whole = parts[0].renamed(name) if len(parts) == 1 else Concat(name, parts, axis)
    n = entry["shape"][axis]
    return whole if n == shape[axis] else whole.sliced(axis, 0, n).renamed(name)
