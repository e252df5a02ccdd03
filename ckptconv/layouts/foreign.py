"""Safetensors outputs ckptconv did not write (save_pretrained, the Hub's conversion bot): their headers,
what the safetensors library sees, each tensor in one place, and the index against the headers; no
digests were recorded, so none are checked. A layout ckptconv checks and reads, never writes (a
single such file is the single layout's to check: it finds no records in its header)."""
from pathlib import Path

from ..formats import manifest as manifest_format
from ..storage import files as storage
from .base import Layout, register
from .report import Report
from .scan import _document, _kind, _regular, _scan
from .shardcheck import _library_view, _our_view, _parsed


FOREIGN_NOTE = ("written without ckptconv's manifest: no file or tensor digests are recorded, so they were not "
                "checked; headers, the index and what the safetensors library sees were"
                + "; use --against SRC to compare every tensor with its source")


def _verify_foreign_files(where: Path, files: list, weight_map: dict, report: Report):
    """Safetensors files ckptconv did not write (save_pretrained, the Hub's conversion bot): their
    headers, what the safetensors library sees, each tensor once, and the index (when there is one)
    against the headers. What only a manifest could prove is listed in `report.notes`."""
    report.notes.append(f"{where}: {FOREIGN_NOTE}")
    report.foreign = True
    located = {}
    for path in files:
        parsed = _parsed(path, report)
        if parsed is None or parsed[1].problems:
            continue
        m, header = parsed
        _library_view(path, _our_view(header), report)
        for e in header.entries:
            if e.name in located:
                report.add(path, f"tensor {e.name!r} also appears in {located[e.name]}", "misplaced", tensor=e.name)
            located[e.name] = path.name
        report.files += 1
        report.bytes += m.size
        m.release(0, m.size)
    for name, file in weight_map.items():
        if located.get(name) != file:
            report.add(where, f"tensor {name!r} is listed in {file} but is "
                              + (f"in {located[name]}" if name in located else "in no file"),
                              "misplaced" if name in located else "missing", tensor=name)
    for name, file in located.items():
        if weight_map and name not in weight_map:
            report.add(where, f"tensor {name!r} is in {file} but missing from the index", "unlisted", tensor=name)
    report.tensors += len(located)


def _verify_foreign_dir(path: Path, report: Report, progress=None):
    """A directory of safetensors files without ckptconv's manifest: its one index and the files it
    names, or every .safetensors file in it."""
    entries = _scan(path, report)
    indexes = sorted(n for n in entries if n.endswith(manifest_format.INDEX_SUFFIX) and not n.startswith("."))
    weight_map = {}
    if len(indexes) > 1:
        report.add(path, f"holds {len(indexes)} indexes ({', '.join(indexes[:4])})", "metadata")
        return
    if indexes and not _regular(entries, indexes[0]):
        report.add(path / indexes[0], f"is {_kind(entries[indexes[0]])}; an index is a regular file (not followed)",
                   "not-regular")
        return
    if indexes:
        weight_map, _, problems = (_document(path, indexes[0], entries, report, "the index",
                                             manifest_format.read_index) or ({}, None, []))
        for p in problems:
            report.add(path / indexes[0], p, "metadata")
        names = sorted(set((weight_map or {}).values()))
        for n in sorted(n for n in entries if n.endswith(".safetensors") and n not in names):
            report.add(path / n, "is not in the index: a consumer following the index never loads it", "unlisted")
    else:
        names = sorted(n for n in entries if n.endswith(".safetensors") and not n.startswith("."))
    for n in names:
        if n not in entries:
            report.add(path / n, "listed in the index but missing", "missing")
        elif not _regular(entries, n):
            report.add(path / n, f"is {_kind(entries[n])}; not followed", "not-regular")
    _verify_foreign_files(path, [path / n for n in names if _regular(entries, n)], weight_map or {}, report)


@register("foreign")
class ForeignDirectory(Layout):
    order = 90   # (last: a directory of safetensors files with none of ckptconv's records)

    @classmethod
    def detect(cls, path) -> bool:
        path = storage.place(path)
        return path.is_dir() and any(n.endswith((".safetensors", manifest_format.INDEX_SUFFIX))
                                     for n in storage.listdir(path))

    @classmethod
    def check(cls, path, report, progress=None, share=None):
        _verify_foreign_dir(storage.place(path), report, progress)

    def plan(self, tensors) -> list:
        raise NotImplementedError("ckptconv writes its own outputs, with their records, never this layout")
