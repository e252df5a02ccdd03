"""verify: prove an output is intact and consistent, equal to its source, and loads onto devices.

Structural checks read every byte once: each shard is streamed from its mapping while one thread
digests the file and another digests each tensor's bytes (both cores), and every finding becomes one
line naming the file and the tensor. Reshard outputs are checked rank by rank, then against
mesh.json by assembling each global tensor lazily from the rank pieces (never in memory).
"""
import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import sha256
from .errors import BadInput, UsageError
from .hashing import CHUNK, HashLanes, sha256_file
from .mapped import MappedFile
from .readers import ReadOptions, mesh as mesh_reader, open_checkpoint
from .safetensors_format import parse_header
from .tensor import as_bytes, cast, iter_blocks, sha256_of
from . import dtypes
from .writer import INDEX_NAME, MANIFEST_FORMAT


@dataclass
class Report:
    problems: list = field(default_factory=list)
    files: int = 0
    tensors: int = 0
    bytes: int = 0
    device: dict | None = None
    shared: int = 0   # problems already merged across processes

    def add(self, where, what):
        self.problems.append(f"{where}: {what}")


def _json(path: Path, report: Report, what: str):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        report.add(path, f"{what} is missing")
    except (OSError, ValueError) as e:
        report.add(path, f"{what} cannot be read: {e}")
    return None


def _sums(path: Path, report: Report) -> dict:
    sums = {}
    try:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            digest, sep, name = line.partition("  ")
            if not sep or len(digest) != 64:
                report.add(path, f"line {n} is not in `sha256sum` format")
                continue
            sums[name] = digest
    except FileNotFoundError:
        report.add(path, "SHA256SUMS is missing")
    return sums


def verify_dir(d: Path, report: Report, progress=None, hash_only=None, structural=True) -> dict:
    """Check one output directory; returns {tensor: manifest entry} for what checked out structurally.
    `hash_only` limits the (expensive) hashing to some shards; `structural=False` skips everything
    else (another process of a multi-process run does it)."""
    index = _json(d / INDEX_NAME, report, "the index")
    manifest = _json(d / "manifest.json", report, "manifest.json")
    sums = _sums(d / "SHA256SUMS", report)
    if manifest is not None and manifest.get("format") != MANIFEST_FORMAT:
        report.add(d / "manifest.json", f"format is {manifest.get('format')!r}, not {MANIFEST_FORMAT}")
    m_files = (manifest or {}).get("files", {})
    m_tensors = (manifest or {}).get("tensors", {})
    weight_map = (index or {}).get("weight_map", {})
    shard_names = sorted(set(weight_map.values()) | {f for f in m_files if f.endswith(".safetensors")})

    located = {}   # tensor -> (file, HeaderEntry)
    for shard in shard_names:
        path = d / shard
        if not path.is_file():
            report.add(path, "shard is missing")
            continue
        m = MappedFile(path)
        try:
            header = parse_header(m.view, m.size, path)
        except BadInput as e:
            report.add(path, str(e).split(": ", 1)[-1])
            continue
        for p in header.problems if structural else ():
            report.add(path, p)
        for e in header.entries:
            if e.name in located:
                report.add(path, f"tensor {e.name!r} also appears in {located[e.name][0]}")
            else:
                located[e.name] = (shard, e)
        if hash_only is None or shard in hash_only:
            _hash_shard(m, header, shard, m_files, m_tensors, sums, report, progress)
            report.files += 1
    if not structural:
        return {}

    for name, file in weight_map.items():
        if name not in located:
            report.add(d / INDEX_NAME, f"tensor {name!r} is listed in the index (in {file}) but is in no shard")
        elif located[name][0] != file:
            report.add(d / INDEX_NAME, f"tensor {name!r} is listed in {file} but is in {located[name][0]}")
    for name, (file, _) in located.items():
        if index is not None and name not in weight_map:
            report.add(d / file, f"tensor {name!r} is in the shard but missing from the index")
        if manifest is not None and name not in m_tensors:
            report.add(d / file, f"tensor {name!r} is in the shard but missing from manifest.json")
    for name, entry in m_tensors.items():
        if name not in located:
            report.add(d / "manifest.json", f"tensor {name!r} is in the manifest but in no shard")
            continue
        file, e = located[name]
        if entry.get("dtype") != e.dtype.code or list(entry.get("shape", [])) != list(e.shape):
            report.add(d / file, f"tensor {name!r} is {e.dtype.code}{list(e.shape)}, the manifest says "
                                 f"{entry.get('dtype')}{entry.get('shape')}")
        if entry.get("file") != file:
            report.add(d / file, f"tensor {name!r} is here, the manifest says {entry.get('file')}")
    report.tensors += len(located)

    listed = set(sums) | set(m_files)
    for name in sorted(listed - set(shard_names)):
        path = d / name
        if not path.is_file():
            report.add(path, "listed in the manifest or SHA256SUMS but missing")
            continue
        digest = sha256_file(path)
        if name in m_files and m_files[name].get("sha256") != digest:
            report.add(path, "sha256 differs from manifest.json")
        if name in sums and sums[name] != digest:
            report.add(path, "sha256 differs from SHA256SUMS")
    if sums and "manifest.json" not in sums:
        report.add(d / "SHA256SUMS", "does not list manifest.json")
    for p in sorted(d.iterdir()):
        if p.is_file() and p.name != "SHA256SUMS" and p.name not in listed:
            report.add(p, "file is not listed in SHA256SUMS or the manifest")
    return {n: m_tensors[n] for n in located if n in m_tensors}


