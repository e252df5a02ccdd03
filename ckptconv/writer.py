"""The sharded safetensors writer: plan the shards (pure data), then stream each file.

Output contract (DESIGN.md): `model-0000k-of-0000n.safetensors` filled in order up to the shard size,
`model.safetensors.index.json`, `manifest.json` with file and per-tensor logical SHA-256, and a
coreutils `SHA256SUMS`. Every chunk is written once and hashed twice (file, tensor), see hashing.py.
Sources that are one contiguous file range are read straight into the output's staging buffers and
hashed there; others are gathered block by block from the mapping, whose pages are released as we
go. Shards bypass the page cache (outfile.py).
"""
import contextlib
import hashlib
import json
import os
import shutil
import stat
from dataclasses import dataclass, field

from . import sha256
from .errors import BadInput, OutputError
from .hashing import CHUNK, Pipeline, sha256_file, write_all
from .outfile import OutFile
from .safetensors_format import build_header
from .sha256sums import write_sums
from .tensor import as_bytes, iter_blocks

MANIFEST_FORMAT = "ckptconv.manifest/1"
INDEX_NAME = "model.safetensors.index.json"


@dataclass
class ShardFile:
    name: str
    tensors: list   # TensorSources, in data order
    header: bytes

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)


def plan_shards(tensors, max_shard_size: int, prefix="model") -> list:
    """Hugging Face's rule: fill shards in order up to `max_shard_size`; a tensor never spans files
    (one larger than the limit gets a shard of its own). Always `prefix-0000k-of-0000n` names."""
    groups, current, size = [], [], 0
    for t in tensors:
        if current and size + t.nbytes > max_shard_size:
            groups.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current or not groups:
        groups.append(current)
    n = len(groups)
    return [ShardFile(f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors", g,
                      build_header([(t.name, t.dtype, t.shape, t.nbytes) for t in g]))
            for i, g in enumerate(groups)]


@dataclass
class Written:
    """What writing produced: digests for the manifest."""

    files: dict = field(default_factory=dict)     # name -> {"sha256", "size"}
    tensors: dict = field(default_factory=dict)   # name -> {"dtype", "shape", "file", "sha256"}


JOURNAL = ".ckptconv-journal.json"


def _plan_id(shards) -> str:
    """Identifies a shard plan: names, headers (names, dtypes, shapes, offsets) in order."""
    h = hashlib.sha256()
    for s in shards:
        h.update(s.name.encode() + b"\0" + s.header)
    return h.hexdigest()


def source_id(paths, description) -> str:
    """Identifies what a run reads, for --resume: for every input file its device, inode, size,
    modification and change times (any write to a file, or another file put in its place, changes
    them; the change time cannot be set back), and the digest of what the reader made of them
    (`description`: the source, extras and other facts that go into the manifest)."""
    h = hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode())
    for p in sorted({os.path.realpath(p) for p in paths}):
        st = os.stat(p)
        h.update(os.fsencode(p) + f"\0{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}\n".encode())
    return h.hexdigest()


def _journal_write(out_dir, job, written: Written):
    """Record finished shards (atomically) so a killed run can be resumed."""
    tmp = os.path.join(out_dir, JOURNAL + ".tmp")
    with open(tmp, "w") as f:
        json.dump({**job, "files": written.files, "tensors": written.tensors}, f)
    os.replace(tmp, os.path.join(out_dir, JOURNAL))


