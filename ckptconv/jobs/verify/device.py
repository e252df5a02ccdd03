"""Device load for verify: put each rank's pieces on its own device with JAX and check them there.

For a reshard output the mesh has one device per rank (axis "tp"); evenly split tensors become global
arrays (`make_array_from_single_device_arrays` with a NamedSharding on the recorded axis), uneven
ones (`ranges`, `boxes`) are checked piece by piece. Contents are checked by copying each device buffer back
and comparing its SHA-256 with the manifest's. One tensor is resident at a time.
"""
import dataclasses
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import UsageError
from ...formats import manifest as manifest_format
from ...formats.safetensors import file_header
from ...formats.mesh import MESH, parse_mesh, rank_dir, read_regular
from ...layouts.scan import _checked_manifest
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
        header = file_header(ckpt.mapped[0], d)
        digests = {n: None if v is None else v.hex()
                   for n, v in manifest_format.check_single(manifest_format.single_document(header.metadata, d))[0].items()}
    else:
        # (verify checked this manifest before anything is placed; read again as every output file is:
        # a regular file, not followed, through safejson)
        digests = {n: e["sha256"] for n, e in _checked_manifest(d)["tensors"].items()}
    return {t.name: (t, digests[t.name]) for t in ckpt.tensors}


@dataclass
class DeviceFacts:
    """What `--device` placed: on which platform, how many devices (all, and this process's), the
    ranks, whether global arrays were assembled over the mesh, the bytes placed, how fast, and each
    local device's peak memory."""

    platform: str
    devices: int
    local_devices: int
    ranks: int
    global_arrays: bool
    bytes: int
    seconds: float
    gb_per_s: float | None
    peak_device_bytes: dict

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class _Placing:
    """The state of one device check: each rank's device, its pieces (this process's ranks only),
    and the bytes live and at peak on each device."""

    jax: object
    placement: list
    dirs: list
    pieces: list
    live: dict
    peak: dict
    placed: int = 0

    def put(self, r, src):
        host = src.region()
        arr = self.jax.device_put(host, self.placement[r])
        device = self.placement[r].id
        self.live[device] += host.nbytes
        self.peak[device] = max(self.peak[device], self.live[device])
        self.placed += host.nbytes
        return arr

    def drop(self, r, arr, src):
        self.live[self.placement[r].id] -= arr.nbytes
        arr.delete()
        src.release()


def device_check(path: Path, platform: str, allow_fewer: bool, report, cluster=None) -> DeviceFacts:
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
    devices = [d for d in devices if d.process_index == jax.process_index()]
    state = _Placing(jax, placement, dirs, [_rank_tensors(d) if local[r] else {} for r, d in enumerate(dirs)],
                     {d.id: 0 for d in devices}, {d.id: 0 for d in devices})
    started = time.perf_counter()
    names = list(mesh.tensors) if mesh else list(state.pieces[0] or _rank_tensors(path))
    jmesh = None
    if use_global:
        from jax.sharding import Mesh
        jmesh = Mesh(np.array(placement), ("tp",))
    for name in names:
        arrays = [(r, state.put(r, state.pieces[r][name][0]), *state.pieces[r][name])
                  for r in range(ranks) if name in state.pieces[r]]
        _check_pieces(state, name, arrays, report)
        if use_global and arrays:
            _check_global(jax, jmesh, path, name, mesh.tensors[name], arrays, report)
        for r, arr, src, _ in arrays:
            state.drop(r, arr, src)
    seconds = time.perf_counter() - started
    stats = {}
    for d in devices:
        s = d.memory_stats() if hasattr(d, "memory_stats") else None
        stats[str(d)] = (s or {}).get("peak_bytes_in_use", state.peak.get(d.id, 0))
    return DeviceFacts(platform, n_devices, len(devices), ranks, use_global, state.placed, round(seconds, 3),
                       round(state.placed / seconds / 1e9, 3) if seconds else None, stats)


def _check_pieces(state: _Placing, name: str, arrays: list, report):
    """Each piece on its device has the file's dtype and shape and, read back, the file's digest."""
    for r, arr, src, digest in arrays:
        where = state.placement[r]
        if tuple(arr.shape) != src.shape or arr.dtype != src.dtype.numpy:
            report.add(state.dirs[r], f"tensor {name!r} on {where}: {arr.dtype}{list(arr.shape)}, "
                                      f"expected {src.dtype.numpy}{list(src.shape)}", "device", tensor=name)
        back = np.asarray(arr)
        if hashlib.sha256(back.reshape(-1).view(np.uint8)).hexdigest() != digest:
            report.add(state.dirs[r], f"tensor {name!r} on {where}: contents differ from the file", "device",
                       tensor=name)


def _check_global(jax, jmesh, path: Path, name: str, entry, arrays: list, report):
    """An evenly split or replicated tensor assembles into one global array over the mesh, of its
    recorded shape and sharding."""
    from jax.sharding import NamedSharding, PartitionSpec
    axis = entry.axis
    if axis is not None and (entry.ranges is not None or entry.boxes is not None):
        return
    spec = [None] * len(entry.shape)
    if axis is not None:
        spec[axis] = "tp"
    sharding = NamedSharding(jmesh, PartitionSpec(*spec))
    shape = tuple(entry.full_shape)
    g = jax.make_array_from_single_device_arrays(shape, sharding, [a for _, a, _, _ in arrays])
    if tuple(g.shape) != shape or not g.sharding.is_equivalent_to(sharding, g.ndim):
        report.add(path, f"tensor {name!r}: global array {g.shape} / {g.sharding} is not as recorded", "device",
                   tensor=name)
    del g
