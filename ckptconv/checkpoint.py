"""The checkpoint a reader makes: its lazy tensors (tensor.py), extras, what the reader found out
(`SourceFacts`, the manifest's "source"), the parts of a source made of others (`Part`)."""
import os
from dataclasses import dataclass, field

from .errors import BadInput, UsageError, encodable
from .io.output import Inputs
from .limits import shape_problem
from .storage import files as storage


@dataclass(kw_only=True)
class SourceFacts:
    """What a reader says about the source it read: the manifest's "source" (the commands add what
    the run did: the recipe, the selection), each fact typed, written out in one place (to_json)."""

    format: str
    path: str
    files: list | int | None = None    # the files read, relative to path (Grok-1: how many)
    state_dict: str | None = None      # the entry of a training checkpoint written ("none": everything)
    dropped: list = field(default_factory=list)        # {"name", "reason"}: state left out, and why
    placeholders: list = field(default_factory=list)   # {"global", "count"}: classes recorded as inert data
    skipped: list = field(default_factory=list)        # {"name", ...}: tensors --skip-unsupported left out
    modules: list = field(default_factory=list)        # {"name", "class", "entries"}: pickled nn.Modules read
                                                       # as their state_dict() (readers/torch_modules.py)
    unindexed: list = field(default_factory=list)      # .safetensors files beside an index that lists none
    damaged: list = field(default_factory=list)        # files cut short where only unread entries lie
                                                       # (readers/damage.py: {"file", "has", "needs", ...})
    layout: str | None = None          # a reader's layout of its format (Grok-1 "mixtral", Megatron "legacy")
    dequantize: str | None = None      # Grok-1 --dequantize
    to: str | None = None              # Megatron --to
    more: dict = field(default_factory=dict)   # the reader's own facts (tp, pp, tag, zero_stage, rules ...)

    _OPTIONAL = ("files", "state_dict", "layout", "dequantize", "to")
    _LISTS = ("dropped", "placeholders", "skipped", "unindexed", "modules", "damaged")

    def to_json(self) -> dict:
        """The facts as the manifest records them: a fact not established is not written."""
        out = {"format": self.format, "path": self.path}
        out.update({k: getattr(self, k) for k in self._OPTIONAL if getattr(self, k) is not None})
        out.update({k: getattr(self, k) for k in self._LISTS if getattr(self, k)})
        out.update(self.more)
        return out


@dataclass
class Part:
    """One part of a source made of others (a diffusers pipeline's component folder): its name (the
    folder's), its weights as the reader that recognises them reads them (`ckpt`; None: a part without
    weights, carried whole), the files carried from it ((name, path), checked by readers.carried) and
    those not carried ({"name", "reason"}), the stem and variant its weight files are named by (`stem`
    and `variant`: `diffusion_pytorch_model`, `fp16`), and what the source says of it (`facts`)."""

    name: str
    ckpt: "Checkpoint | None" = None
    files: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    stem: str | None = None
    variant: str | None = None
    facts: dict = field(default_factory=dict)


