"""The writer interface: planning is pure data, writing is I/O, finishing is metadata.

In the spirit of torch DCP's planner / storage split, a writer turns the tensor stream into an
output in three steps, and the job runner (runner.py) drives them the same way on one process or
several:

- `plan(tensors) -> units`: which tensor bytes go to which file or directory, with their sizes.
  Pure data: `ckptconv plan` prints exactly what a run will do.
- `write(units, tmp, progress, share) -> result`: write the units this process was given into the
  temporary output directory. The result crosses processes: JSON, where bytes (packed digests)
  go as hex (cluster.py).
- `finish(tmp, results) -> facts`: on process 0, once every process's result is in (in process
  order): the index, manifest, SHA256SUMS, mesh.json ...; returns facts for the summary.

A writer is one module with one registration (`@register("name")`).
"""
import dataclasses
import os
from dataclasses import dataclass, field

from ..errors import brief
from ..formats.manifest import STEM, source_stem

WRITERS = {}


def register(name: str):
    def add(cls):
        cls.name = name
        WRITERS[name] = cls
        return cls
    return add


@dataclass
class WriteOptions:
    """How files are written (convert, reshard)."""

    max_shard_size: int = 5 * 10**9
    fsync: bool = False
    direct: bool = True       # shards bypass the page cache (outfile.py)
    overwrite: bool = False
    resume: bool = False
    stem: str | None = None   # --name: STEM.safetensors, or STEM-0000k-of-0000n.safetensors and its index;
                              # None: the source's (named_after)


def named_after(options: WriteOptions, ckpt, src) -> WriteOptions:
    """`options` with its stem decided: `--name`'s, else the one the names of the weight files the
    source was read from give (formats/manifest.source_stem; SRC's own name when it maps none)."""
    if options.stem is not None:
        return options
    return dataclasses.replace(options, stem=source_stem([m.path for m in ckpt.mapped] or [src]))


@dataclass(frozen=True)
class AddedFile:
    """A file named with `--with` (docs/convert.md, "Files carried"), written into OUT under its base
    name: its bytes, read once through the one opener for files a user names (writers/files.read_added)."""

    name: str
    data: bytes


@dataclass
class Content:
    """What an output holds besides its tensors, from the checkpoint."""

    source: dict                                          # manifest's "source"
    extras: dict = field(default_factory=dict)
    manifest: dict = field(default_factory=dict)          # more top-level manifest entries (quantization)
    model_files: list = field(default_factory=list)       # (name, path) carried into OUT
    skipped_files: list = field(default_factory=list)     # model files not carried: {"name", "reason"}
    identity: str | None = None                           # what the run reads (writers.sharded.source_id)
    edited: dict = field(default_factory=dict)            # model file name -> the bytes written instead of it
    added: list = field(default_factory=list)             # AddedFile (--with), written beside the model files

    def added_bytes(self) -> int:
        return sum(len(a.data) for a in self.added)

    def skipped(self) -> dict:
        """The manifest's source entry listing the model files not carried, when there are any."""
        return {"skipped_files": self.skipped_files} if self.skipped_files else {}


def result_bytes(value) -> bytes:
    """Bytes in a writer's result, as they are (one process) or as the hex they crossed as (cluster.py)."""
    return bytes.fromhex(value) if isinstance(value, str) else value


def assign(sizes, processes: int) -> list:
    """Owner process of each unit: balanced by bytes, deterministic."""
    load = [0] * processes
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        p = min(range(processes), key=lambda q: (load[q], q))
        owner[i] = p
        load[p] += sizes[i]
    return owner


class Writer:
    """Base class (see the module docstring). A unit has at least `name` and `size`."""

    name = "?"
    single_file = False   # the output is one file, not a directory

    def __init__(self, options: WriteOptions, content: Content, out):
        # (the commands name the stem after the source, named_after; a writer made without one: `model`)
        self.options = options if options.stem is not None else dataclasses.replace(options, stem=STEM)
        self.content, self.out = content, out

    def plan(self, tensors) -> list:
        raise NotImplementedError

    def write(self, units, tmp, progress=None, share=(0, 1)):
        raise NotImplementedError

    def finish(self, tmp, results) -> dict:
        raise NotImplementedError

    def accepts(self, result, units, tmp) -> str | None:
        """Why another process's `result` does not fit the `units` it was given (None when it does):
        its files are exactly those units, each on disk with the size the plan says, and a digest
        row of 32 bytes per tensor. A result crossed a network: it is read, not trusted."""
        if not (isinstance(result, dict) and isinstance(result.get("files"), dict)
                and isinstance(result.get("digests"), dict)):
            return "not {files, digests}"
        planned = {u.name: u for u in units}
        if set(result["files"]) != set(planned) or set(result["digests"]) != set(planned):
            return f"it names files {sorted(result['files'])[:4]}, not its share {sorted(planned)[:4]}"
        for name, unit in planned.items():
            info, row = result["files"][name], result["digests"][name]
            if not (isinstance(info, dict) and info.get("size") == unit.size and isinstance(info.get("sha256"), str)):
                return f"{name}: {brief(info, 80)} is not {{sha256, size {unit.size}}}"
            if not isinstance(row, str) or len(row) != 64 * len(unit.tensors):
                return f"{name}: not one digest per tensor"
            try:
                size = os.stat(os.path.join(tmp, name), follow_symlinks=False).st_size
            except OSError:
                size = None
            if size != unit.size:
                return f"{name}: not on disk with its {unit.size} bytes"
        return None

    def job(self) -> dict:
        """The options of this writer that change the bytes it writes, as a user gave them (the
        processes of one job must agree on them: cluster.agree)."""
        return {"layout": self.name, "--max-shard-size": self.options.max_shard_size, "--name": self.options.stem}
