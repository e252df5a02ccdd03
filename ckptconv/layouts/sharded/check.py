"""A sharded directory ckptconv wrote, checked against its own records: its shards, index, manifest.json
and SHA256SUMS agreeing, every file and tensor digest as recorded, nothing unlisted (`verify_dir`;
also each rank directory of a reshard output)."""
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from ... import signals
from ...errors import brief
from ...limits import MAX_NDIM
from ...formats.sums import NAME as SUMS
from ...formats.manifest import MANIFEST
from ..report import Report

SHARD_METADATA = {"format": "pt"}   # a shard's whole __metadata__ (docs/output.md)
from ..scan import _kind, _read_meta, _regular, _scan, _sha256_regular
from ..shardcheck import _hash_shard, _library_view, _our_view, _parsed


def verify_dir(d: Path, report: Report, progress=None, hash_only=None, structural=True, sums=None, plain=False):
    """Check one output directory. `hash_only` limits the (expensive) hashing to some shards;
    `structural=False` skips everything else (another process of a multi-process run does it);
    `sums`: the directory's files as an enclosing output's SHA256SUMS lists them (scan._read_meta);
    `plain`: a convert output, not a rank directory of a reshard output."""
    consumer = _check_dir(d, report, progress, hash_only, structural, sums, plain)
    # last, once the directory's tables are let go: the library's own table of a header is about
    # 0.7 KB per tensor (1 KB at its peak), and is never held beside ours
    for path, ours in consumer:
        signals.check()
        _library_view(path, ours, report)


def _check_dir(d: Path, report: Report, progress, hash_only, structural, sums=None, plain=False) -> list:
    """Every check of verify_dir but the safetensors library's; returns the shards that check is
    still owed, as [(path, _our_view of its header)]."""
    found = report if structural else Report()  # what every process would find alike: reported once
    meta = _dir_meta(d, found, sums, plain)
    located, differs, consumer = _check_shards(meta, found, report, progress, hash_only, structural)
    if not structural:
        return []
    _check_tensors_listed(meta, located, differs, report)
    report.tensors += len(located)
    _check_other_files(meta, report)
    return consumer


@dataclass(frozen=True)
class _DirMeta:
    """What an output directory's own metadata lists, for _check_dir's steps: its entries (lstat), its
    index (no index: weight_map and index_names None), manifest.json's files and tensors and SHA256SUMS
    (empty when unreadable: `manifest_ok`, `sums_ok` say whether they were read), and its shards."""

    d: Path
    entries: dict
    index: str
    weight_map: dict | None
    index_names: object
    m_files: dict
    m_tensors: dict
    sums: dict
    manifest_ok: bool
    sums_ok: bool
    shard_names: list


def _dir_meta(d: Path, found: Report, given=None, plain=False) -> _DirMeta:
    entries = _scan(d, found)
    index, weight_map, index_names, m_files, m_tensors, sums = _read_meta(d, entries, found, given, plain)
    manifest_ok = m_files is not None
    m_files, m_tensors, sums_ok = m_files or {}, m_tensors or {}, sums is not None
    sums = sums or {}
    shard_names = sorted(set((weight_map or {}).values()) | {f for f in (*m_files, *sums) if f.endswith(".safetensors")})
    return _DirMeta(d, entries, index, weight_map, index_names, m_files, m_tensors, sums, manifest_ok, sums_ok,
                    shard_names)


def _check_shards(meta: _DirMeta, found: Report, report: Report, progress, hash_only, structural):
    """Each shard's header (tensors in one shard only) and, for those in `hash_only`, its digests.
    Returns ({tensor: file}, {tensor: (dtype code, shape)} of those whose dtype or shape is not what
    the manifest says, [(shard path, our view's digest)] for the library's check). What is kept of a
    tensor is its name, interned as the index's and the manifest's are, and its shard's name: a
    million of them are held at once."""
    d, entries, m_files, m_tensors, sums = meta.d, meta.entries, meta.m_files, meta.m_tensors, meta.sums
    located, differs, consumer = {}, {}, []   # tensor -> file; tensor -> (dtype, shape); (shard, view digest)
    for shard in meta.shard_names:
        signals.check()
        path = d / shard
        if shard not in entries:
            found.add(path, "shard is missing", "missing")
            continue
        if not _regular(entries, shard):
            continue  # never opened; the directory check below reports what it is
        parsed = _parsed(path, found)
        if parsed is None:
            continue
        m, header = parsed
        if structural and not header.problems:
            consumer.append((path, _our_view(header)))   # checked at the end (_library_view)
        if header.metadata != SHARD_METADATA:   # (what ckptconv writes in every shard of a directory)
            shown = dict(sorted(header.metadata.items())) if isinstance(header.metadata, dict) else header.metadata
            found.add(path, f"__metadata__ is {brief(shown, 120)}, not {SHARD_METADATA} as ckptconv "
                            "writes it", "metadata")
        for e in header.entries:
            if e.name in located:
                found.add(path, f"tensor {e.name!r} also appears in {located[e.name]}", "misplaced", tensor=e.name)
                continue
            located[sys.intern(e.name)] = shard
            said = m_tensors.get(e.name)
            if said is not None and (said.dtype != e.dtype.code or said.shape != e.shape):
                differs[e.name] = (e.dtype.code, e.shape)   # (reported in the manifest's order, below)
        if hash_only is None or shard in hash_only:
            _hash_shard(m, header, shard, m_files, lambda name: getattr(m_tensors.get(name), "sha256", None), sums,
                        report, progress)
            report.files += 1
    return located, differs, consumer


