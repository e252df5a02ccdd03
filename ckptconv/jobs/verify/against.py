"""verify --against: the source read again the way the output records it was made (its selection, the
reader's options, convert's recipe replayed), every tensor compared with it bit for bit, streaming, and
what the output records of its source (the reader's description, extras, model files) checked too."""
import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from ... import signals, transforms
from ...errors import BadInput, CkptError, brief
from ...io.hashing import CHUNK
from ...io.mapped import MappedFile
from ...readers import ReadOptions, damage, open_checkpoint, readers
from ...readers.wrappers import NoSuchEntry
from ...formats.safetensors import file_header
from ...recipe import Recipe
from ...tp.presets import recorded_differences
from ...tp.rules import read_config
from ...tensor import as_bytes, iter_blocks
from ...formats import manifest as manifest_format
from ...formats.manifest import MANIFEST
from ...formats.mesh import MESH, read_regular
from ...formats.pipeline import read_document
from ...layouts.base import for_target
from ...layouts.report import Report
from ...storage.files import place
from ...layouts.scan import _checked_manifest, _sha256_regular


def _recorded_source(out_path: Path, layout) -> tuple:
    """(where the manifest is, its "source" entry, its aliases, the whole document) of an output
    verify already checked: what convert did to the source (prefix stripped, cast) is applied again
    before comparing."""
    if out_path.is_file():
        m = MappedFile(out_path)
        raw = manifest_format.single_document(file_header(m, out_path).metadata, out_path)
        where = out_path
    else:
        first = layout.recorded_in(out_path)
        where, raw = first / MANIFEST, _checked_manifest(first) if (first / MANIFEST).is_file() else {}
    source = raw.get("source", {}) if isinstance(raw, dict) else {}
    aliases = raw.get("aliases", {}) if isinstance(raw, dict) else {}
    aliases = {a: b for a, b in aliases.items() if isinstance(a, str) and isinstance(b, str)} \
        if isinstance(aliases, dict) else {}
    # (a malformed source is informational: the tensors still compare)
    return where, source if isinstance(source, dict) else {}, aliases, raw if isinstance(raw, dict) else {}


def compare_against(out_path: Path, layout, src, read: ReadOptions, fmt, report: Report,
                    mine=lambda kind, key: True, source=None):
    """Every tensor (global tensor, for a reshard output) of the output, as its `layout` reads it
    back, equal to the source, bit for bit, streaming. `source`: the source's checkpoint as read
    already (a part of a source made of parts, compare_parts), else SRC is read the way the output
    records it was. Returns what the output records of its source (its manifest's "source")."""
    # what OUT holds is read by the reader its layout names, never by detection: a .pt or .metadata
    # slipped into OUT (and listed in its sums) must not become "the output" that matches the source
    out = layout.open(out_path)
    recorded, manifest, aliases, document = _recorded_source(out_path, layout)
    if source is None:
        source, applied = _open_as_recorded(src, fmt, read, _as_recorded(read, manifest, fmt), out_path, report)
        if applied != read:  # say so: "matches the source" then means the selection convert recorded
            replayed = ([f"--state-dict {brief(applied.state_dict)}"] if applied.state_dict != read.state_dict
                        else []) \
                + ([f"--only {brief(applied.only)}"] if applied.only != read.only else []) \
                + (["--one-shard"] if applied.one_shard != read.one_shard else []) \
                + [f"--{k.replace('_', '-')} {brief(v)}" for k, v in applied.declared.items()
                   if read.declared.get(k) != v]
            if replayed:
                report.notes.append(f"{out_path}: compared with the part of the source the output records it was "
                                    f"made from: {', '.join(replayed)}")
    if source.source.damaged and mine("structure", None):   # (what is not read for the output: a note, exit 0)
        report.notes.append(damage.line(source.source.damaged, source.source.path))
    if mine("structure", None) and document.get("format") == manifest_format.FORMAT:   # (not a foreign output)
        _compare_facts(recorded, document, manifest, source, report, beside=Path(src).is_file())
    try:
        recipe = Recipe.recorded(manifest)
    except BadInput as e:
        report.add(recorded, str(e), "metadata")
        return manifest
    if recipe.target is not None and mine("structure", None):   # (what the target says of the source, again)
        for line in for_target(recipe.target).target_differences(source, recipe.target):
            report.add(recorded, line, "source")
    if out.recorded_rules is not None and mine("structure", None):   # (a reshard output's rules, again)
        config = read_config(source.model_files, source.made) or source.config or {}
        for line in recorded_differences(out.recorded_rules, config):
            report.add(out_path / MESH, line, "source")
    try:   # convert's own steps, with their own checks (a name clash, a layout that does not fit)
        src_list, _ = recipe.apply(source.tensors, src)
    except CkptError as e:
        report.add(recorded, f"the source cannot be made what the output records: {e}", "source")
        return manifest
    src_tensors = {t.name: t for t in src_list}
    written = {t.name: t for t in out.tensors}
    if mine("structure", None):
        prefix = _prefix_between([n for n in written if n not in src_tensors and n not in aliases],
                                 [n for n in src_tensors if n not in written and n not in aliases])
        if prefix is not None:
            report.add(out_path, prefix, "source")
    tied = [(written[aliases[n]], src_tensors.pop(n)) for n in list(src_tensors)
            if n in aliases and aliases[n] in written]   # written once (tied weights): the same bytes
    for t, s in [(t, src_tensors.pop(t.name, None)) for t in out.tensors] + tied:
        if not mine("tensor", t.name):
            continue
        if s is None:
            report.add(out_path, f"tensor {t.name!r} is not in the source {src}", "source", tensor=t.name)
            continue
        if s.dtype != t.dtype or s.shape != t.shape:
            report.add(out_path, f"tensor {t.name!r} is {t.dtype.code}{list(t.shape)}, the source has "
                                 f"{s.dtype.code}{list(s.shape)}", "source", tensor=t.name)
            continue
        _compare(t, s, out_path, report)
    for name in src_tensors if mine("structure", None) else ():
        report.add(out_path, f"tensor {name!r} of the source is missing from the output", "source", tensor=name)
    return manifest


