"""convert: any supported source -> sharded safetensors (reader -> transforms -> writer), atomically."""
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import dtypes, transforms
from .cluster import assign, on_cluster, run_guarded
from .errors import BadInput, UsageError
from .hashing import Pipeline
from .output import atomic_output, temp_path
from .progress import byte_progress
from .readers import ReadOptions, open_checkpoint, readers
from .writer import Written, copy_files, finish, plan_shards, source_id, write_output, write_shards


@dataclass
class ConvertOptions:
    fmt: str | None = None
    read: ReadOptions = field(default_factory=ReadOptions)
    strip_prefix: str | None = None
    dtype: str = "keep"
    max_shard_size: int = 5 * 10**9
    overwrite: bool = False
    copy_extras: bool = True
    pickle_only: bool = False
    quiet: bool = False
    fsync: bool = False
    direct: bool = True     # shards bypass the page cache (outfile.py)
    resume: bool = False


def convert(src, out, opts: ConvertOptions, cluster=None) -> dict:
    started = time.perf_counter()
    ckpt = open_checkpoint(src, opts.fmt, opts.read)
    reader = readers()[ckpt.source["format"]]
    if not getattr(reader, "DATA", True):
        raise UsageError(f"{src}: a {reader.NAME} description holds no tensor data; use `ckptconv plan` with it")
    if opts.pickle_only and not reader.PICKLE:
        raise UsageError(f"{src}: is a {ckpt.source['format']} checkpoint, not a pickle-based one; "
                         "use `ckptconv convert` for it")
    if not ckpt.tensors:
        raise BadInput(f"{src}: no tensors to convert" + (" (after --only)" if opts.read.only else ""))
    tensors = transforms.strip_prefix(ckpt.tensors, opts.strip_prefix)
    target = None if opts.dtype == "keep" else dtypes.CAST_TARGETS[opts.dtype]
    tensors = transforms.cast_floats(tensors, target)
    source = dict(ckpt.source)
    if target is not None:
        source["cast"] = target.code
    if opts.strip_prefix:
        source["strip_prefix"] = opts.strip_prefix
    if ckpt.skipped_files and opts.copy_extras:
        source["skipped_files"] = ckpt.skipped_files
    total = sum(t.nbytes for t in tensors)
    if cluster is not None:
        return _convert_on_cluster(ckpt, tensors, source, src, out, opts, cluster, started)
    carried = ckpt.model_files if opts.copy_extras else ()
    job = source_id(ckpt.inputs(src), [source, ckpt.extras, ckpt.manifest, [rel for rel, _ in carried]])
    with atomic_output(out, opts.overwrite, opts.resume, ckpt.inputs(src)) as tmp, \
            byte_progress(total, "convert", opts.quiet) as progress:
        manifest, reused, note = write_output(tmp, tensors, source, ckpt.extras, carried, opts.max_shard_size,
                                              progress, ckpt.manifest, opts.fsync, job=job, resume=opts.resume,
                                              direct=opts.direct)
        ckpt.check_unchanged()
    seconds = time.perf_counter() - started
    summary = {"out": str(out), "format": ckpt.source["format"], "tensors": len(tensors), "bytes": total,
               "files": sorted(manifest["files"]), "seconds": round(seconds, 3), "resumed_bytes": reused,
               "gb_per_s": round(total / seconds / 1e9, 3) if seconds else None}
    if note:
        summary["resume_note"] = note
    if "skipped_files" in source:
        summary["skipped_files"] = source["skipped_files"]
    return summary


def _convert_on_cluster(ckpt, tensors, source, src, out, opts, cluster, started) -> dict:
    """This process writes the shards `assign` gives it; process 0 merges the digests and publishes.
    The plan, and so the output, is the same as a single-process run's, byte for byte."""
    shards = plan_shards(tensors, opts.max_shard_size)
    owner = assign([s.size for s in shards], cluster.num_processes)
    mine = [s for s, o in zip(shards, owner) if o == cluster.process_id]

    def write_mine():
        pipeline = Pipeline()
        try:
            written = write_shards(temp_path(Path(out)), mine, pipeline, fsync=opts.fsync, direct=opts.direct)
        finally:
            pipeline.close()
        ckpt.check_unchanged()
        return {"files": written.files, "tensors": written.tensors}

    def publish(tmp):
        results = run_guarded(cluster, "shards", write_mine)
        written = Written()
        for shard, o in zip(shards, owner):  # merge in plan order: the manifest is what one process writes
            result = results[o]
            written.files[shard.name] = result["files"][shard.name]
            written.tensors.update({t.name: result["tensors"][t.name] for t in shard.tensors})
        copy_files(tmp, ckpt.model_files if opts.copy_extras else (), written)
        finish(tmp, shards, written, source, ckpt.extras, ckpt.manifest)

    on_cluster(cluster, out, opts.overwrite, publish, lambda: run_guarded(cluster, "shards", write_mine),
               ckpt.inputs(src))
    seconds = time.perf_counter() - started
    mine_bytes = sum(s.size for s in mine)
    return {"out": str(out), "format": ckpt.source["format"], "tensors": len(tensors),
            "bytes": sum(t.nbytes for t in tensors), "files": sorted(s.name for s in mine),
            "seconds": round(seconds, 3), "resumed_bytes": 0, "process": cluster.process_id,
            "processes": cluster.num_processes, "gb_per_s": round(mine_bytes / seconds / 1e9, 3) if seconds else None}