def _hash_shard(m, header, shard, m_files, m_tensors, sums, report, progress):
    """Digest the file and each tensor in one streaming pass (hashing.HashLanes), while this thread
    maps the next chunk's pages in; pages are dropped once the hashes are done with them."""
    path = Path(m.path)
    hashes, file_h, chunks, digests = HashLanes(), sha256.new(), deque(), []
    try:
        pos = released = 0
        ranges = [(None, 0, header.data_start)] + [(e, e.begin, e.end) for e in header.entries if e.end <= m.size]
        for entry, begin, end in ranges:
            if begin > pos:
                chunks.append((hashes.feed(m.view[pos:begin], file_h), begin))
            begin = max(begin, pos)
            tensor_h = sha256.new() if entry is not None else None
            while begin < end:
                n = min(CHUNK, end - begin)
                m.populate(begin, n)
                chunks.append((hashes.feed(m.view[begin:begin + n], file_h, tensor_h), begin + n))
                begin += n
                if len(chunks) > 4:  # wait for the oldest chunk, drop the pages the hashes are done with
                    futures, done_to = chunks.popleft()
                    for f in futures:
                        f.result()
                    m.release(released, done_to - released)
                    released = done_to
                if progress:
                    progress(n)
            if tensor_h is not None:
                digests.append((entry, hashes.digest("tensor", tensor_h)))
            pos = max(pos, end)
        if pos < m.size:
            chunks.append((hashes.feed(m.view[pos:], file_h), m.size))
        for futures, _ in chunks:
            for f in futures:
                f.result()
        file_digest = hashes.digest("file", file_h).result()
    finally:
        hashes.close()
        m.release(0, m.size)
    report.bytes += m.size
    info = m_files.get(shard)
    if info is None:
        report.add(path, "shard is not listed in manifest.json files")
    else:
        if info.get("size") != m.size:
            report.add(path, f"size is {m.size} bytes, the manifest says {info.get('size')} (truncated?)")
        if info.get("sha256") != file_digest:
            report.add(path, "sha256 differs from manifest.json")
    if shard in sums and sums[shard] != file_digest:
        report.add(path, "sha256 differs from SHA256SUMS")
    for entry, digest in digests:
        want = m_tensors.get(entry.name, {}).get("sha256")
        if want is not None and want != digest.result():
            report.add(path, f"tensor {entry.name!r}: sha256 differs from the manifest (its bytes "
                             f"{entry.begin}..{entry.end} are corrupted)")


def verify_mesh(path: Path, report: Report, progress=None, mine=lambda kind, key: True):
    """A reshard output: every rank dir on its own, then the pieces against mesh.json. `mine(kind, key)`
    says which rank dirs and tensors this process checks (all, in a single process)."""
    mesh = mesh_reader.read_mesh(path)
    ranks = mesh["ranks"]
    for r in range(ranks):
        d = path / f"rank-{r:05d}"
        if not d.is_dir():
            report.add(d, "rank directory is missing")
        elif mine("rank", r):
            verify_dir(d, report, progress)
    return mesh