def _open_as_recorded(src, fmt, read: ReadOptions, applied: ReadOptions, out_path, report: Report):
    """(the source, the options it was read with): as convert read it (`applied`); where the recorded
    --state-dict does not apply to it (another checkpoint, without that entry), read as the user
    asked instead: the difference is a problem line, and the tensors still compare (exit 1, never a
    flag the user did not type)."""
    try:
        return open_checkpoint(src, fmt, applied), applied
    except NoSuchEntry:
        if applied.state_dict == read.state_dict:
            raise
    report.add(out_path, f"the output was made from the entry {brief(applied.state_dict)} of its source "
                         f"(--state-dict {brief(applied.state_dict)}), which {src} does not hold; compared with what "
                         f"--state-dict {read.state_dict} reads of it", "source")
    applied = dataclasses.replace(applied, state_dict=read.state_dict)
    return open_checkpoint(src, fmt, applied), applied


def compare_parts(out_path: Path, layout, src, read: ReadOptions, fmt, report: Report,
                  mine=lambda kind, key: True, parts=()):
    """An output made of outputs (a diffusers pipeline: `layout.parts`), against the source read again:
    the same parts; each part of weights compared as an output of its own with the source's part of
    the same name (compare_against: every tensor, the source facts, the model files); the files
    carried (a part's whole, and those beside the parts) the source's, byte for byte."""
    source = open_checkpoint(src, fmt, read)
    theirs = {p.name: p for p in source.parts}
    if not source.parts:
        report.add(out_path, f"is made of parts ({', '.join(p.name for p in parts if p.name)}); {src} is a "
                             f"{source.format} source of one", "source")
        return
    ours = {p.name: p for p in parts}
    structure = mine("structure", None)
    casts = {}   # component of weights -> the cast its manifest records
    for name in sorted(set(theirs) - set(ours)) if structure else ():
        report.add(out_path / name, f"component {name!r} of the source is not in the output", "source")
    for part in parts:
        their = theirs.get(part.name) if part.name else None
        if part.name and their is None:
            if structure:
                report.add(out_path / part.name, "is not a component of the source", "source")
        elif part.name and (part.layout is None) != (their.ckpt is None):
            if structure:
                report.add(out_path / part.name, "holds weights, the source's component none" if part.layout
                           else "holds no weights, the source's component does", "source")
        elif part.layout is not None:
            casts[part.name] = compare_against(
                out_path / part.name, part.layout, Path(src) / part.name, read, fmt, report,
                lambda kind, key, at=part.name: mine(kind, f"{at}/{key}" if kind == "tensor" else key),
                source=their.ckpt).get("cast")
        elif structure:
            files = source.out_files()[0] if not part.name else their.files
            _compare_carried(out_path / part.name, part.files, files, report)
    if structure:
        _compare_pipeline_source(out_path, source, casts, report)


