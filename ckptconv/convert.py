"""convert: any supported source -> sharded safetensors, or one .safetensors file (reader ->
transforms -> writer), atomically, on one process or several (runner.py)."""
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import dtypes, runner, transforms
from .errors import BadInput, UsageError
from .formats.manifest import STEM
from .progress import byte_progress
from .readers import ReadOptions, open_checkpoint, readers
from .writers.base import Content, WriteOptions
from .writers.sharded import ShardedWriter, source_id
from .writers.single import SingleWriter


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
    stem: str = STEM        # --name


def single_file(out) -> bool:
    """OUT ending in .safetensors asks for one file instead of a directory."""
    return str(out).endswith(".safetensors")


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
    one_file = single_file(out)
    if one_file and opts.resume:
        raise UsageError(f"{out}: --resume applies to a sharded output directory, not to one file")
    tensors = transforms.strip_prefix(ckpt.tensors, opts.strip_prefix)
    target = None if opts.dtype == "keep" else dtypes.CAST_TARGETS[opts.dtype]
    tensors = transforms.cast_floats(tensors, target)
    source = dict(ckpt.source)
    if target is not None:
        source["cast"] = target.code
    if opts.strip_prefix:
        source["strip_prefix"] = opts.strip_prefix
    carry = opts.copy_extras and not one_file  # one file carries no model files
    content = Content(source, ckpt.extras, ckpt.manifest, ckpt.model_files if carry else [],
                      ckpt.skipped_files if carry else [])
    content.identity = source_id(ckpt.inputs(src), [{**source, **content.skipped()}, ckpt.extras, ckpt.manifest,
                                                    [rel for rel, _ in content.model_files]])
    options = WriteOptions(opts.max_shard_size, opts.fsync, opts.direct, opts.overwrite, opts.resume, opts.stem)
    writer = SingleWriter(options, content, Path(out).name) if one_file else ShardedWriter(options, content)
    facts = runner.run(writer, tensors, out, options, ckpt.inputs(src), ckpt.check_unchanged, cluster,
                       lambda total: byte_progress(total, "convert", opts.quiet))
    seconds = time.perf_counter() - started
    total = sum(t.nbytes for t in tensors)
    if cluster is not None:
        mine = facts["unit_bytes"]
        return {"out": str(out), "format": ckpt.source["format"], "tensors": len(tensors), "bytes": total,
                "files": sorted(facts["units"]), "seconds": round(seconds, 3), "resumed_bytes": 0,
                "process": cluster.process_id, "processes": cluster.num_processes,
                "gb_per_s": round(mine / seconds / 1e9, 3) if seconds else None}
    summary = {"out": str(out), "format": ckpt.source["format"], "tensors": len(tensors), "bytes": total,
               "files": facts["files"], "seconds": round(seconds, 3), "resumed_bytes": facts.get("resumed_bytes", 0),
               "gb_per_s": round(total / seconds / 1e9, 3) if seconds else None}
    if facts.get("resume_note"):
        summary["resume_note"] = facts["resume_note"]
    if content.skipped_files:
        summary["skipped_files"] = content.skipped_files
    return summary
