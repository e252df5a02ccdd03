"""Several processes on one job: join, agree on the job, exchange small results, and fail as one.

A run on N processes computes the same plan everywhere (pure data), splits the output files among
the processes by bytes (run/share.assign), and each writes only its files into the shared
temporary directory. Process 0 holds the lock, waits for every process's digests, writes index,
manifest, SHA256SUMS and mesh.json, and publishes; its verdict is sent back so every process exits
alike.

The processes talk through a small key-value service that process 0 runs at `--coordinator`
(run/wire.py): length-prefixed JSON over TCP, our own code end to end. So every wait is ours:
it waits in slices, honours a signal between them, and ends with one line naming the process that
did not answer, within `--cluster-timeout` (results) or `--heartbeat-timeout` (a process that
stopped: killed, SIGSTOPped, its host gone). JAX's distributed runtime is joined only when a stage
needs devices across processes (`verify --device`), once every process is known to be there.
"""
import atexit
import json
import os
import re
import time
from dataclasses import dataclass, field

from .. import safejson, signals
from .wire import Connection, Service, WireError
from ..errors import CkptError, OutputError, UsageError, brief, printable
from ..storage.urls import is_url, redact
from ..formats import not_ours
from ..io.output import atomic_output

JAX_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
MAX_PROCESSES = 4096   # processes in one job (a connection and a thread each on process 0)
POLL_S = 0.05   # between two looks for a value that has not come


@dataclass
class Cluster:
    process_id: int
    num_processes: int
    timeout_s: int
    heartbeat_s: int = 10
    coordinator: str | None = None
    _jax: bool = field(default=False, repr=False)

    @property
    def is_main(self) -> bool:
        return self.process_id == 0

    def put(self, key: str, value) -> None:
        raise NotImplementedError

    def get(self, key: str, process: int):
        """The value `process` put under `key`; OutputError if it does not come within the cluster
        timeout or `process` stops answering first. A signal is honoured while it waits."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            found, value = self._look(key)
            if found:
                return value
            gone = self._gone(process)
            if gone:
                raise OutputError(f"process {process} {gone}; nothing was published")
            if time.monotonic() > deadline:
                raise OutputError(f"process {process} did not answer within {self.timeout_s} s (--cluster-timeout); "
                                  "nothing was published")
            signals.check()
            time.sleep(POLL_S)

    def _look(self, key: str) -> tuple:
        raise NotImplementedError

    def _gone(self, process: int) -> str | None:
        return None

    def start_jax(self):
        """JAX's distributed runtime on every process (a device stage across processes), at the
        coordinator's port + 1. Every process has reached this stage, so none waits for a peer that
        never comes; a process that dies during it is then JAX's to report (docs/distributed.md)."""
        if self._jax or self.num_processes == 1:
            return
        import jax
        host, _, port = self.coordinator.rpartition(":")
        try:
            jax.distributed.initialize(f"{host}:{int(port) + 1}", self.num_processes, self.process_id,
                                       initialization_timeout=self.timeout_s,
                                       heartbeat_timeout_seconds=self.heartbeat_s)
        except Exception as e:   # (its own error types)
            raise OutputError(f"JAX's distributed runtime did not start: {str(e).splitlines()[0][:300]}") from None
        self._jax = True

    def close(self):
        pass


class Solo(Cluster):
    """A job of one process: the same steps as several, its messages kept in memory."""

    def __init__(self):
        super().__init__(0, 1, 0)
        self._messages = {}

    def put(self, key: str, value) -> None:
        self._messages[key] = value

    def _look(self, key: str) -> tuple:
        return True, self._messages[key]


class Main(Cluster):
    """Process 0: runs the service and reads it directly."""

    def __init__(self, service: Service, **kw):
        super().__init__(0, service.processes, **kw)
        self.service = service

    def put(self, key: str, value) -> None:
        self.service.put(key, json.dumps(value, default=_wire))

    def _look(self, key: str) -> tuple:
        text = self.service.value(key)
        return (False, None) if text is None else (True, _parse(text, f"the message {key!r}"))

    def _gone(self, process: int) -> str | None:
        return self.service.gone(process, self.heartbeat_s) if process else None

    def close(self):
        """Keep answering until every other process has taken its last message and left (bounded)."""
        self.service.drain(self.timeout_s, self.heartbeat_s)