def _compare_pipeline_source(out_path: Path, source, casts: dict, report: Report):
    """What the pipeline's top-level manifest records of its source (the pipeline's class, each
    component's library, class, format and variant, the files read) is what the reader says today,
    and a recorded cast is the one each component of weights records (`casts`, as compare_against
    read them)."""
    try:
        doc, _ = read_document(read_regular(out_path / MANIFEST), out_path / MANIFEST)
    except BadInput:
        return   # (reported by the structural check)
    if doc is None:
        return
    _compare_description(out_path / MANIFEST, {}, {k: v for k, v in doc.source.items() if k != "cast"},
                         source, report)
    cast = doc.source.get("cast")
    for name, recorded in sorted(casts.items()):
        if recorded != cast:
            report.add(out_path / MANIFEST, f"source.cast is {brief(cast, 20)}, component {name!r} records "
                                            f"{brief(recorded, 20)}", "source")


def _compare_carried(where: Path, ours: dict, theirs: list, report: Report):
    """Files carried whole ({name: recorded sha256}) are the source's ((name, path) as its reader
    carries them today), byte for byte, and none of those is left out."""
    theirs = dict(theirs)
    for name in sorted(ours):
        if name not in theirs:
            report.add(where / name, "is listed as carried, but the source has no such file", "source")
        elif _sha256_regular(place(theirs[name])) != ours[name]:
            report.add(where / name, f"is not the source's {name}", "source")
    for name in sorted(set(theirs) - set(ours)):
        report.add(where, f"file {name!r} of the source was not carried", "source")


def _prefix_between(only_out: list, only_src: list) -> str | None:
    """When the names on one side are the other side's with a prefix added (9 in 10 or more of them),
    one line saying so, to read before the details; else None. Bounded: the prefixes tried are those
    of the first 16 names, at most 200 characters long."""
    if not only_out or not only_src:
        return None
    for longer, shorter, side in ((only_src, only_out, "source"), (only_out, only_src, "output")):
        held, tried = set(shorter), set()
        for name in longer[:16]:
            for cut in range(1, min(len(name), 201)):
                prefix = name[:cut]
                if name[cut:] not in held or prefix in tried:
                    continue
                tried.add(prefix)
                hits = sum(n.startswith(prefix) and n[cut:] in held for n in longer)
                if hits * 10 >= 9 * max(len(longer), len(shorter)):
                    return (f"the {side}'s names are the {'output' if side == 'source' else 'source'}'s with "
                            f"the prefix {prefix!r} ({hits} of {len(longer)}): " + (
                                f"convert with --strip-prefix {prefix!r} gives the output's names"
                                if side == "source" else "the source lacks it"))
    return None


