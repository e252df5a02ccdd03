"""The verify job: every check in order, each stage only if the one before found nothing, on one process
or shared out across several (each checks its share of rank directories, shards and tensors, and process 0
gathers the report); and the bytes an output holds, for the progress bar."""
import hashlib
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import dtypes, safejson, signals
from ..errors import BadInput, UsageError
from ..readers import ReadOptions, mesh as mesh_reader
from ..formats.sums import NAME as SUMS
from ..formats import manifest as manifest_format
from ..formats.identity import identity
from ..formats.manifest import MANIFEST
from ..formats.mesh import MESH, rank_dir, rank_dirs
from .against import compare_against
from .foreign import _verify_foreign_dir
from .mesh import verify_mesh, verify_mesh_tensors
from .output import verify_dir, verify_file
from .report import Problem, Report, _detail
from .scan import _read_meta, _regular, _scan


def verify(path, against=None, read=None, fmt=None, device=None, allow_fewer=False, progress=None,
           cluster=None, expect=None) -> Report:
    """Every check, in order; each stage runs only if the one before found nothing; with `expect`
    (an output's identity, formats/identity.py), the output must also be exactly that one. On several
    processes each checks its share (shards, rank dirs, tensors) and process 0 gathers the report;
    they first agree that they verify the same output the same way."""
    request = VerifyRequest(path, against, read, fmt, device, allow_fewer, expect)
    report = _verify(request, progress, cluster)
    if expect is not None and (cluster is None or cluster.is_main):
        _check_expected(request, report)
    return report


@dataclass(frozen=True)
class VerifyRequest:
    """What one verify is asked, as it travels between the stages: the output (`path` as given), the
    source to compare it with (--against, read with `read` as --from `fmt`), the devices to load it
    onto (--device, --allow-fewer-devices), and the identity it must have (--expect)."""

    path: object
    against: object = None
    read: ReadOptions | None = None
    fmt: str | None = None
    device: str | None = None
    allow_fewer: bool = False
    expect: str | None = None


def _check_expected(request: VerifyRequest, report: Report):
    """--expect: the output is exactly the one named by its identity (formats/identity.py)."""
    path, expect = request.path, request.expect
    try:
        found = identity(path)
    except BadInput as e:
        found, why = None, f"has nothing to name it by ({_detail(e, path)})"
    if found is not None and found != expect:
        why = f"is not the expected output: its identity is {found}, not {expect}"
    if found != expect:
        report.add(path, why, "identity")
    else:
        report.expected = True


def _verify(request: VerifyRequest, progress, cluster) -> Report:
    path = Path(request.path)
    if cluster is not None and cluster.num_processes > 1:
        from ..cluster import agree
        agree(cluster, _job(request))
    if path.name.endswith(".safetensors") and path.is_file():
        return _verify_single(request, progress, cluster)
    if not path.is_dir():
        raise UsageError(f"{path}: neither an output directory nor a .safetensors file")
    is_mesh = os.path.lexists(path / MESH)
    names = os.listdir(path)
    if not is_mesh and not os.path.lexists(path / MANIFEST) and not os.path.lexists(path / SUMS):
        if not any(n.endswith((".safetensors", manifest_format.INDEX_SUFFIX)) for n in names):
            raise UsageError(f"{path}: holds no safetensors files, index, {MANIFEST} or {MESH}; not a ckptconv output "
                             "nor any other safetensors output")
        return _verify_single(request, progress, cluster, _verify_foreign_dir)
    mine = _share(path, is_mesh, cluster)
    report = Report()
    if is_mesh:
        mesh = verify_mesh(path, report, progress, mine)
        _merge(cluster, "rank-dirs", report)
        if not report.problems and mesh is not None:
            verify_mesh_tensors(path, mesh, report, mine)
    else:
        shards = None if cluster is None else {f for f in _shard_sizes(path) if mine("shard", f)}
        verify_dir(path, report, progress, shards, structural=cluster is None or cluster.is_main)
    _merge(cluster, "structure", report)
    if request.against is not None and not report.problems:
        compare_against(path, request.against, request.read or ReadOptions(), request.fmt, report, mine)
        _merge(cluster, "against", report)
    if request.device is not None and not report.problems:
        from ..device import device_check
        report.device = device_check(path, request.device, request.allow_fewer, report, cluster)
        _merge(cluster, "device", report)
    _merge(cluster, "totals", report)
    return report


