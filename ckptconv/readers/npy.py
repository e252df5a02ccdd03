"""Reader for numpy's own files: `.npy` (one array) and `.npz` (a zip of `.npy` members, np.savez and
np.savez_compressed), or a directory holding one `.npz` or `.npy` files (docs/formats.md#numpy).

An `.npy` file is a magic string, a version, a header — a Python dict literal, `{'descr': '<f4',
'fortran_order': False, 'shape': (3, 4), }` — and the array's bytes. The header is parsed here by a
strict grammar of exactly that (a dict of three known keys whose values are a short string, True or
False, and a tuple of integers), never by eval or ast. A stored array is a view of the mapped file
(big-endian and Fortran-ordered ones as strided views, read in bounded blocks like torch's); a
deflated `.npz` member is inflated, when its tensor is first read, into an unlinked temporary file
that is then mapped, to exactly its declared size, and all of a file's deflated members to at most
INFLATE_RATIO times its bytes plus INFLATE_SLACK. Object arrays (`allow_pickle`) are never unpickled.
Files are reached through storage/files.py: from an object store, an .npy costs one ranged read for
its header, an .npz its zip metadata (ziparchive.py) and its stored members' headers in one batch; a
deflated member is fetched front to back as it is inflated.
"""
import math
import re
import struct
import tempfile
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

from .. import dtypes
from ..errors import BadInput, OutputError, printable
from ..io.spill import SpillFile
from ..storage import files as storage
from ..limits import MAX_NDIM, shape_problem
from ..checkpoint import Checkpoint, SourceFacts
from ..tensor import MappedView, Strided, TensorSource
from . import ReadOptions, confined, inside, model_files, source_root, wanted
from . import ziparchive
from .base import Reader, register

NAME = "numpy"
MAGIC = b"\x93NUMPY"
MAX_HEADER = 10_000          # numpy's own limit on the headers it reads (np.load's max_header_size)
INFLATE_RATIO = 64           # deflated members of a file inflate to at most this times its bytes ...
INFLATE_SLACK = 64 << 20     # ... plus this
_PIECE = 1 << 20             # inflated and written a MiB at a time
HEAD_FETCH = 64 << 10        # a deflated member's first bytes: fetched from an object this much at a time
_ARCHIVE = "numpy .npz archive"

# The header grammar's tokens; each alternative is bounded by the header's length, and the scan is linear.
_TOKEN = re.compile(r"[ \t]*(?:([{}(),:])|'([^'\\\n]*)'|\"([^\"\\\n]*)\"|(True|False)|([0-9]{1,20})L?)")
_DESCR = re.compile(r"([<>|=]?)([biufcOSUVMm?])([0-9]{0,10})(\[[A-Za-z0-9]{1,8}\])?")
_KEYS = ("descr", "fortran_order", "shape")


@dataclass(frozen=True)
class Header:
    """What an .npy header says, checked: the dtype (None when safetensors cannot store it: `problem`
    says why), its byte order, the layout, the shape, and where the data starts in the member."""

    dtype: object        # dtypes.DType or None
    big_endian: bool
    fortran: bool
    shape: tuple
    data_start: int      # bytes from the start of the .npy member
    problem: str | None  # why it is not a tensor (object array, strings, complex ...)
    pickled: bool        # an object array: its bytes are a pickle, never read

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize if self.dtype is not None else 0


def preamble(head: bytes, where) -> tuple:
    """(header length, where it starts) from the first 12 bytes of an .npy member."""
    if len(head) < 10 or head[:6] != MAGIC:
        raise BadInput(f"{where}: not an .npy array (no \\x93NUMPY magic)")
    major, minor = head[6], head[7]
    if major not in (1, 2, 3) or minor != 0:
        raise BadInput(f"{where}: .npy format version {major}.{minor}, not 1.0, 2.0 or 3.0")
    if major == 1:
        return struct.unpack_from("<H", head, 8)[0], 10
    if len(head) < 12:
        raise BadInput(f"{where}: .npy preamble is truncated")
    return struct.unpack_from("<I", head, 8)[0], 12


