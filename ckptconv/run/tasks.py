"""A run's units as tasks: the one piece of work an executor (executors.py) runs anywhere.

A task is a pure function of (plan unit, source description, options) -> its result: `run_task`
re-opens the source from the typed request the command was given (a `Job`: a module-level
`prepare` function of the job and its arguments, both picklable by reference, so a process that
did not fork from the driver — a spawned worker, a Ray worker on another host — can run it),
re-derives the writer and its plan (metadata only), writes exactly its units into the driver's
temporary output directory, and returns plain data: the writer's result as it crosses processes
(`Result.to_json()`), and the identity of the inputs it read (sizes and modification times, an
object's ETag). Writing a task twice gives the same bytes, so a retried task is harmless.

The driver (runner.py) checks every answer before it finishes the output (`accept`): the task
planned the same units the driver did (names and sizes), read the same inputs (identity), and its
result fits its units (`Layout.received`: every file on disk with its planned size, a digest per
tensor)."""
import dataclasses
import os
import stat
from dataclasses import dataclass, field

from ..errors import OutputError, brief
from ..io.output import Inputs
from ..layouts.base import ResultError
from ..storage import files as storage
from ..storage.bucket_out import BucketTask, written
from ..storage.urls import is_url


@dataclass
class Prepared:
    """What a job's `prepare` gives back: the writer (its plan not yet made), the tensors it plans,
    the inputs it reads (io.output.Inputs or paths) and the check that they did not change."""

    writer: object
    tensors: list
    inputs: object = ()
    check_unchanged: object = lambda: None


@dataclass(frozen=True)
class Job:
    """How any process re-derives a run: `prepare(*args) -> Prepared`. `prepare` is a module-level
    function (jobs/convert.prepared, jobs/reshard.prepared) and `args` its typed request
    (readers.Source, the command's options, WriteOptions, MeshSpec): both cross processes by pickle."""

    prepare: object
    args: tuple


@dataclass(frozen=True)
class Task:
    """One task of a run: the plan's units it writes, as (name, bytes) (the task re-plans and must
    find exactly these), and its share, (index, count), as the layouts' `write` takes it (which of
    the work no unit names is this task's: a reshard's global digests)."""

    job: Job
    index: int
    units: tuple
    share: tuple
    record: str | None = None   # with --resume: the run's key; the task keeps its answer (DONE) under it

    @property
    def size(self) -> int:
        return sum(size for _, size in self.units)

    @property
    def name(self) -> str:
        return self.units[0][0] if len(self.units) == 1 else f"{self.units[0][0]} (+{len(self.units) - 1} more)"


@dataclass
class Answer:
    """What a task gives back, as plain data: the writer's result (to_json), the identity of the
    inputs it read (`identity`), and how many times it was run (an executor that retries says so)."""

    result: dict
    inputs: dict
    attempts: int = 1
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"result": self.result, "inputs": self.inputs, "attempts": self.attempts, **self.extra}


def tasks_of(job: Job, units) -> list:
    """One task per unit of the plan (an output file, a rank directory), in plan order: the units an
    executor balances and, on a cluster, retries one by one."""
    n = len(units)
    return [Task(job, i, ((u.name, u.size),), (i, n)) for i, u in enumerate(units)]


_CACHE = []   # per process: the last job prepared and its plan (a worker runs many tasks of one job)


def prepared(job: Job) -> tuple:
    """(Prepared, the plan's units) of `job` in this process; the last job's is kept, so a worker
    that runs several tasks of one run opens the source once."""
    if _CACHE and _CACHE[0][0] == job:
        return _CACHE[0][1]
    _CACHE.clear()
    made = job.prepare(*job.args)
    units = made.writer.plan(made.tensors)
    _CACHE.append((job, (made, units)))
    return made, units


def forget():
    """Drop the job this process keeps (its mapped inputs with it)."""
    _CACHE.clear()


def run_task(task: Task, tmp, progress=None) -> Answer:
    """Run `task`: re-derive the writer and its plan, write exactly the task's units into `tmp` (the
    driver's temporary output directory), check the inputs did not change, and answer in plain data.
    A unit the task's own plan does not have (another source, other options) is refused (OutputError)."""
    made, units = prepared(task.job)
    by_name = {u.name: u for u in units}
    mine = []
    for name, size in task.units:
        unit = by_name.get(name)
        if unit is None or unit.size != size:
            found = "not in its plan" if unit is None else f"of {unit.size} bytes in its plan"
            raise OutputError(f"task {task.index} ({brief(name, 100)}): the unit the driver planned with {size} bytes "
                              f"is {found}; its source or options differ from the driver's")
        mine.append(unit)
    if isinstance(tmp, BucketTask):   # (a bucket OUT the driver claimed: this task's objects, named in its answer)
        target = tmp.target()
        try:
            result = made.writer.write(mine, target, progress, task.share)
            made.check_unchanged()
        except BaseException:
            target.out.publisher.rollback()
            raise
        return Answer(result.to_json(), identity(made.inputs), extra={"objects": written(target)})
    result = made.writer.write(mine, tmp, progress, task.share)
    made.check_unchanged()
    answer = Answer(result.to_json(), identity(made.inputs))
    if task.record:
        _keep(task, answer, tmp)
    return answer