def _as_recorded(read: ReadOptions, manifest: dict, fmt=None) -> ReadOptions:
    """The source read the way convert read it: its recorded --state-dict, --only and --one-shard (when
    they are what convert writes: a key or "none", a list of prefixes) and the options its reader
    declares and records (Grok's --dequantize and --layout: one of their choices), unless given again
    here; and what safetensors cannot store read as facts (source.skipped), never a refusal."""
    wrapper, only = manifest.get("state_dict"), manifest.get("only")
    if isinstance(wrapper, str) and wrapper and read.state_dict == "auto":
        read = dataclasses.replace(read, state_dict=wrapper)
    if isinstance(only, list) and 0 < len(only) <= 1000 and all(isinstance(p, str) and len(p) <= 1000 for p in only) \
            and not read.only:
        read = dataclasses.replace(read, only=list(only))
    if manifest.get("one_shard") is True and not read.one_shard:   # (SRC was one shard of an indexed set)
        read = dataclasses.replace(read, one_shard=True)
    if not read.skip_unsupported:   # (what the source holds that safetensors cannot store is compared as a
        read = dataclasses.replace(read, skip_unsupported=True)   # fact, source.skipped: never a refusal here)
    name = manifest.get("format") if fmt is None else fmt
    reader = readers().get(name) if isinstance(name, str) else None   # (a manifest is read, not trusted)
    declared = dict(read.declared)
    for opt in reader.options if reader is not None else ():
        value = manifest.get(opt.dest)
        if opt.choices and value in opt.choices and opt.dest not in declared:
            declared[opt.dest] = value
    return dataclasses.replace(read, declared=declared) if declared != read.declared else read


# What convert and reshard add to the reader's description of the source (the options they applied,
# replayed by compare_against, and where the source was): the rest is the reader's, and must be what
# the reader says of the source today.
_APPLIED = ("path", "cast", "strip_prefix", "only", "skipped_files", "config_edits", "resharded", "target",
            "model_files", "with")
# What the source's bytes were when the output was made, not what the reader says of its structure: the
# damage found today is a note of its own (compare_against), whether or not the output recorded it.
_STATE = ("damaged",)


def _compare_facts(recorded: Path, document: dict, manifest: dict, source, report: Report, beside=False):
    """Everything else the output records of its source: the reader's description and the extras
    (when the output was made by the same reader: an output converted again records the output it
    was made from), and the model files carried (each the source's bytes, or config.json as --dtype
    edits it; `beside`: SRC is one file, whose paired config ckptconv carries, docs/convert.md)."""
    if not isinstance(document.get("source"), dict):
        report.add(recorded, f"source is {brief(document.get('source'), 80)}, not the object ckptconv records",
                   "source")
        return
    document = _compare_description(recorded, document, manifest, source, report)
    _compare_extras(recorded, document, source, report)
    files = document.get("files")
    if not isinstance(files, dict) or recorded.name != MANIFEST:
        return   # (a single file carries no model files)
    _compare_model_files(recorded, files, manifest, source, report, beside)


def _compare_description(recorded: Path, document: dict, manifest: dict, source, report: Report) -> dict:
    """The reader's description of the source, as the output records it (`manifest`, its "source"
    entry, less what convert applied), is what the reader says today. Returns the document to compare
    further: when another reader made the output, the source's own facts stand in for what is not
    compared (a note says so)."""
    fresh = {k: v for k, v in _plain(source.source.to_json()).items() if k != "path" and k not in _STATE}
    kept = {k: v for k, v in _plain(manifest).items() if k not in _APPLIED + _STATE}
    if kept.get("format") != fresh.get("format"):
        report.notes.append(f"{recorded}: made from a {brief(kept.get('format'), 40)} source, compared with a "
                            f"{brief(fresh.get('format'), 40)} one: its tensors and model files are compared, not "
                            "its extras or what its reader recorded")
        fresh = kept = {}
        document = {**source.manifest, **{
            k: document[k] for k in ("format", "source", "files", "tensors", "aliases") if k in document},
            "extras": source.extras}
    for key in sorted(set(fresh) | set(kept)):
        if key in fresh and fresh.get(key) != kept.get(key):
            report.add(recorded, f"source.{key} is {brief(kept.get(key), 120)}, the source gives "
                                 f"{brief(fresh[key], 120)}", "source")
        elif key not in fresh:
            report.add(recorded, f"source.{key} ({brief(kept[key], 120)}) is not what the source gives", "source")
    return document