def parse_header(data, size: int, where) -> Header:
    """The header of an .npy member whose first bytes are `data` (at least the preamble and the
    header, when the member holds them) and whose whole size is `size`."""
    length, start = preamble(bytes(data[:12]), where)
    if length > MAX_HEADER:
        raise BadInput(f"{where}: .npy header of {length} bytes, more than the {MAX_HEADER} numpy reads")
    if start + length > min(size, len(data)):
        raise BadInput(f"{where}: .npy header of {length} bytes is truncated ({size} bytes in all)")
    raw = bytes(data[start:start + length])
    if not raw.isascii():
        raise BadInput(f"{where}: .npy header is not ASCII text")
    fields = _fields(raw.decode("ascii"), where)
    descr, fortran, shape = fields["descr"], fields["fortran_order"], fields["shape"]
    if not isinstance(descr, str) or not isinstance(fortran, bool) or not isinstance(shape, tuple):
        raise BadInput(f"{where}: .npy header values have the wrong types (descr a string, fortran_order True or "
                       f"False, shape a tuple): {printable(raw.decode('ascii').strip(), 300)}")
    if len(shape) > MAX_NDIM:
        raise BadInput(f"{where}: shape has {len(shape)} axes, more than the {MAX_NDIM} numpy and safetensors load")
    dtype, big, problem, pickled = _dtype(descr)
    if dtype is not None and shape_problem(shape, dtype.itemsize):
        raise BadInput(f"{where}: {shape_problem(shape, dtype.itemsize)}")
    header = Header(dtype, big, fortran and len(shape) > 1, shape, start + length, problem, pickled)
    if dtype is not None and size - header.data_start != header.nbytes:
        raise BadInput(f"{where}: a {descr} array of shape {list(shape)} needs {header.nbytes} bytes after its header, "
                       f"the member holds {size - header.data_start}")
    return header


def _fields(text: str, where) -> dict:
    """The header's dict, by the grammar `{ 'key': value, ... }` then spaces and one newline, values
    a string, True/False or a tuple of integers (a one-element tuple with its comma), exactly the keys
    descr, fortran_order and shape, each once."""
    t = _Tokens(_tokens(text, where), where)
    fields = {}
    t.take("p", "{")
    while not t.peek("}"):
        key = t.take("s")
        t.take("p", ":")
        if key not in _KEYS or key in fields:
            raise BadInput(f"{where}: .npy header has {'a second' if key in fields else 'an unknown'} key "
                           f"{printable(key, 40)!r} (numpy writes exactly {', '.join(_KEYS)})")
        fields[key] = t.shape() if t.peek("(") else t.value()
        if not t.peek("}"):
            t.take("p", ",")
    t.take("p", "}")
    if t.i != len(t.tokens) or len(fields) != len(_KEYS):
        raise BadInput(f"{where}: .npy header needs exactly the keys {', '.join(_KEYS)}")
    return fields


def _tokens(text: str, where) -> list:
    """The header's tokens: ("p", punctuation), ("s", a string), ("v", True/False or an integer)."""
    if not text.endswith("\n") or not text[:-1].rstrip(" ").endswith("}"):
        raise BadInput(f"{where}: .npy header does not end with '}}' and a newline")
    body = text[:-1].rstrip(" ")
    tokens, pos = [], 0
    while pos < len(body):
        m = _TOKEN.match(body, pos)
        if m is None or m.end() == pos:
            raise BadInput(f"{where}: .npy header is not the dict numpy writes: unexpected "
                           f"{printable(body[pos:pos + 20], 40)!r} at character {pos}")
        punct, s1, s2, word, number = m.groups()
        tokens.append(("p", punct) if punct else ("s", s1 if s1 is not None else s2) if s1 is not None or s2 is not None
                      else ("v", word == "True") if word else ("v", int(number)))
        pos = m.end()
    return tokens


