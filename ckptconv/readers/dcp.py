"""Reader for PyTorch Distributed Checkpoints (`.metadata` + `__R_N.distcp`), without torch.

`.metadata` is a pickled `Metadata` dataclass; it runs through the allowlisting unpickler with
inert stand-ins for DCP's classes. For each fully qualified name it gives the global shape, dtype and
chunks (offsets, sizes), and for each chunk where its bytes are: a torch.save zip at (offset, length)
of a .distcp file (read with the torch reader, strides kept), a tensor in the safetensors blob of the
SAFETENSORS variant, possibly behind a `stream.zstd/1` transform. Every tensor is one lazy source of
its global shape whose regions are filled from the chunks that overlap them (DESIGN.md, seed 002
§19.6); BYTE_IO items become extras. Items outside `--only` are never read.
"""
import hashlib
import itertools
import json
import math
from collections import OrderedDict
from pathlib import Path

import numpy as np

from .. import dtypes, unpickler
from ..errors import BadInput, UnsafePickle, UsageError
from ..mapped import MappedFile, MemoryFile
from ..safetensors_format import parse_header
from ..tensor import Checkpoint, Concat, TensorSource
from ..torch_globals import TorchTensor, flatten, torch_globals
from ..unpickler import Function, InertClass, InertObject, Marker
from . import ReadOptions, model_files, wanted
from .safetensors import file_tensors
from .torch_pickle import load_zip

NAME = "dcp"
PICKLE = True
DESCRIPTION = "PyTorch Distributed Checkpoint directories (.metadata + *.distcp)"

