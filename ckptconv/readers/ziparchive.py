"""A strict reader for the zip archives torch.save and torch.jit.save write, over a mapped file.

Only what torch produces is accepted: no encryption, unique relative names, local headers that agree
with the central directory, data inside the file and not overlapping. Each entry's data offset is
computed from its local header, so stored entries (all tensor data) can be views of the mapping.
torch.jit.save deflates its `code/` entries: an archive may hold compressed entries, and one is
refused only if it is read, and then inflated no further than its declared size and a fixed ratio.
Pickles are read only stored (as torch writes them): an inflated pickle would build objects in
proportion to its inflated size, not to the bytes in the file.

The file is reached through storage/files.py, so an archive in an object store is read the same way
in a few ranged reads: its last 64 KiB (the end records, and the central directory when it lies
there, else one more read for it) and its first HEAD bytes (a torch archive's data.pkl and first
local headers), then what those do not hold: the other local headers in a batch
(files.read_ranges: headers near each other share a GET), each small entry read whole
(`read_small`). An archive of up to 64 KiB (a DCP chunk) is one read. Those bytes are held until the
reader of the entries lets them go (`torch_pickle.load_zip`); tensor data stays where it is.
"""
import re
import struct
import zlib
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..errors import BadInput
from ..storage import files as storage

_EOCD, _EOCD64, _LOC64, _CEN, _LOC = 0x06054B50, 0x06064B50, 0x07064B50, 0x02014B50, 0x04034B50


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    offset: int   # of the data, in the file
    size: int     # once inflated (stored entries: as stored)
    crc: int
    method: int = 0   # 0 stored, 8 deflated
    stored: int = -1  # bytes in the file (compressed size); -1: same as size

    @property
    def span(self) -> int:
        return self.size if self.stored < 0 else self.stored


INFLATE_RATIO = 64       # the most an entry may inflate to, per byte in the file (beyond 1 MiB)
HEAD = 64 << 10          # an archive in an object store: its first bytes, fetched with its end records


def is_zip(mapped) -> bool:
    return mapped.size >= 4 and mapped.read(0, 4) == b"PK\x03\x04"


def read_entries(mapped, base=0, length=None, kind="torch zip archive") -> "Entries":
    """Parse the archive in [base, base+length) of `mapped`; returns its Entries (name -> Entry, in
    file order). `kind` names the archive in errors."""
    d = _central(mapped, base, length, kind)
    if mapped.remote:   # the archive's first bytes too (torch's: data.pkl, byteorder, the first local headers)
        mapped.need(base, min(d.length, HEAD))
    entries = _directory(d, mapped)
    if not mapped.remote:   # (an object's are held for whoever reads the entries, who lets them go)
        first = min(d.tail_start, d.cd_offset)
        mapped.release(base + first, d.length - first)  # the directory and the end record: read, let go

    offsets = np.frombuffer(entries.offset, np.int64)
    ends = offsets + np.where(np.frombuffer(entries.stored, np.int64) < 0, np.frombuffer(entries.size, np.int64),
                              np.frombuffer(entries.stored, np.int64))
    order = np.argsort(offsets, kind="stable")
    clash = np.flatnonzero(ends[order[:-1]] > offsets[order[1:]] - 30)
    if len(clash):
        a, b = (int(order[clash[0]]), int(order[clash[0] + 1]))
        raise d.bad(f"entries {entries.name_of(a)!r} and {entries.name_of(b)!r} overlap")
    if len(order) and ends[order[-1]] > base + d.cd_offset:
        raise d.bad(f"entry {entries.name_of(int(order[-1]))!r} overlaps the central directory")
    return entries


_NUMBERED = re.compile(r"(.*/)?data/(0|[1-9][0-9]{0,17})")   # torch's storages: PREFIX/data/0, /1, ...