class _Tokens:
    """The header's tokens, read in order."""

    def __init__(self, tokens: list, where):
        self.tokens, self.where, self.i = tokens, where, 0

    def take(self, kind, value=None):
        t, i = self.tokens, self.i
        if i >= len(t) or t[i][0] != kind or (value is not None and t[i][1] != value):
            raise BadInput(f"{self.where}: .npy header is not the dict numpy writes (token {i})")
        self.i += 1
        return t[i][1]

    def peek(self, value) -> bool:
        return self.i < len(self.tokens) and self.tokens[self.i] == ("p", value)

    def value(self):
        """A string, True/False or an integer."""
        if self.i < len(self.tokens) and self.tokens[self.i][0] in ("s", "v"):
            self.i += 1
            return self.tokens[self.i - 1][1]
        raise BadInput(f"{self.where}: .npy header is not the dict numpy writes (token {self.i})")

    def shape(self) -> tuple:
        """A tuple of sizes, a one-element one with its comma."""
        where = self.where
        self.take("p", "(")
        items, comma = [], False
        while not self.peek(")"):
            value = self.take("v")
            if isinstance(value, bool):
                raise BadInput(f"{where}: .npy shape holds {value}, not a size")
            items.append(value)
            comma = self.peek(",")
            if comma:
                self.take("p", ",")
            elif not self.peek(")"):
                raise BadInput(f"{where}: .npy shape is not a tuple of sizes")
        self.take("p", ")")
        if len(items) == 1 and not comma:
            raise BadInput(f"{where}: .npy shape ({items[0]}) is a number, not a tuple")
        return tuple(items)


def _dtype(descr: str) -> tuple:
    """(DType or None, big-endian, why it is not a tensor or None, an object array) for a header's
    descr; structured dtypes (a list) never get here (the grammar has no lists)."""
    m = _DESCR.fullmatch(descr)
    if m is None:
        return None, False, f"dtype {printable(descr, 40)!r} is not one numpy writes for a plain array", False
    order, kind, size, unit = m.groups()
    if kind == "O":
        return None, False, ("an object array (saved with allow_pickle): its bytes are a Python pickle, which "
                             "ckptconv never runs"), True
    what = {"c": "complex", "S": "bytes", "U": "text", "V": "void (raw records; a bfloat16 array numpy saved)",
            "M": "datetime", "m": "timedelta"}.get(kind)
    if what is not None or unit:
        return None, False, f"dtype {descr} ({what or 'with a unit'}) cannot be stored in safetensors", False
    import numpy as np
    try:
        dt = dtypes.from_numpy(np.dtype(order.replace("|", "") + kind + size))
    except (BadInput, TypeError, ValueError):
        return None, False, f"dtype {descr} cannot be stored in safetensors", False
    return dt, order == ">" and dt.itemsize > 1, None, False


# --- where the bytes are -------------------------------------------------------------------------

def _view(name, header: Header, mapped, start: int) -> MappedView:
    """The tensor at `start` of `mapped`: row-major little-endian as it is; Fortran order or
    big-endian as a strided view (read in bounded blocks, byte-swapped by region())."""
    if not header.fortran and not header.big_endian:
        return MappedView(name, header.dtype, header.shape, mapped, start)
    stride, step = [], 1
    for n in (header.shape if header.fortran else reversed(header.shape)):
        stride.append(step)
        step *= n
    stride = tuple(stride) if header.fortran else tuple(reversed(stride))
    return MappedView(name, header.dtype, header.shape, mapped, start,
                      Strided(stride, header.big_endian, (start, header.nbytes)))


class _Spill:
    """The unlinked temporary file a file's deflated members are inflated into, once each."""

    def __init__(self, m):
        self.m, self.lock = m, threading.Lock()
        self.file = SpillFile("ckptconv-npz-", "inflated .npz members")

    def inflate(self, entry, where) -> tuple:
        """(offset, size) in the spill file of the member's inflated bytes: exactly its declared size,
        its CRC checked; the stream is read and written a MiB at a time."""
        start = self.file.begin()
        inflater, size, crc = zlib.decompressobj(-15), 0, 0

        def emit(piece):
            nonlocal size, crc
            if size + len(piece) > entry.size:
                raise BadInput(f"{where}: inflates beyond the {entry.size} bytes its zip entry declares")
            self.file.write(piece, start + size)
            size, crc = size + len(piece), zlib.crc32(piece, crc)

        try:
            for data in storage.pieces(self.m, entry.offset, entry.stored, _PIECE):
                while data and not inflater.eof:
                    emit(inflater.decompress(data, _PIECE))
                    data = inflater.unconsumed_tail
                if inflater.eof:
                    break
            emit(inflater.flush())   # (what one last match left pending: at most 258 bytes)
        except zlib.error as e:
            raise BadInput(f"{where}: does not inflate ({e})") from None
        except OSError as e:
            raise OutputError(f"{tempfile.gettempdir()}: cannot write the inflated {where} to a temporary file: "
                              f"{e.strerror} (set TMPDIR to a larger disk)") from None
        if size != entry.size or not inflater.eof or inflater.unused_data:
            raise BadInput(f"{where}: does not inflate to exactly the {entry.size} bytes its zip entry declares "
                           "(corrupt file)")
        if crc != entry.crc:
            raise BadInput(f"{where}: fails its CRC check (corrupt file)")
        self.file.done(start, size)
        return start, size


