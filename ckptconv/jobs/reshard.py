"""reshard: per-rank tensor-parallel (and expert-parallel) output for a target mesh.

The layout (tp/intervals.py) says, as pure data, which intervals of each tensor every rank holds; the
mesh layout (layouts/mesh) then hands each rank lazy slices of the source, so only what a rank
needs is read. Layout of the output, mesh.json, `ranges` and `boxes`: docs/output.md.
"""
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from .. import dtypes, transforms
from ..run import executors, runner, tasks
from ..errors import UsageError
from ..recipe import Recipe
from ..formats.identity import identity
from ..formats.manifest import source_name, summarised as summarised_extras
from ..readers import Source, open_source, readers
from ..storage import files as storage
from ..storage.urls import is_url, parse
from ..sizes import format_size
from ..tp.intervals import REPLICATED_SHARE, plan, plan_summary, silent_replication
from ..tp.presets import MeshSpec, choose_rules
from ..tp.rules import read_config
from ..layouts import layout
from ..layouts.base import Content, MeshPlan, WriteOptions, named_after
from ..layouts.files import read_added


@dataclass
class ReshardResult:
    """The plan (every field but the last four) and, after a run, what it wrote."""

    preset: str
    layout: str
    params: dict
    tp: int
    ep: int
    ranks: int
    tensors: Sequence      # per tensor: name, rule, axis, shape, dtype, bytes_per_rank (, ranges or boxes)
    split: int
    replicated: list
    bytes_per_rank: list
    source_bytes: int
    replicated_bytes: int = 0    # per rank: what every rank holds whole
    unasked: list = field(default_factory=list)   # [{name, bytes}] replicated though nothing asked (refused)
    refusal: str | None = None   # why a run of this plan stops (unasked replication)
    out: str | None = None
    identity: str | None = None   # sha256:… naming exactly this output (formats/identity.py)
    seconds: float | None = None
    bytes_written: int | None = None
    gb_per_s: float | None = None
    summarised: list = field(default_factory=list)   # extras groups over --max-extras: (name, entries, JSON bytes)
    damaged: list = field(default_factory=list)      # the source's files cut short where only unread entries lie
                                                     # (readers/damage.py; SourceFacts.damaged)

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items()
                if (v is not None or k not in ("out", "seconds", "bytes_written", "gb_per_s", "refusal", "identity"))
                and (v or k not in ("summarised", "damaged"))}


@dataclass(frozen=True)
class ReshardOptions:
    """What reshard does to the tensors besides slicing them, and what it carries along: names without
    `strip_prefix` and floating tensors cast to `dtype` (as convert's), in the layout `target` names
    (layouts.target_choices()), every rank directory also holding the files `with_files` names (--with)."""

    strip_prefix: str | None = None
    target: str = "mesh"
    dtype: str = "keep"
    with_files: tuple = ()


def reshard(source: Source, out, mesh: MeshSpec, options: ReshardOptions = None, write: WriteOptions = None,
            dry_run=False, progress=None, executor=None) -> ReshardResult:
    """Plan (and unless `dry_run`, write) `source` sliced for `mesh` into `out` as `options` say.
    `progress` as in convert.convert."""
    if is_url(out):
        parse(out)   # (a URL OUT that can never be written is refused before anything is read)
    options, write = options or ReshardOptions(), write or WriteOptions()
    started = time.perf_counter()
    ckpt, result, writer, tensors, plans = _opened(source, out, mesh, options, write, dry_run)
    if dry_run:
        return result
    total = sum(p.piece_bytes(r) for p in plans for r in range(result.ranks))
    job = tasks.Job(prepared, (tasks.with_read_workers(source, 1), out, mesh, options, write))
    runner.run(writer, tensors, out, write, ckpt.reads(ckpt.root), ckpt.check_unchanged, progress,
               job, executor or executors.make("local", workers=source.options.workers))
    seconds = time.perf_counter() - started
    result.out, result.seconds, result.bytes_written = str(out), round(seconds, 3), total
    result.identity = identity(storage.locate(out, write.storage))
    result.gb_per_s = round(total / seconds / 1e9, 3) if seconds else None
    return result


