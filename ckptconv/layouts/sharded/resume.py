"""--resume of a sharded directory: a single process keeps a journal after every shard (what the run
reads, its plan, each finished shard's digests), and a run of the same job re-hashes what a killed
one finished and reuses the shards that give the journal's digests again."""
import hashlib
import os
import stat

from ...formats import manifest as fmt
from ...io.hashing import CHUNK
from ...storage.targets import as_target
from ..files import Written


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
    rest is redone. `out_dir`: the output's Target (or a local directory). Returns (Written, why
    nothing or not everything could be reused, or None)."""
    target = as_target(out_dir)
    journal = fmt.read_journal(target)
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
        st = target.stat(shard.name)   # (a link put there is not followed)
        if not isinstance(info, dict) or st is None or not stat.S_ISREG(st.st_mode) or st.st_size != info.get("size"):
            continue
        file_digest, row = _rehash(None, shard, progress, target)
        if file_digest != info.get("sha256") or row is None or row.hex() != digests.get(shard.name):
            redone += 1
            continue
        done.files[shard.name] = info
        done.digests[shard.name] = row
    return done, (f"{redone} finished shard(s) failed their re-check and were rewritten" if redone else None)


def _rehash(path, shard, progress=None, target=None) -> tuple:
    """(file digest, its tensors' digests packed in plan order) of a shard written before (the local
    file `path`, or `shard.name` of the Target `target`), in one read: a journal's digests are
    believed only where the bytes give them again."""
    file_h, done, pos = hashlib.sha256(), bytearray(), 0
    tensors, k, h = iter(shard.tensors), shard.header_size, None   # k: where the current tensor ends
    read = target.chunks(shard.name, CHUNK) if target is not None else \
        as_target(os.path.dirname(os.fspath(path))).chunks(os.path.basename(os.fspath(path)), CHUNK)
    for chunk in read:
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


def rehashes(result, shards) -> bool:
    """Whether every (name in `result`, shard, the Target holding it) of `shards`, read once, gives
    the result's file digest and tensors' digests: a task a killed run finished is kept only then
    (Layout.rehashed), as the journal's shards are (`reusable`)."""
    for name, shard, target in shards:
        file_digest, row = _rehash(None, shard, None, target)
        if file_digest != result.files[name]["sha256"] or row != bytes(result.digests[name]):
            return False
    return True


def _keep_only(tmp, reused: set):
    """What a killed run left in the temporary directory (or under OUT in a store), but the shards
    reused: a shard of another plan, a half-copied model file, must not be published beside the new
    ones."""
    target = as_target(tmp)
    for name, _ in target.entries():
        if name not in reused:
            target.remove(name)
