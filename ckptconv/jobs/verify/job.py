"""The verify job: which layout the output is (layouts.detected), then its stages in order through the
job runner (run/runner.run_stages: each only if the ones before found nothing) — the layout's own
check, --against, --device — on this process, or shared out as tasks of an executor (--ray: each
task checks a share of the units the layout names, run/share.Share, and the driver merges), or
with --device across the processes of a --distributed job (each places its ranks; process 0 gathers
the device findings through JAX's runtime); and the bytes an output holds, for the progress bar."""
import dataclasses
import functools
import hashlib
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

from ... import safejson, signals
from ...errors import BadInput, UsageError
from ...formats import pointer
from ...formats.identity import identity
from ...formats.sums import NAME as SUMS, parse_sums
from ...layouts import detected
from ...storage import files as storage
from ...layouts.report import Problem, Report, _detail
from ...readers import ReadOptions
from ...run.runner import run_stages
from ...run.share import Share
from .against import compare_against, compare_parts


def verify(request: "VerifyRequest", progress=None, cluster=None, executor=None) -> Report:
    """Every check, in order; each stage runs only if the one before found nothing; with `expect`
    (an output's identity, formats/identity.py), the output must also be exactly that one. On several
    processes each checks its share (shards, rank dirs, tensors) and process 0 gathers the report;
    they first agree that they verify the same output the same way."""
    request = dataclasses.replace(request, path=storage.locate(request.path, request.read.storage if request.read
                                                               is not None else None))   # (one session for the driver)
    report = unpublished(request.path)
    if report is not None:
        return report
    if cluster is not None and request.device is None:
        raise UsageError("--distributed is for verify --device across hosts (JAX's runtime places each rank on its "
                         "host); the file checks run with --workers on this host or --ray on a cluster")
    if executor is None and cluster is None:
        from ...run import executors
        executor = executors.make("local", workers=request.read.workers if request.read is not None else None)
    report = _verify(request, progress, cluster) if executor is None else _verify_tasks(request, progress, executor)
    if request.expect is not None and (cluster is None or cluster.is_main):
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


def located(request: VerifyRequest):
    """The output's path with its backend: a URL bound to a storage session with the request's
    options (a task re-locates it from the request it is given)."""
    return storage.place(storage.locate(request.path, request.read.storage if request.read is not None else None))


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


def unpublished(path) -> Report | None:
    """For an output in an object store, a Report of one problem when it is not published: it has no
    SHA256SUMS, or not the file a consumer opens first (its pointer, formats.pointer: written last,
    create-only; docs/storage.md), or (one object) only a run's lock beside it. None for a
    local path and a published output, which verify checks as any other."""
    if not isinstance(path, storage.RemotePath) or storage.is_file(path):
        return None
    lock = storage.join(storage.parent(path), f".{storage.name(path)}.ckptconv-lock")
    names = storage.listdir(path) if storage.is_dir(path) else []
    if not names:
        if not storage.exists(lock):
            return None   # (nothing there: said by the layouts' detection, exit 2)
        why = f"nothing is there but a run's lock ({storage.name(lock)}): a run is writing it, or one was killed"
    else:
        listed, _ = parse_sums(storage.read_bytes(storage.join(path, SUMS), SUMS, 1 << 30), paths=True) \
            if SUMS in names else ({}, [])
        first = pointer(listed)
        if SUMS in names and (first is None or first in names):
            return None
        why = (f"{first} is not there" if SUMS in names else f"{SUMS} is not there") + \
            " (written last: a run is writing it, or one failed or was killed; --resume or --overwrite completes it)"
    report = Report()
    report.add(path, f"incomplete (not published): {why}", "unpublished")
    return report


def _verify(request: VerifyRequest, progress, cluster) -> Report:
    """The stages on this process. With a --distributed device check (`cluster`), every process checks
    the files whole (they find the same, and skip alike), then each places its share of the ranks and
    the device stage's findings are merged on process 0 (`_merge`, through JAX's runtime)."""
    path = located(request)
    layout = detected(path)
    report = Report()

    def check():
        layout.check(path, report, progress, None)

    def against():
        parts = layout.parts(path)   # (an output made of outputs: each compared with the source's part)
        compare = compare_against if parts is None else functools.partial(compare_parts, parts=parts)
        compare(path, layout, request.against, request.read or ReadOptions(), request.fmt, report,
                lambda kind, key: True)

    def device():
        _device_stage(path, layout, request, report, cluster)

    run_stages([("structure", check), ("against", against if request.against is not None else None),
                ("device", device if request.device is not None else None)],
               lambda: not report.problems, lambda stage: _merge(cluster, stage, report, request))
    return report


