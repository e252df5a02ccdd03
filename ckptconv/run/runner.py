"""One job runner: for every command that writes, plan, share the units out (share.py), write mine,
gather the results, and process 0 finishes inside the atomic output; for verify, its stages in
order (`run_stages`). A single process is a cluster of one (`cluster.Solo`), so there is one path,
and the plan `ckptconv plan` prints is the plan run. An OUT in an object store is written by one
process into a bucket output (storage/targets.bucket_output: claimed, published pointer last).
Given a job (tasks.Job) and an executor that runs tasks side by side (executors.py: --workers N on
this host), this process is the driver instead: every unit is a task, the answers are checked and
the driver finishes and publishes (`run_tasks`)."""
import contextlib
import dataclasses
import hashlib
import json
import os
from pathlib import Path

from .cluster import Solo, on_cluster, run_guarded
from ..errors import OutputError, UsageError
from ..formats import not_ours, published
from ..storage.targets import bucket_output
from ..storage.urls import is_url, redact
from ..layouts.base import ResultError, RunFacts
from .share import owners
from . import tasks as _tasks
from ..io.output import Inputs, temp_path

# what the manifest's "source" records of the options that made it, as the user spells them
_OPTIONS = {"cast": "--dtype", "strip_prefix": "--strip-prefix", "only": "--only", "state_dict": "--state-dict",
            "format": "--from", "target": "--target", "dequantize": "--dequantize", "layout": "--layout",
            "with": "--with"}


def shares(units, cluster) -> list:
    """The units process `cluster.process_id` writes (balanced by bytes, deterministic)."""
    return [u for u, o in zip(units, owners(units, cluster.num_processes)) if o == cluster.process_id]


def run_stages(stages, clean, merge):
    """A verify's stages, [(name, step or None)], in order: each step runs only while `clean()` (nothing
    found so far; the first always), and every process's findings are merged after it (`merge(name)`,
    on every process alike, so they all see the same findings and skip alike)."""
    for at, (name, step) in enumerate(stages):
        if step is None or (at and not clean()):
            continue
        step()
        merge(name)


def run(writer, tensors, out, options, inputs=(), check_unchanged=lambda: None, cluster=None,
        progress=None, job=None, executor=None) -> RunFacts:
    """Write `tensors` to `out` with `writer`; returns the writer's facts (process 0) and this
    process's units. `progress(total)` gives a context manager yielding an update(nbytes) callable.
    With `job` (tasks.Job: how any process re-derives this run) and an `executor` that runs tasks
    side by side (executors.py), every unit is a task: see `run_tasks`."""
    tasked = cluster is None   # (--distributed, even of one process, shares out as before)
    cluster = cluster or Solo()
    units = writer.plan(tensors)
    remote = executor is not None and executor.name != "local"
    if remote and is_url(os.fspath(out)):
        raise UsageError(f"{redact(os.fspath(out))}: an object-store OUT is written by one process; --{executor.name} "
                         "writes OUT on a file system every node sees (SRC may be in a bucket)")
    if tasked and job is not None and executor is not None and (not options.resume or remote) \
            and not is_url(os.fspath(out)) and executor.parallel(_tasks.tasks_of(job, units)):
        return run_tasks(writer, tensors, units, out, options, inputs, check_unchanged, progress, job, executor)
    mine = shares(units, cluster)
    share = (cluster.process_id, cluster.num_processes)
    facts, own = RunFacts(), []

    def work(tmp):
        with (progress or _no_progress)(sum(u.size for u in mine)) as update:
            result = writer.write(mine, tmp, update, share)
        check_unchanged()
        own.append(result)
        return result

    def publish(tmp):  # process 0, inside the atomic output: its share, everyone's results, the metadata
        sent = run_guarded(cluster, "units", lambda: work(tmp))
        owner = owners(units, cluster.num_processes)
        results = own[:1]   # (its own as it is; the others' as they crossed: read and checked)
        for p, data in enumerate(sent[1:], 1):
            try:
                results.append(writer.received(data, [u for u, o in zip(units, owner) if o == p], tmp))
            except ResultError as e:
                raise OutputError(f"process {p} sent a result that does not fit its share: {e}") from None
        nonlocal facts
        facts = writer.finish(tmp, results)

    def contribute():  # the other processes: their share, into process 0's temporary directory
        run_guarded(cluster, "units", lambda: work(temp_path(Path(os.path.abspath(out)))))

    if is_url(os.fspath(out)):
        if cluster.num_processes > 1:
            raise UsageError(f"{redact(os.fspath(out))}: an object-store OUT is written by one process; "
                             "--distributed writes a local or shared file system only")
        with bucket_output(out, options.overwrite, options.resume, inputs, writer.single_file, not_ours,
                           writer.pointer(units), published) as target:
            publish(target)
    else:
        job = job_of(writer, tensors, units, inputs) if cluster.num_processes > 1 else None
        on_cluster(cluster, out, options.overwrite, publish, contribute, inputs, options.resume, writer.single_file, job)
    return dataclasses.replace(facts, units=[u.name for u in mine], unit_bytes=sum(u.size for u in mine))


