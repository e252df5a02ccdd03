"""What every writer shares: shard files planned as pure data, streamed through one pipeline, and
an output directory's metadata written once every shard is hashed.

Every chunk is written once and hashed twice (file, tensor), see hashing.py. Sources that are one
contiguous file range are read straight into the output's staging buffers and hashed there; others
are gathered block by block from the mapping, whose pages are released as we go. Shards bypass the
page cache (outfile.py). Every file goes through the output's Target (storage/targets.py): a local
temporary directory, or an object-store prefix where each file is an object uploaded as it is
written. The directory contract: docs/output.md.
"""
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from .. import signals
from ..io import sha256
from ..errors import BadInput, UsageError, brief, encodable
from ..formats import manifest as fmt
from ..formats import safetensors as st_format
from ..formats.mesh import MESH, rank_number
from ..formats.safetensors import fits, header_entry, header_length, header_pieces, header_start, too_long
from ..formats.sums import NAME as SUMS, unsafe_name, write_sums
from ..io.hashing import CHUNK, GATHERED, SMALL, Digests, Pipeline
from ..readers import weights_name
from ..storage import files as storage
from ..storage.targets import as_target, no_space
from ..tensor import fetch_ahead, as_bytes, iter_blocks
from .base import AddedFile, FilesResult


@dataclass
class ShardFile:
    """A planned shard: its tensors (a sequence: any object with name, dtype, shape and nbytes), in
    data order, and the sizes of its header and data. The header is made again as it is written
    (`header()`), a MiB at a time: a million tensors' header is about 90 MB."""
    name: str
    tensors: Sequence
    header_size: int
    data_size: int
    metadata: dict | None = None   # the header's __metadata__ ({"format": "pt"} when None)

    @property
    def size(self) -> int:
        return self.header_size + self.data_size

    def header(self):
        """The header's bytes, in pieces of about a MiB."""
        return header_pieces(((t.name, t.dtype, t.shape, t.nbytes) for t in self.tensors), self.header_size,
                             self.metadata)


def plan_shards(tensors: Sequence, max_shard_size: int, stem: str = fmt.STEM) -> list:
    """Hugging Face's rule: fill shards in order up to `max_shard_size`; a tensor never spans files
    (one larger than the limit gets a shard of its own). A shard is also closed before its header
    would pass SHARD_HEADER (8 MiB: about 100,000 tensors), whatever the size allows, so any reader
    opens any shard of ours in bounded memory (the safetensors library holds ~1 KB per entry: ~100
    MB); a tensor whose entry alone passes what readers accept (MAX_HEADER) is refused. Named as
    huggingface_hub names them (formats/manifest.shard_name): `STEM.safetensors` when there is one,
    else `STEM-0000k-of-0000n.safetensors`."""
    groups, begin, size, head = [], 0, 0, len(header_start())   # head: the open shard's header JSON
    closes = min(st_format.SHARD_HEADER, st_format.MAX_HEADER)
    for k, t in enumerate(tensors):
        entry = len(header_entry(t.name, t.dtype, t.shape, size, t.nbytes))
        if k > begin and (size + t.nbytes > max_shard_size or not fits(head + entry, closes)):
            groups.append((begin, k, head, size))
            begin, size, head = k, 0, len(header_start())
            entry = len(header_entry(t.name, t.dtype, t.shape, 0, t.nbytes))
        if k == begin and not fits(head + entry):
            raise BadInput(f"{too_long(head + entry)}, for tensor {brief(t.name, 80)} alone")
        head += entry
        size += t.nbytes
    groups.append((begin, len(tensors), head, size))
    n = len(groups)
    return [ShardFile(fmt.shard_name(stem, i, n), tensors[a:b], 8 + header_length(head), size)
            for i, (a, b, head, size) in enumerate(groups)]


@dataclass
class Written:
    """What writing produced. A tensor's manifest entry is its plan's dtype, shape and file with its
    digest: only the digests are kept, 32 bytes per tensor, never an object or a hex string per
    tensor (a million-tensor optimizer state)."""

    files: dict = field(default_factory=dict)     # name -> {"sha256", "size"}
    digests: dict = field(default_factory=dict)   # shard name -> its tensors' digests in plan order, packed

    def add(self, other: "Written"):
        self.files.update(other.files)
        self.digests.update(other.digests)

    def by_tensor(self, shards):
        """(tensor name, hex digest) of every tensor of the written `shards`, in plan order."""
        for s in shards:
            row = self.digests[s.name]
            for k, t in enumerate(s.tensors):
                yield t.name, row[32 * k:32 * k + 32].hex()

    def result(self, reused: int = 0, note: str | None = None) -> FilesResult:
        """A writer's result (layouts/base.py): these files and digests, and what --resume reused.
        Packed digests cross to another process as hex (FilesResult.to_json); a run of one process
        hands them over as they are."""
        return FilesResult(self.files, self.digests, reused, note)


