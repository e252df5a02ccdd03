"""Reader for torch.save files without torch: the zip format (torch >= 1.6), the legacy format, and
Hugging Face directories of `.bin` shards with `pytorch_model.bin.index.json`.

`data.pkl` runs through the allowlisting unpickler with torch's stand-ins; each storage resolves to
its zip entry (or its place after the legacy pickles), so every tensor is a view of the mapped file.
Files are reached through storage/files.py: from an object store, a zip's metadata costs a few ranged
reads (ziparchive.py), a legacy file's pickles are fetched front to back once, as far as their STOP
(`_pickle_at`), and the element counts before its storages in one batch; tensors fetch their own bytes.
"""
import struct
from array import array
from pathlib import Path

from .pickle import unpickler
from .pickle.memo import pickle_end
from . import torch_modules, wrappers, ziparchive
from .base import Reader, register
from ..errors import BadInput, brief
from ..limits import Budget
from ..storage import files as storage
from ..checkpoint import Checkpoint, SourceFacts
from ..formats.manifest import index_kind, is_index
from .pickle.torch_globals import TORCH_OWNED, Storage, flatten, storage_dtype, torch_globals
from . import (DEEPSPEED_RANK_FILE, LIGHTNING_META, ReadOptions, by_shard, check_listed, inside, model_files,
               source_root, training_state, wanted, weight_map, weights_file)

NAME = "torch"

AMPLIFICATION = 16  # the most bytes of tensors a file's bytes may describe (beyond 64 MiB)
TORCH_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pth.tar", ".pt.tar")   # torch files a directory may hold
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_HEAD = b"\x80\x02\x8a\x0a" + _LEGACY_MAGIC.to_bytes(10, "little")


def _is_torch_file(path: Path) -> bool:
    head = storage.head(path, len(_LEGACY_HEAD))
    if head.startswith(_LEGACY_HEAD):
        return True
    if not head.startswith(b"PK\x03\x04"):
        return False
    try:
        return any(n.endswith("data.pkl") for n in ziparchive.names(storage.open_file(path)))
    except BadInput:
        return path.name.endswith(TORCH_SUFFIXES)  # let open() give the precise error


def _dir_files(directory: Path) -> list:
    """A directory's index files (`*.bin.index.json`, `*.pt.index.json`; without one, a variant's
    `*.bin.index.VARIANT.json`) if it has any, else its torch files; `load` reads a directory only
    when this is exactly one."""
    found = sorted(directory.glob("*.bin.index.json")) + sorted(directory.glob("*.pt.index.json")) \
        or sorted(p for p in directory.iterdir() if is_index(p.name, ("bin", "pt")) and index_kind(p.name)[1])
    if found:
        return found
    root = source_root(directory)
    files = [p for p in sorted(directory.iterdir()) if p.name.endswith(TORCH_SUFFIXES) and p.is_file()
             and inside(p, root) and not training_state(p.name)   # a link leading elsewhere is not even looked at
             and not DEEPSPEED_RANK_FILE.fullmatch(p.name)         # (a ZeRO checkpoint: readers/deepspeed.py)
             and not (p.name == LIGHTNING_META and (directory / ".metadata").is_file())]   # (readers/dcp_lightning.py)
    return [p for p in files if _is_torch_file(p)]


def detect(path: Path) -> bool:
    if path.is_dir():
        return bool(_dir_files(path))  # several: load says so
    return is_index(path.name, ("bin", "pt")) or _is_torch_file(path)