_DCP_CLASSES = ["Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                "MetadataIndex", "TensorProperties", "StorageMeta"]
_MODULES = ["torch.distributed.checkpoint.metadata", "torch.distributed._shard.checkpoint.metadata"]
ZSTD = "stream.zstd/1"


def _posix_path(ctx, *parts):
    return "/".join(str(p) for p in parts)


def _enum(qualname):
    return Function(qualname, lambda ctx, value: f"{qualname}({value})")


def allowlist(extra=()) -> dict:
    """DCP's metadata classes (current and older module paths) as inert records, plus torch's."""
    allow = torch_globals()
    for module in _MODULES:
        for cls in _DCP_CLASSES:
            allow[(module, cls)] = InertClass(cls)
        allow[(module, "_MEM_FORMAT_ENCODING")] = _enum("_MEM_FORMAT_ENCODING")
    for module in ("torch.distributed._shard.sharded_tensor.metadata",):
        allow[(module, "TensorProperties")] = InertClass("TensorProperties")
        allow[(module, "MEM_FORMAT_ENCODING")] = _enum("MEM_FORMAT_ENCODING")
    for module in ("torch.distributed.checkpoint.filesystem", "torch.distributed._shard.checkpoint.filesystem"):
        allow[(module, "_StorageInfo")] = InertClass("_StorageInfo")
    allow[("pathlib", "PosixPath")] = Function("pathlib.PosixPath", _posix_path)
    allow[("pathlib", "WindowsPath")] = Function("pathlib.WindowsPath", _posix_path)
    allow.update(unpickler.allow_globals(extra))
    return allow


def detect(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


def _field(obj, name, where, default=KeyError):
    """A dataclass field of an inert record: from its BUILD state, or positional constructor args."""
    if not isinstance(obj, InertObject):
        raise BadInput(f"{where}: expected a DCP record, found {type(obj).__name__}")
    if name in obj.state:
        return obj.state[name]
    if default is KeyError:
        raise BadInput(f"{where}: {obj.qualname} has no field {name!r}")
    return default


def _dtype(props, where):
    """TensorProperties state: a dict with `dtype`, or the (dtype, layout, …) tuple of its __getstate__."""
    state = props.state.get("__state__") if isinstance(props, InertObject) else None
    dt = state[0] if isinstance(state, tuple) and state else _field(props, "dtype", where)
    if not isinstance(dt, Marker) or not isinstance(dt.value, (dtypes.DType,)):
        what = getattr(getattr(dt, "value", None), "what", dt)
        raise BadInput(f"{where}: dtype {what} cannot be stored in safetensors")
    return dt.value


class Chunk:
    """One saved chunk of a tensor: its place in the global tensor and where its bytes are."""

    def __init__(self, reader, fqn, offsets, sizes, info):
        self.reader, self.fqn, self.offsets, self.sizes, self.info = reader, fqn, offsets, sizes, info
        self._source = None

    @property
    def transformed(self) -> bool:
        return bool(_field(self.info, "transform_descriptors", self.reader.path, None))

    def source(self) -> TensorSource:
        if self.transformed:
            return self.reader.cached(self)  # decompressed: keep only a couple in memory
        if self._source is None:
            self._source = self.reader.chunk_source(self)
        return self._source


class DCPReader:
    def __init__(self, path: Path, allow):
        self.path, self.allow = path, allow
        self.files = {}
        self._cache = OrderedDict()

    def cached(self, chunk) -> TensorSource:
        """Sources of decompressed chunks, the two most recently used kept (memory stays bounded)."""
        key = id(chunk)
        if key not in self._cache:
            self._cache[key] = self.chunk_source(chunk)
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return self._cache[key]

    def file(self, rel) -> MappedFile:
        if not isinstance(rel, str) or "/" in rel or rel.startswith("."):
            raise BadInput(f"{self.path / '.metadata'}: storage file {rel!r} is not a file name in the checkpoint")
        if rel not in self.files:
            p = self.path / rel
            if not p.is_file():
                raise BadInput(f"{p}: .distcp file named by .metadata is missing")
            self.files[rel] = MappedFile(p)
        return self.files[rel]

    def item_bytes(self, info, what):
        """(mapped, offset, length) of an item, undoing its transforms into memory if it has any."""
        where = self.path / ".metadata"
        rel = _field(info, "relative_path", where)
        offset, length = _field(info, "offset", where), _field(info, "length", where)
        transforms = _field(info, "transform_descriptors", where, None) or []
        m = self.file(rel)
        if not isinstance(offset, int) or not isinstance(length, int):
            raise BadInput(f"{m.path}: {what}: offset/length are not integers")
        m.check(offset, length, what)
        if not transforms:
            return m, offset, length
        if list(transforms) != [ZSTD]:
            raise BadInput(f"{m.path}: {what}: unsupported transform {list(transforms)!r} (known: {ZSTD})")
        try:
            import zstandard
        except ImportError:
            raise UsageError(f"{m.path}: {what} is zstd-compressed; install zstandard: pip install 'ckptconv[zstd]'") \
                from None
        try:
            data = zstandard.ZstdDecompressor().stream_reader(m.view[offset:offset + length]).read()
        except zstandard.ZstdError as e:
            raise BadInput(f"{m.path}: {what}: corrupt zstd stream: {e}") from None
        return MemoryFile(data, f"{m.path}[{what}, decompressed]"), 0, len(data)

    def chunk_source(self, chunk: Chunk) -> TensorSource:
        what = f"chunk of {chunk.fqn!r} at {list(chunk.offsets)}"
        m, offset, length = self.item_bytes(chunk.info, what)
        try:
            return self._chunk_source(chunk, m, offset, length)
        except BadInput as e:
            if what in str(e):
                raise
            raise BadInput(f"{m.path}: {what} (bytes {offset}..{offset + length}): "
                           f"{str(e).removeprefix(m.path + ': ')}") from None

    def _chunk_source(self, chunk, m, offset, length):
        head = bytes(m.view[offset:offset + 4])
        if head == b"PK\x03\x04":
            obj = load_zip(m, self.allow, offset, length)
            if not isinstance(obj, TorchTensor):
                raise BadInput(f"{m.path}: chunk of {chunk.fqn!r} at offset {offset} is not a tensor")
            src = obj.source(chunk.fqn) if not obj.unsupported else None
            if src is None:
                raise BadInput(f"{m.path}: chunk of {chunk.fqn!r} has dtype {obj.unsupported}")
        else:
            src = self._safetensors_chunk(m, offset, chunk)
        if src.shape != tuple(chunk.sizes):
            raise BadInput(f"{m.path}: chunk of {chunk.fqn!r} holds shape {src.shape}, .metadata says {chunk.sizes}")
        return src

    def _safetensors_chunk(self, m, offset, chunk):
        """SAFETENSORS variant: the rank's tensors are one safetensors blob; find this chunk in it."""
        if offset + 8 > m.size:
            raise BadInput(f"{m.path}: chunk of {chunk.fqn!r} at offset {offset} is neither a torch zip nor safetensors")
        blob = MemoryFile(m.view[offset:], m.path)  # the blob seen as a file of its own
        header = parse_header(blob.view, blob.size, m.path)
        info = json.loads(header.metadata.get("DCP_SHARDING_INFO", "{}") or "{}")
        entry = next((e for e in header.entries if e.name == chunk.fqn), None)
        saved = info.get(chunk.fqn, {}).get("saved_offsets")
        if entry is None or (saved is not None and list(saved) != list(chunk.offsets)):
            raise BadInput(f"{m.path}: chunk of {chunk.fqn!r} at {chunk.offsets} is not in the safetensors blob "
                           f"at offset {offset}")
        return next(t for t in file_tensors(blob) if t.name == chunk.fqn)


class ChunkedTensor(TensorSource):
    """A global tensor whose regions are filled from the chunks that overlap them."""

    def __init__(self, name, dtype, shape, chunks):
        self.name, self.dtype, self.shape, self.chunks = name, dtype, tuple(shape), chunks

    def _region(self, index):
        out = np.empty(tuple(s.stop - s.start for s in index), self.dtype.numpy)
        for c in self.chunks:
            lo = [max(s.start, o) for s, o in zip(index, c.offsets)]
            hi = [min(s.stop, o + n) for s, o, n in zip(index, c.offsets, c.sizes)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            local = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, c.offsets))
            dest = tuple(slice(a - s.start, b - s.start) for a, b, s in zip(lo, hi, index))
            out[dest] = c.source().region(local)
        return out

    def release(self):
        for c in self.chunks:
            if not c.transformed:
                c.source().release()


def _tile_axis(shape, chunks):
    """The axis along which the chunks tile the tensor whole (each full in every other axis), if any."""
    for axis in range(len(shape)):
        if all(all(c.offsets[k] == 0 and c.sizes[k] == shape[k] for k in range(len(shape)) if k != axis)
               for c in chunks):
            return axis
    return None


def _check_coverage(fqn, shape, chunks, where):
    """Chunks must lie inside the tensor, not overlap, and cover it exactly."""
    for c in chunks:
        if len(c.offsets) != len(shape) or len(c.sizes) != len(shape) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(c.offsets, c.sizes, shape)):
            raise BadInput(f"{where}: tensor {fqn!r}: chunk at {c.offsets} of size {c.sizes} lies outside {shape}")
    for a, b in itertools.combinations(chunks, 2):
        if all(max(oa, ob) < min(oa + na, ob + nb) for oa, na, ob, nb in zip(a.offsets, a.sizes, b.offsets, b.sizes)):
            raise BadInput(f"{where}: tensor {fqn!r}: chunks at {a.offsets} and {b.offsets} overlap")
    if sum(math.prod(c.sizes) for c in chunks) != math.prod(shape):
        raise BadInput(f"{where}: tensor {fqn!r}: chunks do not cover the tensor (gaps in {shape})")