class OutputStream:
    """One output directory's shards, written tensor by tensor in plan order; it owns the file and
    tensor digests. Several can be open at once (reshard writes every rank's files side by side);
    they share one hashing pipeline."""

    def __init__(self, out_dir, shards, pipeline: Pipeline, fsync=False, on_close=None, direct=True):
        """`out_dir`: the Target (or local directory) the shards go to."""
        self.out_dir, self.shards, self.pipeline, self.fsync, self.direct = as_target(out_dir), shards, pipeline, \
            fsync, direct
        self.on_close = on_close
        self.written = Written()
        self._current, self._file, self._file_h, self._digests = None, None, None, Digests()
        self._next = 0   # of the current shard's tensors, the next to be written
        self._small = bytearray()   # small tensors' bytes, in order, not yet pushed (SmallTensorWriter)

    def add(self, t, progress=None, tap=None):
        """Write all of tensor `t` into the shard the plan puts it in; `tap` (a sha256 state fed by
        the hash threads, or an InlineTap) is fed the same bytes."""
        small = t.nbytes <= SMALL and (tap is None or isinstance(tap, InlineTap))
        piece = SmallTensorWriter(self, t, tap) if small else self.tensor(t, tap)
        write_tensor(piece, t, progress)
        piece.close()

    def tensor(self, t, tap=None) -> "TensorWriter":
        """A writer for tensor `t`'s bytes, pushed in order by the caller (reshard's scatter)."""
        self._flush()
        return TensorWriter(self, t, tap)

    def _flush(self):
        """Push the small tensors' bytes gathered so far into the open shard (and its digest)."""
        if self._small:
            self.pipeline.push(self._file, self._file_h, None, self._small)
            self._small = bytearray()

    def _file_for(self, t):
        """(file, file hash) of the shard that holds tensor `t`: tensors come in plan order, so it
        is the open shard's next one, or the first of a later shard (those before it were reused by
        --resume), which is opened and the one before closed. No lookup table per tensor; a shard's
        tensors are compared by name (a reshard's are made when asked for, tp/intervals.RankPieces)."""
        shard = self.shards[self._current] if self._current is not None else None
        planned = shard.tensors[self._next] if shard is not None and self._next < len(shard.tensors) else None
        if planned is None or planned.name != t.name:
            start = 0 if self._current is None else self._current + 1
            index = next((i for i in range(start, len(self.shards))
                          if self.shards[i].tensors and self.shards[i].tensors[0].name == t.name), None)
            if index is None:
                raise AssertionError(f"tensor {t.name!r} was not written in plan order")
            self._close()
            shard = self.shards[index]
            self._file = self.out_dir.create(shard.name, self.pipeline.staging, shard.size, self.direct,
                                             head=shard.header_size)
            self._current, self._file_h, self._next = index, sha256.new(), 0
            for piece in shard.header():
                self.pipeline.push(self._file, self._file_h, None, piece)
            planned = shard.tensors[0]
        if planned.nbytes != t.nbytes:   # (the header says the plan's size: the bytes must be that many)
            raise AssertionError(f"tensor {t.name!r}: {t.nbytes} bytes to write where the plan has {planned.nbytes}")
        self._next += 1
        return self._file, self._file_h

    def _record(self, digest):
        """The current shard's next tensor is fully pushed; `digest` is its future SHA-256."""
        self._digests.append(digest)

    def _close(self):
        if self._file is None:
            return
        shard = self.shards[self._current]
        self._flush()
        self.pipeline.drain()
        self._file.close(self.fsync)  # on failure, the caller abandons the stream (and this file)
        self._file = None
        if len(self._digests) != len(shard.tensors):   # (each was checked against the plan as it began)
            raise AssertionError(f"{shard.name}: its tensors were not written as planned, one by one in order")
        self.written.digests[shard.name] = self._digests.packed()
        self.written.files[shard.name] = {"sha256": self._file_h.hexdigest(), "size": shard.size}
        self._digests = Digests()
        if self.on_close is not None:
            self.on_close(self.written)

    def finish(self) -> Written:
        self._close()
        return self.written

    def abandon(self):
        """After a failure: let go of the open shard's descriptors, writing nothing more."""
        if self._file is not None:
            self._file.abandon()
            self._file = None