class Peer(Cluster):
    """A process other than 0: a connection to the service."""

    def __init__(self, connection: Connection, **kw):
        super().__init__(connection.process, connection.processes, **kw)
        self.connection = connection

    def put(self, key: str, value) -> None:
        self._request({"op": "put", "key": key, "value": json.dumps(value, default=_wire)})

    def _look(self, key: str) -> tuple:
        reply = self._request({"op": "get", "key": key})
        if "value" in reply:
            return True, _parse(reply["value"], "process 0")
        if reply.get("closing"):
            raise OutputError("process 0 ended before it sent what this process waits for (its own error says "
                              "why); nothing was published")
        return False, None

    def _request(self, message: dict) -> dict:
        try:
            return self.connection.request(message)
        except WireError as e:
            raise OutputError(str(e)) from None

    def _gone(self, process: int) -> str | None:
        return self.connection.broken   # (process 0's service answers for everyone)

    def close(self):
        self.connection.close()


def _wire(value):
    """A typed value in a message (a writer's result) goes as its `to_json()` (its bytes as hex; the
    receiver reads it back with the type's `from_json`); other bytes go as hex."""
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return value.hex()
    raise TypeError(f"{type(value).__name__} cannot cross processes")


def _parse(text: str, where: str):
    return safejson.loads(text, where, "a message")


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
    """Join the job when asked (flags, JAX_* or SLURM environment); None for a single process.
    Process 0 serves at the coordinator's port and waits for every other process to say hello;
    the others connect (waiting up to `timeout_s` for process 0 to be there). `paths`: (what, path)
    of the command's SRC and OUT (local_paths)."""
    if not requested(distributed, coordinator):
        return None
    local_paths(paths)
    coordinator, n, me = _detected(coordinator, num_processes, process_id, timeout_s)
    host, _, port = coordinator.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) <= 65535:
        raise UsageError(f"--coordinator {brief(coordinator, 100)}: expected HOST:PORT")
    common = {"timeout_s": timeout_s, "heartbeat_s": heartbeat_s, "coordinator": coordinator}
    try:
        if me == 0:
            service = Service(int(port), n, loopback=_is_loopback(host))
            cluster = Main(service, **common)
            atexit.register(cluster.close)
            service.wait_for_all(timeout_s, signals.check)
        else:
            cluster = Peer(Connection.open(host.strip("[]"), int(port), me, n, timeout_s, heartbeat_s, signals.check),
                           **common)
            atexit.register(cluster.close)
    except WireError as e:
        raise OutputError(str(e)) from None
    return cluster


def local_paths(paths):
    """A job of several processes reads and writes local paths only (docs/distributed.md): its
    processes share a filesystem, not yet an object store. A URL among `paths` ((what, path): SRC,
    OUT ...) is refused in one line, before anything joins or is read."""
    for what, path in paths:
        if is_url(path):
            shown = printable(re.sub(r"^([^:]+://)[^/@]*@", r"\1", redact(path)), 300)   # (as urls.local_only)
            raise UsageError(f"{shown}: {what} is an object-store URL; a --distributed job reads and writes local paths "
                             "only (until its executor reaches object stores): run it as one process, or give a path "
                             "every process sees")


def _is_loopback(host: str) -> bool:
    """Whether `--coordinator` names this host's loopback (then process 0 listens there only)."""
    import ipaddress
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def gather(cluster: Cluster, key: str, mine):
    """Everyone sends `mine` (or an error) under `key`; process 0 gets all, in process order.
    A process's error becomes an error naming it."""
    cluster.put(f"{key}/{cluster.process_id}", mine)
    if not cluster.is_main:
        return None
    results = [cluster.get(f"{key}/{p}", p) for p in range(cluster.num_processes)]
    for p, r in enumerate(results):
        if isinstance(r, dict) and "error" in r:
            raise OutputError(f"process {p} failed: {r['error']}")
    return results


def agree(cluster: Cluster, job: dict):
    """Before anything is written, every process shows process 0 the job it is about to run (`job`:
    the source it read, the options that change bytes, its plan, as JSON); any difference stops
    every process with one line naming it (exit 2)."""
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
    outcome = cluster.get("outcome", 0)
    if not outcome["ok"]:
        raise OutputError(f"the run failed: {outcome['message']}")


def on_cluster(cluster, out, overwrite, publish, work, inputs=(), resume=False, single_file=False, job=None):
    """Every process: agree on `job` (when several run it). Process 0: lock, make the shared temporary
    directory, let the others start, run `publish(tmp)` (its own work and the merge), publish,
    announce. Others: wait for the start, `work()`, wait for the outcome. Any failure anywhere means
    nothing is published and every process exits non-zero."""
    if cluster.num_processes > 1 and job is not None:
        try:
            agree(cluster, job)
        except CkptError as e:
            if cluster.is_main:
                cluster.put("ready", {"ok": False, "message": str(e)})
            raise
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
    ready = cluster.get("ready", 0)
    if not ready["ok"]:
        raise OutputError(f"process 0 could not start the run: {ready['message']}")
    work()
    finish(cluster, True)
