"""An output layout owns its whole life: how it is planned and written, how it is found and checked,
and how it is read back. One module or package per layout registers one class with `@register(name)`;
everything else finds it through the registry (layouts/__init__.py): convert and reshard pick the
layout they write, verify the one an output is, `--target` lists those a reshard writes.

Writing is torch DCP's planner / storage split, driven the same way on one process or several by
the job runner (run/runner.py):

- `plan(tensors) -> units`: which tensor bytes go to which file or directory, with their sizes.
  Pure data: `ckptconv plan` prints exactly what a run will do.
- `write(units, tmp, progress, share) -> result`: write the units this process was given into the
  temporary output directory. The result is the layout's `Result` type (FilesResult, or the mesh
  layout's MeshResult); it crosses processes as its `to_json()` (packed digests as hex: a task's answer, run/tasks.py),
  and process 0 reads another's back with `received` (`Result.from_json`, then `accepts`).
- `finish(tmp, results) -> RunFacts`: on process 0, once every process's result is in (in process
  order): the index, manifest, SHA256SUMS, mesh.json ...; returns facts for the summary.

Reading an output back (verify; classmethods, no instance):

- `detect(path) -> bool`: this layout is what `path` holds (tried in `order`, lowest first).
- `check_units(path) -> {kind: [(key, bytes)]}`: what a check of several processes shares out
  (run/share.Share); None: process 0 checks it whole.
- `check(path, report, progress, share)`: every finding into the Report, one line each.
- `open(path, options) -> Checkpoint`: its tensors, through the reader named `reader`.
"""
import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field

from ..storage import files as storage
from ..storage.targets import as_target
from ..storage.urls import StorageOptions
from ..errors import brief
from ..formats.manifest import STEM, index_name, indexed, source_stem

LAYOUTS = {}


def register(name: str):
    def add(cls):
        cls.name = name
        LAYOUTS[name] = cls
        return cls
    return add


def engine_of(record) -> type | None:
    """The engine's layout an output's recorded target (its manifest's and mesh.json's `target`,
    e.g. `{"engine": "vllm", ...}`) names by its "engine", when one is registered; else None. Only a
    layout that records a target (`records_target`) is ever named: a recorded "sharded" is none."""
    engine = record.get("engine") if isinstance(record, dict) else None
    cls = LAYOUTS.get(engine) if isinstance(engine, str) else None
    return cls if cls is not None and cls.records_target else None


def for_target(record) -> type | None:
    """engine_of(record), when that layout also accepts the whole record as one it writes."""
    cls = engine_of(record)
    return cls if cls is not None and cls.accepts_target(record) else None


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
    max_extras: int = 10**6   # --max-extras: JSON bytes of extras the manifest holds whole (formats/manifest.summarised)
    storage: StorageOptions = field(default_factory=StorageOptions)   # an OUT in an object store: --endpoint-url, ...


def named_after(options: WriteOptions, ckpt, src) -> WriteOptions:
    """`options` with its stem decided: `--name`'s, else the one the names of the weight files the
    source was read from give (formats/manifest.source_stem; SRC's own name when it maps none)."""
    if options.stem is not None:
        return options
    return dataclasses.replace(options, stem=source_stem([m.path for m in ckpt.mapped] or [src]))


@dataclass(frozen=True)
class AddedFile:
    """A file named with `--with` (docs/convert.md, "Files carried"), written into OUT under its base
    name: its bytes, read once through the one opener for files a user names (layouts/files.read_added)."""

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
    identity: str | None = None                           # what the run reads (source_id)
    edited: dict = field(default_factory=dict)            # model file name -> the bytes written instead of it
    added: list = field(default_factory=list)             # AddedFile (--with), written beside the model files
    parts: list = field(default_factory=list)             # PartContent: an output made of outputs (a pipeline's
                                                          # components), each in its folder

    def added_bytes(self) -> int:
        return sum(len(a.data) for a in self.added)

    def skipped(self) -> dict:
        """The manifest's source entry listing the model files not carried, when there are any."""
        return {"skipped_files": self.skipped_files} if self.skipped_files else {}


@dataclass
class PartContent:
    """One folder of an output made of outputs (a diffusers pipeline's component): its name, what it
    holds besides its tensors (a Content of its own: its source record, model files, identity), its
    tensors as the recipe makes them (none: a folder carried whole), and the stem and variant its
    weight files are named by (`diffusion_pytorch_model`, `fp16`: formats/manifest.index_name)."""

    name: str
    content: Content
    tensors: list = field(default_factory=list)
    stem: str | None = None
    variant: str | None = None

    @property
    def weights(self) -> bool:
        return self.stem is not None


