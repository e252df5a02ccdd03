"""plan: what a run would do, as data, without reading tensor data.

A run's units (shard files of a conversion, rank directories of a reshard) come from the same
writer's `plan` the run uses, and run/share.assign balances them over processes by bytes, exactly as
the job runner splits them (run/runner.py): the plan printed is the plan run. Peak memory and time are
estimates from ckptconv's measured behaviour (docs/benchmarks.md), stated as such. A source in an
object store is read over the network, and an OUT there written over it: those bytes go at the
network's speed instead of the disk's (docs/plan.md, "The estimates").
"""
import math
from dataclasses import dataclass

from ..storage.urls import is_url, parse

from ..run.share import assign
from ..tp.intervals import plan as reshard_plan
from ..tp.presets import MeshSpec, choose_rules
from ..layouts import layout
from ..layouts.base import Content, MeshPlan, PartContent, WriteOptions, named_after

# The estimates' constants, measured on the bench machine (docs/benchmarks.md, "plan against the run"):
BASE_RSS = 45 * 2**20          # interpreter, numpy, the reader and writer modules
IN_FLIGHT = 45 * 2**20         # staging buffers and chunks being hashed that a large write touches
# bytes per tensor: a convert's source record and packed digest, per tensor it writes; a reshard's
# source record and layout entry, per tensor of the checkpoint (every process plans them all) ...
PER_TENSOR_RSS = {"convert": 260, "reshard": 380}
# ... and per rank piece it writes, the piece's packed digest and its place in its shard plan (pieces
# themselves are made as they are written)
PER_PIECE_RSS = 48
CPU_GBPS = {"convert": 0.8,    # read, hash (file and tensor digests) and write, one process, warm cache
            "reshard": 0.5}    # the same and a third digest (the global tensor's), gathered row splits
# reading a tensor's record, planning, hashing and listing it; a convert's small tensors are digested
# in bulk (hashing.SMALL), a reshard's rank pieces one by one through the hash threads
PER_TENSOR_SECONDS = {"convert": 115e-6, "reshard": 110e-6}
NETWORK_GBPS = 1.25            # --network-gbps by default: a 10 Gbit/s link, in GB/s as --disk-gbps is
WORKER_START_S = 1.0           # --workers N > 1: starting the worker processes (spawned: interpreter, imports)


def units(ckpt, mesh: MeshSpec | None = None, write: WriteOptions = None):
    """(name, bytes) of every output file (convert) or rank directory (reshard, with `mesh`), in
    output order, and the rules chosen."""
    if ckpt.parts and mesh is None:   # (a diffusers pipeline: each component's shards, in its folder)
        parts = [PartContent(p.name, Content(p.ckpt.source.to_json()), p.ckpt.tensors, p.stem, p.variant)
                 for p in ckpt.parts if p.ckpt is not None]
        writer = layout(ckpt.output)(write or WriteOptions(), Content(ckpt.source.to_json(), parts=parts))
        return [(u.name, u.size) for u in writer.plan(ckpt.tensors)], None
    write, content = named_after(write or WriteOptions(), ckpt, ckpt.source.path), Content(ckpt.source.to_json())
    if mesh is None:
        return [(u.name, u.size) for u in layout("sharded")(write, content).plan(ckpt.tensors)], None
    rules = choose_rules(ckpt.whole(ckpt.source.path, "a reshard plan (--tp)"), mesh)
    plans = reshard_plan(ckpt.tensors, rules, mesh.tp, mesh.ep, mesh.pad_vocab)
    writer = layout("mesh")(write, content, mesh=MeshPlan(plans, rules, mesh.tp, mesh.ep))
    return [(u.name, u.size) for u in writer.plan(ckpt.tensors)], rules


@dataclass
class UnitPlan:
    """One output file (convert) or rank directory (reshard): its bytes, the process (host) that
    writes it, and which of that host's --workers lanes (a task in flight at a time) it falls to."""

    name: str
    bytes: int
    process: int
    worker: int = 0

    def to_json(self) -> dict:
        return {"name": self.name, "bytes": self.bytes, "process": self.process, "worker": self.worker}


@dataclass
class ProcessPlan:
    """What one process of the run does: its units, the bytes it reads and writes (and of those, the
    bytes that go over the network: a source or an OUT in an object store), the tensors (or rank
    pieces) it writes, and the estimates of its peak memory and time."""

    process: int
    units: list                 # unit names
    bytes_read: int
    bytes_written: int
    tensors_written: int
    peak_rss_bytes: int
    seconds: float
    network_bytes_read: int = 0
    network_bytes_written: int = 0

    def to_json(self) -> dict:
        return {"process": self.process, "units": self.units, "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written, "network_bytes_read": self.network_bytes_read,
                "network_bytes_written": self.network_bytes_written, "tensors_written": self.tensors_written,
                "peak_rss_bytes": self.peak_rss_bytes, "seconds": self.seconds}