def portable(tmp):
    """Where tasks write, as it crosses processes: a local temporary directory's path, or the BucketTask."""
    return tmp if isinstance(tmp, BucketTask) else os.fspath(tmp)


def adopt(target, tasks, answers):
    """The objects each task wrote into the driver's bucket OUT (`target`), as its answer names them,
    become the run's: known to the target (its checks, the publication's), rolled back with the rest.
    Only names inside the task's own units are taken (OutputError otherwise)."""
    publisher = target.out.publisher
    for task, answer in zip(tasks, answers):
        objects = answer.extra.get("objects")
        mine = [name for name, _ in task.units]
        if not isinstance(objects, dict) or not all(
                isinstance(k, str) and type(v) is int and any(k == n or k.startswith(n + "/") for n in mine)
                for k, v in objects.items()):
            raise OutputError(f"{task.name}: its task's answer names objects outside its unit; nothing was published")
        target.out.known.update(objects)
        publisher.adopt([publisher.place(k).key for k in objects])


DONE = ".ckptconv-tasks"   # in the temporary output, with --resume: each finished task's answer
MAX_RECORD = 1 << 30       # bytes of one kept answer (a million tensors' digests in hex are 64 MB)


def _files_of(tmp, units) -> dict:
    """{path inside tmp: "mode, size, mtime_ns"} of every entry a task's units are (a shard; a rank
    directory's files and folders, a link there as a link, never followed): what must still be there,
    untouched, for a rerun to keep the task."""
    found = {}
    for name, _ in units:
        top = os.path.join(os.fspath(tmp), name)
        walk = [top] if not os.path.isdir(top) or os.path.islink(top) else \
            [os.path.join(d, f) for d, ds, fs in os.walk(top) for f in [*ds, *fs]]
        for path in walk:
            st = os.lstat(path)
            found[os.path.relpath(path, os.fspath(tmp))] = f"{st.st_mode:o}, {st.st_size}, {st.st_mtime_ns}"
    return dict(sorted(found.items()))


def _done(tmp) -> str:
    """tmp/DONE as a directory of this run's own: anything else there (a link, a file) is removed
    first, so a record is never written through a link nor read from elsewhere."""
    folder = os.path.join(os.fspath(tmp), DONE)
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        os.unlink(folder)   # (a link is removed, never followed)
    os.makedirs(folder, exist_ok=True)
    return folder


def _keep(task: Task, answer: Answer, tmp):
    """Record a finished task's answer in tmp/DONE (written whole, then renamed into place)."""
    import json
    folder = _done(tmp)
    record = {"key": task.record, "units": [list(u) for u in task.units], "answer": answer.to_json(),
              "files": _files_of(tmp, task.units)}
    part = os.path.join(folder, f".{task.index}.{os.getpid()}.part")
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with open(fd, "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(part, os.path.join(folder, f"{task.index}.json"))


def finished(tmp, tasks, key: str, planned: dict) -> dict:
    """{task index: Answer} of the tasks an interrupted run of the same job (`key`) finished, whose
    files are still as the task left them (sizes and modification times) and which read the inputs
    the run plans with (`planned`, as `identity` gives them); anything else is redone.
    (The runner then re-hashes what it keeps: Layout.rehashed.) Records are read from a directory
    of the run's own, never through a link, at most MAX_RECORD bytes each."""
    from .. import safejson
    from ..errors import BadInput
    folder = _done(tmp)
    kept = {}
    for t in tasks:
        path = os.path.join(folder, f"{t.index}.json")
        try:
            if not os.path.lexists(path):
                continue
            with safejson.open_regular(path, "task record", follow=False) as fd:
                size = os.fstat(fd).st_size
                if size > MAX_RECORD:
                    continue
                record = safejson.loads(os.read(fd, size), path, "a task's record")
            if not isinstance(record, dict) or record.get("key") != key \
                    or record.get("units") != [list(u) for u in t.units]:
                continue
            if record.get("files") != _files_of(tmp, t.units):
                continue
            a = record["answer"]
            if not isinstance(a, dict) or not isinstance(a.get("inputs"), dict) \
                    or difference(planned, a["inputs"]) is not None:
                continue
            kept[t.index] = Answer(a["result"], a["inputs"])
        except (OSError, BadInput, KeyError, TypeError):
            continue
    return kept


def keep_only(tmp, kept):
    """Remove from `tmp` what a killed run left there but the units of the `kept` tasks (a file, or
    a rank directory whole; a unit inside a folder, as a pipeline's component, keeps that folder but
    nothing else in it) and their records: a file of another plan or of a task that is redone, a link
    or anything else planted in the records' directory must not be published (nor written through)."""
    import shutil
    keep = {name for t in kept for name, _ in t.units}
    records = {f"{t.index}.json" for t in kept}

    def remove(entry):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)

    def sweep(folder, rel):
        for entry in os.scandir(folder):
            path = rel + entry.name
            if not rel and entry.name == DONE and entry.is_dir(follow_symlinks=False):
                for record in os.scandir(entry.path):
                    if record.name not in records or not record.is_file(follow_symlinks=False):
                        remove(record)
            elif path in keep:
                continue
            elif entry.is_dir(follow_symlinks=False) and any(k.startswith(path + "/") for k in keep):
                sweep(entry.path, path + "/")
            else:
                remove(entry)

    sweep(os.fspath(tmp), "")