def load(path: Path, options: ReadOptions) -> Checkpoint:
    allow = unpickler.allowing(torch_globals(), options.allow_globals, TORCH_OWNED)
    if path.is_dir():
        found = _dir_files(path)
        if len(found) != 1:
            indexes = found and (found[0].name.endswith(".index.json") or index_kind(found[0].name))
            what = "indexes" if indexes else "torch files and no index"
            raise BadInput(f"{path}: holds {len(found)} {what} ({', '.join(p.name for p in found[:4])}); give the "
                           "one to read as SRC")
        target = weights_file(found[0], source_root(path))
    else:
        target = path
    shards, listed = [target], None
    if target.name.endswith(".index.json") or index_kind(target.name) is not None:
        listed = by_shard(weight_map(target, options.only))
        shards = [weights_file(target.parent / f, source_root(target)) for f in sorted(listed)]
    tensors, extras, skipped, mapped, dropped, placeholders, unwrapped, layouts = [], {}, [], [], [], [], None, []
    modules, unsupported = [], None
    for shard in shards:
        m = storage.open_file(shard)
        mapped.append(m)
        budget, unlisted = Budget(shard), unpickler.Unlisted(shard)
        obj, pickled = torch_modules.as_state_dicts(_load_file(m, allow, budget, unlisted), shard, budget)
        modules += [p.to_json() for p in pickled]
        dropped += [{"name": f"{p.name}.{a}" if p.name else a, "reason": "tensors outside the module's state dict: "
                     "its class's own state-dict code never runs"} for p in pickled for a in p.left_out]
        found = wrappers.unwrap(obj, options.state_dict, shard, budget)
        obj = None
        unwrapped = found.key
        t, e, s = flatten(found.kept, shard, budget=budget)
        if s and unsupported is None:
            unsupported = (f"{shard}: tensor {s[0]['name']!r} has dtype {s[0]['reason']}, which safetensors cannot "
                           "store", "--skip-unsupported leaves it out")
        written = list(t) + [x["name"] for x in s]
        if listed is not None:
            check_listed(target, shard.name, listed[shard.name], set(written))
        justified(m, t.values())
        tensors += [src for name, src in t.items() if wanted(name, options.only)]
        t = None
        extras.update(unpickler.extras_json({k: v for k, v in e.items() if wanted(k, options.only)}, budget))
        skipped += s
        rest = wrappers.set_aside(found.rest, shard, budget, lambda k: wanted(k, options.only))
        extras.update(rest.extras)
        dropped += rest.dropped
        layouts.append(wrappers.layout(found, options.state_dict, written, rest.counts))
        found = None   # (the pickle's records: the sources replace them)
        placeholders.append(unlisted)
    source = SourceFacts(format=NAME, path=str(path), files=[str(p.relative_to(path) if path.is_dir() else p.name)
                                                            for p in shards],
                         skipped=skipped, dropped=dropped, placeholders=unpickler.listing(placeholders),
                         modules=modules,
                         # (verify --against reads the source the same way)
                         state_dict=unwrapped or "none" if unwrapped is not None or options.state_dict == "none"
                         else None)
    consumed = shards + ([target] if target not in shards else [])
    files = model_files(path, consumed) if path.is_dir() else []
    return Checkpoint(tensors, extras, source, files, mapped, layout=layouts[0] if len(layouts) == 1 else None,
                      unsupported=unsupported)


def justified(m, tensors):
    """Views may repeat bytes (tied weights) or stretch them (a stride-0 `expand`), but the tensors of
    a file may not describe far more bytes than it holds: a 620-byte file is not 2 GB of output."""
    described = sum(t.nbytes for t in tensors)
    if described > AMPLIFICATION * m.size + (64 << 20):
        raise BadInput(f"{m.path}: its tensors describe {described} bytes from a file of {m.size} (views that "
                       f"repeat or stretch the same bytes over {AMPLIFICATION}x); refused")


def _load_file(m, allow, budget, unlisted):
    if m.read(0, min(m.size, len(_LEGACY_HEAD))) == _LEGACY_HEAD:
        return _load_legacy(m, allow, budget, unlisted)
    if not ziparchive.is_zip(m):
        raise BadInput(f"{m.path}: not a torch.save file (neither a zip archive nor the legacy format)")
    entries = ziparchive.read_entries(m)
    code = archive_prefix(m, entries) + "code/"
    if any(n.startswith(code) for n in entries):
        raise BadInput(f"{m.path}: is a TorchScript archive (torch.jit.save), read by the torchscript reader: give "
                       "the file itself as SRC, or --from torchscript")
    return load_zip(m, allow, budget=budget, unlisted=unlisted, entries=entries)


def archive_prefix(m, entries) -> str:
    """The folder inside a torch zip archive that holds its one data.pkl (`archive/`, or the stem)."""
    pkl = [n for n in entries if n == "data.pkl" or n.endswith("/data.pkl")]
    if len(pkl) != 1:
        raise BadInput(f"{m.path}: torch zip archive must hold exactly one data.pkl, found {len(pkl)}")
    return pkl[0][:-len("data.pkl")]


