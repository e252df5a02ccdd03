"""plan: what a run would do, as data, without reading tensor data.

A run's units (shard files of a conversion, rank directories of a reshard) come from the same
writer's `plan` the run uses, and `cluster.assign` balances them over processes by bytes, exactly as
the job runner splits them (runner.py): the plan printed is the plan run. Peak memory and time are
estimates from ckptconv's measured behaviour (docs/benchmarks.md), stated as such.
"""
import math

from .writers.base import assign
from .tp.layout import plan as reshard_plan
from .tp.presets import MeshSpec, choose_rules
from .writers import WRITERS
from .writers.base import Content, WriteOptions

BASE_RSS = 110 * 2**20        # interpreter, numpy, jax-free import: measured peak of a 2 GB convert
IN_FLIGHT = 6 * 8 * 2**20 + 2 * 16 * 2**20  # the staging pool (outfile.py) + gathered chunks being hashed


def units(ckpt, mesh: MeshSpec | None = None, write: WriteOptions = None):
    """(name, bytes) of every output file (convert) or rank directory (reshard, with `mesh`), in
    output order, and the rules chosen."""
    write, content = write or WriteOptions(), Content(ckpt.source)
    if mesh is None:
        return [(u.name, u.size) for u in WRITERS["sharded"](write, content).plan(ckpt.tensors)], None
    rules = choose_rules(ckpt, mesh)
    layout = reshard_plan(ckpt.tensors, rules, mesh.tp, mesh.ep, mesh.pad_vocab)
    writer = WRITERS["mesh"](write, content, None, layout, rules, mesh.tp, mesh.ep, {})
    return [(u.name, u.size) for u in writer.plan(ckpt.tensors)], rules


def plan_run(ckpt, hosts=1, disk_gbps=2.0, mesh: MeshSpec | None = None, write: WriteOptions = None) -> dict:
    work, rules = units(ckpt, mesh, write)
    owner = assign([b for _, b in work], hosts)
    processes = []
    for p in range(hosts):
        mine = [(n, b) for (n, b), o in zip(work, owner) if o == p]
        written = sum(b for _, b in mine)
        processes.append({"process": p, "units": [n for n, _ in mine], "bytes_read": written,
                          "bytes_written": written, "peak_rss_bytes": BASE_RSS + IN_FLIGHT if mine else BASE_RSS,
                          "seconds": 2 * written / (disk_gbps * 1e9)})
    return {"source": ckpt.source.get("path"), "format": ckpt.format,
            "tensors": len(ckpt.tensors), "source_bytes": sum(math.prod(t.shape) * t.dtype.itemsize for t in ckpt.tensors),
            "job": "reshard" if mesh else "convert", "tp": mesh.tp if mesh else None, "ep": mesh.ep if mesh else 1,
            "rules": rules.name if rules else None, "hosts": hosts, "disk_gbps": disk_gbps,
            "units": [{"name": n, "bytes": b, "process": o} for (n, b), o in zip(work, owner)],
            "processes": processes, "seconds": max(p["seconds"] for p in processes),
            "time_model": "each process reads and writes its bytes through one disk of --disk-gbps: "
                          "seconds = 2 x bytes / bandwidth"}