class Entries(Mapping):
    """An archive's {name: Entry}, in file order, kept as columns (array.array): a torch archive of a
    million storages names them `PREFIX/data/0`, `/1`, ... and those rows are found by their number
    in a dense table, with no string or record per entry (about 50 bytes each, against about 270 as
    a dict of records: docs/benchmarks.md, "Fourth pass"). Other names are kept in a dict. An Entry
    is made when it is asked for."""

    def __init__(self):
        self.offset, self.size, self.stored = array("q"), array("q"), array("q")
        self.crc, self.method, self.number = array("L"), array("B"), array("q")   # number: -1 for a named row
        self._named, self._prefix, self._dense = {}, None, array("q")   # name -> row; PREFIX; number -> row or -1
        self._unnumbered = {}   # row -> name, for every row not found by number

    def add(self, name: str, offset: int, size: int, crc: int, method: int = 0, stored: int = -1):
        """Append the next entry; ValueError if its name is taken."""
        if self.row(name) is not None:
            raise ValueError(name)
        row = len(self.offset)
        numbered = _NUMBERED.fullmatch(name)
        number = -1
        if numbered is not None and numbered[1] is not None and (self._prefix is None or numbered[1] == self._prefix):
            self._prefix, number = numbered[1], int(numbered[2])
            if number > 4 * (row + 1) + 1024:   # sparse numbers would make a table larger than the archive
                number = -1
        if number >= 0:
            if number >= len(self._dense):
                self._dense.extend(array("q", [-1]) * (max(number + 1, 2 * len(self._dense)) - len(self._dense)))
            self._dense[number] = row
        else:
            self._named[name] = row
            self._unnumbered[row] = name
        self.offset.append(offset)
        self.size.append(size)
        self.stored.append(stored)
        self.crc.append(crc)
        self.method.append(method)
        self.number.append(number)

    def name_of(self, row: int) -> str:
        number = self.number[row]
        return self._unnumbered[row] if number < 0 else f"{self._prefix}data/{number}"

    def row(self, name) -> int | None:
        """The row of entry `name` (0, 1, ... in file order), or None."""
        row = self._named.get(name)
        if row is None and self._prefix is not None and isinstance(name, str) and name.startswith(self._prefix) \
                and (numbered := _NUMBERED.fullmatch(name)) is not None and numbered[1] == self._prefix:
            number = int(numbered[2])
            if number < len(self._dense) and self._dense[number] >= 0:
                row = self._dense[number]
        return row

    def entry(self, row: int) -> Entry:
        return Entry(self.name_of(row), self.offset[row], self.size[row], self.crc[row], self.method[row],
                     self.stored[row])

    def __getitem__(self, name) -> Entry:
        row = self.row(name)
        if row is None:
            raise KeyError(name)
        return self.entry(row)

    def __contains__(self, name) -> bool:
        return self.row(name) is not None

    def __iter__(self):
        for row in range(len(self.offset)):
            yield self.name_of(row)

    def __len__(self) -> int:
        return len(self.offset)


class _Directory(NamedTuple):
    view: memoryview   # of the archive
    base: int          # its offset in the file
    length: int
    tail_start: int    # where the search for the end record began
    count: int
    cd_size: int
    cd_offset: int     # in the archive
    bad: object        # message -> the BadInput that names the file


def _central(mapped, base, length, kind="torch zip archive") -> _Directory:
    """Where the central directory of the archive in [base, base+length) of `mapped` lies, checked."""
    length = mapped.size - base if length is None else length
    path = mapped.path
    if base < 0 or length < 22 or base + length > mapped.size:
        raise BadInput(f"{path}: zip archive at offset {base} is truncated")
    view = mapped.view[base:base + length]

    def bad(msg):
        return BadInput(f"{path}: not a valid {kind}: {msg}")

    tail_start = max(0, length - 22 - 65535)
    mapped.need(base + tail_start, length - tail_start)   # (an object's: one ranged read)
    tail = bytes(view[tail_start:])
    at = tail.rfind(struct.pack("<I", _EOCD))
    if at < 0:
        raise bad("end of central directory not found (truncated file?)")
    eocd = tail_start + at
    if eocd + 22 > length:
        raise bad("end of central directory record is truncated")
    (_, disk, cd_disk, _, count, cd_size, cd_offset, _) = struct.unpack_from("<IHHHHIIH", view, eocd)
    if disk or cd_disk:
        raise bad("multi-disk archives are not supported")
    if 0xFFFF in (count,) or 0xFFFFFFFF in (cd_size, cd_offset):
        loc = eocd - 20
        if loc >= 0:
            mapped.need(base + loc, 20)
        if loc < 0 or struct.unpack_from("<I", view, loc)[0] != _LOC64:
            raise bad("ZIP64 end-of-directory locator missing")
        z64 = struct.unpack_from("<Q", view, loc + 8)[0]
        if z64 + 56 <= length:
            mapped.need(base + z64, 56)
        if z64 + 56 > length or struct.unpack_from("<I", view, z64)[0] != _EOCD64:
            raise bad("ZIP64 end of central directory record missing or out of bounds")
        count, cd_size, cd_offset = struct.unpack_from("<QQQ", view, z64 + 32)
    if cd_offset + cd_size > length:
        raise bad(f"central directory ({cd_size} bytes at {cd_offset}) lies beyond the end of the file")
    if count > cd_size // 46 + 1:
        raise bad(f"central directory claims {count} entries in {cd_size} bytes")
    mapped.need(base + cd_offset, cd_size)   # (held already when it lies in the tail)
    return _Directory(view, base, length, tail_start, count, cd_size, cd_offset, bad)


