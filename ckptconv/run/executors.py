"""Executors: what runs a run's tasks (tasks.py), registered by name like readers. `local` (the
default) keeps `--workers N` tasks in flight on this host, each in a worker process of its own.

An executor's `run(tasks, tmp, progress)` returns every task's `tasks.Answer` in task (plan) order,
or raises: the first task that fails stops the run at once (the others are cancelled, the workers
ended), with the task's own error (a BadInput stays a BadInput: exit 2, its one line). The driver
(runner.py) checks the answers and finishes the output; nothing is published unless every task
answered. `progress(nbytes)` is the driver's one bar, fed by every task's bytes.

Why processes and not threads (measured, docs/benchmarks.md#workers): a task is CPU work in
Python between the C parts (the write pipeline, SHA-256), and a thread cannot be stopped when the
driver is told to stop; a process is killed, and its files go with the temporary output. Workers are
spawned, not forked: a task must run in a process that shares nothing with the driver (as on a
cluster), and the driver holds threads and mappings a fork would copy in an unknown state."""
import contextlib
import os
import signal
import sys

from .. import signals
from ..errors import BadInput, OutputError, UsageError
from ..safejson import loads
from . import tasks as _tasks

EXECUTORS = {}
POLL_S = 0.1          # how often the driver looks at its workers while it waits for answers
PROGRESS_BYTES = 16 << 20   # a worker reports its bytes to the driver's bar in steps of this


def register(name: str):
    """Class decorator: the executor `name` (run/executors.py's registry; the Ray executor adds "ray")."""
    def add(cls):
        cls.name = name
        EXECUTORS[name] = cls
        return cls
    return add


def make(name: str = "local", **options):
    """The executor registered as `name`, made with `options` (the Ray executor's module is imported
    when asked for: it imports Ray only when it runs)."""
    if name == "ray" and name not in EXECUTORS:
        from .ray_executor import RayExecutor   # (imports Ray only when it runs)
        register("ray")(RayExecutor)
    return EXECUTORS[name](**options)


def chosen(ray, workers: int | None, runtime_env=None):
    """The executor a command asked for: None (the local one, made by the job from `workers`) without
    `ray`; else the Ray executor at `ray` (an address; "" or True: RAY_ADDRESS, else auto), its tasks
    in `runtime_env` (--ray-runtime-env: a dict, or its JSON text) merged with ckptconv's own
    (ray_nodes.py). Both `ray` and `workers` at once is refused (--workers sets this host's tasks,
    the cluster's CPUs set Ray's), and so is --ray without Ray installed, before anything is read."""
    if ray is None or ray is False:
        if runtime_env is not None:
            raise UsageError("--ray-runtime-env is the runtime_env of --ray's tasks: give --ray too")
        return None
    if workers is not None:
        raise UsageError("--workers sets this host's tasks in flight; with --ray the cluster's CPUs do "
                         "(one a task): give one of them")
    if ray is not True and not isinstance(ray, str):
        raise UsageError(f"ray: expected an address, True or None, not {type(ray).__name__}")
    runtime_env = _runtime_env(runtime_env)
    import importlib.util
    if importlib.util.find_spec("ray") is None:   # (Ray itself is imported when it runs)
        raise UsageError("--ray needs Ray: pip install 'ckptconv[ray]'")
    return make("ray", address=None if ray is True else (ray or None), runtime_env=runtime_env)


def _runtime_env(given) -> dict | None:
    """--ray-runtime-env as a dict: a JSON object (as `ray job submit --runtime-env-json` takes it)."""
    if given is None or isinstance(given, dict):
        return given
    if not isinstance(given, str):
        raise UsageError(f"ray_runtime_env: expected a dict or its JSON text, not {type(given).__name__}")
    try:
        value = loads(given, "--ray-runtime-env", "its value")
    except BadInput as e:
        raise UsageError(str(e)) from None
    if not isinstance(value, dict):
        raise UsageError(f"--ray-runtime-env: expected a JSON object (Ray's runtime_env), not {type(value).__name__}")
    return value


CORES_PER_TASK = 2   # a task's writer and its two SHA-256 streams keep about 1.6 cores busy (benchmarks.md)