class TensorWriter:
    """One tensor's bytes on their way into its shard. It owns what they are hashed into: the
    stream's file digest, the tensor's own digest, and a `tap` (the global tensor's, in reshard)."""

    def __init__(self, stream: OutputStream, t, tap=None):
        self.stream, self.t, self.tap = stream, t, tap
        self.file, self.file_h = stream._file_for(t)
        self.tensor_h = sha256.new()

    def fill(self, fill_at, offset, n, progress=None):
        """Bytes [offset, offset + n) of a source, put in place by `fill_at(view, at)` (no copy)."""
        self.stream.pipeline.push_range(self.file, self.file_h, self.tensor_h, fill_at, offset, n, self.tap,
                                        progress)

    def copy(self, data):
        self.stream.pipeline.push(self.file, self.file_h, self.tensor_h, data, self.tap)

    def close(self):
        """Every byte is pushed: the tensor's digest (a future) goes to the stream's manifest entry."""
        self.stream._record(self.stream.pipeline.hashes.digest("tensor", self.tensor_h))


class InlineTap:
    """A global digest fed in this thread: reshard's, of a tensor whose every rank piece is small (a
    state the hash threads also fed could not take bytes here without racing them)."""

    def __init__(self):
        self._h = hashlib.sha256()

    def update(self, data):
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest()


class SmallTensorWriter:
    """A tensor of at most SMALL bytes: digested in this thread, and its bytes gathered with its
    neighbours' into one push of up to GATHERED bytes (hashing.SMALL says why). Same calls as TensorWriter."""

    def __init__(self, stream: OutputStream, t, tap: InlineTap = None):
        stream._file_for(t)   # (the shard before it, with what was gathered for it, is closed here)
        self.stream, self.t, self.tap, self.tensor_h = stream, t, tap, hashlib.sha256()

    def fill(self, fill_at, offset, n, progress=None):
        data = bytearray(n)
        fill_at(memoryview(data), offset)
        self.copy(data)
        if progress:
            progress(n)

    def copy(self, data):
        self.tensor_h.update(data)
        if self.tap is not None:
            self.tap.update(data)
        self.stream._small += data

    def close(self):
        self.stream._digests.append_done(self.tensor_h.digest())
        if len(self.stream._small) >= GATHERED:
            self.stream._flush()
        signals.check()   # (a signal pending outside our code: no chunk may pass for a million of these)


def write_tensor(piece: TensorWriter, t, progress):
    """Push all of `t` through `piece`."""
    span = t.file_span()
    try:
        if span is not None:
            # One contiguous range of a file: read straight into the output's staging buffers.
            mapped, offset = span
            mapped.check(offset, t.nbytes, f"tensor {t.name!r}")
            with mapped.reader() as fill_at:
                piece.fill(fill_at, offset, t.nbytes, progress)
        else:
            pushed = 0
            for block in iter_blocks(t, CHUNK):
                data = as_bytes(block)
                pushed += len(data)
                if pushed > t.nbytes:
                    break
                piece.copy(data)
                t.release()  # the bytes are in the staging buffers now
                if progress:
                    progress(len(data))
            if pushed != t.nbytes:  # the header promised nbytes: never publish a file that lies
                raise BadInput(f"tensor {t.name!r}: its source gave {pushed} bytes where its shape {list(t.shape)} "
                               f"needs {t.nbytes}")
    except (ValueError, IndexError) as e:
        raise BadInput(f"tensor {t.name!r}: cannot read its data: {e}") from None
    finally:
        t.release()


def read_added(paths, limit: int, taken=()) -> list:
    """The files named with `--with` (docs/convert.md, "Files carried") as AddedFiles: each read
    through safejson.read (a regular file, opened without blocking, at most `limit` bytes, else
    BadInput naming it), named in OUT by its base name. A name is refused (UsageError naming the file)
    when it is not a plain file name, starts with `.`, is one of an output's own files or a rank
    directory's (manifest.json, SHA256SUMS, mesh.json, rank-NNNNN), ends like a weights file or an
    index (a consumer would load it as one), or is the name of a model file carried from the source
    (`taken`) or of another --with: nothing written into OUT is ever replaced by one."""
    added, seen = [], set(taken)
    for path in paths:
        name = os.path.basename(os.path.normpath(os.fspath(path)))
        why = unsafe_name(name) or (None if encodable(name) else "not valid Unicode text")
        if why is None and (name.startswith(".") or name in (fmt.MANIFEST, SUMS, MESH) or rank_number(name) is not None
                            or weights_name(name)):
            why = "an output's own file name or a weights file's; OUT holds only the converted weights under those"
        if why is None and name in seen:
            why = ("the name of a model file carried from the source (--no-copy-extras carries none)"
                   if name in taken else "named by another --with")
        if why is not None:
            raise UsageError(f"--with {brief(os.fspath(path), 200)}: cannot be written into OUT as {brief(name, 80)}: "
                             f"{why}")
        seen.add(name)
        added.append(AddedFile(name, storage.read_bytes(path, "--with file", limit)))
    return added