def _verify_single(request: VerifyRequest, progress, cluster, check=None) -> Report:
    """One file (or an output ckptconv did not write) is checked whole by process 0; the others wait
    for its report."""
    path, report = Path(request.path), Report()
    if cluster is None or cluster.is_main:
        (check or verify_file)(path, report, progress)
        if request.against is not None and not report.problems:
            compare_against(path, request.against, request.read or ReadOptions(), request.fmt, report)
        if request.device is not None and not report.problems and report.foreign:
            report.notes.append(f"{path}: --device compares what reaches the device with the recorded digests; "
                                "there are none here, so nothing was placed")
        elif request.device is not None and not report.problems:
            from ..device import device_check
            report.device = device_check(path, request.device, request.allow_fewer, report)
    _merge(cluster, "totals", report)
    return report


def _shard_sizes(path: Path) -> dict:
    """{shard: size} of the regular shard files the output's (valid) metadata names, for sharing work."""
    entries = _scan(path, Report())
    _, weight_map, _, m_files, _, sums = _read_meta(path, entries, Report())
    names = sorted(set((weight_map or {}).values())
                   | {f for f in (*(m_files or {}), *(sums or {})) if f.endswith(".safetensors")})
    return {n: entries[n].st_size if _regular(entries, n) else 0 for n in names}


def _share(path: Path, is_mesh: bool, cluster):
    """Which rank dirs, shards and tensors this process checks: balanced by bytes, as runs split work.
    Only what is on disk and valid is shared out; process 0 reports everything else."""
    if cluster is None:
        return lambda kind, key: True
    from ..writers.base import assign
    owners = {}
    if is_mesh:
        try:
            mesh = mesh_reader.read_mesh(path)
        except BadInput:
            mesh = None
        ranks = sorted(r for r in rank_dirs(path) if mesh is not None and r < mesh.ranks)
        sizes = [sum(_shard_sizes(path / rank_dir(r)).values()) for r in ranks]
        owners.update({("rank", r): o for r, o in zip(ranks, assign(sizes, cluster.num_processes))})
        tensors = mesh.tensors if mesh is not None else {}
        names = list(tensors)
        tsizes = [math.prod(tensors[n].shape) * dtypes.from_code(tensors[n].dtype).itemsize for n in names]
    else:
        shards = _shard_sizes(path)
        owners.update({("shard", n): o for n, o in zip(shards, assign(list(shards.values()), cluster.num_processes))})
        _, _, _, _, m_tensors, _ = _read_meta(path, _scan(path, Report()), Report())
        tensors = {n: e for n, e in (m_tensors or {}).items() if e is not None}
        names = list(tensors)
        tsizes = [math.prod(tensors[n].shape) for n in names]
    owners.update({("tensor", n): o for n, o in zip(names, assign(tsizes, cluster.num_processes))})
    return lambda kind, key: owners.get((kind, key), 0) == cluster.process_id


def _merge(cluster, stage, report: Report):
    """Process 0 collects every process's findings for a stage, and tells everyone the total. (A
    stage's end is a checkpoint for a pending signal, see signals.py.)"""
    signals.check()
    if cluster is None:
        return
    from ..cluster import gather
    found = {"problems": [asdict(p) for p in report.problems[report.shared:]]}
    if stage == "totals":
        found.update(files=report.files, tensors=report.tensors, bytes=report.bytes)
    results = gather(cluster, f"verify/{stage}", found)
    if cluster.is_main:
        merged = {"problems": [asdict(p) for p in report.problems[:report.shared]]
                  + [p for r in results for p in r["problems"]]}
        if stage == "totals":
            merged.update({k: sum(r[k] for r in results) for k in ("files", "tensors", "bytes")})
        cluster.put(f"verify/{stage}/all", merged)
    total = cluster.get(f"verify/{stage}/all", 0)
    report.problems = [Problem(**p) for p in total["problems"]]
    report.shared = len(report.problems)
    if stage == "totals":
        report.files, report.tensors, report.bytes = total["files"], total["tensors"], total["bytes"]


def _job(request: VerifyRequest) -> dict:
    """What one process of a verify is about to check, for `cluster.agree`: the options, and the
    output by what names every file of it (its SHA256SUMS, or a single file's header), as digests."""
    path = Path(request.path)
    first = path / SUMS if path.is_dir() else path
    try:
        with safejson.open_regular(first, follow=False) as fd:
            head = os.read(fd, 1 << 20)
    except BadInput:
        head = b""
    return {"options": {"--against": request.against is not None, "--from": request.fmt, "--device": request.device,
                        "--allow-fewer-devices": request.allow_fewer},
            "output": {"name": path.name, "digest": hashlib.sha256(head).hexdigest()}}


def total_bytes(path: Path) -> int:
    """Bytes of the .safetensors files in an output and its rank directories (for the progress bar);
    symlinks are not followed, and nothing deeper than a rank directory is walked."""
    total = 0

    def scan(d, depth):
        nonlocal total
        with os.scandir(d) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    if depth == 0:
                        scan(entry.path, 1)
                elif entry.name.endswith(".safetensors") and entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size

    try:
        scan(path, 0)
    except OSError:
        pass
    return total