def _check_tensors_listed(meta: _DirMeta, located: dict, differs: dict, report: Report):
    """The tensors in the shards (`located`) are those the index and manifest.json list, where they
    list them, with the dtype and shape the manifest says (`differs`: those that have another)."""
    d, index, m_tensors = meta.d, meta.index, meta.m_tensors
    for name, file in (meta.weight_map or {}).items():
        if name not in located:
            report.add(d / index, f"tensor {name!r} is listed in the index (in {file}) but is in no shard",
                       "missing", tensor=name)
        elif located[name] != file:
            report.add(d / index, f"tensor {name!r} is listed in {file} but is in {located[name]}",
                       "misplaced", tensor=name)
    for name, file in located.items():
        if meta.index_names is not None and name not in meta.index_names:
            report.add(d / file, f"tensor {name!r} is in the shard but missing from the index", "unlisted", tensor=name)
        if meta.manifest_ok and name not in m_tensors:
            report.add(d / file, f"tensor {name!r} is in the shard but missing from manifest.json",
                       "unlisted", tensor=name)
    for name, entry in m_tensors.items():
        if name not in located:
            report.add(d / MANIFEST, f"tensor {name!r} is in the manifest but in no shard", "missing", tensor=name)
            continue
        if entry is None:
            continue  # malformed: reported
        file = located[name]
        if name in differs:
            code, shape = differs[name]
            report.add(d / file, f"tensor {name!r} is {code}{list(shape)}, the manifest says "
                                 f"{_as_said(entry.dtype, entry.shape)}", "metadata", tensor=name)
        if entry.file != file:
            report.add(d / file, f"tensor {name!r} is here, the manifest says {entry.file}",
                       "misplaced", tensor=name)


def _check_other_files(meta: _DirMeta, report: Report):
    """The files besides the shards: each listed one present with its recorded digest, manifest.json
    and SHA256SUMS listing the same files, and every entry a regular file that one of them lists."""
    d, entries, m_files, sums = meta.d, meta.entries, meta.m_files, meta.sums
    listed = set(sums) | set(m_files) | set(meta.shard_names)
    for name in sorted(listed - set(meta.shard_names)):
        path = d / name
        if name not in entries:
            report.add(path, "listed in the manifest or SHA256SUMS but missing", "missing")
            continue
        digest = _sha256_regular(path) if _regular(entries, name) else None
        if digest is None:
            continue  # not a regular file: reported below, never opened
        if m_files.get(name) is not None and m_files[name]["sha256"] != digest:
            report.add(path, "sha256 differs from manifest.json", "digest")
        if name in sums and sums[name] != digest:
            report.add(path, "sha256 differs from SHA256SUMS", "digest")
    if meta.sums_ok:
        if MANIFEST not in sums:
            report.add(d / SUMS, "does not list manifest.json", "unlisted")
        for name in sorted(set(m_files) - set(sums)):
            report.add(d / name, "listed in manifest.json but not in SHA256SUMS", "unlisted")
        if meta.manifest_ok:
            for name in sorted(set(sums) - set(m_files) - {MANIFEST}):
                report.add(d / name, "listed in SHA256SUMS but not in manifest.json", "unlisted")
    for name, st in sorted(entries.items()):
        if not stat.S_ISREG(st.st_mode):
            report.add(d / name, f"is {_kind(st)}; an output directory holds only regular files (not followed)",
                       "not-regular")
        elif name != SUMS and name not in listed:
            report.add(d / name, "file is not listed in SHA256SUMS or the manifest", "unlisted")


def _as_said(dtype: str, shape) -> str:
    """A dtype and shape as manifest.json says them, for a problem line: as written where they could
    be a tensor's, else bounded (a manifest may say a megabyte of dtype or a 4,000-digit size)."""
    said = dtype if len(dtype) <= 16 else brief(dtype, 16)
    if len(shape) <= MAX_NDIM and all(n.bit_length() <= 64 for n in shape):
        return f"{said}{list(shape)}"
    return said + brief(list(shape))
