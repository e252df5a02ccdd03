"""The Ray executor: a run's tasks (tasks.py) on a Ray cluster (`--ray [ADDRESS]`, `pip install
'ckptconv[ray]'`). Ray is imported only when a run asks for it.

The driver (the `ckptconv` process) joins the cluster (`ray.init(ADDRESS)`: without a value
RAY_ADDRESS, Ray's own convention, else "auto", the cluster this host is in) with ckptconv itself in
the job's runtime_env (ray_nodes.py: py_modules, merged with the Ray Job's and --ray-runtime-env;
CKPTCONV_RAY_SHIP=0 leaves it out), checks that every node with CPUs imports what a task needs (one
line naming the node and the module, before any task runs), submits one Ray task
per unit of the plan (an output file, a rank directory), gathers the answers in plan order and hands
them back to the runner, which checks and publishes them exactly as for the local executor. A task
re-opens the source from the request on its node, so SRC and OUT must be on storage every node sees
at the same path (a shared file system; SRC may be a bucket), and the driver checks that each task
read the inputs it planned with (tasks.accept).

Faults:
- a task whose worker or node dies is rerun by Ray on a live node, up to MAX_RETRIES times; then the
  run fails with one line naming the unit and why. A rerun task writes the same bytes. The run says
  on stderr when a task ran more than once;
- a task that raises a ckptconv error (BadInput: exit 2) is not retried: it answers with its error
  as data, the driver stops at once with that line and cancels every other task;
- a signal to the driver (Ctrl-C, SIGTERM) cancels every task (`ray.cancel(force=True)`), waits for
  them to end and lets the runner remove the temporary output: nothing is published.

Progress: every task reports its bytes (in steps of PROGRESS_BYTES) and its starts to a small actor,
`Tally`, placed on the driver's node; the driver feeds its one bar from it. A task run twice counts
its bytes twice: the bar is capped at the total."""
import logging
import os
import signal
import sys
import time

from .. import signals
from ..errors import OutputError, UsageError, brief
from . import ray_nodes
from . import tasks as _tasks

MAX_RETRIES = 3          # reruns of a task whose worker or node died (Ray's max_retries)
POLL_S = 0.2             # how often the driver looks at its tasks (and a pending signal)
TALLY_S = 0.5            # how often it asks the tally for bytes and starts
CONNECT_S = 10           # how long ADDRESS may take to answer before the run says there is no cluster
CANCEL_WAIT_S = 30       # how long it waits for cancelled tasks to end before it lets the output go
NODE_CHECK_S = 120       # how long a node may take to answer the check of what it imports (its first
                         # worker, the shipped package unpacked); one that does not is left to its tasks
OVERRIDE_JOB_ENV = "RAY_OVERRIDE_JOB_RUNTIME_ENV"   # (Ray's: ray.init's runtime_env over the Job's)
PROGRESS_BYTES = 16 << 20


def import_ray():
    """Ray, or one line saying how to get it."""
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs Ray: pip install 'ckptconv[ray]'") from None
    return ray


def address_of(given: str | None) -> str:
    """The cluster `--ray` joins: ADDRESS as given, else RAY_ADDRESS, else "auto"."""
    return given or os.environ.get("RAY_ADDRESS") or "auto"


def _bare(address: str) -> tuple:
    """(ADDRESS without a user and password, a query or a fragment: what a line may show of it, and the
    parts taken out, each of which may hold a credential)."""
    parts = []
    for mark in ("#", "?"):
        address, sep, tail = address.partition(mark)
        if sep and tail:   # (and each value of it, as a message may show it parsed)
            parts += [tail, *(v for kv in tail.split("&") for v in kv.split("=", 1)[1:] if v)]
    scheme, sep, rest = address.rpartition("://")
    if "@" in rest:
        user, _, rest = rest.rpartition("@")
        parts += [user, *([user.split(":", 1)[1]] if ":" in user else [])]
        rest = "***@" + rest
    return scheme + sep + rest, parts


SHORTEST_SECRET = 4   # a part of ADDRESS shorter than this is not looked for in a message (it would garble it)