class Deflated(TensorSource):
    """A tensor of a deflated .npz member: inflated into the spill file when it is first read, then a
    view of that mapping (as a stored member's is of the file)."""

    def __init__(self, name, header: Header, spill: _Spill, entry, where):
        self.name, self.dtype, self.shape = name, header.dtype, header.shape
        self._header, self._spill, self._entry, self._where, self._base = header, spill, entry, where, None

    def _source(self) -> MappedView:
        with self._spill.lock:
            if self._base is None:
                start, size = self._spill.inflate(self._entry, self._where)
                mapped = self._spill.file.map(start, size, f"{self._where}, inflated")
                self._base = _view(self.name, self._header, mapped, self._header.data_start)
            return self._base

    def _region(self, index):
        return self._source()._region(index)

    def release(self):
        if self._base is not None:
            self._base.release()


# --- files and directories -----------------------------------------------------------------------

def _npz_names(m):
    try:
        return list(ziparchive.names(m, _ARCHIVE)) if ziparchive.is_zip(m) else None
    except BadInput:
        return None


def _is_npz(path: Path) -> bool:
    """A zip named *.npz (load says what is wrong with it, if anything), or any zip whose entries (at
    least one) are all `.npy` members, told by the central directory alone."""
    try:
        m = storage.open_file(path)
    except BadInput:
        return False
    if path.name.endswith(".npz"):
        return ziparchive.is_zip(m)
    names = _npz_names(m)
    return bool(names) and all(n.endswith(".npy") for n in names)


def _is_npy(path: Path) -> bool:
    return storage.head(path, len(MAGIC)) == MAGIC


def _dir_files(directory: Path) -> list:
    """A directory's `.npz` files if it has any, else its `.npy` files (regular, inside the source)."""
    root = source_root(directory)
    files = [p for p in sorted(directory.iterdir()) if p.name.endswith((".npz", ".npy")) and not p.name.startswith(".")
             and p.is_file() and inside(p, root)]
    return [p for p in files if p.name.endswith(".npz")] or files


def detect(path: Path) -> bool:
    if path.is_dir():
        return bool(_dir_files(path))
    return path.is_file() and (_is_npy(path) or _is_npz(path))


def load(path: Path, options: ReadOptions) -> Checkpoint:
    if path.is_dir():
        files = [confined(p, source_root(path)) for p in _dir_files(path)]
        if not files:
            raise BadInput(f"{path}: holds no .npz or .npy file")
        npz = [p for p in files if p.name.endswith(".npz")]
        if len(npz) > 1:
            raise BadInput(f"{path}: holds {len(npz)} .npz files ({', '.join(p.name for p in npz[:4])}); give the one "
                           "to read as SRC")
    else:
        files = [path]
    tensors, skipped, mapped = [], _Skipped(), []
    for f in files:
        m = storage.open_file(f)
        mapped.append(m)
        if f.name.endswith(".npy") or (not f.name.endswith(".npz") and _is_npy(f)):   # one array, named by its stem
            name = f.name[:-4] if f.name.endswith(".npy") else f.stem
            if wanted(name, options.only):
                _add(tensors, skipped, name, *_npy(m), options)
        else:
            _npz(m, options, tensors, skipped)
    source = SourceFacts(format=NAME, path=str(path), files=[p.name for p in files], skipped=list(skipped))
    return Checkpoint(tensors, {}, source, model_files(path, files) if path.is_dir() else [], mapped,
                      unsupported=skipped.first)


class _Skipped(list):
    """The arrays safetensors cannot store, and the line for the first (`_add`)."""

    first = None


def _npy(m) -> tuple:
    header = parse_header(storage.buffer(m, 0, 12 + MAX_HEADER), m.size, m.path)
    m.release(0, header.data_start)
    return header, lambda name: _view(name, header, m, header.data_start), m.path


