"""convert: any supported source -> sharded safetensors, or one .safetensors file (reader ->
transforms -> writer), atomically, by one driver whose tasks may run on this host or a cluster (run/runner.py)."""
import dataclasses
import time
from dataclasses import asdict, dataclass, field

from .. import dtypes, transforms
from ..run import executors, runner, tasks
from ..errors import BadInput, UsageError
from ..recipe import Recipe
from ..formats.identity import identity
from ..formats.manifest import source_name, summarised as summarised_extras
from ..readers import Source, open_source, readers
from ..storage import files as storage
from ..storage.urls import is_url, parse
from ..readers.wrappers import TrainingParts
from ..tp.rules import read_config
from ..layouts import layout
from ..layouts.base import Content, PartContent, WriteOptions, named_after, source_id
from ..layouts.files import read_added


@dataclass
class ConvertOptions:
    """What convert does to the tensors and what it carries along."""

    strip_prefix: str | None = None
    dtype: str = "keep"         # keep | bf16 | f16 | f32 (floating tensors only)
    copy_extras: bool = True    # carry config.json, tokenizer files ... into a sharded OUT
    with_files: tuple = ()      # --with FILE: more files written into OUT (layouts/files.read_added)


@dataclass
class ConvertResult:
    out: str
    format: str                 # the reader that read the source
    tensors: int
    bytes: int
    files: list                 # of OUT
    seconds: float
    gb_per_s: float | None
    resumed_bytes: int = 0
    resume_note: str | None = None
    skipped_files: list = field(default_factory=list)
    also: list = field(default_factory=list)        # other formats the source directory holds, not read
    state_dict: str | None = None                   # the training wrapper's key unwrapped (--state-dict)
    dropped: list = field(default_factory=list)     # parts of the wrapper not written: {"name", "reason"}
    placeholders: list = field(default_factory=list)  # classes on no allowlist, recorded as inert data
    layout: TrainingParts | None = None                    # a training checkpoint's parts, and which were written
    modules: list = field(default_factory=list)     # pickled nn.Modules read as their state_dict()
    summarised: list = field(default_factory=list)  # extras groups over --max-extras: (name, entries, JSON bytes)
    identity: str | None = None                     # sha256:… naming exactly this output (formats/identity.py)
    damaged: list = field(default_factory=list)     # the source's files cut short where only entries not written
                                                    # lie (readers/damage.py; SourceFacts.damaged)

    def to_json(self) -> dict:
        """The `--json` summary: the fields that apply to this run."""
        optional = ("resume_note", "skipped_files", "also", "state_dict", "dropped",
                    "placeholders", "identity", "layout", "modules", "summarised", "damaged")
        out = {"tensor_count" if k == "tensors" else k: v for k, v in asdict(self).items()
               if k not in optional or v not in (None, [])}
        if self.layout is not None:
            out["layout"] = self.layout.to_json()
        return out


def _config(model_files, made=None) -> dict:
    """The carried (or made) config.json as an object, or {}: one that does not parse is carried
    unchanged and read for nothing (convert never needed it before it tied weights or edited the dtype)."""
    try:
        return read_config(model_files, made) or {}
    except BadInput:
        return {}


def single_file(out) -> bool:
    """OUT ending in .safetensors asks for one file instead of a directory."""
    return str(out).endswith(".safetensors")


def _content(ckpt, src, options: ConvertOptions, one_file: bool, read, max_extras: int, taken=()) -> tuple:
    """(the tensors as convert's recipe makes them, what the output holds besides them, the extras
    groups summarised past `max_extras`) of a checkpoint read from `src`: the manifest's source
    record, the model files carried (or not), the --with files (`taken`: more names they may not
    have), config.json as --dtype edits it, and the run's identity."""
    config = _config(ckpt.model_files, ckpt.made)
    target = None if options.dtype == "keep" else dtypes.CAST_TARGETS[options.dtype]
    recipe = Recipe(options.strip_prefix, target)
    tensors, aliases = recipe.apply(ckpt.tensors, src, untie=True, same_bytes=config.get("tie_word_embeddings") is True)
    described = {**ckpt.source.to_json(), "path": source_name(src), **recipe.records()}
    if read.only:
        described["only"] = list(read.only)   # verify --against compares the same selection
    carry = options.copy_extras and not one_file  # one file carries no model files
    if not options.copy_extras and not one_file and ckpt.model_files:
        described["model_files"] = "not carried"       # (--no-copy-extras: verify --against expects none)
    files, made = ckpt.out_files()
    added = read_added(options.with_files, read.max_extra_size, [*(rel for rel, _ in files), *taken] if carry else ())
    if added:
        described["with"] = [a.name for a in added]    # (not the source's: verify --against leaves them out)
    extras, summarised = summarised_extras(ckpt.extras, max_extras)
    content = Content(described, extras, {**ckpt.manifest, **({"aliases": aliases} if aliases else {})},
                      files if carry else [], ckpt.skipped_files if carry else [], added=added,
                      edited=made if carry else {})
    if carry and target is not None:
        content.edited.update(transforms.config_with_dtype(config, target, described))
    content.identity = source_id(ckpt.inputs(src), [{**described, **content.skipped()}, ckpt.extras, ckpt.manifest,
                                                    [rel for rel, _ in content.model_files]])
    return tensors, content, summarised