def reusable(out_dir, shards, source: str, progress=None):
    """Shards a killed run of the same job finished, re-hashed and checked against its journal; the
    rest is redone. Returns (Written, why nothing or not everything could be reused, or None)."""
    try:
        with open(os.path.join(out_dir, JOURNAL)) as f:
            journal = json.load(f)
        files, tensors = journal["files"], journal["tensors"]
        if not isinstance(files, dict) or not isinstance(tensors, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        return Written(), "no interrupted run of this output to resume; started afresh"
    done = Written()
    if journal.get("source") != source:
        return done, "the interrupted run read a different or changed source; started over"
    if journal.get("plan") != _plan_id(shards):
        return done, "the interrupted run wrote other tensors or used other options; started over"
    redone = 0
    for shard in shards:
        info = files.get(shard.name)
        path = os.path.join(out_dir, shard.name)
        if not isinstance(info, dict) or not os.path.isfile(path) or os.path.getsize(path) != info.get("size"):
            continue
        if sha256_file(path, progress=progress) != info.get("sha256") or not all(
                isinstance(tensors.get(t.name), dict) for t in shard.tensors):
            redone += 1
            continue
        done.files[shard.name] = info
        done.tensors.update({t.name: tensors[t.name] for t in shard.tensors})
    return done, (f"{redone} finished shard(s) failed their re-check and were rewritten" if redone else None)


class OutputStream:
    """One output directory's shards, written tensor by tensor in plan order. Several can be open at
    once (reshard writes every rank's files side by side); they share one hashing pipeline."""

    def __init__(self, out_dir, shards, pipeline: Pipeline, fsync=False, on_close=None, direct=True):
        self.out_dir, self.shards, self.pipeline, self.fsync, self.direct = out_dir, shards, pipeline, fsync, direct
        self.on_close = on_close
        self.where = {t.name: i for i, s in enumerate(shards) for t in s.tensors}
        self.written = Written()
        self._current, self._file, self._file_h, self._digests = None, None, None, []

    def file_for(self, name):
        """(file, file hash) of the shard that holds tensor `name`, opening it (and closing the one
        before) when the plan moves on to it."""
        index = self.where[name]
        if index != self._current:
            self._close()
            shard = self.shards[index]
            path = os.path.join(self.out_dir, shard.name)
            self._file = OutFile(path, self.pipeline.staging, self.direct)
            self._current, self._file_h = index, sha256.new()
            self.pipeline.push(self._file, self._file_h, None, shard.header)
        return self._file, self._file_h

    def record(self, t, digest):
        """A tensor of the current shard is fully pushed; `digest` is its future SHA-256."""
        self._digests.append((t, digest))

    def _close(self):
        if self._file is None:
            return
        shard = self.shards[self._current]
        self.pipeline.drain()
        self._file.close(self.fsync)  # on failure, the caller abandons the stream (and this file)
        self._file = None
        for t, digest in self._digests:
            self.written.tensors[t.name] = {"dtype": t.dtype.code, "shape": list(t.shape), "file": shard.name,
                                            "sha256": digest.result()}
        self.written.files[shard.name] = {"sha256": self._file_h.hexdigest(), "size": shard.size}
        self._digests = []
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


def write_shards(out_dir, shards, pipeline: Pipeline, progress=None, fsync=False, taps=None,
                 reuse: Written = None, source=None, direct=True) -> Written:
    """Write `shards` into `out_dir`; with `source` (a `source_id`), keep a journal for --resume."""
    job = {"plan": _plan_id(shards), "source": source}
    reuse = reuse or Written()
    taps = taps or {}
    stream = OutputStream(out_dir, shards, pipeline, fsync,
                          (lambda written: _journal_write(out_dir, job, written)) if source else None, direct)
    try:
        for shard in shards:
            if shard.name in reuse.files:
                stream.written.files[shard.name] = reuse.files[shard.name]
                stream.written.tensors.update({t.name: reuse.tensors[t.name] for t in shard.tensors})
                continue
            for t in shard.tensors:
                f, file_h = stream.file_for(t.name)
                stream.record(t, write_tensor(f, file_h, t, pipeline, progress, taps.get(t.name)))
        written = stream.finish()
    except BaseException:
        stream.abandon()
        raise
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(out_dir, JOURNAL))
    return written


def write_tensor(f, file_h, t, pipeline, progress, tap):
    """Push all of `t` into `f`; returns the future of its SHA-256."""
    tensor_h = sha256.new()
    span = t.file_span()
    try:
        if span is not None:
            # One contiguous range of a file: read straight into the output's staging buffers.
            mapped, offset = span
            mapped.check(offset, t.nbytes, f"tensor {t.name!r}")
            with mapped.reader() as fill_at:
                pipeline.push_range(f, file_h, tensor_h, fill_at, offset, t.nbytes, tap, progress)
        else:
            pushed = 0
            for block in iter_blocks(t, CHUNK):
                data = as_bytes(block)
                pushed += len(data)
                if pushed > t.nbytes:
                    break
                pipeline.push(f, file_h, tensor_h, data, tap)
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
    return pipeline.hashes.digest("tensor", tensor_h)


