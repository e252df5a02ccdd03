"""A reshard output's own files: mesh.json (format tag, validation, building it) and the rank
directories beside it. Layout and meaning: docs/output.md ("Reshard outputs")."""
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from .. import dtypes, safejson
from ..storage import files as storage
from ..errors import BadInput
from ..io.hashing import sha256_file
from ..limits import MAX_NDIM
from .manifest import Rows
from .sums import NAME as SUMS, is_digest, write_sums

MESH = "mesh.json"
FORMAT = "ckptconv.mesh/1"
FORMAT_BOXES = "ckptconv.mesh/2"   # /1 plus `boxes` (pieces cut on two axes): written only when used
MAX_METADATA = 256 * 2**20  # mesh.json, manifests, indexes, SHA256SUMS: read whole, so bounded
_RANK_DIR = re.compile(r"rank-([0-9]{5,})")
# A partition rule's fields, as a rules file or mesh.json gives them, and the one type each must have
# (tp/rules.py builds rules from them).
RULE_FIELDS = {"pattern": str, "kind": str, "axis": int, "heads": int, "kv_heads": int, "head_dim": int,
               "experts": bool}


def rank_dir(rank: int) -> str:
    """The directory name of rank `rank`: rank-00000, rank-00001 ..."""
    return f"rank-{rank:05d}"


def read_regular(path, limit=MAX_METADATA) -> bytes:
    """The bytes of `path` in an output: a regular file, not followed if it is a link (safejson.read),
    or an object (storage/files.py)."""
    return storage.read_bytes(path, "file", limit, follow=False)


@dataclass(slots=True)
class MeshEntry:
    """One tensor of mesh.json, validated (docs/output.md): its global shape and dtype code, the axis
    it is split on (None: whole on every rank), its global SHA-256 (hex), the rule that placed it, and
    how an uneven split is cut: `ranges` (per rank, its [start, stop) intervals along `axis`) or
    `boxes` (per rank, boxes {axis: [start, stop]} cut on `axis` and one other); `padded_shape` for a
    --pad-vocab split. Neither: an even split of `full_shape[axis]` over the ranks."""

    shape: list
    dtype: str
    axis: int | None
    sha256: str
    rule: str | None = None
    ranges: list | None = None
    boxes: list | None = None
    padded_shape: list | None = None

    @property
    def full_shape(self) -> list:
        """The shape the ranks' pieces make up: `padded_shape` when the split axis was padded."""
        return self.shape if self.padded_shape is None else self.padded_shape


@dataclass(slots=True)
class MeshDoc:
    """mesh.json, validated (`parse_mesh`): the mesh (tp x ep = ranks), the partition rules it records
    (as data: tp/rules.from_json builds them), what the reshard read and how (`source`, the manifest's
    source without its rules), and every tensor by name (a MeshEntry), in the file's order."""

    format: str
    tp: int
    ep: int
    ranks: int
    rules: dict
    tensors: dict
    source: dict
    rank_order: str | None = None

    @property
    def target(self):
        """The layout a reshard wrote for an engine (vLLM's: `{"engine": "vllm", ...}`), else None."""
        return self.source.get("target")


def parse_mesh(data: bytes, where, on_disk: int | None = None) -> MeshDoc:
    """Validate everything the readers, reshard and verify rely on (types, ranges, sizes); any fault
    is a BadInput naming mesh.json and what is wrong, never a crash later on. With `on_disk` (how
    many rank directories are on disk), the rank count must be that: a count read from a file is
    never looped over unchecked. Returns the document as a MeshDoc."""
    mesh = safejson.loads(data, where, MESH)
    if not isinstance(mesh, dict) or mesh.get("format") not in (FORMAT, FORMAT_BOXES):
        raise BadInput(f"{where}: not a {FORMAT} or {FORMAT_BOXES} description")

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
    if not isinstance(mesh.get("source", {}), dict):
        raise bad("'source' must be an object")
    tensors = {}
    for name, entry in mesh["tensors"].items():
        _check_entry(name, entry, ranks, bad)
        if "boxes" in entry and mesh["format"] != FORMAT_BOXES:
            raise bad(f"tensor {name!r}: 'boxes' are {FORMAT_BOXES}, this file says {mesh['format']}")
        tensors[name] = MeshEntry(entry["shape"], entry["dtype"], entry["axis"], entry["sha256"], entry.get("rule"),
                                  entry.get("ranges"), entry.get("boxes"), entry.get("padded_shape"))
    order = mesh.get("rank_order")
    return MeshDoc(mesh["format"], mesh["tp"], mesh["ep"], ranks, mesh["rules"], tensors, mesh.get("source", {}),
                   order if isinstance(order, str) else None)


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
            want = RULE_FIELDS.get(key)
            if want is None or type(value) is not want:
                raise bad(f"rule {i}: {key!r} = {value!r} is not a valid rule field")