def run_tasks(writer, tensors, units, out, options, inputs, check_unchanged, progress, job, executor) -> RunFacts:
    """Every unit a task (tasks.py) run by `executor`; this process is the driver: it holds the lock and
    the temporary output, feeds one progress bar from every task's bytes, checks each answer (the
    inputs the task read are those planned with, its result fits its unit), writes the metadata
    (`writer.finish`) and publishes. A failing task stops the run (its error, as raised there); a
    signal ends the workers and removes the temporary output (io/output.atomic_output).

    With --resume (the Ray executor), every finished task's answer is kept in the temporary output
    (tasks.DONE) and a rerun of the same job takes those whose files are still as the task left them
    (tasks.finished): only the other tasks run again."""
    planned = _tasks.identity(inputs)
    todo = _tasks.tasks_of(job, units)
    key = run_key(writer, tensors, units, planned) if options.resume else None
    facts = RunFacts()

    def publish(tmp):
        nonlocal facts
        kept = _tasks.finished(tmp, todo, key) if key else {}
        left = [t for t in todo if t.index not in kept]
        with (progress or _no_progress)(sum(t.size for t in left)) as update:
            ran = executor.run([dataclasses.replace(t, record=key) for t in left] if key else left, tmp, update)
        answers = {**kept, **{t.index: a for t, a in zip(left, ran)}}
        check_unchanged()
        accepted = _tasks.accept(writer, units, todo, [answers[t.index] for t in todo], tmp, planned)
        _tasks.forget_done(tmp)
        facts = writer.finish(tmp, accepted)
        if kept:
            facts.resumed_bytes = sum(t.size for t in todo if t.index in kept)
            facts.resume_note = facts.resume_note or f"{len(kept)} of {len(todo)} task(s) finished by the interrupted run were kept"

    on_cluster(Solo(), out, options.overwrite, publish, None, inputs, options.resume, writer.single_file)
    return dataclasses.replace(facts, units=[u.name for u in units], unit_bytes=sum(u.size for u in units))


def run_key(writer, tensors, units, planned: dict) -> str:
    """Identifies a job for --resume of its tasks: job_of's parts with the inputs as tasks.identity
    gives them (a bucket's objects too)."""
    job = job_of(writer, tensors, units, ())
    job["inputs"] = planned
    return hashlib.sha256(json.dumps(job, sort_keys=True, default=str).encode("utf-8", "surrogatepass")).hexdigest()


def job_of(writer, tensors, units, inputs) -> dict:
    """What this process is about to write, for `cluster.agree`: the options that change bytes (as
    the user gave them), what the reader made of the source, the input files (names inside the
    source, sizes, modification times: the identity --resume uses, without what differs by host),
    and the plan (every unit, every tensor's name, dtype and shape), the big parts as digests."""
    source = {k: v for k, v in writer.content.source.items() if k != "path"}
    options = {**{flag: source.pop(key, None) for key, flag in _OPTIONS.items()}, **writer.job()}
    h = hashlib.sha256(json.dumps([[u.name, u.size] for u in units]).encode())
    for t in tensors:
        h.update(f"{t.name}\0{t.dtype.code}\0{list(t.shape)}\n".encode("utf-8", "surrogatepass"))
    extras = json.dumps([writer.content.extras, writer.content.manifest], sort_keys=True, default=str)
    return {"options": options, "source": source, "inputs": _input_files(inputs),
            "extras": hashlib.sha256(extras.encode("utf-8", "surrogatepass")).hexdigest(), "plan": h.hexdigest()}


def _input_files(inputs) -> dict:
    """{name: "size bytes, modified at mtime_ns"} of every input file, named inside the source."""
    inputs = inputs if isinstance(inputs, Inputs) else Inputs(tuple(inputs))
    roots = [os.path.realpath(r) for r in inputs.roots]
    found = {}
    for p in inputs.files:
        real = os.path.realpath(p)
        root = next((r for r in roots if real.startswith(r + os.sep)), None)
        st = os.stat(real)
        found[os.path.relpath(real, root) if root else os.path.basename(real)] = \
            f"{st.st_size} bytes, modified at {st.st_mtime_ns}" if not os.path.isdir(real) else "a directory"
    return dict(sorted(found.items()))


@contextlib.contextmanager
def _no_progress(total):
    yield None
