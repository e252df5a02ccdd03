"""plan: what a run would do, as data, without reading tensor data.

A run's units (shard files of a conversion, rank directories of a reshard) come from the same
writer's `plan` the run uses, and `cluster.assign` balances them over processes by bytes, exactly as
the job runner splits them (runner.py): the plan printed is the plan run. Peak memory and time are
estimates from ckptconv's measured behaviour (docs/benchmarks.md), stated as such.
"""
import math

from .cluster import assign
from .reshard import plan as reshard_plan
from .rules import choose, read_config
from .writers.base import Content, WriteOptions
from .writers.mesh import MeshWriter
from .writers.sharded import ShardedWriter

BASE_RSS = 110 * 2**20        # interpreter, numpy, jax-free import: measured peak of a 2 GB convert
IN_FLIGHT = 6 * 8 * 2**20 + 2 * 16 * 2**20  # the staging pool (outfile.py) + gathered chunks being hashed


def units(ckpt, tp=None, ep=1, max_shard_size=5 * 10**9, preset=None, rules_file=None, heads=None):
    """(name, bytes) of every output file (convert) or rank directory (reshard), in output order."""
    options, content = WriteOptions(max_shard_size), Content(ckpt.source)
    if not tp:
        return [(u.name, u.size) for u in ShardedWriter(options, content).plan(ckpt.tensors)], None
    rules = choose([t.name for t in ckpt.tensors], read_config(ckpt.model_files) or ckpt.source.get("config"),
                   preset, rules_file, heads or {})
    writer = MeshWriter(options, content, reshard_plan(ckpt.tensors, rules, tp, ep), rules, tp, ep, {})
    return [(u.name, u.size) for u in writer.plan(ckpt.tensors)], rules


def plan_run(ckpt, hosts=1, disk_gbps=2.0, **kw) -> dict:
    work, rules = units(ckpt, **kw)
    owner = assign([b for _, b in work], hosts)
    processes = []
    for p in range(hosts):
        mine = [(n, b) for (n, b), o in zip(work, owner) if o == p]
        written = sum(b for _, b in mine)
        processes.append({"process": p, "units": [n for n, _ in mine], "bytes_read": written,
                          "bytes_written": written, "peak_rss_bytes": BASE_RSS + IN_FLIGHT if mine else BASE_RSS,
                          "seconds": 2 * written / (disk_gbps * 1e9)})
    return {"source": ckpt.source.get("path"), "format": ckpt.source.get("format"),
            "tensors": len(ckpt.tensors), "source_bytes": sum(math.prod(t.shape) * t.dtype.itemsize for t in ckpt.tensors),
            "job": "reshard" if kw.get("tp") else "convert", "tp": kw.get("tp"), "ep": kw.get("ep", 1),
            "rules": rules.name if rules else None, "hosts": hosts, "disk_gbps": disk_gbps,
            "units": [{"name": n, "bytes": b, "process": o} for (n, b), o in zip(work, owner)],
            "processes": processes, "seconds": max(p["seconds"] for p in processes),
            "time_model": "each process reads and writes its bytes through one disk of --disk-gbps: "
                          "seconds = 2 x bytes / bandwidth"}