def shown(address: str, text: str | None = None) -> str:
    """`text` (default: ADDRESS itself) as a line may show it: ADDRESS without its credential-bearing
    parts (_bare), every such part in `text` and every credential variable's value replaced by ***,
    bounded."""
    from ..storage.urls import hide_secrets
    bare, parts = _bare(address)
    if text is None:
        return brief(hide_secrets(bare), 200)
    text = text.replace(address, bare)
    for part in sorted((p for p in parts if len(p) >= SHORTEST_SECRET), key=len, reverse=True):
        text = text.replace(part, "***")
    return brief(hide_secrets(text), 200)


def _probe(address: str):
    """A HOST:PORT that nothing answers at is one line within CONNECT_S (ray.init would wait minutes)."""
    import socket
    host, sep, port = _bare(address)[0].split("://", 1)[-1].rsplit("@", 1)[-1].rstrip("/").rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_S).close()
    except OSError as e:
        raise OutputError(f"--ray {shown(address)}: no Ray cluster could be joined (nothing answers there: "
                          f"{e.strerror or e}); start one (`ray start --head`) or give its address") from None


class RayExecutor:
    """Tasks on a Ray cluster at `address` (see address_of); registered as "ray" in executors.py
    (when asked for). Ray schedules by the CPUs its nodes offer: one CPU a task."""

    name = "ray"

    def __init__(self, address: str | None = None, workers: int | None = None, retries: int = MAX_RETRIES,
                 runtime_env: dict | None = None):
        self.workers = workers
        self.address = address_of(address)
        self.retries = retries
        self.notes = []
        self.ship = ray_nodes.shipped()
        self.runtime_env = ray_nodes.runtime_env(runtime_env, ray_nodes.job_runtime_env(), self.ship)
        self.checked = False

    def parallel(self, tasks) -> bool:
        return True   # (asked for: every unit goes to the cluster, even one)

    def side_by_side(self, count: int, nbytes: int) -> bool:
        return True

    def connect(self):
        ray = import_ray()
        if ray.is_initialized():   # (an API caller that joined the cluster itself: its runtime_env stands)
            self._check_nodes(ray)
            return ray
        _probe(self.address)
        env = self._valid_env(ray)
        saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        override = os.environ.get(OVERRIDE_JOB_ENV)
        if ray_nodes.JOB_CONFIG_ENV in os.environ:
            os.environ[OVERRIDE_JOB_ENV] = "1"   # (env holds the Job's own runtime_env, merged field by field)
        try:
            ray.init(address=self.address, logging_level=logging.ERROR, log_to_driver=False,
                     configure_logging=True, namespace="ckptconv", runtime_env=env)
        except (ConnectionError, RuntimeError, ValueError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise OutputError(f"--ray {shown(self.address)}: no Ray cluster could be joined "
                              f"({self._hidden(shown(self.address, first))}); "
                              "start one (`ray start --head`) or give its address") from None
        finally:
            for s, h in saved.items():   # (ckptconv's own handlers: the driver decides how a signal ends it)
                if h is not None:
                    signal.signal(s, h)
            if override is None:
                os.environ.pop(OVERRIDE_JOB_ENV, None)
            else:
                os.environ[OVERRIDE_JOB_ENV] = override
        try:
            self._check_nodes(ray)
        except BaseException:
            with signals.deferred():
                ray.shutdown()   # (joined here: a caller of the API may join again, with another runtime_env)
            raise
        return ray

    def _valid_env(self, ray):
        """The runtime_env, as Ray checks it before the driver joins (a field of the wrong type, a
        py_modules entry that is not there): one line, exit 2."""
        if not self.runtime_env:
            return None
        try:
            from ray.runtime_env import RuntimeEnv
            RuntimeEnv(**self.runtime_env)
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UsageError(f"--ray-runtime-env: Ray refuses the runtime_env "
                             f"({self._hidden(brief(first, 300))})") from None
        return self.runtime_env

    def _hidden(self, text: str) -> str:
        """`text` without the values of the runtime_env's env_vars (a key the user handed the tasks)."""
        for value in sorted((v for v in (self.runtime_env.get("env_vars") or {}).values()
                             if isinstance(v, str) and len(v) >= SHORTEST_SECRET), key=len, reverse=True):
            text = text.replace(value, "***")
        return text

    def _check_nodes(self, ray):
        """Every live node with CPUs imports what a task needs (ray_nodes.node_report, one task pinned
        to each, pickled by value), else one line naming the node and the module, before any task runs
        (a task that cannot be unpickled there would be retried, then lost). Once an executor."""
        if self.checked:
            return
        self.checked = True
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        ray.cloudpickle.register_pickle_by_value(ray_nodes)
        nodes = [n for n in ray.nodes() if n.get("Alive") and (n.get("Resources") or {}).get("CPU", 0) >= 1]
        needed, compiled = ray_nodes.wanted()
        check = ray.remote(ray_nodes.node_report)
        refs = {check.options(num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            n["NodeID"], soft=False)).remote(needed, compiled): n for n in nodes}
        reports, pending, deadline = [], list(refs), time.monotonic() + NODE_CHECK_S
        try:
            while pending and time.monotonic() < deadline:
                done, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
                for ref in done:
                    reports.append((refs[ref], self._report(ray, ref, refs[ref])))
                signals.check()
        finally:
            if pending:   # (a node that does not answer in time: its tasks will say what it lacks)
                self._cancel(ray, pending)
        line, notes = ray_nodes.verdict([(n, r) for n, r in reports if r is not None],
                                        ray_nodes.version_here(), self.ship)
        if line:
            raise OutputError(f"--ray {shown(self.address)}: {line}")
        for note in notes:
            print(f"ckptconv: note: {note}", file=sys.stderr)

    def _report(self, ray, ref, node):
        """A node's report, or None where the node went away meanwhile (Ray schedules nothing there)."""
        try:
            return ray.get(ref)
        except ray.exceptions.RayError as e:
            if not any(n.get("NodeID") == node.get("NodeID") and n.get("Alive") for n in ray.nodes()):
                return None
            first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
            raise OutputError(f"--ray {shown(self.address)}: {ray_nodes.named(node)} cannot run a task "
                              f"({type(e).__name__}: {self._hidden(brief(first, 300))})") from None

    def run(self, tasks, tmp, progress=None) -> list:
        if not tasks:
            return []
        ray = self.connect()
        try:
            return self._run(ray, tasks, _tasks.portable(tmp), progress)
        finally:
            with signals.deferred():
                ray.shutdown()

    def _run(self, ray, tasks, tmp, progress):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        here = ray.get_runtime_context().get_node_id()
        tally = ray.remote(Tally).options(num_cpus=0, max_restarts=0, scheduling_strategy=
                                          NodeAffinitySchedulingStrategy(here, soft=True)).remote()
        remote = ray.remote(_ray_task).options(num_cpus=1, max_retries=self.retries, retry_exceptions=False)
        refs = [remote.remote(t, tmp, tally) for t in tasks]
        index = {ref: i for i, ref in enumerate(refs)}
        found, pending = {}, list(refs)
        total, shown, starts, last = sum(t.size for t in tasks), 0, {}, 0.0

        def look():
            nonlocal shown, starts, last
            last = time.monotonic()
            try:
                nbytes, starts = ray.get(tally.take.remote(), timeout=10)
            except Exception:   # (the tally is only for the bar and the note: a lost one is not the run's end)
                return
            if progress is not None and nbytes:
                step = min(nbytes, total - shown)
                if step > 0:
                    progress(step)
                    shown += step

        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S, fetch_local=True)
                for ref in done:
                    i = index[ref]
                    found[i] = self._answer(ray, ref, tasks[i], starts)
                if time.monotonic() - last > TALLY_S:
                    look()
                signals.check()
            look()
        except BaseException:
            with signals.deferred():
                self._cancel(ray, [r for r in refs if index[r] not in found])
            raise
        if progress is not None and shown < total:
            progress(total - shown)
        answers = [found[i] for i in range(len(tasks))]
        for i, t in enumerate(tasks):
            n = max(starts.get(i, 1), answers[i].attempts)
            answers[i].attempts = n
            if n > 1:
                self.notes.append(f"{t.name}: its task ran {n} times (a worker or node was lost; Ray reran it "
                                  "elsewhere); the output is the same")
        for note in self.notes:
            print(f"ckptconv: note: {note}", file=sys.stderr)
        return answers

    def map(self, fn, calls, names, progress=None) -> list:
        """`fn(*args)` for every args of `calls` as Ray tasks (a module-level `fn` that answers as
        _ray_task does), their answers in order; the same faults as `run` (`names`: each call's,
        for the lines). verify's shares of the checks go this way. A call cannot feed the driver's
        bar as it runs: an answer's "bytes" (a dict's) are counted when it arrives."""
        if not calls:
            return []
        ray = self.connect()
        remote = ray.remote(_call).options(num_cpus=1, max_retries=self.retries, retry_exceptions=False)
        refs = [remote.remote(fn, args) for args in calls]
        index = {ref: i for i, ref in enumerate(refs)}
        found, pending = {}, list(refs)
        named = [type("Call", (), {"name": n})() for n in names]
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
                for ref in done:
                    i = index[ref]
                    found[i] = self._answer(ray, ref, named[i], {}, raw=True)
                    if progress is not None and isinstance(found[i], dict) and found[i].get("bytes"):
                        progress(found[i]["bytes"])
                signals.check()
        except BaseException:
            with signals.deferred():
                self._cancel(ray, [r for r in refs if index[r] not in found])
                ray.shutdown()
            raise
        with signals.deferred():
            ray.shutdown()
        return [found[i] for i in range(len(calls))]

    def lanes(self) -> int:
        """How many tasks the cluster runs at once (its CPUs)."""
        ray = self.connect()
        return max(1, int(ray.cluster_resources().get("CPU", 1)))

    def _answer(self, ray, ref, task, starts, raw=False):
        """A task's Answer, or its error raised (a ckptconv error as it was raised there)."""
        try:
            kind, *rest = ray.get(ref)
        except ray.exceptions.TaskCancelledError:
            raise OutputError(f"{task.name}: its task was cancelled; nothing was published") from None
        except ray.exceptions.RayError as e:   # (its worker or node died more often than it may be rerun)
            why = type(e).__name__
            first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
            raise OutputError(f"{task.name}: its task was lost {self.retries + 1} times ({why}: {brief(first, 200)}); "
                              "nothing was published") from None
        if kind == "error":
            name, line = rest
            raise _tasks.raised(name, line)
        return rest[0] if raw else _tasks.Answer(**rest[0])

    def _cancel(self, ray, refs):
        """Cancel every task still running (their workers killed) and wait for them to end, so that
        none writes into the temporary output once it is removed."""
        for ref in refs:
            try:
                ray.cancel(ref, force=True)
            except Exception:
                pass
        try:
            ray.wait(refs, num_returns=len(refs), timeout=CANCEL_WAIT_S)
        except Exception:
            pass


