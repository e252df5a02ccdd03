"""Device load for verify: put each rank's pieces on its own device with JAX and check them there.

For a reshard output the mesh has one device per rank (axis "tp"); evenly split tensors become global
arrays (`make_array_from_single_device_arrays` with a NamedSharding on the recorded axis), uneven
ones (`ranges`, `boxes`) are checked piece by piece. Contents are checked by copying each device buffer back
and comparing its SHA-256 with the manifest's. One tensor is resident at a time.
"""
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from ...errors import UsageError
from ...formats import manifest as manifest_format
from ...formats.manifest import MANIFEST
from ...formats.safetensors import parse_header
from ...formats.mesh import MESH, parse_mesh, rank_dir, read_regular
from ...readers import ReadOptions, safetensors as st_reader

CUDA_HINT = "pip install 'ckptconv[cuda]'"


def import_jax(platform: str, ranks: int, cluster=None):
    """Import jax for `platform`; on the CPU, ask XLA for one host device per rank. With several
    processes, JAX's distributed runtime is started first (`Cluster.start_jax`)."""
    if platform == "cpu" and "jax" not in __import__("sys").modules:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={max(ranks, 1)}".strip()
    try:
        import jax
    except ImportError:
        hint = CUDA_HINT if platform == "cuda" else "pip install 'ckptconv[jax]'"
        raise UsageError(f"--device {platform} needs JAX, which is not installed: {hint}") from None
    jax.config.update("jax_enable_x64", True)  # else int64/float64 tensors would arrive as 32-bit
    if cluster is not None:
        cluster.start_jax()
    try:
        devices = jax.devices(platform)
    except RuntimeError as e:
        hint = f": {CUDA_HINT}" if platform == "cuda" else ""
        raise UsageError(f"--device {platform}: JAX has no {platform} backend ({str(e).splitlines()[0]}){hint}") \
            from None
    return jax, devices


def _rank_tensors(d: Path):
    """{name: (tensor, recorded sha256)} of a rank dir, an output dir or a single-file output."""
    ckpt = st_reader.load(d, ReadOptions())
    if d.is_file():
        header = parse_header(ckpt.mapped[0].view, ckpt.mapped[0].size, d)
        digests = {n: None if v is None else v.hex()
                   for n, v in manifest_format.check_single(manifest_format.single_document(header.metadata, d))[0].items()}
    else:
        digests = {n: e["sha256"] for n, e in json.loads((d / MANIFEST).read_text())["tensors"].items()}
    return {t.name: (t, digests[t.name]) for t in ckpt.tensors}


def device_check(path: Path, platform: str, allow_fewer: bool, report, cluster=None) -> dict:
    """Place and check every piece on its device. With several processes (jax.distributed), the mesh
    spans every process's devices; each process places the ranks whose device is local to it, and
    global arrays are assembled over the global mesh from each process's local pieces."""
    mesh = parse_mesh(read_regular(path / MESH), path / MESH) if (path / MESH).is_file() else None
    ranks = mesh.ranks if mesh else 1
    jax, devices = import_jax(platform, ranks // (cluster.num_processes if cluster else 1), cluster)
    if len(devices) < ranks and not allow_fewer:
        raise UsageError(f"--device {platform}: {ranks} ranks but only {len(devices)} devices "
                         "(--allow-fewer-devices maps ranks to devices round-robin)")
    placement = [devices[r % len(devices)] for r in range(ranks)]
    local = [d.process_index == jax.process_index() for d in placement]
    use_global = mesh is not None and len(devices) >= ranks and mesh.ep == 1
    n_devices = len(devices)
    dirs = [path / rank_dir(r) for r in range(ranks)] if mesh else [path]
    pieces = [_rank_tensors(d) if local[r] else {} for r, d in enumerate(dirs)]
    devices = [d for d in devices if d.process_index == jax.process_index()]
    live = {d.id: 0 for d in devices}
    peak = dict(live)
    placed, started = 0, time.perf_counter()
    names = list(mesh.tensors) if mesh else list(pieces[0] or _rank_tensors(path))
    if use_global:
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        jmesh = Mesh(np.array(placement), ("tp",))
    for name in names:
        arrays = []
        for r in range(ranks):
            if name not in pieces[r]:
                continue
            src, digest = pieces[r][name]
            host = src.region()
            arr = jax.device_put(host, placement[r])
            arrays.append((r, arr, src, digest))
            live[placement[r].id] += host.nbytes
            peak[placement[r].id] = max(peak[placement[r].id], live[placement[r].id])
            placed += host.nbytes
        for r, arr, src, digest in arrays:
            if tuple(arr.shape) != src.shape or arr.dtype != src.dtype.numpy:
                report.add(dirs[r], f"tensor {name!r} on {placement[r]}: {arr.dtype}{list(arr.shape)}, "
                                    f"expected {src.dtype.numpy}{list(src.shape)}")
            back = np.asarray(arr)
            if hashlib.sha256(back.reshape(-1).view(np.uint8)).hexdigest() != digest:
                report.add(dirs[r], f"tensor {name!r} on {placement[r]}: contents differ from the file")
        if use_global and arrays:
            entry = mesh.tensors[name]
            axis = entry.axis
            if axis is None or (entry.ranges is None and entry.boxes is None):
                spec = [None] * len(entry.shape)
                if axis is not None:
                    spec[axis] = "tp"
                sharding = NamedSharding(jmesh, PartitionSpec(*spec))
                shape = tuple(entry.full_shape)
                g = jax.make_array_from_single_device_arrays(shape, sharding, [a for _, a, _, _ in arrays])
                if tuple(g.shape) != shape or not g.sharding.is_equivalent_to(sharding, g.ndim):
                    report.add(path, f"tensor {name!r}: global array {g.shape} / {g.sharding} is not as recorded")
                del g
        for r, arr, src, _ in arrays:
            live[placement[r].id] -= arr.nbytes
            arr.delete()
            src.release()
    seconds = time.perf_counter() - started
    stats = {}
    for d in devices:
        s = d.memory_stats() if hasattr(d, "memory_stats") else None
        stats[str(d)] = (s or {}).get("peak_bytes_in_use", peak.get(d.id, 0))
    return {"platform": platform, "devices": n_devices, "local_devices": len(devices),
            "ranks": ranks, "global_arrays": use_global,
            "bytes": placed, "seconds": round(seconds, 3), "gb_per_s": round(placed / seconds / 1e9, 3) if seconds else None,
            "peak_device_bytes": stats}