def default_workers() -> int:
    """Tasks in flight by default: one per CORES_PER_TASK of the cores this process may use (1 on
    two cores, where a second task measured slower; 8 on 16)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores // CORES_PER_TASK)


AUTO_MIN_BYTES = 256 * 10**6   # without --workers, a run smaller than this is one task at a time


class Executor:
    """Runs tasks; `workers`: how many in flight (None: auto, `default_workers()` for a run of at least
    AUTO_MIN_BYTES, where starting workers pays). See the module docstring for `run`."""

    name = "?"

    def __init__(self, workers: int | None = None):
        self.auto = workers is None
        self.workers = default_workers() if workers is None else workers

    def parallel(self, tasks) -> bool:
        """Whether it would run `tasks` anywhere but in this process one after another."""
        return self.side_by_side(len(tasks), sum(t.size for t in tasks))

    def side_by_side(self, count: int, nbytes: int) -> bool:
        """Whether `count` pieces of work of `nbytes` in all would run side by side."""
        return self.workers > 1 and count > 1 and (not self.auto or nbytes >= AUTO_MIN_BYTES)

    def run(self, tasks, tmp, progress=None) -> list:
        raise NotImplementedError


@register("local")
class LocalExecutor(Executor):
    """`workers` tasks in flight on this host: worker processes (spawned), each fed the next task in
    plan order when it answers; with `kind="thread"`, threads of this process instead (kept for
    measurement: bench.py's workers scenario)."""

    def __init__(self, workers: int | None = None, kind: str | None = None):
        super().__init__(workers)
        self.kind = kind or os.environ.get("CKPTCONV_LOCAL_WORKERS", "process")
        if self.kind not in ("process", "thread"):
            raise UsageError(f"CKPTCONV_LOCAL_WORKERS={self.kind!r}: process or thread")

    def run(self, tasks, tmp, progress=None) -> list:
        if not tasks:
            return []
        if not self.parallel(tasks):   # one at a time, in this process: as a run always was
            return [_tasks.run_task(t, tmp, progress) for t in tasks]
        found = self._pool([("task", t, _tasks.portable(tmp)) for t in tasks], progress)
        return [_tasks.Answer(**a) for a in found]

    def lanes(self) -> int:
        """How many tasks it runs at once."""
        return self.workers

    def map(self, fn, calls, names=None, progress=None) -> list:
        """`fn(*args, progress=update)` for every args of `calls` (`fn` module-level, its answer plain
        data), in the worker processes, answers in order; the same faults as `run`. `update(nbytes)`
        feeds the driver's bar. verify's shares of the checks go this way."""
        if not calls:
            return []
        if self.workers <= 1 or len(calls) <= 1:
            return [fn(*args, progress=progress) for args in calls]
        return self._pool([("call", fn, tuple(args)) for args in calls], progress)

    def _pool(self, items, progress) -> list:
        return (self._threads if self.kind == "thread" else self._processes)(items, progress)

    def _threads(self, items, progress):
        from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
        import threading
        lock = threading.Lock()

        def update(n):
            if progress is not None:
                with lock:
                    progress(n)

        pool = ThreadPoolExecutor(min(self.workers, len(items)))
        try:
            futures = [pool.submit(_perform, item, update) for item in items]
            pending = set(futures)
            while pending:
                done, pending = wait(pending, POLL_S, FIRST_EXCEPTION)
                for f in done:
                    f.result()   # (the first failure, raised)
                signals.check()
            return [f.result() for f in futures]
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _processes(self, items, progress):
        """`items` in spawned worker processes, each fed one item at a time over a pipe of its own (no
        queue: a queue's semaphores are multiprocessing's resource tracker's to clean, and it spoke up
        in tracebacks when a terminal's SIGHUP reached it too)."""
        import multiprocessing
        from multiprocessing.connection import wait
        ctx = multiprocessing.get_context("spawn")
        todo = iter(enumerate(items))
        workers, busy, found = {}, {}, {}

        def feed(conn):
            item = next(todo, None)
            try:
                conn.send(item)   # (None: no more, the worker ends)
            except OSError:   # (it ended after its last answer)
                if item is None:
                    return
                lost(conn)
            if item is not None:
                busy[conn] = item[0]

        def lost(conn):
            p = workers[conn]
            p.join(1)
            raise OutputError(f"a worker process ended ({_how(p.exitcode)}) before its task answered; "
                              "nothing was published") from None

        tracker = _Tracker()

        def end():   # every process the pool started, ended and reaped before the driver goes on
            for p in workers.values():
                if p.is_alive():
                    p.kill()
            for conn, p in workers.items():
                p.join()
                conn.close()
            tracker.stop()

        with signals.on_escape(end):   # (also the watcher's way out, when a signal finds no checkpoint)
            try:
                with _quiet_children(), _no_main():
                    for _ in range(min(self.workers, len(items))):
                        here, there = ctx.Pipe()
                        p = ctx.Process(target=_worker, args=(there, os.getpid()), daemon=True)
                        p.start()
                        there.close()
                        workers[here] = p
                for conn in workers:
                    feed(conn)
                while len(found) < len(items):
                    ready = wait(list(busy), POLL_S)
                    signals.check()
                    for conn in ready:
                        try:
                            message = conn.recv()
                        except (EOFError, OSError):
                            lost(conn)
                        kind = message[0]
                        if kind == "bytes":
                            if progress is not None:
                                progress(message[1])
                        elif kind == "done":
                            found[message[1]] = message[2]
                            del busy[conn]
                            feed(conn)
                        else:   # ("error", index, type name, line)
                            _, index, name, line = message
                            raise _tasks.raised(name, line)
                return [found[i] for i in range(len(items))]
            finally:
                with signals.deferred():
                    end()


class _Tracker:
    """multiprocessing's resource tracker, as a pool sees it. Spawning the first worker starts it: a
    process of its own, beside the workers, that unlinks the semaphores and shared memory a process
    leaks, and ends when every process holding its pipe (the driver, each worker) has closed it,
    i.e. only after the driver exits; nothing then reaps it (a zombie where the system's init does
    not), and a terminal's SIGHUP ends it before the driver. A pool that started it stops it and
    reaps it once its workers are reaped, so no process of the run outlives the driver. One that was
    running before (the program's own) is left alone."""

    def __init__(self):
        self.before = self._running()

    @staticmethod
    def _running() -> bool:
        from multiprocessing import resource_tracker
        return getattr(resource_tracker._resource_tracker, "_pid", None) is not None   # (launched here)

    def stop(self):
        if self.before or not self._running():
            return
        from multiprocessing import resource_tracker
        with contextlib.suppress(ChildProcessError):   # (reaped already)
            resource_tracker._resource_tracker._stop()   # closes its pipe, waits for it (3.8 and later)


def _perform(item, update):
    """One item of a pool, in plain data: ("task", Task, tmp) -> the Answer's fields; ("call", fn, args)
    -> fn(*args, progress=update)."""
    if item[0] == "task":
        _, task, tmp = item
        answer = _tasks.run_task(task, tmp, update)
        return {"result": answer.result, "inputs": answer.inputs, "extra": answer.extra}
    _, fn, args = item
    return fn(*args, progress=update)


def _how(code) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


@contextlib.contextmanager
def _quiet_children():
    """Spawned workers ignore Ctrl-C (the terminal sends it to the whole group: the driver decides and
    ends them); the disposition is inherited at spawn, and restored here at once."""
    try:
        before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:   # (not the main thread)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@contextlib.contextmanager
def _no_main():
    """Start workers without the driver's __main__: multiprocessing's spawn would re-import the script
    that called us in each worker (a program using the API at its top level, without a
    `if __name__ == "__main__"` guard, would run again there). A worker needs none of it: what it runs
    is named by module (ckptconv's, or a job's prepare function)."""
    import types
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _die_with(parent: int):
    """End this worker when the driver ends, however it ends (Linux: the parent-death signal)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:   # (it ended before the signal was asked for)
        os._exit(1)


def _worker(conn, parent: int):
    """A worker process: items from the driver over `conn` until None (a task, or a call of `map`:
    _perform), each answered: ("done", index, plain data), ("error", index, the CkptError's class
    name, its line); its bytes as ("bytes", n)."""
    _die_with(parent)
    pending = [0]

    def update(n):
        pending[0] += n
        if pending[0] >= PROGRESS_BYTES:
            conn.send(("bytes", pending[0]))
            pending[0] = 0

    while True:
        try:
            item = conn.recv()
        except EOFError:   # (the driver is gone)
            break
        if item is None:
            break
        index, what = item
        try:
            value = _perform(what, update)
            if pending[0]:
                conn.send(("bytes", pending[0]))
                pending[0] = 0
            conn.send(("done", index, value))
        except BaseException as e:
            conn.send(("error", index, *_tasks.failure(e, f"task {index}")))
            break
    _tasks.forget()
    conn.close()
    sys.exit(0)