def names(mapped, kind="torch zip archive"):
    """The entry names of a zip archive in `mapped`, from its central directory alone, in order: for
    telling formats apart (a torch.save archive from a TorchScript one) without the per-entry checks
    and records of `read_entries` (a million-tensor archive: a second each). BadInput if malformed."""
    d = _central(mapped, 0, None, kind)
    for record in _records(d):
        yield _name(record, d.bad)


def _records(d: "_Directory"):
    """The central directory's records, each (its offset, flags, method, crc, compressed size, size,
    name bytes, extra bytes, local header offset), bounds-checked against the directory."""
    view, pos, end, bad = d.view, d.cd_offset, d.cd_offset + d.cd_size, d.bad
    for _ in range(d.count):
        if pos + 46 > end or struct.unpack_from("<I", view, pos)[0] != _CEN:
            raise bad(f"central directory entry at offset {d.base + pos} is malformed")
        (flags, method, crc, csize, usize, nlen, xlen, clen, hdr) = (
            struct.unpack_from("<H", view, pos + 8)[0], struct.unpack_from("<H", view, pos + 10)[0],
            *struct.unpack_from("<IIIHHH", view, pos + 16), struct.unpack_from("<I", view, pos + 42)[0])
        if pos + 46 + nlen + xlen + clen > end:
            raise bad(f"central directory entry at offset {d.base + pos} overruns the directory")
        yield (pos, flags, method, crc, csize, usize, bytes(view[pos + 46:pos + 46 + nlen]),
               bytes(view[pos + 46 + nlen:pos + 46 + nlen + xlen]), hdr)
        pos += 46 + nlen + xlen + clen


def _name(record, bad) -> str:
    raw_name = record[6]
    try:
        return raw_name.decode("utf-8")
    except UnicodeDecodeError:
        raise bad(f"entry name {raw_name!r} is not UTF-8") from None


def _directory(d: "_Directory", mapped) -> dict:
    """The central directory's entries, each checked against its local header. Local headers lie one
    before each entry's data, all over the file: they are read with pread, not through the mapping
    (touching one page of a mapping can map a whole 2 MiB folio of the page cache: one per tensor),
    and from an object in a batch of concurrent GETs (files.read_ranges) a bounded window ahead."""
    if mapped.remote:
        headers = storage.read_ranges(mapped, _local_ranges(d))
        try:
            return _checked(d, lambda offset, n: next(headers))
        finally:
            headers.close()   # (its GETs ahead)
    with mapped.reader() as fill_at:
        def header_at(offset, n):
            local = bytearray(n)
            fill_at(memoryview(local), offset)
            return local
        return _checked(d, header_at)


def _checked(d: "_Directory", header_at) -> "Entries":
    """The entries, each checked against its local header, `header_at(offset, length)`'s bytes."""
    entries, base, length, bad = Entries(), d.base, d.length, d.bad
    for record in _records(d):
        _, flags, method, crc, csize, usize, raw_name, extra, hdr = record
        nlen = len(raw_name)
        name = _name(record, bad)
        usize, csize, hdr = _zip64(extra, usize, csize, hdr, bad, name)
        if name.startswith(("/", "\\")) or ".." in name.replace("\\", "/").split("/") or ":" in name:
            raise bad(f"entry name {name!r} is absolute or escapes the archive")
        if flags & 0x1:
            raise bad(f"entry {name!r} is encrypted")
        if method == 0 and csize != usize:
            raise bad(f"entry {name!r} is stored but its sizes differ ({csize} != {usize})")
        if hdr + 30 + nlen > length:
            raise bad(f"entry {name!r}: local header at offset {base + hdr} is missing")
        local = header_at(base + hdr, 30 + nlen)
        signature, lmethod = struct.unpack_from("<IxxxxH", local, 0)
        lnlen, lxlen = struct.unpack_from("<HH", local, 26)
        if signature != _LOC:
            raise bad(f"entry {name!r}: local header at offset {base + hdr} is missing")
        if lnlen != nlen or bytes(local[30:]) != raw_name or lmethod != method:
            raise bad(f"entry {name!r}: local header disagrees with the central directory")
        data = hdr + 30 + lnlen + lxlen
        if data + csize > length:
            raise bad(f"entry {name!r} claims {csize} bytes at offset {base + data}, beyond the end of the file "
                      "(truncated?)")
        try:
            entries.add(name, base + data, usize, crc, method, -1 if method == 0 else csize)
        except ValueError:
            raise bad(f"entry {name!r} appears twice") from None
    return entries