def _parts_writer(ckpt, src, out, options: ConvertOptions, write: WriteOptions, read) -> tuple:
    """(the writer, every part's tensors, the whole's Content, the extras groups summarised as
    PART/GROUP) of a source made of parts (a diffusers
    pipeline, docs/convert.md#diffusers-pipelines): each part with weights made as convert makes a
    checkpoint read from its folder (its recipe, model files, identity), the others carried whole,
    into the layout the source names (`ckpt.output`)."""
    refused = [flag for flag, given in (("a .safetensors OUT", single_file(out)), ("--strip-prefix", options.strip_prefix),
                                        ("--name", write.stem is not None), ("--no-copy-extras", not options.copy_extras))
               if given]
    if refused:
        raise UsageError(f"{src}: {refused[0]} does not apply to a {ckpt.format} source, whose components keep "
                         "their own folders, names and files; convert a component's folder (SRC/unet) for that")
    parts, skipped, summarised = [], list(ckpt.skipped_files), []
    for part in ckpt.parts:
        skipped += [{**s, "name": f"{part.name}/{s['name']}"} for s in part.skipped]
        if part.ckpt is None:
            parts.append(PartContent(part.name, Content({}, model_files=part.files, skipped_files=part.skipped)))
            continue
        tensors, content, cut = _content(part.ckpt, storage.join(ckpt.root, part.name),
                                         dataclasses.replace(options, with_files=()), False, read, write.max_extras)
        summarised += [(f"{part.name}/{g}", n, b) for g, n, b in cut]
        content.skipped_files = part.skipped
        parts.append(PartContent(part.name, content, tensors, part.stem, part.variant))
    target = None if options.dtype == "keep" else dtypes.CAST_TARGETS[options.dtype]
    described = {**ckpt.source.to_json(), "path": source_name(src), **Recipe(None, target).records()}
    files, made = ckpt.out_files()
    added = read_added(options.with_files, read.max_extra_size, [rel for rel, _ in files] + [p.name for p in parts])
    if added:
        described["with"] = [a.name for a in added]
    content = Content(described, model_files=files, skipped_files=skipped, edited=made, added=added, parts=parts)
    content.identity = source_id(ckpt.inputs(src), [{**described, **content.skipped()},
                                                    [[p.name, p.content.identity] for p in parts]])
    tensors = [t for p in parts for t in p.tensors]
    return layout(ckpt.output)(write, content, out), tensors, content, summarised


def _opened(source: Source, out, options: ConvertOptions, write: WriteOptions) -> tuple:
    """(the checkpoint, the writer, its tensors, what the output holds besides them, the extras
    groups summarised) of a convert of `source` into `out`: what the driver and every task derive
    alike from the same request."""
    ckpt = open_source(source)
    src = ckpt.root   # (SRC as given, with its storage backend)
    if not readers()[ckpt.format].holds_data:
        raise UsageError(f"{src}: a {ckpt.format} description holds no tensor data; use `ckptconv plan` with it")
    if not ckpt.tensors:
        raise BadInput(f"{src}: no tensors to convert" + (" (after --only)" if source.options.only else ""))
    one_file = single_file(out)
    if options.with_files and one_file:
        raise UsageError(f"{out}: --with writes files into an output directory; one .safetensors file holds none")
    if ckpt.parts:
        writer, tensors, content, summarised = _parts_writer(ckpt, src, out, options, write, source.options)
    else:
        tensors, content, summarised = _content(ckpt, src, options, one_file, source.options, write.max_extras)
        writer = layout("single" if one_file else "sharded")(named_after(write, ckpt, src), content, out)
    return ckpt, writer, tensors, content, summarised


def prepared(source: Source, out, options: ConvertOptions, write: WriteOptions) -> tasks.Prepared:
    """A convert's writer as a task re-derives it (run/tasks.py): from the request alone."""
    ckpt, writer, tensors, _, _ = _opened(source, out, options, write)
    return tasks.Prepared(writer, tensors, ckpt.reads(ckpt.root), ckpt.check_unchanged)


def convert(source: Source, out, options: ConvertOptions = None, write: WriteOptions = None, progress=None,
            executor=None) -> ConvertResult:
    """Convert `source` into `out`. `progress(total_bytes)` gives a context manager yielding an
    update(nbytes) callable (progress.byte_progress), or None."""
    if is_url(out):
        parse(out)   # (a URL OUT that can never be written is refused before anything is read)
    options, write = options or ConvertOptions(), write or WriteOptions()
    started = time.perf_counter()
    if write.resume and single_file(out):
        raise UsageError(f"{out}: --resume applies to a sharded output directory, not to one file")
    ckpt, writer, tensors, content, summarised = _opened(source, out, options, write)
    job = tasks.Job(prepared, (tasks.with_read_workers(source, 1), out, options, write))
    facts = runner.run(writer, tensors, out, write, ckpt.reads(ckpt.root), ckpt.check_unchanged, progress,
                       job, executor or executors.make("local", workers=source.options.workers))
    seconds = time.perf_counter() - started
    total = sum(t.nbytes for t in tensors)
    result = ConvertResult(str(out), ckpt.format, len(tensors), total, facts.files, round(seconds, 3),
                           round(total / seconds / 1e9, 3) if seconds else None, facts.resumed_bytes,
                           facts.resume_note, content.skipped_files, ckpt.also,
                           None if ckpt.source.state_dict in (None, "none") else ckpt.source.state_dict,
                           ckpt.source.dropped, ckpt.source.placeholders, ckpt.layout,
                           modules=ckpt.source.modules, summarised=summarised, damaged=ckpt.source.damaged)
    result.identity = identity(storage.locate(out, write.storage))
    return result
