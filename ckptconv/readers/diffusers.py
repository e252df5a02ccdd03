"""Reader for a diffusers pipeline directory (`DiffusionPipeline.save_pretrained`): model_index.json
and one folder per component it names (formats/pipeline.py).

Each component folder that holds weights is read by the reader that recognises it, exactly as
`ckptconv convert SRC/COMPONENT` reads it (a UNet's `diffusion_pytorch_model.bin`, a text encoder's
`model.safetensors`, shards with their index); a folder that holds them as several variants
(`diffusion_pytorch_model.bin` beside `.fp16.bin`) is read for the ones without a variant, the others
listed as not carried. A folder without weights (scheduler/, tokenizer/, feature_extractor/) is a
part carried whole. Every file read, in every part, resolves inside SRC (`readers.within`).

The checkpoint lists every component's tensors as COMPONENT/NAME (what inspect and plan show) and
its parts (checkpoint.Part), which the pipeline layout writes folder by folder (layouts/diffusers.py).
"""
import re
from pathlib import Path

from ..storage import files as storage
from ..errors import BadInput, UsageError
from ..formats.manifest import MANIFEST, VARIANT, index_kind, source_stem
from ..formats.pipeline import MODEL_INDEX, components
from ..formats.sums import NAME as SUMS
from ..checkpoint import Checkpoint, Part, SourceFacts
from .base import ReadOptions, Reader, register
from . import (carried, confined, detect as readers_detecting, model_files, open_checkpoint, source_root,
               training_files, weight_suffixes, weights_name, within)

NAME = "diffusers"
MAX_INDEX = 1 << 20   # model_index.json: a few hundred bytes
_SHARD = re.compile(r"-\d{1,9}-of-\d{1,9}$")


def detect(path: Path) -> bool:
    return path.is_dir() and (path / MODEL_INDEX).is_file()


def load(path: Path, options: ReadOptions) -> Checkpoint:
    if not path.is_dir():
        raise BadInput(f"{path}: not a directory; a diffusers pipeline is one, holding {MODEL_INDEX}")
    if options.only:
        raise UsageError(f"{path}: --only selects the tensors of one checkpoint, not of a pipeline's components: "
                         "convert the component's folder (SRC/unet) with it")
    root = source_root(path)
    index = confined(path / MODEL_INDEX, root)
    doc = storage.load_json(index, MODEL_INDEX, MAX_INDEX)
    named = components(doc, index)
    parts, tensors, mapped, read = [], [], [], []
    with within(root):
        for name, library, cls in named:
            part = _part(path / name, name, library, cls, root, options)
            parts.append(part)
            if part.ckpt is not None:
                tensors += [t.renamed(f"{name}/{t.name}") for t in part.ckpt.tensors]
                mapped += part.ckpt.mapped
                files = part.ckpt.source.files
                read += [f"{name}/{f}" for f in files] if isinstance(files, list) else []
    source = SourceFacts(format=NAME, path=str(path), files=read,
                         more={"pipeline": doc["_class_name"], "components": {p.name: p.facts for p in parts}})
    return Checkpoint(tensors, {}, source, model_files(path), mapped, skipped_files=_beside(path, named),
                      parts=parts, output=NAME)


def _beside(path: Path, named) -> list:
    """What SRC holds beside model_index.json and its components that is not carried, and why: other
    folders, and weight files (a single-file checkpoint the repository also ships)."""
    folders = {name for name, _, _ in named}
    skipped = []
    for p in sorted(path.iterdir()):
        if p.name.startswith(".") or p.name in folders:
            continue
        if p.is_dir():
            skipped.append({"name": p.name, "reason": f"a folder {MODEL_INDEX} names no component of"})
        elif weights_name(p.name):
            skipped.append({"name": p.name, "reason": "weights beside the components, not part of the pipeline "
                                                      "(convert them as a SRC of their own)"})
    return skipped