@dataclass
class Checkpoint:
    """What a reader returns: ordered tensors, JSON-able extras, what it found out about the source."""

    tensors: list
    extras: dict = field(default_factory=dict)
    source: SourceFacts = None
    model_files: list = field(default_factory=list)  # (relative name, path) carried into OUT unchanged
    mapped: list = field(default_factory=list)       # MappedFiles to check for changes during a run
    manifest: dict = field(default_factory=dict)     # extra top-level manifest entries (quantization)
    skipped_files: list = field(default_factory=list)  # model files not carried: {"name", "reason"}
    format: str | None = None                        # the reader's name (set by readers.open_checkpoint)
    config: dict | None = None                       # a model config the source describes (shapes JSON)
    recorded_rules: dict | None = None               # partition rules a reshard output records (mesh.json)
    also: list = field(default_factory=list)         # other formats the same directory holds, not read
    layout: object = None                            # readers/wrappers.TrainingParts: a training checkpoint's parts
    made: dict = field(default_factory=dict)         # model files the reader makes from what the source says,
                                                     # name -> bytes (a Megatron checkpoint's config.json)
    unsupported: tuple | None = None                 # (what, hint) of the first tensor in source.skipped: what
                                                     # refuses the source unless --skip-unsupported (readers/__init__)
    parts: list = field(default_factory=list)        # Part: a source made of others (a diffusers pipeline's
                                                     # components); `tensors` then lists theirs as PART/NAME
    output: str | None = None                        # the output layout such a source is written as (its name)
    root: object = None                              # the path it was read from, with its storage backend
                                                     # (storage/files.locate; set by readers.open_checkpoint)

    def __post_init__(self):
        """Every reader's tensors meet the same rules before anything is planned or written: distinct
        names that UTF-8 can spell (a safetensors header is UTF-8 JSON) and shapes consumers can load."""
        if self.source is None:
            self.source = SourceFacts(format="", path="checkpoint")
        where = self.source.path
        seen = set()
        for t in self.tensors:
            if not isinstance(t.name, str) or not encodable(t.name):
                raise BadInput(f"{where}: tensor name {t.name!r} is not valid Unicode text")
            if t.name in seen:
                raise BadInput(f"{where}: two tensors are named {t.name!r}")
            if t.name == "__metadata__":
                raise BadInput(f"{where}: a tensor is named '__metadata__', which the safetensors format reserves")
            seen.add(t.name)
            problem = shape_problem(t.shape, t.dtype.itemsize)
            if problem:
                raise BadInput(f"{where}: tensor {t.name!r}: {problem}")

    def inputs(self, src) -> list:
        """Every path this checkpoint reads: SRC, its mapped files and the model files it (and each of
        its parts) carries."""
        return [src] + [m.path for m in self.mapped] + [p for _, p in self.model_files] \
            + [p for part in self.parts for _, p in part.files]

    def reads(self, src) -> Inputs:
        """What a run over this checkpoint must not write into: its files, and the directories a
        reader of SRC reads from (SRC itself if a directory; SRC's if SRC is a file read with other
        weight files, an index or a DCP `.metadata`; none for a file read alone, whatever model file
        beside it is carried: a later read of the file does not look at what else is there)."""
        files = self.inputs(src)
        if storage.is_dir(src):
            roots = (src,)
        else:
            alone = storage.realpath(src)
            weights = [src] + [m.path for m in self.mapped]
            roots = (storage.parent(alone),) if any(storage.realpath(p) != alone for p in weights) else ()
        return Inputs(tuple(files), roots)

    def out_files(self) -> tuple:
        """(the model files for OUT as layouts take them: (name, path) carried, (name, None) made; the
        bytes of those made, {name: bytes})."""
        return self.model_files + [(name, None) for name in self.made], dict(self.made)

    def whole(self, src, what: str) -> "Checkpoint":
        """This checkpoint, for `what` (reshard, plan --tp), which takes one: UsageError for a source made
        of parts, naming the parts to give instead."""
        if self.parts:
            names = [os.path.join(str(src), p.name) for p in self.parts if p.ckpt is not None]
            raise UsageError(f"{src}: {what} takes one checkpoint, not a {self.format} source of several; give one of "
                             f"its components ({', '.join(names[:6])})")
        return self

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def check_unchanged(self):
        """Refuse to publish if an input file changed while we read it: replaced, resized or touched
        (`MappedFile.unchanged`), or pages of it gone under a mapping (the SIGBUS guard read zeros
        there) — also for mapped files a reader did not list in `mapped`."""
        from .io.mapped import changed_files
        changed = [m.path for m in self.mapped if not m.unchanged()] or changed_files()
        if changed:
            raise BadInput(f"{changed[0]}: changed while it was being read; nothing was written")
