"""The sharded safetensors directory (docs/output.md): shards filled in order up to the shard size and
named as huggingface_hub names them (`STEM.safetensors` alone, or `STEM-0000k-of-0000n.safetensors`
and `STEM.safetensors.index.json`), `manifest.json` with file and per-tensor
SHA-256, a coreutils `SHA256SUMS`, and the model files carried over. A single process keeps a
journal after every shard so that `--resume` can reuse what a killed run finished."""
import hashlib
import json
import os
import shutil
import stat

from ..formats import manifest as fmt
from ..io.hashing import CHUNK, Pipeline
from .base import Content, RunFacts, WriteOptions, Writer, register
from .files import Written, check_space, copy_files, finish_dir, plan_shards, write_shards


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


def _plan_id(shards) -> str:
    """Identifies a shard plan: names, headers (names, dtypes, shapes, offsets) in order."""
    h = hashlib.sha256()
    for s in shards:
        h.update(s.name.encode() + b"\0")
        for piece in s.header():
            h.update(piece)
    return h.hexdigest()


def reusable(out_dir, shards, identity: str, progress=None):
    """Shards a killed run of the same job finished, re-hashed and checked against its journal; the
    rest is redone. Returns (Written, why nothing or not everything could be reused, or None)."""
    journal = fmt.read_journal(out_dir)
    if journal is None:
        return Written(), "no interrupted run of this output to resume; started afresh"
    done = Written()
    if journal.get("source") != identity:
        return done, "the interrupted run read a different or changed source; started over"
    if journal.get("plan") != _plan_id(shards):
        return done, "the interrupted run wrote other tensors or used other options; started over"
    files, digests, redone = journal["files"], journal["digests"], 0
    for shard in shards:
        info = files.get(shard.name)
        path = os.path.join(out_dir, shard.name)
        st = os.lstat(path) if os.path.lexists(path) else None   # (a link put there is not followed)
        if not isinstance(info, dict) or st is None or not stat.S_ISREG(st.st_mode) or st.st_size != info.get("size"):
            continue
        file_digest, row = _rehash(path, shard, progress)
        if file_digest != info.get("sha256") or row is None or row.hex() != digests.get(shard.name):
            redone += 1
            continue
        done.files[shard.name] = info
        done.digests[shard.name] = row
    return done, (f"{redone} finished shard(s) failed their re-check and were rewritten" if redone else None)


def _rehash(path, shard, progress=None) -> tuple:
    """(file digest, its tensors' digests packed in plan order) of a shard written before, in one
    read: a journal's digests are believed only where the bytes give them again."""
    file_h, done, pos = hashlib.sha256(), bytearray(), 0
    tensors, k, h = iter(shard.tensors), shard.header_size, None   # k: where the current tensor ends
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            file_h.update(chunk)
            view, end = memoryview(chunk), pos + len(chunk)
            while True:
                if h is None:   # the next tensor starts at k
                    t = next(tensors, None)
                    if t is None:
                        break
                    h, start, k = hashlib.sha256(), k, k + t.nbytes
                h.update(view[max(start, pos) - pos:min(k, end) - pos] if start < end else b"")
                if k > end:
                    break
                done += h.digest()
                h = None
            pos = end
            if progress is not None:
                progress(len(chunk))
    return file_h.hexdigest(), bytes(done) if h is None and next(tensors, None) is None else None


def _keep_only(tmp, reused: set):
    """What a killed run left in the temporary directory, but the shards reused: a shard of another
    plan, a half-copied model file, must not be published beside the new ones."""
    for entry in os.scandir(tmp):
        if entry.name in reused:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)


@register("sharded")
class ShardedWriter(Writer):
    def __init__(self, options: WriteOptions, content: Content, out=None):
        super().__init__(options, content, out)
        self.shards = []

    def plan(self, tensors) -> list:
        self.shards = plan_shards(tensors, self.options.max_shard_size, self.options.stem)
        return self.shards

    def write(self, units, tmp, progress=None, share=(0, 1)):
        solo = share[1] == 1  # the journal (and --resume) belong to a run of one process
        reuse, note = Written(), None
        if solo and self.options.resume and self.content.identity:
            reuse, note = reusable(tmp, self.shards, self.content.identity)
            _keep_only(tmp, set(reuse.files))
        check_space(tmp, sum(s.size for s in units if s.name not in reuse.files)
                    + (self.content.added_bytes() if share[0] == 0 else 0), self.content.model_files if share[0] == 0 else ())
        journal = {"plan": _plan_id(self.shards), "source": self.content.identity} if solo and self.content.identity \
            else None
        pipeline = Pipeline()
        try:
            written = write_shards(tmp, units, pipeline, progress, self.options.fsync, reuse, journal,
                                   self.options.direct)
        finally:
            pipeline.close()
        return written.result(sum(v["size"] for v in reuse.files.values()), note)

    def finish(self, tmp, results) -> RunFacts:
        written, by_name = Written(), {}
        for r in results:
            by_name.update({name: r for name in r.files})
        for shard in self.shards:  # merged in plan order: the manifest is what one process writes
            r = by_name[shard.name]
            written.files[shard.name] = r.files[shard.name]
            written.digests[shard.name] = r.digests[shard.name]
        copy_files(tmp, self.content.model_files, written, self.content.edited, self.content.added)
        manifest = finish_dir(tmp, self.shards, written, {**self.content.source, **self.content.skipped()},
                              self.content.extras, self.content.manifest, self.options.stem)
        notes = [r.note for r in results if r.note]
        return RunFacts(sorted(manifest["files"]), sum(r.reused for r in results), notes[0] if notes else None)
