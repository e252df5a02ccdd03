"""Reader for PyTorch Distributed Checkpoints (`.metadata` + `__R_N.distcp`), without torch.

`.metadata` is a pickled `Metadata` dataclass; it runs through the allowlisting unpickler with
inert stand-ins for DCP's classes. For each fully qualified name it gives the global shape, dtype and
chunks (offsets, sizes), and for each chunk where its bytes are: a torch.save zip at (offset, length)
of a .distcp file (read with the torch reader, strides kept), a tensor in the safetensors blob of the
SAFETENSORS variant, possibly behind a `stream.zstd/1` transform. Every tensor is one lazy source of
its global shape whose regions are filled from the chunks that overlap them (docs/dcp.md); BYTE_IO
items become extras. Items outside `--only` are never read.

Everything `.metadata` says is checked before it is used (record types, field types, shapes, that the
chunks tile each tensor exactly, that items' byte ranges lie in their files and do not share bytes),
and every loop, allocation and decompression is bounded by bytes that are present or by sizes they
justify: see the limits in dcp_metadata.py and docs/dcp.md. The checks are dcp_metadata.py's,
the reading of the bytes dcp_chunks.py's; this module is the reader. Files are reached through
storage/files.py: a checkpoint in an object store is read by ranged reads (`.metadata` whole, each
item's metadata, tensor bytes when they are written).
"""
import hashlib
from pathlib import Path

from .base import Reader, register
from ..errors import BadInput, UnsafePickle
from ..limits import Budget
from ..storage import files as storage
from ..checkpoint import Checkpoint, SourceFacts
from .pickle import unpickler
from .pickle.torch_globals import TORCH_OWNED, flatten, torch_globals
from .pickle.unpickler import Function, InertClass
from . import LIGHTNING_META, ReadOptions, confined, damage, dcp_lightning, dcp_training, model_files, source_root, wanted
from .dcp_chunks import _ZIP, DCPReader, global_tensor
from .dcp_metadata import (Loc, _check_coverage, _field, _found, _read_tensor, _record, _storage_index,
                           unread_places)
from .torch_pickle import load_zip

NAME = "dcp"