def verify_mesh_tensors(path: Path, mesh: dict, report: Report, mine=lambda kind, key: True):
    """With every rank dir intact: replicas equal, shared intervals equal, reassembled digests right."""
    ranks = mesh["ranks"]
    per_rank = [json.loads((path / f"rank-{r:05d}" / "manifest.json").read_text())["tensors"] for r in range(ranks)]
    pieces, _ = mesh_reader.rank_pieces(path, ranks)  # headers parsed once, for every check below
    for name, entry in mesh["tensors"].items():
        if not mine("tensor", name):
            continue
        holders = [r for r in range(ranks) if name in per_rank[r]]
        if entry["axis"] is None:
            digests = {per_rank[r][name]["sha256"] for r in holders}
            if len(holders) != ranks:
                report.add(path / "mesh.json", f"replicated tensor {name!r} is missing on ranks "
                                               f"{sorted(set(range(ranks)) - set(holders))}")
            if len(digests) > 1:
                report.add(path / "mesh.json", f"replicated tensor {name!r} differs between ranks")
        else:
            _check_shared_intervals(name, entry, pieces, path, report)
        try:
            if sha256_of(mesh_reader.assemble(name, entry, pieces, ranks)) != entry["sha256"]:
                report.add(path / "mesh.json", f"tensor {name!r}: the global tensor reassembled from the rank "
                                               "pieces does not match its sha256 (a piece is on the wrong rank "
                                               "or cut on the wrong axis)")
        except BadInput as e:
            report.add(path / "mesh.json", str(e))


def _check_shared_intervals(name, entry, pieces, path, report):
    """Where several ranks hold the same interval (a shared kv head), their bytes must be equal."""
    if "ranges" not in entry:
        return
    axis, ranks = entry["axis"], len(pieces)
    seen = {}
    for r in range(ranks):
        at = 0
        for a, b in mesh_reader.intervals(entry, ranks, r, name):
            seen.setdefault((a, b), []).append((r, at))
            at += b - a
    for (a, b), holders in seen.items():
        if len(holders) < 2:
            continue
        digests = {sha256_of(pieces[r][name].sliced(axis, at, at + b - a)) for r, at in holders}
        if len(digests) > 1:
            report.add(path / "mesh.json", f"tensor {name!r}: interval {a}..{b} of axis {axis} differs between "
                                           f"ranks {[r for r, _ in holders]}")


def compare_against(out_path: Path, src, read: ReadOptions, fmt, report: Report, mine=lambda kind, key: True):
    """Every tensor (global tensor, for a reshard output) equal to the source, bit for bit, streaming."""
    out = open_checkpoint(out_path, None, ReadOptions())
    source = open_checkpoint(src, fmt, read)
    manifest = {}
    first = out_path / "rank-00000" if (out_path / "mesh.json").is_file() else out_path
    if (first / "manifest.json").is_file():
        manifest = json.loads((first / "manifest.json").read_text()).get("source", {})
    src_tensors = {t.name: t for t in source.tensors}
    prefix = manifest.get("strip_prefix")
    if prefix:
        src_tensors = {(n[len(prefix):] if n.startswith(prefix) and len(n) > len(prefix) else n): t
                       for n, t in src_tensors.items()}
    target = dtypes.BY_CODE.get(manifest.get("cast", ""))
    for t in out.tensors:
        s = src_tensors.pop(t.name, None)
        if not mine("tensor", t.name):
            continue
        if s is None:
            report.add(out_path, f"tensor {t.name!r} is not in the source {src}")
            continue
        if target is not None and s.dtype.is_float:
            s = cast(s, target)
        if s.dtype != t.dtype or s.shape != t.shape:
            report.add(out_path, f"tensor {t.name!r} is {t.dtype.code}{list(t.shape)}, the source has "
                                 f"{s.dtype.code}{list(s.shape)}")
            continue
        _compare(t, s, out_path, report)
    for name in src_tensors if mine("structure", None) else ():
        report.add(out_path, f"tensor {name!r} of the source is missing from the output")


def _compare(a, b, where, report):
    done = 0
    for x, y in zip(iter_blocks(a, CHUNK), iter_blocks(b, CHUNK)):
        xb, yb = as_bytes(x), as_bytes(y)
        if xb != yb:
            i = int(np.flatnonzero(np.frombuffer(xb, np.uint8) != np.frombuffer(yb, np.uint8))[0]) // x.dtype.itemsize
            index = np.unravel_index(done + i, a.shape) if a.shape else ()
            report.add(where, f"tensor {a.name!r} differs from the source at index {tuple(int(v) for v in index)}: "
                              f"{x.reshape(-1)[i]!r} != {y.reshape(-1)[i]!r}")
            break
        done += x.size
        a.release()
        b.release()