def load_zip(m, allow, base=0, length=None, budget=None, unlisted=None, entries=None):
    """Unpickle a torch zip archive at [base, base+length) of `m` (DCP chunks are such archives);
    `entries` if the caller has read them already."""
    try:
        entries = entries if entries is not None else ziparchive.read_entries(m, base, length)
        return _run_zip(m, allow, entries, budget, unlisted)
    finally:
        if m.remote:   # what read_entries fetched and held (ziparchive.HEAD, the end records): let go
            m.release(base, (m.size - base) if length is None else length)


def _run_zip(m, allow, entries, budget, unlisted):
    prefix = archive_prefix(m, entries)
    order = entries.get(prefix + "byteorder")
    said = bytes(ziparchive.read_small(m, order, 16)) if order is not None else b"little"   # (as torch.save wrote it)
    if said not in (b"little", b"big"):   # (torch.load refuses it too)
        raise BadInput(f"{m.path}: {prefix}byteorder says {brief(said, 20)}, not 'little' or 'big'")
    big = said == b"big"
    # The first reference to a storage says what it is (its dtype and size), as for torch.load; later
    # ones get the same. Kept per entry row as a number and a byte, not as a table of Storage records:
    # a million of them, each with its key, would stay in memory to the end of the load.
    claimed, kind, kinds = array("q", [-1]) * len(entries), bytearray(len(entries)), []   # kinds: dtypes seen

    def persistent_load(pid, ctx):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise ctx.unsafe(f"persistent id {brief(pid)} is not a torch storage reference")
        _, stype, key, _location, numel = pid
        if not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
            raise ctx.bad(f"malformed storage reference {brief(pid)}")
        dtype = storage_dtype(stype, ctx)   # (every reference's type is checked, as torch.load reads each)
        row = entries.row(f"{prefix}data/{key}")
        if row is None:
            raise ctx.bad(f"storage {key!r} has no entry data/{key} in the archive")
        offset = entries.offset[row]   # (read from the columns: no Entry, nor its name, per reference)
        if claimed[row] >= 0:
            return Storage(key, kinds[kind[row]], m, offset, claimed[row], big)
        if entries.method[row]:
            raise ctx.bad(f"storage {key!r}: its entry data/{key} is compressed (torch stores tensor data "
                          "uncompressed - was this archive repacked?)")
        nbytes = numel * _itemsize(dtype)
        if nbytes > entries.size[row]:
            raise ctx.bad(f"storage {key!r} needs {nbytes} bytes but its entry holds {entries.size[row]}")
        if dtype not in kinds:   # (a few storage classes: a byte holds their number)
            kinds.append(dtype)
        claimed[row], kind[row] = nbytes, kinds.index(dtype)
        return Storage(key, dtype, m, offset, nbytes, big)

    entry = entries[prefix + "data.pkl"]
    if entry.method:
        raise BadInput(f"{m.path}: its {entry.name} is compressed; torch stores pickles uncompressed, and a "
                       "compressed one could build far more than the file holds (was this archive repacked? "
                       "store it again with `zip -0`)")
    data = ziparchive.read_small(m, entry)
    m.release(entry.offset, entry.span)   # read once for its CRC; the run reads it again, a step at a time
    try:
        return unpickler.load(data, allow, m.path, entry.offset, persistent_load, budget, unlisted, m.release)
    finally:
        m.release(entry.offset, entry.span)  # parsed: its pages go (a DCP checkpoint has one per chunk)


