"""convert: any supported source -> sharded safetensors (reader -> transforms -> writer), atomically."""
import time
from dataclasses import dataclass, field

from . import dtypes, transforms
from .errors import BadInput, UsageError
from .output import atomic_output
from .progress import byte_progress
from .readers import ReadOptions, open_checkpoint, readers
from .writer import write_output


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
    resume: bool = False


def convert(src, out, opts: ConvertOptions) -> dict:
    started = time.perf_counter()
    ckpt = open_checkpoint(src, opts.fmt, opts.read)
    if opts.pickle_only and not readers()[ckpt.source["format"]].PICKLE:
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
    total = sum(t.nbytes for t in tensors)
    with atomic_output(out, opts.overwrite, opts.resume) as tmp, byte_progress(total, "convert", opts.quiet) as progress:
        manifest, reused = write_output(tmp, tensors, source, ckpt.extras,
                                        ckpt.model_files if opts.copy_extras else (), opts.max_shard_size, progress,
                                        ckpt.manifest, opts.fsync, resume=opts.resume)
        for m in ckpt.mapped:
            if not m.unchanged():
                raise BadInput(f"{m.path}: changed while it was being converted; nothing was written")
    seconds = time.perf_counter() - started
    return {"out": str(out), "format": ckpt.source["format"], "tensors": len(tensors), "bytes": total,
            "files": sorted(manifest["files"]), "seconds": round(seconds, 3), "resumed_bytes": reused,
            "gb_per_s": round(total / seconds / 1e9, 3) if seconds else None}