@dataclass
class PlanReport:
    """`ckptconv plan`: the source, the job (convert, or a reshard for tp x ep with its rules), every
    unit and every process's share, and the estimated time, with the model that gives it."""

    source: str
    format: str
    tensors: int                # how many
    source_bytes: int
    job: str                    # convert | reshard
    tp: int | None
    ep: int
    rules: str | None           # the rules' name (reshard)
    hosts: int
    disk_gbps: float
    units: list                 # UnitPlan, in output order
    processes: list             # ProcessPlan, in process order
    seconds: float
    time_model: str
    network_gbps: float = NETWORK_GBPS
    out: str | None = None      # where the run would write (a URL: over the network), when given
    workers: int = 1            # tasks in flight on each host (--workers)

    def to_json(self) -> dict:
        """The `--json` document (docs/json.md), less its schema tag."""
        return {"source": self.source, "format": self.format, "tensor_count": self.tensors,
                "source_bytes": self.source_bytes, "job": self.job, "tp": self.tp, "ep": self.ep, "rules": self.rules,
                "hosts": self.hosts, "workers": self.workers, "disk_gbps": self.disk_gbps, "network_gbps": self.network_gbps,
                **({"out": self.out} if self.out is not None else {}), "units": [u.to_json() for u in self.units],
                "processes": [p.to_json() for p in self.processes], "seconds": self.seconds,
                "time_model": self.time_model}

    @property
    def networked(self) -> bool:
        """Whether the run reads or writes anything over the network (a source or OUT in a bucket)."""
        return any(p.network_bytes_read or p.network_bytes_written for p in self.processes)


def plan_run(ckpt, hosts=1, disk_gbps=2.0, mesh: MeshSpec | None = None, write: WriteOptions = None,
             network_gbps=NETWORK_GBPS, out=None, workers=1) -> PlanReport:
    """The plan of a run over `ckpt` on `hosts` processes (hosts), each with `workers` tasks in flight
    (one output file or rank directory each: run/executors.py); `out` (optional) is where it would
    write, which only matters as a local path or an object-store URL (written over the network).
    A host's disk and network are shared by its workers; its CPU work is split over them, each
    lane's units balanced by bytes as the host's are."""
    if out is not None and is_url(out):
        parse(out)   # (a URL that names no bucket is refused here as the run would refuse it)
    src_remote, out_remote = is_url(ckpt.source.path), out is not None and is_url(out)
    work, rules = units(ckpt, mesh, write)
    owner = assign([b for _, b in work], hosts)
    processes = []
    job = "reshard" if mesh else "convert"
    total, cpu_gbps, per_tensor, per_tensor_rss = (sum(b for _, b in work) or 1, CPU_GBPS[job],
                                                   PER_TENSOR_SECONDS[job], PER_TENSOR_RSS[job])
    lane = [0] * len(work)

    def pieces_of(units_, written):
        # tensors written: every tensor in each of its rank directories, or its share of a convert's
        return len(ckpt.tensors) * len(units_) if mesh else round(len(ckpt.tensors) * written / total)

    def rss(units_, written):
        pieces = pieces_of(units_, written)
        return BASE_RSS + min(IN_FLIGHT, written) + (per_tensor_rss * len(ckpt.tensors) + PER_PIECE_RSS * pieces
                                                     if mesh else per_tensor_rss * pieces)

    for p in range(hosts):
        at = [i for i, o in enumerate(owner) if o == p]
        mine = [work[i] for i in at]
        written = read = sum(b for _, b in mine)
        pieces = pieces_of(mine, written)
        net_read, net_written = read if src_remote else 0, written if out_remote else 0
        disk = read + written - net_read - net_written
        lanes = min(workers, len(mine)) or 1
        for i, w in zip(at, assign([work[i][1] for i in at], lanes)):
            lane[i] = w
        by_lane = [[work[i] for i in at if lane[i] == w] for w in range(lanes)]
        sums = [sum(b for _, b in u) for u in by_lane]
        cpu = max(s / (cpu_gbps * 1e9) for s in sums)
        overhead = max(per_tensor * pieces_of(u, s) for u, s in zip(by_lane, sums))
        memory = rss(mine, written) if lanes == 1 else \
            BASE_RSS + per_tensor_rss * len(ckpt.tensors) + sum(rss(u, s) for u, s in zip(by_lane, sums))
        processes.append(ProcessPlan(p, [n for n, _ in mine], read, written, pieces, memory,
                                     max(disk / (disk_gbps * 1e9), (net_read + net_written) / (network_gbps * 1e9), cpu)
                                     + overhead + (WORKER_START_S if lanes > 1 else 0), net_read, net_written))
    lanes_note = (f"; with --workers {workers}, the CPU part is the busiest of its workers' and a worker's start "
                  f"({WORKER_START_S:g} s) is added" if workers > 1 else "")
    if src_remote or out_remote:
        where = {(True, True): "reads from and writes to", (True, False): "reads from",
                 (False, True): "writes to"}[src_remote, out_remote]
        model = (f"per process, the slowest of its disk (the bytes it reads or writes there / --disk-gbps), its "
                 f"network (the bytes it {where} an object store / --network-gbps) and its CPU (bytes / {cpu_gbps} "
                 f"GB/s), plus {per_tensor * 1e6:.0f} us per tensor written")
    else:
        model = (f"per process, the slower of its disk (2 x bytes / --disk-gbps) and its CPU (bytes / {cpu_gbps} "
                 f"GB/s), plus {per_tensor * 1e6:.0f} us per tensor written")
    return PlanReport(ckpt.source.path, ckpt.format, len(ckpt.tensors),
                      sum(math.prod(t.shape) * t.dtype.itemsize for t in ckpt.tensors), job,
                      mesh.tp if mesh else None, mesh.ep if mesh else 1, rules.name if rules else None, hosts,
                      disk_gbps, [UnitPlan(n, b, o, w) for (n, b), o, w in zip(work, owner, lane)], processes,
                      max(p.seconds for p in processes), model + lanes_note, network_gbps, out, workers)