def _local_ranges(d: "_Directory"):
    """(offset, length) of each entry's local header that `_directory` reads, in the same order, for
    the entries it gets to; read ahead of it, so what is wrong is left for it to find, in order."""
    records = _records(d)
    while True:
        try:
            _, _, _, _, csize, usize, raw_name, extra, hdr = next(records)
            hdr = _zip64(extra, usize, csize, hdr, d.bad, "")[2]
        except (BadInput, StopIteration):
            return
        if hdr + 30 + len(raw_name) > d.length:
            return
        yield d.base + hdr, 30 + len(raw_name)


def _zip64(extra, usize, csize, hdr, bad, name):
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4:pos + 4 + size]
        if tag == 0x0001:
            fields, k = [], 0
            for present in (usize == 0xFFFFFFFF, csize == 0xFFFFFFFF, hdr == 0xFFFFFFFF):
                if present:
                    if k + 8 > len(body):
                        raise bad(f"entry {name!r}: ZIP64 extra field is too short")
                    fields.append(struct.unpack_from("<Q", body, k)[0])
                    k += 8
                else:
                    fields.append(None)
            usize = fields[0] if fields[0] is not None else usize
            csize = fields[1] if fields[1] is not None else csize
            hdr = fields[2] if fields[2] is not None else hdr
        pos += 4 + size
    if 0xFFFFFFFF in (usize, csize, hdr):
        raise bad(f"entry {name!r} needs a ZIP64 extra field that is missing")
    return usize, csize, hdr


def read_small(mapped, entry: Entry, limit=1 << 31):
    """An entry's bytes, CRC-checked: for pickles and small metadata, not tensor data. A stored entry
    is a view of the mapping; a deflated one is inflated into memory, no further than its declared
    size, `limit` and INFLATE_RATIO times its bytes in the file (so memory follows the bytes present)."""
    if entry.size > limit:
        raise BadInput(f"{mapped.path}: entry {entry.name!r} is unexpectedly large ({entry.size} bytes)")
    if entry.method == 0:
        data = storage.buffer(mapped, entry.offset, entry.size)   # (an object's: fetched now, bytes)
    elif entry.method == 8:
        data = _inflate(mapped, entry)
    else:
        raise BadInput(f"{mapped.path}: entry {entry.name!r} is compressed with method {entry.method}; only "
                       "stored and deflated entries can be read")
    if zlib.crc32(data) != entry.crc:
        raise BadInput(f"{mapped.path}: entry {entry.name!r} fails its CRC check (corrupt file)")
    return data


def _inflate(mapped, entry: Entry) -> bytes:
    if entry.size > INFLATE_RATIO * entry.stored + (1 << 20):
        raise BadInput(f"{mapped.path}: entry {entry.name!r} claims to inflate from {entry.stored} to {entry.size} "
                       f"bytes (over {INFLATE_RATIO}x); refused")
    inflater = zlib.decompressobj(-15)
    try:
        data = inflater.decompress(storage.buffer(mapped, entry.offset, entry.stored), entry.size + 1)
    except zlib.error as e:
        raise BadInput(f"{mapped.path}: entry {entry.name!r} does not inflate ({e})") from None
    if len(data) != entry.size or not inflater.eof or inflater.unused_data:
        raise BadInput(f"{mapped.path}: entry {entry.name!r} does not inflate to exactly the {entry.size} bytes its "
                       "header declares (corrupt file)")
    return data
