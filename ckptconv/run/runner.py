"""One job runner: for every command that writes, plan, and run the plan's units in one driver (this
process); for verify, its stages in order (`run_stages`). The plan `ckptconv plan` prints is the
plan run. Given a job (tasks.Job) and an executor that runs tasks side by side (executors.py:
--workers N on this host, --ray on a cluster), every unit is a task: the answers are checked and
the driver finishes and publishes (`run_tasks`). Otherwise the driver writes every unit itself, into
the atomic output (io/output.atomic_output), or an OUT in an object store into a bucket output
(storage/bucket_out.bucket_output: claimed, published pointer last; its tasks write into it through a
BucketTask)."""
import contextlib
import dataclasses
import hashlib
import json
import os

from ..errors import UsageError
from ..formats import not_ours, published
from ..storage.bucket_out import BucketTask, bucket_output
from ..storage.urls import is_url, redact
from ..layouts.base import RunFacts
from ..layouts.files import check_space
from . import tasks as _tasks
from ..io.output import atomic_output

# what the manifest's "source" records of the options that made it, as the user spells them
_OPTIONS = {"cast": "--dtype", "strip_prefix": "--strip-prefix", "only": "--only", "state_dict": "--state-dict",
            "format": "--from", "target": "--target", "dequantize": "--dequantize", "layout": "--layout",
            "with": "--with"}


def run_stages(stages, clean, merge):
    """A verify's stages, [(name, step or None)], in order: each step runs only while `clean()` (nothing
    found so far; the first always), and the findings are merged after it (`merge(name)`: across the
    processes of a --distributed device check, on every process alike, so they all skip alike)."""
    for at, (name, step) in enumerate(stages):
        if step is None or (at and not clean()):
            continue
        step()
        merge(name)


def run(writer, tensors, out, options, inputs=(), check_unchanged=lambda: None, progress=None, job=None,
        executor=None) -> RunFacts:
    """Write `tensors` to `out` with `writer`; returns the writer's facts. `progress(total)` gives a
    context manager yielding an update(nbytes) callable. With `job` (tasks.Job: how any process
    re-derives this run) and an `executor` that runs tasks side by side (executors.py), every unit
    is a task: see `run_tasks`."""
    units = writer.plan(tensors)
    bucket = is_url(os.fspath(out))
    if bucket and options.resume and executor is not None and executor.name != "local":
        raise UsageError(f"{redact(os.fspath(out))}: --resume of an object-store OUT is the driver's own (it re-checks "
                         f"what a killed run left there); run it without --{executor.name}")
    if job is not None and executor is not None and not (bucket and options.resume) \
            and executor.parallel(_tasks.tasks_of(job, units)):
        return run_tasks(writer, tensors, units, out, options, inputs, check_unchanged, progress, job, executor)
    facts = RunFacts()

    def publish(tmp):   # inside the atomic output: every unit, then the metadata
        nonlocal facts
        with (progress or _no_progress)(sum(u.size for u in units)) as update:
            result = writer.write(units, tmp, update, (0, 1))
        check_unchanged()
        facts = writer.finish(tmp, [result])

    if is_url(os.fspath(out)):
        with bucket_output(out, options.overwrite, options.resume, inputs, writer.single_file, not_ours,
                           writer.pointer(units), published, options=options.storage) as target:
            publish(target)
    else:
        with atomic_output(out, options.overwrite, options.resume, inputs, writer.single_file, not_ours) as tmp:
            publish(tmp)
    return dataclasses.replace(facts, units=[u.name for u in units], unit_bytes=sum(u.size for u in units))