def forget_done(tmp):
    """Remove the kept answers: they are no part of the output (a link there is removed, not followed)."""
    import shutil
    folder = os.path.join(os.fspath(tmp), DONE)
    if os.path.islink(folder) or os.path.isfile(folder):
        os.unlink(folder)
    else:
        shutil.rmtree(folder, ignore_errors=True)


def identity(inputs) -> dict:
    """{name inside the source: "size bytes, modified at mtime_ns"} of every input file (a local
    path; the directory a source is read from is no input of its own), or "etag:size" of an object:
    what must be the same wherever a task reads the source. Host-specific parts (device, inode)
    are left out: a shared file system shows other numbers on other hosts."""
    inputs = inputs if isinstance(inputs, Inputs) else Inputs(tuple(inputs))
    roots = [r if is_url(os.fspath(r)) else os.path.realpath(r) for r in inputs.roots]
    found = {}
    for p in inputs.files:
        p = os.fspath(p)
        if is_url(p):
            root = next((r for r in roots if p.startswith(r.rstrip("/") + "/")), None)
            found[p[len(root.rstrip("/")) + 1:] if root else p.rsplit("/", 1)[-1]] = storage.fingerprint(p)
            continue
        real = os.path.realpath(p)
        root = next((r for r in roots if real.startswith(r + os.sep)), None)
        st = os.stat(real)
        found[os.path.relpath(real, root) if root else os.path.basename(real)] = \
            f"{st.st_size} bytes, modified at {st.st_mtime_ns}" if not os.path.isdir(real) else "a directory"
    return dict(sorted(found.items()))


def difference(planned: dict, read: dict) -> str | None:
    """The first input whose identity differs between the driver's plan and a task's read, in words."""
    for name in sorted(set(planned) | set(read)):
        if planned.get(name) != read.get(name):
            return (f"{brief(name, 200)} is {brief(read.get(name, 'absent'), 80)} there, "
                    f"{brief(planned.get(name, 'absent'), 80)} to the driver")
    return None


def accept(writer, units, tasks, answers, tmp, planned_inputs: dict) -> list:
    """The writer's results of every task, in plan order, each read back and checked: the inputs the
    task read are those the driver planned with, and its result fits its units (Layout.received).
    OutputError naming the unit otherwise; nothing is published then."""
    by_name = {u.name: u for u in units}
    results = []
    for task, answer in zip(tasks, answers):
        why = difference(planned_inputs, answer.inputs)
        if why:
            raise OutputError(f"{task.name}: its task read other inputs than the run planned with ({why}); "
                              "every host must see the same SRC; nothing was published")
        try:
            results.append(writer.received(answer.result, [by_name[n] for n, _ in task.units], tmp))
        except ResultError as e:
            raise OutputError(f"{task.name}: its task's result does not fit the unit: {e}") from None
    return results


def failure(e: BaseException, what: str) -> tuple:
    """A task's error as it crosses processes, (class name, line): a ckptconv error as raised; an
    OSError as an OutputError naming its file; anything else (a bug) its type and line, for `what`
    (not a traceback the driver cannot show). `raised` makes it an error again in the driver."""
    from ..errors import CkptError
    if isinstance(e, CkptError):
        return type(e).__name__, str(e)
    if isinstance(e, OSError):
        return "OutputError", f"{e.filename or ''}: {e.strerror or e}"
    return "OutputError", f"{what} failed: {type(e).__name__}: {e}"


def raised(name: str, line: str):
    """The error a task answered with (`failure`), as the driver raises it: the CkptError subclass
    called `name` (OutputError if there is none), so a BadInput stays exit 2 and its one line."""
    from .. import errors
    found = getattr(errors, name, None)
    return (found if isinstance(found, type) and issubclass(found, errors.CkptError) else OutputError)(line)


def with_read_workers(source, workers: int):
    """`source` (readers.Source) read with `workers` parse threads: a task parses with one, as
    several tasks are already in flight."""
    return dataclasses.replace(source, options=dataclasses.replace(source.options, workers=workers))