def _compare_extras(recorded: Path, document: dict, source, report: Report):
    """The extras, and the other facts the reader records beside its tensors (`quantization` …), are
    the source's."""
    extras = _plain(document.get("extras", {}))
    if not isinstance(extras, dict):
        report.add(recorded, f"extras is {brief(extras, 80)}, not the object ckptconv records", "source")
        extras = {}
    theirs = _plain(manifest_format.summarised_like(source.extras, extras))   # (--max-extras: summarised alike)
    for key in sorted(set(extras) | set(theirs), key=str) if extras != theirs else ():
        if extras.get(key) != theirs.get(key):
            report.add(recorded, f"extras {key!r} is {brief(extras.get(key), 120)}, the source's is "
                                 f"{brief(theirs.get(key), 120)}", "source")
    others = _plain({k: v for k, v in document.items() if k not in _OWN_KEYS})   # (not its million tensors)
    theirs_top = _plain(source.manifest)
    for key in sorted(set(others) | set(theirs_top)) if others != theirs_top else ():
        if others.get(key) != theirs_top.get(key):
            report.add(recorded, f"{key} is {brief(others.get(key), 120)}, the source's reader gives "
                                 f"{brief(theirs_top.get(key), 120)}", "source")


def _compare_model_files(recorded: Path, files: dict, manifest: dict, source, report: Report, beside: bool):
    """The model files the output lists as carried (`files`) are the source's: each one the source
    has, with its bytes (config.json as --dtype edits it), and none it lacks; --with files aside."""
    carried, edited = source.out_files()   # (the files a reader makes, as it makes them from the source today)
    try:
        target = Recipe.recorded(manifest).cast
    except BadInput:   # (reported where the tensors are compared)
        target = None
    if target is not None and manifest.get("config_edits"):
        edited.update(transforms.config_with_dtype(_config(source.model_files, source.made), target, {}))
    listed = manifest.get("skipped_files", [])
    skipped = {s.get("name") for s in (listed if isinstance(listed, list) else []) if isinstance(s, dict)
               and isinstance(s.get("name"), str)}
    theirs = {rel for rel, _ in carried}
    added = set(manifest["with"]) if isinstance(manifest.get("with"), list) and all(
        isinstance(n, str) for n in manifest["with"]) else set()   # (--with: written from elsewhere, not compared)
    for name in sorted(files):
        if name not in theirs | added and not (name.endswith((".safetensors", manifest_format.INDEX_SUFFIX))
                                              or manifest_format.is_index(name)):
            report.add(recorded.parent / name, "is listed as carried, but the source has no such model file", "source")
    for rel, path in carried:
        info = files.get(rel)
        if rel in added:
            continue
        if info is None:
            if rel in skipped or manifest.get("model_files") == "not carried":
                pass
            elif beside:   # (an output of ckptconv from before a file's paired config was carried)
                report.notes.append(f"{recorded.parent}: does not hold {rel}, the config beside the source file "
                                    "that convert now carries with it (docs/convert.md, \"Files carried\")")
            else:
                report.add(recorded.parent, f"model file {rel!r} of the source was not carried", "source")
            continue
        digest = hashlib.sha256(edited[rel]).hexdigest() if rel in edited else _sha256_regular(place(path))
        if not isinstance(info, dict) or info.get("sha256") != digest:
            report.add(recorded.parent / rel, f"is not the source's {rel}" + (" as --dtype edits it" if rel in edited
                                                                              else ""), "source")


# What a manifest holds beside what its reader recorded of the source (the rest: `quantization` …)
_OWN_KEYS = ("format", "source", "extras", "files", "tensors", "aliases")


def _plain(value):
    """`value` as JSON gives it back (tuples are lists, keys strings): what a manifest holds."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _config(model_files, made=None) -> dict:
    try:
        return read_config(model_files, made) or {}
    except BadInput:
        return {}


def _compare(a, b, where, report):
    done = 0
    for x, y in zip(iter_blocks(a, CHUNK), iter_blocks(b, CHUNK)):
        xb, yb = as_bytes(x), as_bytes(y)
        if xb != yb:
            i = int(np.flatnonzero(np.frombuffer(xb, np.uint8) != np.frombuffer(yb, np.uint8))[0]) // x.dtype.itemsize
            index = np.unravel_index(done + i, a.shape) if a.shape else ()
            report.add(where, f"tensor {a.name!r} differs from the source at index {tuple(int(v) for v in index)}: "
                              f"{x.reshape(-1)[i]!r} != {y.reshape(-1)[i]!r}", "source", tensor=a.name)
            break
        done += x.size
        a.release()
        b.release()
        signals.check()
