"""Several processes on one device check: `verify --device` under `--distributed`, started by JAX's
launcher (or SLURM, or by hand with --coordinator/--num-processes/--process-id), each placing the
pieces of the ranks whose devices are local to it, global arrays assembled over every process's
devices (jax.distributed). This is all that remains of ckptconv's own coordinator: file work
(convert, reshard, verify without --device) runs in one driver, its tasks on --workers or --ray
(run/executors.py, run/ray_executor.py), and a lost host is the executor's to handle.

Every process checks the files itself (the structure and --against stages need no agreement:
every process finds the same), then starts JAX's distributed runtime (`start_jax`, at the
coordinator's address) when the device stage begins, and the processes exchange what they must
through JAX's own key-value store: that they check the same output the same way (`agree`), and the
device stage's findings (`gather`: process 0 prints the whole report). JAX reports a process that
never joins or dies during the stage (its coordination service ends the others: docs/distributed.md).
"""
import json
import os
import re
import time
from dataclasses import dataclass, field

from ... import safejson, signals
from ...errors import OutputError, UsageError, brief, printable
from ...storage.urls import is_url, redact

JAX_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
MAX_PROCESSES = 4096   # processes in one job
POLL_S = 0.05          # between two looks for a value that has not come
MAX_MESSAGE = 1 << 30  # bytes of one value in the store


@dataclass
class Cluster:
    """This process's place in a --distributed device check; `put`/`get` through JAX's key-value
    store once `start_jax` has run."""

    process_id: int
    num_processes: int
    timeout_s: int
    heartbeat_s: int = 10
    coordinator: str | None = None
    _client: object = field(default=None, repr=False)

    @property
    def is_main(self) -> bool:
        return self.process_id == 0

    def start_jax(self):
        """JAX's distributed runtime on every process (the device stage), at the coordinator."""
        if self._client is not None:
            return
        import jax
        from jax._src import distributed
        try:
            jax.distributed.initialize(self.coordinator, self.num_processes, self.process_id,
                                       initialization_timeout=self.timeout_s,
                                       heartbeat_timeout_seconds=self.heartbeat_s)
        except Exception as e:   # (its own error types)
            raise OutputError(f"JAX's distributed runtime did not start: {str(e).splitlines()[0][:300]}") from None
        self._client = distributed.global_state.client

    def put(self, key: str, value) -> None:
        self._started().key_value_set(f"ckptconv/{key}", json.dumps(value))

    def get(self, key: str, process: int):
        """The value `process` put under `key`; OutputError if it does not come within the cluster
        timeout. A signal is honoured while it waits."""
        client, deadline = self._started(), time.monotonic() + self.timeout_s
        while True:
            try:
                text = client.key_value_try_get(f"ckptconv/{key}")
            except Exception:   # (NOT_FOUND: not there yet)
                text = None
            if text is not None:
                if len(text) > MAX_MESSAGE:
                    raise OutputError(f"process {process} sent {len(text)} bytes under {key!r}, more than accepted")
                return safejson.loads(text, f"process {process}", "a message")
            if time.monotonic() > deadline:
                raise OutputError(f"process {process} did not answer within {self.timeout_s} s (--cluster-timeout); "
                                  "the device check stopped")
            signals.check()
            time.sleep(POLL_S)

    def _started(self):
        if self._client is None:
            raise OutputError("the processes exchange findings through JAX's runtime, which is started by the "
                              "device stage only")
        return self._client


def requested(distributed: bool, coordinator) -> bool:
    if distributed or coordinator:
        return True
    if all(os.environ.get(k) for k in JAX_ENV):
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ


def _detected(coordinator, num_processes, process_id, timeout_s) -> tuple:
    """(coordinator, processes, process id) from the flags, JAX_* variables, or a launcher JAX
    recognises (SLURM, …: its detection is plain Python, read here without starting JAX)."""
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if process_id is None and os.environ.get("JAX_PROCESS_ID"):
        process_id = _int(os.environ["JAX_PROCESS_ID"], "JAX_PROCESS_ID")
    if num_processes is None and os.environ.get("JAX_NUM_PROCESSES"):
        num_processes = _int(os.environ["JAX_NUM_PROCESSES"], "JAX_NUM_PROCESSES")
    if coordinator is None or num_processes is None or process_id is None:
        try:
            from jax._src.clusters import ClusterEnv
            coordinator, num_processes, process_id, _ = ClusterEnv.auto_detect_unset_distributed_params(
                coordinator, num_processes, process_id, None, None, timeout_s)
        except ImportError:
            pass
        except Exception as e:   # (a launcher's variables it could not read)
            raise UsageError(f"--distributed: the launcher's settings could not be read: {str(e)[:200]}") from None
    if coordinator is None or num_processes is None or process_id is None:
        raise UsageError("--distributed needs --coordinator HOST:PORT, --num-processes and --process-id (or "
                         "JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID, or a multi-task SLURM job)")
    if not 0 < num_processes <= MAX_PROCESSES:
        raise UsageError(f"--num-processes {brief(num_processes, 40)}: from 1 to {MAX_PROCESSES}")
    if not 0 <= process_id < num_processes:
        raise UsageError(f"--process-id {process_id}: must be below --num-processes {num_processes}")
    return coordinator, num_processes, process_id


def _int(text: str, what: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 9:
        raise UsageError(f"{what}={brief(text, 40)}: expected a whole number")
    return int(text)


def join(distributed=False, coordinator=None, num_processes=None, process_id=None, timeout_s=60,
         heartbeat_s=10, paths=()):
    """This process's place in a --distributed device check when asked (flags, JAX_* or SLURM
    environment); None for a single process. Nothing is started here: JAX's runtime starts with the
    device stage. `paths`: (what, path) of the command's PATH and --against (local_paths)."""
    if not requested(distributed, coordinator):
        return None
    local_paths(paths)
    coordinator, n, me = _detected(coordinator, num_processes, process_id, timeout_s)
    host, _, port = coordinator.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) <= 65535:
        raise UsageError(f"--coordinator {brief(coordinator, 100)}: expected HOST:PORT")
    return Cluster(me, n, timeout_s, heartbeat_s, coordinator)


def local_paths(paths):
    """A device check of several processes reads local paths only (docs/distributed.md): its
    processes share a filesystem. A URL among `paths` ((what, path)) is refused in one line, before
    anything is read."""
    for what, path in paths:
        if is_url(path):
            shown = printable(re.sub(r"^([^:]+://)[^/@]*@", r"\1", redact(path)), 300)   # (no user or password either)
            raise UsageError(f"{shown}: {what} is an object-store URL; a --distributed job reads and writes local paths "
                             "only: run it as one process, or give a path every process sees")


def gather(cluster: Cluster, key: str, mine):
    """Everyone sends `mine` under `key`; process 0 gets all, in process order (the others None)."""
    cluster.put(f"{key}/{cluster.process_id}", mine)
    if not cluster.is_main:
        return None
    return [cluster.get(f"{key}/{p}", p) for p in range(cluster.num_processes)]


def agree(cluster: Cluster, job: dict):
    """Every process shows process 0 the check it is about to run (`job`: the options and the output,
    as JSON); any difference stops every process with one line naming it (exit 2)."""
    cluster.put(f"job/{cluster.process_id}", job)
    if cluster.is_main:
        problem = next((f"process {p} runs another job than process 0: {why}"
                        for p in range(1, cluster.num_processes)
                        for why in [_difference(job, cluster.get(f"job/{p}", p))] if why), None)
        cluster.put("agreed", {"ok": problem is None, "message": problem})
        if problem:
            raise UsageError(problem)
        return
    verdict = cluster.get("agreed", 0)
    if not verdict["ok"]:
        raise UsageError(verdict["message"])


def _difference(mine: dict, theirs) -> str | None:
    """What differs between two jobs, as a user would put it (the first difference), or None."""
    if not isinstance(theirs, dict):
        return "it sent no job description"
    for part in [*mine, *(p for p in theirs if p not in mine)]:
        if mine.get(part) == theirs.get(part):
            continue
        a, b = mine.get(part), theirs.get(part)
        if isinstance(a, dict) and isinstance(b, dict):
            key = next((k for k in sorted(set(a) | set(b), key=str) if a.get(k) != b.get(k) or (k in a) != (k in b)),
                       None)
            if key is not None:
                return f"its {part} {key} is {brief(b.get(key), 120)}, process 0's {brief(a.get(key), 120)}"
        return f"its {part} differs ({brief(b, 120)} against process 0's {brief(a, 120)})"
    return None
