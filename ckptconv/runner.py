"""One job runner for every command that writes: plan, assign units to processes, write mine,
gather the results, and process 0 finishes inside the atomic output. A single process is a cluster
of one (`cluster.Solo`), so there is one path, and the plan `ckptconv plan` prints is the plan run."""
import contextlib
import os
from pathlib import Path

from .cluster import Solo, on_cluster, run_guarded
from .writers.base import assign
from .io.output import temp_path


def shares(units, cluster) -> list:
    """The units process `cluster.process_id` writes (balanced by bytes, deterministic)."""
    owner = assign([u.size for u in units], cluster.num_processes)
    return [u for u, o in zip(units, owner) if o == cluster.process_id]


def run(writer, tensors, out, options, inputs=(), check_unchanged=lambda: None, cluster=None, progress=None) -> dict:
    """Write `tensors` to `out` with `writer`; returns the writer's facts (process 0) and this
    process's units. `progress(total)` gives a context manager yielding an update(nbytes) callable."""
    cluster = cluster or Solo()
    units = writer.plan(tensors)
    mine = shares(units, cluster)
    share = (cluster.process_id, cluster.num_processes)
    facts = {}

    def work(tmp):
        with (progress or _no_progress)(sum(u.size for u in mine)) as update:
            result = writer.write(mine, tmp, update, share)
        check_unchanged()
        return result

    def publish(tmp):  # process 0, inside the atomic output: its share, everyone's results, the metadata
        results = run_guarded(cluster, "units", lambda: work(tmp))
        facts.update(writer.finish(tmp, results) or {})

    def contribute():  # the other processes: their share, into process 0's temporary directory
        run_guarded(cluster, "units", lambda: work(temp_path(Path(os.path.abspath(out)))))

    on_cluster(cluster, out, options.overwrite, publish, contribute, inputs, options.resume, writer.single_file)
    return {**facts, "units": [u.name for u in mine], "unit_bytes": sum(u.size for u in mine)}


@contextlib.contextmanager
def _no_progress(total):
    yield None