def source_id(paths, description) -> str:
    """Identifies what a run reads, for --resume: for every input file its device, inode, size,
    modification and change times (any write to a file, or another file put in its place, changes
    them; the change time cannot be set back), and the digest of what the reader made of them
    (`description`: the source, extras and other facts that go into the manifest)."""
    h = hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode())
    for p in sorted({storage.realpath(p) for p in paths}):
        h.update(os.fsencode(p) + f"\0{storage.fingerprint(p)}\n".encode())
    return h.hexdigest()


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
        """As it crosses processes (a task's answer, run/tasks.py): the packed digests as hex."""
        return {"files": self.files, "digests": {name: row.hex() for name, row in self.digests.items()},
                "reused": self.reused, "note": self.note}

    @classmethod
    def from_json(cls, data) -> "FilesResult":
        """A result that crossed from another process, read, not trusted: ResultError when a part
        is not of its type (whether it fits the share is `Layout.accepts`)."""
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


@dataclass(frozen=True)
class OutputPart:
    """What an output made of outputs records of one of its folders (`Layout.parts`): its name ("": the
    top level, beside the folders), the layout that reads its weights back (None: files carried
    whole), and the files carried into it, {name inside it: sha256} (a folder of weights: its own
    manifest lists them)."""

    name: str
    layout: type | None
    files: dict = field(default_factory=dict)


@dataclass
class RunFacts:
    """What a run wrote, for the command's summary: from `finish` (process 0), the files of OUT, the
    bytes --resume reused and why not more; from the runner, this process's units and their bytes."""

    files: list = field(default_factory=list)
    resumed_bytes: int = 0
    resume_note: str | None = None
    units: list = field(default_factory=list)
    unit_bytes: int = 0


@dataclass(frozen=True)
class MeshPlan:
    """What a layout of rank directories writes (reshard): the tensors' layout (tp/intervals.py's
    TensorPlans, in order), the rules that made it, the mesh, and each planned tensor's lazy source
    (in the layout's order; none when only planning)."""

    layout: list
    rules: object
    tp: int
    ep: int = 1
    sources: list = field(default_factory=list)


class Layout:
    """Base class (see the module docstring). A unit has at least `name` and `size`."""

    name = "?"
    single_file = False   # the output is one file, not a directory
    Result = FilesResult  # what write() returns (to_json / from_json: how it crosses processes)
    order = 50            # detection order (lowest first)
    reader = "safetensors"   # the reader that opens an output of this layout (open)
    target = None         # the line `reshard --target NAME` shows, for a layout of rank directories
    records_target = False   # an engine's layout: its outputs record {"engine": name, ...} as their target

    def __init__(self, options: WriteOptions, content: Content, out=None, mesh: MeshPlan | None = None):
        # (the commands name the stem after the source, named_after; a layout made without one: `model`)
        self.options = options if options.stem is not None else dataclasses.replace(options, stem=STEM)
        self.content, self.out, self.mesh = content, out, mesh

    # -- reading an output back --------------------------------------------------------------------

    @classmethod
    def detect(cls, path) -> bool:
        return False

    @classmethod
    def check_units(cls, path) -> dict | None:
        return None

    @classmethod
    def check(cls, path, report, progress=None, share=None):
        raise NotImplementedError

    @classmethod
    def recorded_in(cls, path):
        """Where the output records its source (its manifest, or a single file's header): `path`."""
        return path

    @classmethod
    def parts(cls, path) -> list | None:
        """An output made of outputs (a diffusers pipeline): its OutputParts as its records name them,
        for verify --against to compare each with the source's part of the same name; None for an
        output of one checkpoint."""
        return None

    @classmethod
    def accepts_target(cls, record) -> bool:
        """Whether `record` is a target this layout writes (only an engine's layout writes one)."""
        return False

    @classmethod
    def open(cls, path, options=None):
        """The output's tensors, as its reader reads them (lazy views, nothing loaded)."""
        from ..readers import ReadOptions, open_checkpoint
        return open_checkpoint(path, cls.reader, options or ReadOptions())

    # -- writing -----------------------------------------------------------------------------------

    def plan(self, tensors) -> list:
        raise NotImplementedError

    def write(self, units, tmp, progress=None, share=(0, 1)):
        raise NotImplementedError

    def finish(self, tmp, results) -> RunFacts:
        raise NotImplementedError

    def received(self, data, units, tmp):
        """Another process's result, from the JSON it crossed as (a task's answer, run/tasks.py): read with
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
            st = as_target(tmp).stat(name)
            size = st.st_size if st is not None else None
            if size != unit.size:
                return f"{name}: not on disk with its {unit.size} bytes"
        return None

    def rehashed(self, result, units, tmp) -> bool:
        """Whether the files of `units` in `tmp`, read again, give `result`'s digests: a task a killed
        run finished is kept by --resume only then (run/runner.py). A layout that cannot tell says
        no, and its tasks are redone."""
        return False

    def pointer(self, units) -> str:
        """The file of the output a consumer opens first (formats.pointer): in an object store it is
        written last, create-only, so that finding it means finding the whole output
        (docs/storage.md). Sharded files: the index, or the one shard."""
        return index_name(self.options.stem) if indexed(len(units)) else units[0].name

    def job(self) -> dict:
        """The options of this writer that change the bytes it writes, as a user gave them (the
        processes of one job must agree on them: cluster.agree)."""
        return {"layout": self.name, "--max-shard-size": self.options.max_shard_size, "--name": self.options.stem}