def _load_legacy(m, allow, budget, unlisted=None):
    """Legacy format: magic, protocol, sys_info pickles, the object pickle, the storage-key list pickle,
    then each storage as an int64 element count followed by its bytes."""
    pos = 0
    header = []
    for _ in range(3):
        value, length = unpickler.load_prefix(_pickle_at(m, pos), {}, m.path, pos)
        header.append(value)
        pos += length
    if header[0] != _LEGACY_MAGIC or header[1] != 1001:
        raise BadInput(f"{m.path}: legacy torch file with unknown magic/protocol {brief(header[:2])}")
    sys_info = header[2] if isinstance(header[2], dict) else {}
    if sys_info.get("little_endian") is False:
        raise BadInput(f"{m.path}: big-endian legacy torch files are not supported")
    storages, views = {}, []

    def persistent_load(pid, ctx):
        if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage"):
            raise ctx.unsafe(f"persistent id {brief(pid)} is not a torch storage reference")
        _, stype, key, _location, numel, view = pid
        dtype = storage_dtype(stype, ctx)
        if not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
            raise ctx.bad(f"malformed legacy storage reference {brief(pid)}")
        item = _itemsize(dtype)
        root = storages.setdefault(key, Storage(key, dtype, m, -1, numel * item))
        if view is None:
            return root
        if not (isinstance(view, tuple) and len(view) == 3 and isinstance(view[0], str)
                and all(type(v) is int and v >= 0 for v in view[1:])):
            raise ctx.bad(f"malformed storage view {brief(view)}")
        vkey, voffset, vsize = view
        sub = Storage(vkey, dtype, m, -1, vsize * item)
        views.append((sub, root, voffset * item))
        return sub

    obj, length = unpickler.load_prefix(_pickle_at(m, pos), allow, m.path, pos, persistent_load, budget=budget,
                                        unlisted=unlisted)
    pos += length
    keys, length = unpickler.load_prefix(_pickle_at(m, pos), {}, m.path, pos)
    pos += length
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or set(keys) != set(storages):
        raise BadInput(f"{m.path}: legacy storage key list does not match the storages the pickle uses")
    # Each storage follows the last, after its element count: where each lies follows from the sizes
    # the pickle gave, so the counts are read in one batch (files.read_ranges), then checked in order.
    places, beyond = [], None
    for key in keys:
        st = storages[key]
        try:
            m.check(pos, 8, f"storage {key!r} header")
            m.check(pos + 8, st.nbytes, f"storage {key!r}")
        except BadInput as e:
            beyond = e   # (raised once the counts before it are checked)
            break
        places.append((key, pos))
        pos += 8 + st.nbytes
    counts = storage.read_ranges(m, ((at, 8) for _, at in places))
    try:
        for (key, at), head in zip(places, counts):
            numel = struct.unpack_from("<q", head, 0)[0]
            st = storages[key]
            if numel < 0 or numel * _itemsize(st.dtype) != st.nbytes:
                raise BadInput(f"{m.path}: storage {key!r} at offset {at} holds {numel} elements, "
                               f"the pickle expects {st.nbytes // _itemsize(st.dtype)}")
            st.offset = at + 8
    finally:
        counts.close()
    if beyond is not None:
        raise beyond
    for sub, root, off in views:
        if off + sub.nbytes > root.nbytes:
            raise BadInput(f"{m.path}: storage view {sub.key!r} lies outside its storage {root.key!r}")
        sub.offset = root.offset + off
    return obj


FIRST_FETCH = 64 << 10      # an object's legacy pickle: fetched this much first, then twice as much each time
MAX_FETCH_STEP = 64 << 20


def _pickle_at(m, pos: int):
    """The buffer the pickle at `pos` of a legacy torch file is run from: the rest of a local file's
    mapping; for an object, its bytes fetched front to back as far as the pickle's STOP
    (memo.pickle_end steps over the opcodes), then copied out of the mapping and let go (a
    pickle's payloads stay views of what the VM ran). A pickle the VM will refuse before its end, or
    one cut short by the end of the object, is run from the mapping as a local one is (the same
    error, at the same offset)."""
    if not m.remote:
        return m.view[pos:]
    held, step, state, at, resume = pos, FIRST_FETCH, "short", pos, pos
    while state == "short" and held < m.size and at <= m.size:   # (past the end: the VM says it is truncated)
        end = min(m.size, max(at, held + step))
        m.need(held, end - held)
        held, step = end, min(2 * step, MAX_FETCH_STEP)
        state, at, resume = pickle_end(m.view[:held], resume)
    if state != "stop":
        return m.view[pos:]
    data = m.read(pos, at - pos)
    m.release(pos, held - pos)
    return data


def _itemsize(dtype) -> int:
    """Bytes per element a storage reference counts in: untyped storages (None) count bytes."""
    if dtype is None:
        return 1
    return dtype.itemsize


READER = register(Reader(NAME, "torch.save files (.pt/.pth/.bin/.ckpt, zip or legacy) and HF .bin shard directories",
                         detect, load, priority=40, parses_pickles=True, suffixes=(".bin", ".pt", ".pth", ".ckpt", ".pth.tar", ".pt.tar"),
                         fuzz=(("input.pt", None),),
                         looks_for="a torch.save file (a zip holding data.pkl, or the legacy magic number), "
                         "*.bin.index.json, *.pt.index.json, or a directory holding one, or one torch file named "
                         + ", ".join("*" + s for s in TORCH_SUFFIXES)))