def load(path: Path, options: ReadOptions) -> Checkpoint:
    allow = allowlist(options.allow_globals)
    meta_path = path / ".metadata"
    meta = MappedFile(meta_path)
    md = unpickler.load(meta.view, allow, meta_path)
    sdm = _field(md, "state_dict_metadata", meta_path)
    storage = _field(md, "storage_data", meta_path)
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise BadInput(f"{meta_path}: Metadata.state_dict_metadata/storage_data are not dicts")
    where_by_key = {}
    for key, info in storage.items():
        fqn = _field(key, "fqn", meta_path)
        offset = _field(key, "offset", meta_path, None)
        where_by_key[(fqn, tuple(offset) if offset is not None else None)] = info
    reader = DCPReader(path, allow)
    tensors, extras = [], {}
    for fqn, item in sdm.items():
        if not isinstance(fqn, str):
            raise BadInput(f"{meta_path}: a state dict key is not a string: {fqn!r}")
        if not wanted(fqn, options.only):
            continue
        if item.qualname == "BytesStorageMetadata":
            info = where_by_key.get((fqn, None))
            if info is None:
                raise BadInput(f"{meta_path}: no storage entry for bytes item {fqn!r}")
            _bytes_item(reader, fqn, info, tensors, extras, options)
            continue
        if item.qualname != "TensorStorageMetadata":
            raise BadInput(f"{meta_path}: item {fqn!r} is a {item.qualname}")
        dt = _dtype(_field(item, "properties", meta_path), f"{meta_path}: tensor {fqn!r}")
        shape = tuple(_field(item, "size", meta_path))
        chunks = []
        for c in _field(item, "chunks", meta_path):
            offsets, sizes = tuple(_field(c, "offsets", meta_path)), tuple(_field(c, "sizes", meta_path))
            info = where_by_key.get((fqn, offsets))
            if info is None:
                raise BadInput(f"{meta_path}: tensor {fqn!r}: no storage entry for the chunk at {offsets}")
            chunks.append(Chunk(reader, fqn, offsets, sizes, info))
        _check_coverage(fqn, shape, chunks, meta_path)
        for c in chunks:
            if not c.transformed:
                src = c.source()  # untransformed chunks are validated now (cheap: headers only)
                if src.dtype != dt:
                    raise BadInput(f"{meta_path}: tensor {fqn!r}: chunk holds {src.dtype.code}, .metadata says {dt.code}")
        tensors.append(_global(fqn, dt, shape, chunks))
    source = {"format": NAME, "path": str(path), "files": sorted(p.name for p in path.glob("*.distcp"))}
    return Checkpoint(tensors, extras, source, model_files(path), [meta] + list(reader.files.values()))