def _part(folder: Path, name: str, library: str, cls: str, root: str, options: ReadOptions) -> Part:
    """One component: its weights read by the reader that recognises them, or its files carried whole."""
    facts = {"library": library, "class": cls}
    confined(folder, root)
    if not folder.is_dir():
        raise BadInput(f"{folder}: {MODEL_INDEX} names the component {name!r} ({library} {cls}), but there is no "
                       "such folder")
    entries = [p for p in sorted(folder.iterdir()) if not p.name.startswith(".")]
    skipped = [{"name": p.name, "reason": "a folder inside a component (not carried)"} for p in entries if p.is_dir()]
    weights = [p for p in entries if weights_name(p.name) and not p.is_dir()]
    if not weights:
        files, more = _folder_files(folder, (), root, options)
        return Part(name, None, files, skipped + more, facts=facts)
    groups = {}
    for p in weights:
        groups.setdefault(_variant(p.name), []).append(p)
    if len(groups) == 1:   # (as `convert SRC/COMPONENT` reads it)
        (variant, chosen), = groups.items()
        ckpt = open_checkpoint(folder, None, options)
    else:
        if None not in groups:
            raise UsageError(f"{folder}: holds its weights as the variants {', '.join(sorted(groups))} and none "
                             "without one; convert the folder of the variant to keep (SRC/COMPONENT with "
                             "--from ...), or a pipeline that holds one")
        variant, chosen = None, groups[None]
        ckpt = open_checkpoint(_target(folder, chosen), None, options)
        ckpt.model_files, ckpt.skipped_files = _folder_files(folder, weights, root, options)
        skipped += [{"name": p.name, "reason": f"the {v} variant; the weights without one were converted"}
                    for v, found in sorted(groups.items(), key=lambda kv: kv[0] or "") if v for p in found]
    if not ckpt.tensors:   # (its weight files hold nothing: a component of weights needs some)
        raise BadInput(f"{folder}: its weight files ({', '.join(p.name for p in chosen[:4])}) hold no tensors; "
                       "remove them if the component has no weights")
    facts.update({"format": ckpt.format, **({"variant": variant} if variant else {}),
                  **({"also": ckpt.also} if ckpt.also else {})})
    stem = source_stem([m.path for m in ckpt.mapped] or [chosen[0]])
    return Part(name, ckpt, ckpt.model_files, skipped + ckpt.skipped_files, stem, variant, facts)


def _folder_files(folder: Path, consumed, root: str, options: ReadOptions) -> tuple:
    """(carried, skipped) of a component folder's files besides its weights, as open_checkpoint
    carries a directory's."""
    files, skipped = carried(model_files(folder, consumed), root, options.max_extra_size)
    skipped += [{"name": p.name, "reason": f"training state: {what}"} for p, what in training_files(folder)]
    skipped += [{"name": n, "reason": "an earlier output's own metadata (OUT gets its own)"}
                for n in (MANIFEST, SUMS) if (folder / n).exists() or (folder / n).is_symlink()]
    return files, skipped


def _variant(name: str) -> str | None:
    """The variant a weight file's name carries, as diffusers and transformers name one (`STEM.fp16.bin`,
    `STEM.fp16-00001-of-00002.safetensors`, `STEM.safetensors.index.fp16.json`), or None."""
    kind = index_kind(name)
    if kind is not None:
        return kind[1]
    suffix = max((s for s in weight_suffixes() if name.endswith(s)), key=len, default="")
    base = _SHARD.sub("", name[:len(name) - len(suffix)])
    _, dot, variant = base.partition(".")
    return variant if dot and VARIANT.fullmatch(variant) else None


def _target(folder: Path, chosen: list) -> Path:
    """Of a folder's weight files without a variant, the one to read: its index, else its one file, of
    the format detection reads first (safetensors before torch, as for a directory)."""
    indexes = [p for p in chosen if index_kind(p.name) is not None]
    found = {}
    for p in indexes or chosen:
        try:
            reader = readers_detecting(p)[0]
        except BadInput:
            continue   # (weights of a framework no reader reads: .msgpack, .h5)
        found.setdefault((reader.priority, reader.name), []).append(p)
    if not found:
        raise BadInput(f"{folder}: holds no weights without a variant that ckptconv reads "
                       f"({', '.join(p.name for p in chosen[:4])})")
    first = found[min(found)]
    if len(first) > 1:
        raise BadInput(f"{folder}: holds {len(first)} {min(found)[1]} files without a variant and no index "
                       f"({', '.join(p.name for p in first[:4])})")
    return first[0]


READER = register(Reader(NAME, "diffusers pipeline directories (model_index.json and a folder per component)",
                         detect, load, priority=5,
                         fuzz=(("model_index.json", None), ("scheduler/scheduler_config.json", b"{}")),
                         looks_for=f"a directory holding {MODEL_INDEX} (a diffusers pipeline)"))