def verify(path, against=None, read=None, fmt=None, device=None, allow_fewer=False, progress=None,
           cluster=None) -> Report:
    """Every check, in order; each stage runs only if the one before found nothing. On several
    processes each checks its share (shards, rank dirs, tensors) and process 0 gathers the report."""
    path = Path(path)
    if not path.is_dir():
        raise UsageError(f"{path}: not an output directory")
    is_mesh = (path / "mesh.json").is_file()
    if not is_mesh and not ((path / INDEX_NAME).is_file() or (path / "manifest.json").is_file()):
        raise UsageError(f"{path}: holds neither {INDEX_NAME} nor mesh.json; not a ckptconv output")
    mine = _share(path, is_mesh, cluster)
    report = Report()
    if is_mesh:
        mesh = verify_mesh(path, report, progress, mine)
        _merge(cluster, "rank-dirs", report)
        if not report.problems:
            verify_mesh_tensors(path, mesh, report, mine)
    else:
        shards = None if cluster is None else {f for f in _shard_sizes(path) if mine("shard", f)}
        verify_dir(path, report, progress, shards, structural=cluster is None or cluster.is_main)
    _merge(cluster, "structure", report)
    if against is not None and not report.problems:
        compare_against(path, against, read or ReadOptions(), fmt, report, mine)
        _merge(cluster, "against", report)
    if device is not None and not report.problems:
        from .device import device_check
        report.device = device_check(path, device, allow_fewer, report, cluster)
        _merge(cluster, "device", report)
    _merge(cluster, "totals", report)
    return report


def _shard_sizes(path: Path) -> dict:
    index = json.loads((path / INDEX_NAME).read_text()) if (path / INDEX_NAME).is_file() else {}
    names = sorted(set(index.get("weight_map", {}).values()))
    return {n: (path / n).stat().st_size if (path / n).is_file() else 0 for n in names}


def _share(path: Path, is_mesh: bool, cluster):
    """Which rank dirs, shards and tensors this process checks: balanced by bytes, as runs split work."""
    if cluster is None:
        return lambda kind, key: True
    from .cluster import assign
    owners = {}
    if is_mesh:
        mesh = mesh_reader.read_mesh(path)
        ranks = list(range(mesh["ranks"]))
        sizes = [sum(p.stat().st_size for p in (path / f"rank-{r:05d}").glob("*.safetensors")) for r in ranks]
        owners.update({("rank", r): o for r, o in zip(ranks, assign(sizes, cluster.num_processes))})
        names = list(mesh["tensors"])
        tsizes = [int(np.prod(mesh["tensors"][n]["shape"])) * dtypes.from_code(mesh["tensors"][n]["dtype"]).itemsize
                  for n in names]
    else:
        shards = _shard_sizes(path)
        owners.update({("shard", n): o for n, o in zip(shards, assign(list(shards.values()), cluster.num_processes))})
        manifest = json.loads((path / "manifest.json").read_text()) if (path / "manifest.json").is_file() else {}
        names = list(manifest.get("tensors", {}))
        tsizes = [int(np.prod(manifest["tensors"][n]["shape"])) for n in names]
    owners.update({("tensor", n): o for n, o in zip(names, assign(tsizes, cluster.num_processes))})
    return lambda kind, key: owners.get((kind, key), 0) == cluster.process_id


def _merge(cluster, stage, report: Report):
    """Process 0 collects every process's findings for a stage, and tells everyone the total."""
    if cluster is None:
        return
    from .cluster import gather
    found = {"problems": report.problems[report.shared:]}
    if stage == "totals":
        found.update(files=report.files, tensors=report.tensors, bytes=report.bytes)
    results = gather(cluster, f"verify/{stage}", found)
    if cluster.is_main:
        merged = {"problems": report.problems[:report.shared] + [p for r in results for p in r["problems"]]}
        if stage == "totals":
            merged.update({k: sum(r[k] for r in results) for k in ("files", "tensors", "bytes")})
        cluster.put(f"verify/{stage}/all", merged)
    total = cluster.get(f"verify/{stage}/all", "process 0")
    report.problems, report.shared = list(total["problems"]), len(total["problems"])
    if stage == "totals":
        report.files, report.tensors, report.bytes = total["files"], total["tensors"], total["bytes"]


def total_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*.safetensors"))
