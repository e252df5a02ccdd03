"""Several processes on one job: join JAX's distributed runtime and exchange small results.

A run on N processes computes the same plan everywhere (pure data), splits the output files among
the processes by bytes (`plan.assign`), and each writes only its files into the shared temporary
directory. Process 0 holds the lock, waits for every process's digests, writes index, manifest,
SHA256SUMS and mesh.json, and publishes; its verdict is sent back so every process exits alike.
Messages go through the coordination service's key-value store. A process that dies is detected by
JAX's heartbeats; JAX then terminates the others (naming the dead task) and nothing is published.
"""
import json
import os
import socket
import time
from dataclasses import dataclass

from .errors import CkptError, OutputError, UsageError
from .formats import not_ours
from .io.output import atomic_output

JAX_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


@dataclass
class Cluster:
    process_id: int
    num_processes: int
    client: object
    timeout_s: int

    @property
    def is_main(self) -> bool:
        return self.process_id == 0

    def put(self, key: str, value) -> None:
        self.client.key_value_set(f"ckptconv/{key}", json.dumps(value, default=_hex))

    def get(self, key: str, who: str):
        try:
            return json.loads(self.client.blocking_key_value_get(f"ckptconv/{key}", self.timeout_s * 1000))
        except Exception as e:  # the runtime's own error types
            raise OutputError(f"{who} did not answer within {self.timeout_s} s ({str(e).splitlines()[0]}); "
                              "nothing was published") from None


def _hex(value) -> str:
    """Bytes in a message (a writer's packed digests) go as hex; the receiver knows to read them back."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return value.hex()
    raise TypeError(f"{type(value).__name__} cannot cross processes")


class Solo(Cluster):
    """A job of one process: the same steps as several, its messages kept in memory."""

    def __init__(self):
        super().__init__(0, 1, None, 0)
        self._messages = {}

    def put(self, key: str, value) -> None:
        self._messages[key] = value

    def get(self, key: str, who: str):
        return self._messages[key]


def requested(distributed: bool, coordinator) -> bool:
    if distributed or coordinator:
        return True
    if all(os.environ.get(k) for k in JAX_ENV):
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ


def _reachable(address: str, timeout_s: int):
    """Wait for the coordinator's port to accept connections, so a missing coordinator is a clear error."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise UsageError(f"the coordinator {address} did not answer within {timeout_s} s "
                                 "(is process 0 running?)") from None
            time.sleep(0.2)
        except ValueError:
            raise UsageError(f"--coordinator {address!r}: expected HOST:PORT") from None


def join(distributed=False, coordinator=None, num_processes=None, process_id=None, timeout_s=60,
         heartbeat_s=10):
    """Join the job when asked (flags, JAX_* or SLURM environment); None for a single process."""
    if not requested(distributed, coordinator):
        return None
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if coordinator and process_id is None and os.environ.get("JAX_PROCESS_ID"):
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if coordinator and num_processes is None and os.environ.get("JAX_NUM_PROCESSES"):
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if coordinator and (num_processes is None or process_id is None):
        raise UsageError("--coordinator needs --num-processes and --process-id (or JAX_NUM_PROCESSES/JAX_PROCESS_ID)")
    if coordinator and process_id:
        _reachable(coordinator, timeout_s)
    try:
        import jax
        from jax._src import distributed as jax_distributed
    except ImportError:
        raise UsageError("several processes need JAX: pip install 'ckptconv[jax]'") from None
    jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=timeout_s,
                               heartbeat_timeout_seconds=heartbeat_s)
    return Cluster(jax.process_index(), jax.process_count(), jax_distributed.global_state.client, timeout_s)


def gather(cluster: Cluster, key: str, mine):
    """Everyone sends `mine` (or an error) under `key`; process 0 gets all, in process order.
    A process's error becomes an error naming it."""
    cluster.put(f"{key}/{cluster.process_id}", mine)
    if not cluster.is_main:
        return None
    results = [cluster.get(f"{key}/{p}", f"process {p}") for p in range(cluster.num_processes)]
    for p, r in enumerate(results):
        if isinstance(r, dict) and "error" in r:
            raise OutputError(f"process {p} failed: {r['error']}")
    return results


def run_guarded(cluster: Cluster, key: str, work):
    """Run this process's share; report its result or its failure, so that process 0 can decide."""
    try:
        mine = work()
    except CkptError as e:
        cluster.put(f"{key}/{cluster.process_id}", {"error": str(e)})
        raise
    except OSError as e:
        cluster.put(f"{key}/{cluster.process_id}", {"error": f"{e.filename or ''}: {e.strerror or e}"})
        raise
    return gather(cluster, key, mine)


def finish(cluster: Cluster, ok: bool, message: str = ""):
    """Process 0 announces the outcome; the others wait for it and fail if the run failed."""
    if cluster.is_main:
        cluster.put("outcome", {"ok": ok, "message": message})
        return
    outcome = cluster.get("outcome", "process 0")
    if not outcome["ok"]:
        raise OutputError(f"the run failed: {outcome['message']}")


def on_cluster(cluster, out, overwrite, publish, work, inputs=(), resume=False, single_file=False):
    """Process 0: lock, make the shared temporary directory, let the others start, run `publish(tmp)`
    (its own work and the merge), publish, announce. Others: wait for the start, `work()`, wait for
    the outcome. Any failure anywhere means nothing is published and every process exits non-zero."""
    if cluster.is_main:
        started = False
        try:
            with atomic_output(out, overwrite, resume, inputs, single_file, not_ours) as tmp:
                cluster.put("ready", {"ok": True})
                started = True
                publish(tmp)
        except Exception as e:
            if not started:
                cluster.put("ready", {"ok": False, "message": str(e)})
            finish(cluster, False, str(e))
            raise
        finish(cluster, True)
        return
    ready = cluster.get("ready", "process 0")
    if not ready["ok"]:
        raise OutputError(f"process 0 could not start the run: {ready['message']}")
    work()
    finish(cluster, True)
