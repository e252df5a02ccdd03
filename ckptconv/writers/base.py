"""The writer interface: planning is pure data, writing is I/O, finishing is metadata.

In the spirit of torch DCP's planner / storage split, a writer turns the tensor stream into an
output in three steps, and the job runner (runner.py) drives them the same way on one process or
several:

- `plan(tensors) -> units`: which tensor bytes go to which file or directory, with their sizes.
  Pure data: `ckptconv plan` prints exactly what a run will do.
- `write(units, tmp, progress, share) -> result`: write the units this process was given into the
  temporary output directory. The result is the writer's `Result` type (FilesResult, or the mesh
  writer's MeshResult); it crosses processes as its `to_json()` (packed digests as hex, cluster.py),
  and process 0 reads another's back with `received` (`Result.from_json`, then `accepts`).
- `finish(tmp, results) -> RunFacts`: on process 0, once every process's result is in (in process
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


class ResultError(ValueError):
    """Another process's result is not one, or not one of the share it was given: why, in one line."""


def is_digest(value) -> bool:
    """A SHA-256 as a result carries it: 64 lowercase hex digits."""
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def from_hex(value, what: str) -> bytes:
    """Packed bytes that crossed as hex (to_json); ResultError naming `what` when they are not hex."""
    try:
        data = bytes.fromhex(value) if isinstance(value, str) else None
    except ValueError:
        data = None
    if data is None or 2 * len(data) != len(value):   # (fromhex would skip spaces)
        raise ResultError(f"{what} are not hex")
    return data


@dataclass
class FilesResult:
    """What a writer of shard files (sharded, single) wrote of its share: each file's manifest entry
    by name ({"sha256", "size"}), each shard's tensor digests packed in plan order (32 bytes a
    tensor, never an object per tensor), and with --resume, the bytes of shards reused from an
    interrupted run (`reused`) and why not more (`note`)."""

    files: dict
    digests: dict
    reused: int = 0
    note: str | None = None

    def to_json(self) -> dict:
        """As it crosses processes (cluster.py): the packed digests as hex."""
        return {"files": self.files, "digests": {name: row.hex() for name, row in self.digests.items()},
                "reused": self.reused, "note": self.note}

    @classmethod
    def from_json(cls, data) -> "FilesResult":
        """A result that crossed from another process, read, not trusted: ResultError when a part
        is not of its type (whether it fits the share is `Writer.accepts`)."""
        if not (isinstance(data, dict) and isinstance(data.get("files"), dict)
                and isinstance(data.get("digests"), dict)):
            raise ResultError("not {files, digests}")
        for name, info in data["files"].items():
            if not (isinstance(info, dict) and set(info) == {"sha256", "size"} and is_digest(info["sha256"])
                    and type(info["size"]) is int and info["size"] >= 0):
                raise ResultError(f"{brief(name, 80)}: {brief(info, 80)} is not {{sha256, size}}")
        reused, note = data.get("reused", 0), data.get("note")
        if type(reused) is not int or reused < 0 or not (note is None or isinstance(note, str)):
            raise ResultError(f"its reused bytes {brief(reused, 40)} and note {brief(note, 80)} are not a count "
                              "and a text")
        digests = {name: from_hex(row, f"{brief(name, 80)}: its tensor digests")
                   for name, row in data["digests"].items()}
        return cls(data["files"], digests, reused, note)


@dataclass
class RunFacts:
    """What a run wrote, for the command's summary: from `finish` (process 0), the files of OUT, the
    bytes --resume reused and why not more; from the runner, this process's units and their bytes."""

    files: list = field(default_factory=list)
    resumed_bytes: int = 0
    resume_note: str | None = None
    units: list = field(default_factory=list)
    unit_bytes: int = 0


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
    Result = FilesResult  # what write() returns (to_json / from_json: how it crosses processes)

    def __init__(self, options: WriteOptions, content: Content, out):
        # (the commands name the stem after the source, named_after; a writer made without one: `model`)
        self.options = options if options.stem is not None else dataclasses.replace(options, stem=STEM)
        self.content, self.out = content, out

    def plan(self, tensors) -> list:
        raise NotImplementedError

    def write(self, units, tmp, progress=None, share=(0, 1)):
        raise NotImplementedError

    def finish(self, tmp, results) -> RunFacts:
        raise NotImplementedError

    def received(self, data, units, tmp):
        """Another process's result, from the JSON it crossed as (cluster.py): read with
        `Result.from_json`, then checked to fit the `units` it was given (`accepts`); ResultError
        saying why not. A result crossed a network: it is read, not trusted."""
        result = self.Result.from_json(data)
        why = self.accepts(result, units, tmp)
        if why:
            raise ResultError(why)
        return result

    def accepts(self, result: FilesResult, units, tmp) -> str | None:
        """Why another process's `result` does not fit the `units` it was given (None when it does):
        its files are exactly those units, each on disk with the size the plan says, and a digest
        row of 32 bytes per tensor."""
        planned = {u.name: u for u in units}
        if set(result.files) != set(planned) or set(result.digests) != set(planned):
            return f"it names files {sorted(result.files)[:4]}, not its share {sorted(planned)[:4]}"
        for name, unit in planned.items():
            info, row = result.files[name], result.digests[name]
            if info["size"] != unit.size:
                return f"{name}: {brief(info, 80)} is not {{sha256, size {unit.size}}}"
            if len(row) != 32 * len(unit.tensors):
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