def copy_files(out_dir, files, written: Written, edited=None, added=()):
    """Carry model files (config.json, tokenizer...) into OUT unchanged, hashed for the manifest, or
    for a name in `edited`, its new bytes (convert's --dtype edits config.json); then the files named
    with --with (`added`, AddedFile). The paths were resolved and checked by `readers.carried`; they
    are opened without following a link (one swapped in since is refused), a copy never gets wider
    permissions than its source, and a file that changes while it is copied stops the run
    (storage.files.copy_file). `out_dir`: the Target (or local directory) they go to."""
    target = as_target(out_dir)
    edited = {**(edited or {}), **{a.name: a.data for a in added}}
    for rel, src in [*files, *((a.name, None) for a in added)]:
        if rel in edited:
            data = edited[rel]
            target.put(rel, data, 0o644, exclusive=True)
            written.files[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
            continue
        digest, size = storage.copy_file(src, lambda mode, rel=rel: target.open(rel, mode, exclusive=True))
        written.files[rel] = {"sha256": digest, "size": size}


def write_json(out_dir, name, obj, written: Written = None) -> str:
    """Write `obj` as our JSON (formats/manifest.py), streamed and hashed as it goes: its digest."""
    h, size = hashlib.sha256(), 0
    sink = as_target(out_dir).open(name)
    try:
        for data in fmt.dump_chunks(obj):
            sink.write(data)
            h.update(data)
            size += len(data)
    except BaseException:
        sink.abandon()
        raise
    sink.close()
    if written is not None:
        written.files[name] = {"sha256": h.hexdigest(), "size": size}
    return h.hexdigest()


def finish_dir(out_dir, shards, written: Written, source: dict, extras: dict, extra_manifest=None,
               stem: str = fmt.STEM, variant: str | None = None, sums: bool = True) -> dict:
    """Write a directory's index (when it has several shards; a `variant`'s is named as diffusers and
    transformers name it: formats/manifest.index_name), manifest and SHA256SUMS once every shard is
    written and hashed. `sums=False`: no SHA256SUMS, an enclosing output's lists the directory's
    files (a pipeline's component folder: layouts/diffusers); `written` then gets manifest.json's."""
    order = fmt.name_order(shards)
    if fmt.indexed(len(shards)):
        write_json(out_dir, fmt.index_name(stem, variant), fmt.index_document(shards, order), written)
    manifest = fmt.manifest_document(source, written.files, shards, order, written.digests, extras, extra_manifest)
    if not sums:
        write_json(out_dir, fmt.MANIFEST, manifest, written)
        return manifest
    digests = {name: info["sha256"] for name, info in written.files.items()}
    digests[fmt.MANIFEST] = write_json(out_dir, fmt.MANIFEST, manifest)
    write_sums(out_dir, digests)
    return manifest


def check_space(out_dir, shard_bytes: int, model_files=(), copies: int = 1):
    """Refuse to start when the shards and `copies` of the carried model files cannot fit."""
    target = as_target(out_dir)
    if target.remote:
        return   # (a store is not full)
    needed = shard_bytes + copies * sum(storage.size(p) for _, p in model_files if p is not None)  # (None: made)
    no_space(target, needed)


def write_shards(out_dir, shards, pipeline: Pipeline, progress=None, fsync=False, reuse: Written = None,
                 journal: dict = None, direct=True) -> Written:
    """Write `shards` into `out_dir` (a Target, or a local directory), skipping those in `reuse`; with
    `journal` (the job's identity and plan), record each finished shard for --resume."""
    reuse, target = reuse or Written(), as_target(out_dir)
    on_close = (lambda w: fmt.write_journal(target, journal, w.files, w.digests)) if journal else None
    stream = OutputStream(target, shards, pipeline, fsync, on_close, direct)
    try:
        for shard in shards:
            if shard.name in reuse.files:
                stream.written.files[shard.name] = reuse.files[shard.name]
                stream.written.digests[shard.name] = reuse.digests[shard.name]
                continue
            fetch_ahead(shard.tensors)
            for t in shard.tensors:
                stream.add(t, progress)
        written = stream.finish()
    except BaseException:
        stream.abandon()
        raise
    target.remove(fmt.JOURNAL)
    return written