def prepared(source: Source, out, mesh: MeshSpec, options: ReshardOptions, write: WriteOptions) -> tasks.Prepared:
    """A reshard's writer as a task re-derives it (run/tasks.py): from the request alone."""
    ckpt, _, writer, tensors, _ = _opened(source, out, mesh, options, write, False)
    return tasks.Prepared(writer, tensors, ckpt.reads(ckpt.root), ckpt.check_unchanged)


def _opened(source: Source, out, mesh: MeshSpec, options: ReshardOptions, write: WriteOptions, dry_run) -> tuple:
    """(the checkpoint, the plan's summary, the writer (None for a dry run), the tensors, their
    TensorPlans): what the driver and every task derive alike from the same request."""
    strip_prefix, target, dtype, with_files = options.strip_prefix, options.target, options.dtype, options.with_files
    opened = open_source(source)
    src = opened.root   # (SRC as given, with its storage backend)
    ckpt = opened.whole(src, "reshard")
    cast_to = None if dtype == "keep" else dtypes.CAST_TARGETS[dtype]
    written = layout(target)
    engine, rules = written.engine(ckpt, mesh)   # (an engine's layout: its tensors and the rules that split them)
    recipe = Recipe(strip_prefix, cast_to, engine)
    tensors, _ = recipe.apply(ckpt.tensors, src)
    described = {**ckpt.source.to_json(), "path": source_name(src), **recipe.records(),
                 **({"only": list(source.options.only)} if source.options.only else {})}
    if rules is None:
        rules = choose_rules(ckpt if tensors is ckpt.tensors else dataclasses.replace(ckpt, tensors=tensors), mesh)
    plans = plan(tensors, rules, mesh.tp, mesh.ep, mesh.pad_vocab)
    if not any(p.axis is not None for p in plans):
        raise UsageError(f"{src}: the {rules.name} rules split no tensor of this checkpoint; an output in "
                         "which nothing is split would be a mistake (check --preset/--rules)")
    result = ReshardResult(**plan_summary(plans, rules, mesh.tp, mesh.ep))
    result.damaged = ckpt.source.damaged
    result.unasked = [{"name": n, "bytes": b} for n, b in silent_replication(plans, rules, mesh.allow_replicate)]
    if result.unasked:
        result.refusal = f"{src}: {replication_refusal(result.unasked, rules)}"
    if dry_run:
        return ckpt, result, None, tensors, plans
    if result.refusal:
        raise UsageError(result.refusal)
    if not readers()[ckpt.format].holds_data:
        raise UsageError(f"{src}: a shapes-only description holds no data; use --dry-run or `ckptconv plan`")
    files, made = ckpt.out_files()
    added = read_added(with_files, source.options.max_extra_size, [rel for rel, _ in files])
    if added:
        described["with"] = [a.name for a in added]
    extras, result.summarised = summarised_extras(ckpt.extras, write.max_extras)
    content = Content(described, extras, ckpt.manifest, files, ckpt.skipped_files, added=added, edited=made)
    if cast_to is not None:
        content.edited.update(transforms.config_with_dtype(read_config(ckpt.model_files, ckpt.made) or {}, cast_to,
                                                           described))
    writer = written(named_after(write, ckpt, src), content, out,
                     MeshPlan(plans, rules, mesh.tp, mesh.ep, list(tensors)))   # (plans' order)
    return ckpt, result, writer, tensors, plans


def replication_refusal(unasked, rules) -> str:
    """Why a reshard that would copy big tensors whole to every rank stops, and the ways on."""
    shown = ", ".join(f"{u['name']} ({format_size(u['bytes'])} per rank)" for u in unasked[:8])
    more = f" and {len(unasked) - 8} more" if len(unasked) > 8 else ""
    why = (f"the {rules.name} preset was guessed from tensor names (config.json names no model_type a preset "
           "serves)" if rules.guessed else f"each holds more than {REPLICATED_SHARE:.0%} of the model")
    return (f"{len(unasked)} tensor(s) would be copied whole to every rank, {why}: {shown}{more}; give --preset or "
            "--rules that split them, rules that say 'replicate', or --allow-replicate PATTERN")