_DCP_CLASSES = ["Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                "MetadataIndex", "TensorProperties", "StorageMeta"]
_MODULES = ["torch.distributed.checkpoint.metadata", "torch.distributed._shard.checkpoint.metadata"]
_PLANNER = "torch.distributed.checkpoint.planner"
_MCORE_STRATEGY = "megatron.core.dist_checkpointing.strategies.torch"


def _posix_path(ctx, *parts):
    return "/".join(str(p) for p in parts)


def _enum(qualname):
    return Function(qualname, lambda ctx, value: f"{qualname}({value})")


def allowlist(extra=(), base=None) -> dict:
    """DCP's metadata classes (current and older module paths) as inert records, plus torch's (or
    `base`: a format's allowlist that extends torch's)."""
    allow = dict(base) if base is not None else torch_globals()
    for module in _MODULES:
        for cls in _DCP_CLASSES:
            allow[(module, cls)] = InertClass(cls)
        allow[(module, "_MEM_FORMAT_ENCODING")] = _enum("_MEM_FORMAT_ENCODING")
    for module in ("torch.distributed._shard.sharded_tensor.metadata",):
        allow[(module, "TensorProperties")] = InertClass("TensorProperties")
        allow[(module, "MEM_FORMAT_ENCODING")] = _enum("MEM_FORMAT_ENCODING")
    for module in ("torch.distributed.checkpoint.filesystem", "torch.distributed._shard.checkpoint.filesystem"):
        allow[(module, "_StorageInfo")] = InertClass("_StorageInfo")
    # the save plans a planner may keep in Metadata.planner_data (Megatron-Core's does, to save the same
    # structure again faster): records, never used here
    for cls in ("SavePlan", "WriteItem", "TensorWriteData"):
        allow[(_PLANNER, cls)] = InertClass(cls)
    # Megatron-Core 0.13-0.15 pickle their planner's own SavePlan subclass there, and 0.15 its Metadata
    # subclass as the whole file (both: the same fields plus per-tensor `mcore_data`, never used here)
    allow[(_MCORE_STRATEGY, "MCoreSavePlan")] = InertClass("MCoreSavePlan")
    allow[(_MCORE_STRATEGY, "MCoreMetadata")] = InertClass("MCoreMetadata")
    allow[(_PLANNER, "WriteItemType")] = _enum("WriteItemType")
    allow[("pathlib", "PosixPath")] = Function("pathlib.PosixPath", _posix_path)
    allow[("pathlib", "WindowsPath")] = Function("pathlib.WindowsPath", _posix_path)
    return unpickler.allowing(allow, extra, (*TORCH_OWNED, *_MODULES, "torch.distributed._shard.sharded_tensor.metadata",
                                             "torch.distributed.checkpoint.filesystem",
                                             "torch.distributed._shard.checkpoint.filesystem", _PLANNER))


def detect(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


def load(path: Path, options: ReadOptions) -> Checkpoint:
    return read(path, options, allowlist(options.allow_globals))


def read(path: Path, options: ReadOptions, allow, keep=None) -> Checkpoint:
    """The items of the DCP checkpoint in `path` whose name `keep(fqn)` accepts (the others are checked
    as records, never read), unpickled with `allow` (DCP's records plus a format's own: the megatron
    reader's torch_dist directories). Without `keep` (the dcp reader), a training state's model is
    unwrapped as --state-dict says (dcp_training.py), Lightning's meta.pt beside `.metadata` read with
    it (dcp_lightning.py), and --only selects among the names written."""
    meta_path = path / ".metadata"
    meta = storage.open_file(confined(meta_path, source_root(path)))
    md = _record(unpickler.load(storage.buffer(meta, 0, meta.size), allow, meta_path), ("Metadata", "MCoreMetadata"),
                 "the pickle", meta_path)
    sdm = _field(md, "state_dict_metadata", meta_path)
    storage_data = _field(md, "storage_data", meta_path)
    if not isinstance(sdm, dict) or not isinstance(storage_data, dict):
        raise BadInput(f"{meta_path}: Metadata.state_dict_metadata/storage_data are not dicts")
    where_by_key = _storage_index(storage_data, meta_path)
    reader = DCPReader(path, allow)
    unwrapped, lightning, aside = None, None, None
    if keep is None:
        kinds = {fqn: _record(item, ("TensorStorageMetadata", "BytesStorageMetadata"), f"item {fqn!r}", meta_path)
                 .qualname == "TensorStorageMetadata" for fqn, item in sdm.items() if isinstance(fqn, str)}
        lightning = dcp_lightning.open_meta(path, allow)
        aside = lightning.set_aside(lambda name: wanted(name, options.only)) if lightning is not None else None
        unwrapped = dcp_training.unwrap(kinds, _field(md, "planner_data", meta_path, None), options.state_dict,
                                        meta_path, aside.counts if aside is not None else None)
        names = unwrapped.names if unwrapped is not None else {}
        keep = (lambda fqn: fqn in names and wanted(names[fqn], options.only)) if unwrapped is not None else \
            (lambda fqn: wanted(fqn, options.only))
    name_of = (lambda fqn: unwrapped.names[fqn]) if unwrapped is not None else (lambda fqn: fqn)

    # 1. Check every wanted item's records and layout before reading any bytes.
    items, chunked = [], []
    for fqn, item in sdm.items():
        if not isinstance(fqn, str):
            raise BadInput(f"{meta_path}: a key of Metadata.state_dict_metadata is not a string: {_found(fqn)}")
        if not keep(fqn):
            continue
        _record(item, ("TensorStorageMetadata", "BytesStorageMetadata"), f"item {fqn!r}", meta_path)
        if item.qualname == "BytesStorageMetadata":
            info = where_by_key.get((fqn, None))
            if info is None:
                raise BadInput(f"{meta_path}: no storage entry for bytes item {fqn!r}")
            items.append((fqn, Loc(info, f"bytes item {fqn!r}", meta_path)))
            continue
        dt, shape, chunks = _read_tensor(reader, fqn, item, where_by_key, meta_path)
        grid = _check_coverage(fqn, shape, chunks, meta_path)
        items.append((fqn, (dt, shape, chunks, grid)))
        chunked.extend(c for c in chunks if c.numel)

    # 2. Every range inside its file; no two items sharing bytes (SAFETENSORS blobs excepted).
    reader.mark_blob_members([c.loc for c in chunked])
    reader.claim([x for _, x in items if isinstance(x, Loc)], [c.loc for c in chunked])
    # ... and the items not read: the damage their files' sizes show, from .metadata alone (readers/damage.py)
    damaged = damage.survey(unread_places(where_by_key, {fqn for fqn, _ in items}), reader.size)

    # 3. Read: bytes items now, tensor chunks lazily (untransformed ones validated now: headers only).
    tensors, extras, skipped = [], {}, []
    for fqn, x in items:
        if isinstance(x, Loc):
            _bytes_item(reader, fqn, name_of(fqn), x, tensors, extras, skipped)
            continue
        dt, shape, chunks, grid = x
        for c in chunks:
            if c.numel and not c.transformed:
                c.source()
        tensors.append(global_tensor(name_of(fqn), dt, shape, chunks, grid))
    dropped = unwrapped.dropped if unwrapped is not None else []
    if lightning is not None:   # meta.pt: the rest of the wrapper, or written too when everything is
        if unwrapped is not None:
            extras.update(aside.extras)
            dropped = dropped + [d for d in aside.dropped if d not in dropped]
        else:
            t, e, s = lightning.whole(lambda name: wanted(name, options.only))
            tensors += t
            extras.update(e)
            skipped += [(x, lightning.file.path) for x in s]
    files = sorted(p.name for p in path.glob("*.distcp")) + ([LIGHTNING_META] if lightning is not None else [])
    source = SourceFacts(format=NAME, path=str(path), files=files,
                         skipped=[s for s, _ in skipped], damaged=damaged,
                         **({"placeholders": unpickler.listing([lightning.unlisted])} if lightning is not None else {}),
                         **({"state_dict": unwrapped.chosen, "dropped": dropped}
                            if unwrapped is not None else {"state_dict": "none"} if options.state_dict == "none" else {}))
    mapped = [meta] + list(reader.files.values()) + ([lightning.file] if lightning is not None else [])
    return Checkpoint(tensors, extras, source, model_files(path), mapped,
                      layout=unwrapped.layout if unwrapped is not None else None,
                      unsupported=(f"{skipped[0][1]}: tensor {skipped[0][0]['name']!r} has dtype {skipped[0][0]['reason']}, "
                                   "which safetensors cannot store", "--skip-unsupported leaves it out")
                      if skipped else None)


def _bytes_item(reader, fqn, name, loc, tensors, extras, skipped):
    m, offset, length = reader.item_bytes(loc)
    budget = Budget(m.path)
    head = bytes(storage.buffer(m, offset, 4))
    if head == _ZIP:
        value = load_zip(m, reader.allow, offset, length, budget=budget)
    else:
        # Any pickle protocol (0 and 1 have no header) is run by the VM, which never executes
        # anything: a hostile global is refused; bytes that do not parse as a pickle are opaque.
        raw = storage.buffer(m, offset, length)
        try:
            value = unpickler.load(raw, reader.allow, m.path, offset, budget=budget)
        except UnsafePickle:
            raise
        except BadInput:
            extras[name] = {"__opaque__": length, "sha256": hashlib.sha256(raw).hexdigest()}
            return
    t, e, s = flatten(value, m.path, prefix=name, budget=budget)
    skipped += [(x, m.path) for x in s]
    tensors.extend(t.values())
    extras.update(unpickler.extras_json(e, budget))


READER = register(Reader(NAME, "PyTorch Distributed Checkpoint directories (.metadata + *.distcp)",
                         detect, load, priority=20, parses_pickles=True, suffixes=(".distcp",),
                         fuzz=((".metadata", None), ("__0_0.distcp", None)),
                         looks_for="a directory holding .metadata"))