def _device_stage(path, layout, request: VerifyRequest, report: Report, cluster=None):
    """--device: the output's tensors placed on the devices and compared with the recorded digests
    (jobs/verify/device.py); under --distributed each process places its share of the ranks."""
    main = cluster is None or cluster.is_main
    if report.foreign and main:
        report.notes.append(f"{path}: --device compares what reaches the device with the recorded digests; "
                            "there are none here, so nothing was placed")
    elif layout.parts(path) is not None:
        raise UsageError(f"{path}: --device places the tensors of one output; give one of its folders "
                         f"({', '.join(str(path / p.name) for p in layout.parts(path) if p.layout)})")
    elif not report.foreign:
        whole = cluster is not None and layout.check_units(path) is None   # (one file: process 0 places it)
        if main or not whole:
            from .device import device_check
            report.device = device_check(path, request.device, request.allow_fewer, report,
                                         None if whole else cluster)


def _verify_tasks(request: VerifyRequest, progress, executor) -> Report:
    """verify's file checks as tasks of `executor` (--workers N on this host, --ray on a cluster): the
    units the layout names are split into as many shares as the executor runs at once, each share's
    stage a task (share_task); the driver merges each stage's findings in share order (share 0 also
    checks what no unit names) and runs the next stage only if nothing was found. The device stage
    is not for tasks: --device places on this host, after the file checks (--ray refuses it; across
    hosts it runs under --distributed with JAX's launcher). Work that would not run side by side (one
    worker, one unit, a small output without --workers) runs in this process as it always did."""
    remote = executor.name != "local"
    if request.device is not None and remote:
        raise UsageError("--device loads onto this host's devices (or, across hosts, under --distributed with JAX's "
                         "launcher); --ray checks files only: give one of them")
    path = located(request)
    layout = detected(path)
    units = layout.check_units(path)
    rows = max((len(r) for r in units.values()), default=0) if units is not None else 0
    measured = not remote and executor.auto   # (the bytes decide only an automatic worker count)
    if units is None or not executor.side_by_side(rows, total_bytes(path) if measured else 0):
        return _verify(request, progress, None)   # (one file, an output ckptconv did not write, or too little to share)
    n = max(1, min(executor.lanes(), rows))
    if request.read is not None:   # (a task parses --against's files with one thread: the tasks are in flight side by side)
        request = dataclasses.replace(request, read=dataclasses.replace(request.read, workers=1))
    report = Report()
    for stage in ("structure", "against") if request.against is not None else ("structure",):
        if report.problems:
            break
        found = executor.map(share_task, [(request, stage, i, n, units) for i in range(n)],
                             [f"{path} ({stage}, share {i + 1} of {n})" for i in range(n)], progress)
        for f in found:
            report.problems += [Problem(**p) for p in f["problems"]]
            report.files, report.tensors, report.bytes = (report.files + f["files"], report.tensors + f["tensors"],
                                                          report.bytes + f["bytes"])
            report.notes += [n_ for n_ in f["notes"] if n_ not in report.notes]
            report.foreign = report.foreign or f["foreign"]
    if request.device is not None and not report.problems:
        _device_stage(path, layout, request, report)
    return report


def share_task(request: VerifyRequest, stage: str, i: int, n: int, units: dict, progress=None) -> dict:
    """One share (`i` of `n`) of one verify stage, as a task runs it anywhere: its findings and counts
    (`progress(nbytes)`: the bytes it checks, where the executor feeds the driver's bar from it)."""
    path = located(request)
    layout = detected(path)
    report = Report()
    share = Share(i, n, units)
    if stage == "structure":
        layout.check(path, report, progress, share)
    else:
        parts = layout.parts(path)
        compare = compare_against if parts is None else functools.partial(compare_parts, parts=parts)
        compare(path, layout, request.against, request.read or ReadOptions(), request.fmt, report, share.mine)
    return {"problems": [asdict(p) for p in report.problems], "files": report.files, "tensors": report.tensors,
            "bytes": report.bytes, "notes": report.notes, "foreign": report.foreign}


def _merge(cluster, stage, report: Report, request: VerifyRequest):
    """After the device stage of a --distributed check, the processes agree that they checked the same
    output the same way, and process 0 collects every process's device findings and tells everyone
    the total (so they all exit alike). (A stage's end is a checkpoint for a pending signal, see
    signals.py.)"""
    signals.check()
    if cluster is None or stage != "device" or cluster._client is None:
        return
    from .cluster import agree, gather
    agree(cluster, _job(request))
    found = {"problems": [asdict(p) for p in report.problems[report.shared:]]}
    results = gather(cluster, f"verify/{stage}", found)
    if cluster.is_main:
        merged = {"problems": [asdict(p) for p in report.problems[:report.shared]]
                  + [p for r in results for p in r["problems"]]}
        cluster.put(f"verify/{stage}/all", merged)
    total = cluster.get(f"verify/{stage}/all", 0)
    report.problems = [Problem(**p) for p in total["problems"]]
    report.shared = len(report.problems)


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
        for name, st in storage.scan(d).items():
            if stat.S_ISDIR(st.st_mode):
                if depth == 0:
                    scan(storage.join(d, name), 1)
            elif name.endswith(".safetensors") and stat.S_ISREG(st.st_mode):
                total += st.st_size

    try:
        scan(os.fspath(path), 0)
    except (OSError, BadInput):
        pass
    return total