def _global(fqn, dt, shape, chunks):
    """One chunk: its own source; chunks tiling one axis: a join (keeps slices contiguous); else
    a region-filling tensor. Transformed chunks are always read lazily."""
    if any(c.transformed for c in chunks):
        return ChunkedTensor(fqn, dt, shape, chunks)
    if len(chunks) == 1:
        return chunks[0].source().renamed(fqn)
    axis = _tile_axis(shape, chunks)
    if axis is not None:
        ordered = sorted(chunks, key=lambda c: c.offsets[axis])
        return Concat(fqn, [c.source() for c in ordered if c.sizes[axis]], axis)
    return ChunkedTensor(fqn, dt, shape, chunks)


def _bytes_item(reader, fqn, info, tensors, extras, options):
    m, offset, length = reader.item_bytes(info, f"bytes item {fqn!r}")
    head = bytes(m.view[offset:offset + 4])
    if head == b"PK\x03\x04":
        value = load_zip(m, reader.allow, offset, length)
    else:
        # Any pickle protocol (0 and 1 have no header) is run by the VM, which never executes
        # anything: a hostile global is refused; bytes that do not parse as a pickle are opaque.
        try:
            value = unpickler.load(m.view[offset:offset + length], reader.allow, m.path, offset)
        except UnsafePickle:
            raise
        except BadInput:
            raw = m.view[offset:offset + length]
            extras[fqn] = {"__opaque__": length, "sha256": hashlib.sha256(raw).hexdigest()}
            return
    t, e, _ = flatten(value, m.path, prefix=fqn, skip_unsupported=options.skip_unsupported)
    tensors.extend(t.values())
    extras.update({k: unpickler.to_jsonable(v) for k, v in e.items()})