def copy_files(out_dir, files, written: Written):
    """Carry model files (config.json, tokenizer...) into OUT unchanged, hashed for the manifest. The
    paths were resolved and checked by `readers.carried`; they are opened without following a link
    (one swapped in since is refused), a copy never gets wider permissions than its source, and a file
    that changes while it is copied stops the run."""
    for rel, src in files:
        dst = os.path.join(out_dir, rel)
        h = hashlib.sha256()
        try:
            fi = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise BadInput(f"{src}: cannot read: {e.strerror}") from None
        try:
            before = os.fstat(fi)
            if not stat.S_ISREG(before.st_mode):
                raise BadInput(f"{src}: is no longer a regular file")
            with open(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, before.st_mode & 0o666),
                      "wb") as fo:
                left = before.st_size
                while left > 0 and (chunk := os.read(fi, min(CHUNK, left))):
                    h.update(chunk)
                    write_all(fo, chunk)
                    left -= len(chunk)
            after = os.fstat(fi)
        finally:
            os.close(fi)
        if left or (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            raise BadInput(f"{src}: changed while it was being read; nothing was written")
        written.files[rel] = {"sha256": h.hexdigest(), "size": before.st_size}


def write_json(out_dir, name, obj, written: Written = None) -> bytes:
    """Pretty, sorted JSON in UTF-8. Text UTF-8 cannot spell (a file name that is not UTF-8, read by
    Python as unpaired surrogates) is written as its JSON escape, which reads back the same."""
    data = (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8", "backslashreplace")
    with open(os.path.join(out_dir, name), "wb") as f:
        write_all(f, data)
    if written is not None:
        written.files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    return data


def finish(out_dir, shards, written: Written, source: dict, extras: dict, extra_manifest=None):
    """Write the index, the manifest and SHA256SUMS once every shard is written and hashed."""
    total = sum(t.nbytes for s in shards for t in s.tensors)
    index = {"metadata": {"total_size": total},
             "weight_map": {t.name: s.name for s in shards for t in s.tensors}}
    write_json(out_dir, INDEX_NAME, index, written)
    manifest = {"format": MANIFEST_FORMAT, "source": source, "files": dict(sorted(written.files.items())),
                "tensors": written.tensors, "extras": extras}
    manifest.update(extra_manifest or {})
    data = write_json(out_dir, "manifest.json", manifest)
    sums = {name: info["sha256"] for name, info in written.files.items()}
    sums["manifest.json"] = hashlib.sha256(data).hexdigest()
    write_sums(out_dir, sums)
    return manifest


def check_space(out_dir, shard_bytes: int, model_files=(), copies: int = 1):
    """Refuse to start when the shards and `copies` of the carried model files cannot fit."""
    needed = shard_bytes + copies * sum(os.path.getsize(p) for _, p in model_files)
    if shutil.disk_usage(out_dir).free < needed:
        raise OutputError(f"{out_dir}: not enough free disk space for {needed} bytes")


def write_output(out_dir, tensors, source, extras, model_files=(), max_shard_size=5 * 10**9,
                 progress=None, extra_manifest=None, fsync=False, taps=None, job=None, resume=False, direct=True):
    """Write a complete output directory (shards, index, manifest, SHA256SUMS) into `out_dir`;
    returns (manifest, bytes reused from a killed run, a note on --resume or None).

    `taps` maps tensor names to extra hashes fed with those tensors' bytes as they are written.
    `job` (a `source_id` of what the run reads) names the journal kept for --resume; with `resume`,
    shards a killed run of the same job finished in `out_dir` are re-verified and kept."""
    shards = plan_shards(tensors, max_shard_size)
    reuse, note = reusable(out_dir, shards, job) if resume else (Written(), None)
    check_space(out_dir, sum(s.size for s in shards if s.name not in reuse.files), model_files)
    pipeline = Pipeline()
    try:
        written = write_shards(out_dir, shards, pipeline, progress, fsync, taps, reuse, job, direct=direct)
    finally:
        pipeline.close()

    copy_files(out_dir, model_files, written)
    manifest = finish(out_dir, shards, written, source, extras, extra_manifest)
    return manifest, sum(v["size"] for v in reuse.files.values()), note