def _check_entry(name, e, ranks, bad):
    if not isinstance(e, dict):
        raise bad(f"tensor {name!r}: entry must be an object")
    if not _dims(e.get("shape")) or len(e["shape"]) > MAX_NDIM:
        raise bad(f"tensor {name!r}: shape is not a list of at most {MAX_NDIM} sizes")
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
        if "ranges" in e or "padded_shape" in e or "boxes" in e:
            raise bad(f"tensor {name!r}: a replicated tensor (axis null) has no ranges, boxes or padded_shape")
        return
    if type(axis) is not int or not 0 <= axis < len(shape):
        raise bad(f"tensor {name!r}: axis {axis!r} is not null or an axis of its {len(shape)}-d shape")
    if "boxes" in e:
        if "ranges" in e or "padded_shape" in e:
            raise bad(f"tensor {name!r}: 'boxes' go without 'ranges' and 'padded_shape'")
        _check_boxes(name, e["boxes"], shape, axis, ranks, bad)
        return
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
        if not isinstance(ivs, list) or not all(_interval(iv, n) for iv in ivs):
            raise bad(f"tensor {name!r}: ranges of rank {r} are not [start, stop) intervals within 0..{n}")
        if len({tuple(iv) for iv in ivs}) != len(ivs):
            raise bad(f"tensor {name!r}: rank {r} lists an interval twice")


def _interval(iv, n) -> bool:
    """A non-empty [start, stop) within 0..n (reshard replicates a tensor with no elements)."""
    return isinstance(iv, list) and len(iv) == 2 and all(type(x) is int for x in iv) and 0 <= iv[0] < iv[1] <= n


def _check_boxes(name, boxes, shape, axis, ranks, bad):
    """Per rank a list of boxes {axis: [start, stop]} (keys the axes' decimal numbers), joined along
    `axis`: every box names `axis` and the one other axis the entry is cut on, and a rank's boxes
    share their interval on that other axis (so they join into one piece)."""
    if not isinstance(boxes, list) or len(boxes) != ranks:
        raise bad(f"tensor {name!r}: boxes must list the boxes of each of the {ranks} ranks")
    axes, sizes = None, {str(i): n for i, n in enumerate(shape)}
    for r, rank_boxes in enumerate(boxes):
        if not isinstance(rank_boxes, list):
            raise bad(f"tensor {name!r}: boxes of rank {r} must be a list")
        outer, seen = None, set()
        for box in rank_boxes:
            ok = isinstance(box, dict) and str(axis) in box and all(
                k in sizes and _interval(iv, sizes[k]) for k, iv in box.items())
            if not ok:
                raise bad(f"tensor {name!r}: a box of rank {r} is not {{axis: [start, stop)}} within the shape "
                          f"{shape}, naming axis {axis}")
            axes = axes or set(box)
            if set(box) != axes or len(axes) != 2:
                raise bad(f"tensor {name!r}: every box must name axis {axis} and one same other axis")
            other = next(k for k in box if k != str(axis))
            if outer not in (None, box[other]):
                raise bad(f"tensor {name!r}: the boxes of rank {r} differ on axis {other}: they do not join")
            outer = box[other]
            if tuple(box[str(axis)]) in seen:
                raise bad(f"tensor {name!r}: rank {r} lists a box twice")
            seen.add(tuple(box[str(axis)]))


def outer_cut(entry: MeshEntry, rank: int):
    """(axis, (start, stop)) of the other axis a `boxes` entry cuts rank `rank`'s piece on, else None."""
    if entry.boxes is None:
        return None
    for box in entry.boxes[rank]:
        other = next(k for k in box if k != str(entry.axis))
        return int(other), tuple(box[other])
    return None