def run_tasks(writer, tensors, units, out, options, inputs, check_unchanged, progress, job, executor) -> RunFacts:
    """Every unit a task (tasks.py) run by `executor`; this process is the driver: it holds the lock and
    the temporary output, feeds one progress bar from every task's bytes, checks each answer (the
    inputs the task read are those planned with, its result fits its unit), writes the metadata
    (`writer.finish`) and publishes. A failing task stops the run (its error, as raised there); a
    signal ends the workers and removes the temporary output (io/output.atomic_output).

    With --resume, every finished task's answer is kept in the temporary output (tasks.DONE) and a
    rerun of the same job takes those whose files are still as the task left them (tasks.finished):
    only the other tasks run again (a kept task's files are re-hashed first and must give its
    digests again: `Layout.rehashed`, as the journal's shards are; a task that read other inputs
    is redone), and nothing else a killed run left there stays (a file of another plan, a
    half-written one). (A run of one task at a time keeps its own journal instead:
    layouts/sharded/resume.py; each kind starts afresh from what the other left.)"""
    planned = _tasks.identity(inputs)
    todo = _tasks.tasks_of(job, units)
    bucket = is_url(os.fspath(out))
    key = run_key(writer, tensors, units, planned) if options.resume and not bucket else None
    facts = RunFacts()

    def publish(tmp):
        nonlocal facts
        kept = _tasks.finished(tmp, todo, key, planned) if key else {}
        kept = {i: a for i, a in kept.items() if _rehashed(writer, units, todo[i], a, tmp)}
        if key:
            _tasks.keep_only(tmp, [t for t in todo if t.index in kept])
        left = [t for t in todo if t.index not in kept]
        check_space(tmp, sum(t.size for t in left))   # (each task checks only its own unit's room)
        where = BucketTask(os.fspath(out), options.storage, writer.single_file) if bucket else tmp
        with (progress or _no_progress)(sum(t.size for t in left)) as update:
            ran = executor.run([dataclasses.replace(t, record=key) for t in left] if key else left, where, update)
        answers = {**kept, **{t.index: a for t, a in zip(left, ran)}}
        if bucket:
            _tasks.adopt(tmp, left, ran)
        check_unchanged()
        accepted = _tasks.accept(writer, units, todo, [answers[t.index] for t in todo], tmp, planned)
        if key:
            _tasks.forget_done(tmp)
        facts = writer.finish(tmp, accepted)
        if kept:
            facts.resumed_bytes = sum(t.size for t in todo if t.index in kept)
            facts.resume_note = facts.resume_note or \
                f"{len(kept)} of {len(todo)} task(s) finished by the interrupted run were kept"
        elif key:
            facts.resume_note = facts.resume_note or \
                "no task an interrupted run of this job finished was left; started afresh"

    if bucket:
        with bucket_output(out, options.overwrite, options.resume, inputs, writer.single_file, not_ours,
                           writer.pointer(units), published, options=options.storage, tasks=True) as target:
            publish(target)
    else:
        with atomic_output(out, options.overwrite, options.resume, inputs, writer.single_file, not_ours) as tmp:
            publish(tmp)
    return dataclasses.replace(facts, units=[u.name for u in units], unit_bytes=sum(u.size for u in units))


def _rehashed(writer, units, task, answer, tmp) -> bool:
    """Whether a task a killed run finished may be kept: its answer fits its units and its files,
    read again, give the answer's digests."""
    from ..layouts.base import ResultError
    by_name = {u.name: u for u in units}
    try:
        mine = [by_name[n] for n, _ in task.units]
        return writer.rehashed(writer.received(answer.result, mine, tmp), mine, tmp)
    except (ResultError, KeyError, OSError):
        return False


def run_key(writer, tensors, units, planned: dict) -> str:
    """Identifies a job, for --resume of its tasks: the options that change bytes (as the user gave
    them), what the reader made of the source, the inputs (`planned`: tasks.identity, the same on
    every host; and as the driver sees them, `content.identity`: devices, inodes, change times, so a
    file put in the place of another with its size and times is another job), and the plan (every
    unit, every tensor's name, dtype and shape), as one digest."""
    source = {k: v for k, v in writer.content.source.items() if k != "path"}
    options = {**{flag: source.pop(key, None) for key, flag in _OPTIONS.items()}, **writer.job()}
    h = hashlib.sha256(json.dumps([[u.name, u.size] for u in units]).encode())
    for t in tensors:
        h.update(f"{t.name}\0{t.dtype.code}\0{list(t.shape)}\n".encode("utf-8", "surrogatepass"))
    extras = json.dumps([writer.content.extras, writer.content.manifest], sort_keys=True, default=str)
    job = {"options": options, "source": source, "inputs": planned, "identity": writer.content.identity,
           "plan": h.hexdigest(),
           "extras": hashlib.sha256(extras.encode("utf-8", "surrogatepass")).hexdigest()}
    return hashlib.sha256(json.dumps(job, sort_keys=True, default=str).encode("utf-8", "surrogatepass")).hexdigest()


@contextlib.contextmanager
def _no_progress(total):
    yield None