class Tally:
    """A Ray actor on the driver's node: the bytes tasks wrote since the driver last asked, and how
    many times each task started (a start after the first is a rerun)."""

    def __init__(self):
        self.bytes = 0
        self.starts = {}

    def started(self, index: int):
        self.starts[index] = self.starts.get(index, 0) + 1

    def add(self, n: int):
        self.bytes += n

    def take(self):
        n, self.bytes = self.bytes, 0
        return n, dict(self.starts)


def _ray_task(task, tmp, tally):
    """One task on a Ray worker: ("done", Answer fields) or ("error", the CkptError's class name, its
    line). A ckptconv error is an answer, not an exception: it is the input's fault, a rerun would
    fail alike (and Ray does not rerun what returns)."""
    tally.started.remote(task.index)
    pending = [0]

    def update(n):
        pending[0] += n
        if pending[0] >= PROGRESS_BYTES:
            tally.add.remote(pending[0])
            pending[0] = 0

    hook = os.environ.get("CKPTCONV_TEST_TASK_SLEEP")   # (tests only: a task that takes long enough to kill its node)
    if hook:
        time.sleep(float(hook))
    try:
        answer = _tasks.run_task(task, tmp, update)
    except Exception as e:
        return ("error", *_tasks.failure(e, f"task {task.index}"))
    if pending[0]:
        tally.add.remote(pending[0])
    return ("done", {"result": answer.result, "inputs": answer.inputs, "attempts": _attempt() + 1,
                     "extra": answer.extra})


def _attempt() -> int:
    """Which run of this task this is (0: the first; Ray counts a rerun after a lost worker or node)."""
    try:
        import ray
        return int(ray._private.worker.global_worker.core_worker.get_current_task_attempt_number())
    except Exception:   # (a Ray without it: the tally's count of starts stands alone)
        return 0


def _call(fn, args):
    """A call of `map` on a Ray worker, answered as _ray_task answers."""
    try:
        return ("done", fn(*args))
    except Exception as e:
        return ("error", *_tasks.failure(e, "a share of the checks"))