def rank_number(name: str):
    """r for a directory name `rank_dir(r)` (exactly that spelling), else None."""
    m = _RANK_DIR.fullmatch(name)
    return int(m.group(1)) if m and name == rank_dir(int(m.group(1))) else None


def rank_dirs(path: Path) -> dict:
    """{rank: name} of the rank directories in `path` (real directories, not symlinks; prefixes in a
    store)."""
    found = {}
    for name, st in storage.scan(path).items():
        r = rank_number(name)
        if r is not None and stat.S_ISDIR(st.st_mode):
            found[r] = name
    return found


def intervals(entry: MeshEntry, ranks: int, rank: int, name: str):
    """The [start, stop) intervals along the split axis that rank `rank` holds (docs/output.md)."""
    if entry.ranges is not None:
        return [tuple(iv) for iv in entry.ranges[rank]]
    if entry.boxes is not None:
        return [tuple(box[str(entry.axis)]) for box in entry.boxes[rank]]
    n = entry.full_shape[entry.axis]
    if n % ranks:
        raise BadInput(f"{MESH}: tensor {name!r} is recorded as an even split of {n} over {ranks} ranks")
    k = n // ranks
    return [(rank * k, (rank + 1) * k)]


def _boxed(p) -> bool:
    """A TensorPlan recorded as `boxes`: split unevenly on two axes (which makes mesh.json `/2`)."""
    return p.axis is not None and not p.even and p.outer is not None


def recorded_cut(p) -> dict:
    """How mesh.json (and the plan) records a TensorPlan's (tp/intervals.py) uneven cut: `ranges` along
    `axis`, or `boxes` for a piece cut on two axes (docs/output.md); {} for an even split or a
    replicated tensor."""
    if p.axis is None or p.even:
        return {}
    if not _boxed(p):
        return {"ranges": [[list(iv) for iv in r] for r in p.ranges]}
    outer, groups = p.outer
    first = min(outer, p.axis)
    return {"boxes": [[{str(first): list(groups[r] if first == outer else iv),
                        str(max(outer, p.axis)): list(iv if first == outer else groups[r])} for iv in rank]
                      for r, rank in enumerate(p.ranges)]}


def document(plans, rules, tp, ep, source, digests) -> dict:
    """mesh.json for a reshard's TensorPlans (reshard.py), its RuleSet and the global digests (32
    bytes per plan, in plan order, back to back); its tensors are written entry by entry (manifest.Rows)."""
    def entry(i) -> dict:
        p = plans[i]
        e = {"shape": list(p.shape), "dtype": p.dtype.code, "axis": p.axis, "rule": p.rule,
             "sha256": digests[32 * i:32 * i + 32].hex(), **recorded_cut(p)}
        if p.padded is not None:
            e["padded_shape"] = list(p.shape[:p.axis] + (p.padded,) + p.shape[p.axis + 1:])
        return e

    order = sorted(range(len(plans)), key=lambda i: plans[i].name)
    return {"format": FORMAT_BOXES if any(map(_boxed, plans)) else FORMAT, "tp": tp, "ep": ep, "ranks": tp * ep,
            "rank_order": "rank = expert_group * tp + tp_rank", "rules": rules.to_json(),
            "source": {k: v for k, v in source.items() if k != "rules"},
            "tensors": Rows(len(plans), lambda: ((plans[i].name, entry(i)) for i in order))}


def write_top_sums(out_dir, known=None):
    """OUT/SHA256SUMS over mesh.json and every other top-level regular file (the rank directories
    carry their own), so nothing in a reshard output is unhashed; `known`: digests the writer already
    has of files it made here (mesh.json, hard links to rank shards, files carried), not read again.
    In an object store (a Target that is remote) what the writer made is what `known` names."""
    from ..storage.targets import as_target
    target, digests, known = as_target(out_dir), {}, known or {}
    if target.remote:
        digests = dict(known)
    else:
        with os.scandir(target.path()) as it:
            for entry in it:
                if entry.name != SUMS and entry.is_file(follow_symlinks=False):
                    digests[entry.name] = known[entry.name] if entry.name in known else sha256_file(entry.path)
    write_sums(target, digests)