def _npz(m, options: ReadOptions, tensors, skipped):
    entries = ziparchive.read_entries(m, kind=_ARCHIVE)
    heads = storage.read_ranges(m, _stored_heads(entries, options))
    try:
        _members(m, entries, heads, options, tensors, skipped)
    finally:
        heads.close()


def _stored_heads(entries, options: ReadOptions):
    """(offset, length) of the first bytes of each stored member `_members` parses, in its order
    (read ahead of it in one batch: one ranged read per member would be one request each)."""
    for member in entries:
        entry = entries[member]
        if member.endswith(".npy") and wanted(member[:-4], options.only) and entry.method == 0:
            yield entry.offset, min(entry.size, 12 + MAX_HEADER)


def _members(m, entries, heads, options: ReadOptions, tensors, skipped):
    inflated, spill = 0, _Spill(m)
    for member in entries:
        where = f"{m.path}: member {printable(member, 200)!r}"
        if not member.endswith(".npy"):
            raise BadInput(f"{where} is not an .npy array (np.savez writes only those)")
        name = member[:-4]
        if not wanted(name, options.only):
            continue   # (never read)
        entry = entries[member]
        if entry.method == 0:
            header = parse_header(next(heads), entry.size, where)
            m.release(entry.offset, header.data_start)
            _add(tensors, skipped, name, header,
                 lambda n, h=header, e=entry: _view(n, h, m, e.offset + h.data_start), where, options)
        elif entry.method == 8:
            inflated += entry.size
            if inflated > INFLATE_RATIO * m.size + INFLATE_SLACK:
                raise BadInput(f"{m.path}: its deflated members would inflate to more than {INFLATE_RATIO}x its "
                               f"{m.size} bytes (+{INFLATE_SLACK >> 20} MiB); refused (np.load it and np.savez it "
                               "uncompressed to convert it)")
            header = parse_header(_head(m, entry, where), entry.size, where)
            _add(tensors, skipped, name, header, lambda n, h=header, e=entry, w=where: Deflated(n, h, spill, e, w),
                 where, options)
        else:
            raise BadInput(f"{where} is compressed with zip method {entry.method}; numpy writes stored and deflated "
                           "members only")


def _head(m, entry, where) -> bytes:
    """The first bytes of a deflated member, as much as holds its preamble and header (inflated no
    further; an object's compressed bytes fetched HEAD_FETCH at a time, as they are needed)."""
    inflater = zlib.decompressobj(-15)
    want = min(entry.size, 12 + MAX_HEADER)
    out = b""
    try:
        for at in range(0, entry.stored, 4096):
            if at % HEAD_FETCH == 0:
                src = storage.buffer(m, entry.offset + at, min(HEAD_FETCH, entry.stored - at))
            data = src[at % HEAD_FETCH:at % HEAD_FETCH + 4096]
            while data and len(out) < want and not inflater.eof:
                out += inflater.decompress(data, want - len(out))
                data = inflater.unconsumed_tail
            if len(out) >= want or inflater.eof:
                break
        if len(out) < want and not inflater.eof:
            out += inflater.flush()[:want - len(out)]
    except zlib.error as e:
        raise BadInput(f"{where}: does not inflate ({e})") from None
    return out


def _add(tensors, skipped, name, header: Header, source, where, options: ReadOptions):
    """A tensor, or one safetensors cannot store: skipped, the first with the line that refuses the
    source unless --skip-unsupported (readers/__init__)."""
    if header.problem is None:
        tensors.append(source(name))
        return
    skipped.append({"name": name, "reason": header.problem})
    if len(skipped) == 1:
        skipped.first = (f"{where}: {header.problem}", "--skip-unsupported leaves it out" + (" unread" if header.pickled else ""))


READER = register(Reader(NAME, "numpy .npy and .npz files (np.save, np.savez, np.savez_compressed)", detect, load,
                         priority=45, suffixes=(".npy", ".npz"),
                         fuzz=(("input.array", None),),   # (no suffix: an .npy by its magic, else an .npz)
                         looks_for="an .npy file (\\x93NUMPY), an .npz of .npy members, or a directory "
                         "holding one .npz or .npy files"))
