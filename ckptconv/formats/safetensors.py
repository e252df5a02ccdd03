"""The safetensors file format, both ways: parse and validate a header, build one.

Layout: u64 little-endian header length N, N bytes of JSON (padded with spaces to 8 bytes), data.
The JSON maps names to {"dtype", "shape", "data_offsets": [begin, end]} relative to the data start,
plus an optional "__metadata__" string map.
"""
import json
import math
import struct
from dataclasses import dataclass
from typing import NamedTuple

from .. import dtypes, safejson
from ..errors import BadInput, brief
from ..limits import shape_problem

MAX_HEADER = 100 * 1000 * 1000  # the safetensors library's own limit (what is read)
SHARD_HEADER = 8 << 20          # what a shard of ours holds at most: ~100,000 tensors, ~100 MB in any reader
_json_string = json.encoder.encode_basestring   # json.dumps(s, ensure_ascii=False) for a str, without the
#                                                 encoder's set-up (every header entry is made three times)


class HeaderEntry(NamedTuple):  # a tuple: headers of a million tensors are built fast
    name: str
    dtype: dtypes.DType
    shape: tuple
    begin: int  # absolute file offsets
    end: int


@dataclass
class Header:
    entries: list       # HeaderEntry in data order
    metadata: dict
    data_start: int
    problems: list      # everything wrong, as sentences (empty for a valid file)


def file_header(m, path=None) -> Header:
    """`parse_header` of a file (io/mapped.MappedFile or storage/files.RemoteFile: the header's bytes
    fetched first, at most MAX_HEADER of them)."""
    if m.remote:
        m.need(0, min(m.size, 8))
        n = int.from_bytes(m.view[:8], "little") if m.size >= 8 else 0
        m.need(0, min(m.size, 8 + min(n, MAX_HEADER)))
    return parse_header(m.view, m.size, m.path if path is None else path)


def parse_header(view, size: int, path) -> Header:
    """Parse and check a header. Unreadable headers raise BadInput; other faults land in `problems`."""
    if size < 8:
        raise BadInput(f"{path}: not a safetensors file: {size} bytes is too short for a header")
    n = struct.unpack_from("<Q", view, 0)[0]
    if n > MAX_HEADER:
        raise BadInput(f"{path}: safetensors header claims {n} bytes, more than the {MAX_HEADER} safetensors readers "
                       "accept")
    if 8 + n > size:
        raise BadInput(f"{path}: safetensors header claims {n} bytes but the file has {size} (truncated or corrupt)")

    data_start, data_len = 8 + n, size - 8 - n
    entries, metadata, problems, shapes = [], {}, [], {}   # shapes: each distinct one kept once
    # member by member (safejson.members): a million tensors' entries are checked as they come, not
    # first built as a million dicts and lists (docs/benchmarks.md, "Fourth pass")
    with safejson.no_gc():   # (tuples by the million: the cyclic collector need not scan them as they come)
        for name, info in safejson.members(view[8:8 + n], path, "safetensors header"):
            if name == "__metadata__":
                metadata = info
                continue
            try:
                entries.append(_entry(name, info, data_start, data_len, shapes))
            except ValueError as e:
                problems.append(f"tensor {name!r}: {e}")
    if not metadata or not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        if metadata:
            problems.insert(0, "__metadata__ must map strings to strings")
        metadata = {}
    entries.sort(key=lambda e: (e.begin, e.end))
    at = data_start
    for e in entries:
        if e.begin < at:
            problems.append(f"tensor {e.name!r} at bytes {e.begin - data_start}..{e.end - data_start} overlaps "
                            "the tensor before it")
        elif e.begin > at:
            problems.append(f"{e.begin - at} unused bytes before tensor {e.name!r}")
        at = max(at, e.end)
    if at < data_start + data_len:
        problems.append(f"{data_start + data_len - at} bytes after the last tensor are not described by the header")
    return Header(entries, metadata, data_start, problems)


_FIELDS = {"dtype", "shape", "data_offsets"}


def _entry(name, info, data_start, data_len, shapes: dict) -> HeaderEntry:
    if type(info) is not dict or info.keys() != _FIELDS:
        raise ValueError("entry must have exactly dtype, shape and data_offsets")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    dt = dtypes.BY_CODE.get(code) if type(code) is str else None
    if dt is None:
        raise ValueError(f"unknown dtype {brief(code)}")
    problem = shape_problem(shape, dt.itemsize) if type(shape) is list else "shape is not a list"
    if problem:
        raise ValueError(f"invalid shape: {problem}")
    if not (type(offsets) is list and len(offsets) == 2 and type(offsets[0]) is int and type(offsets[1]) is int
            and 0 <= offsets[0] <= offsets[1] <= data_len):
        raise ValueError(f"data_offsets {brief(offsets)} are outside the {data_len} data bytes")
    need = math.prod(shape) * dt.itemsize
    if offsets[1] - offsets[0] != need:
        raise ValueError(f"dtype {code} x shape {shape} needs {need} bytes, data_offsets give "
                         f"{offsets[1] - offsets[0]}")
    shape = tuple(shape)
    return HeaderEntry(name, dt, shapes.setdefault(shape, shape), data_start + offsets[0], data_start + offsets[1])


def header_start(metadata=None) -> bytes:
    """The header's JSON up to its first tensor entry."""
    return b'{"__metadata__":' + json.dumps(dict(metadata or {"format": "pt"}), separators=(",", ":"),
                                            ensure_ascii=False).encode()


def header_entry(name: str, dt, shape, at: int, nbytes: int) -> bytes:
    """One tensor's member of the header's JSON (its leading comma included), its data at `at`."""
    if name == "__metadata__":
        raise BadInput("a tensor named '__metadata__' cannot be stored: safetensors reserves the name")
    return (f',{_json_string(name)}:{{"dtype":"{dt.code}","shape":[{",".join(map(str, shape))}],'
            f'"data_offsets":[{at},{at + nbytes}]}}').encode()


def header_length(json_bytes: int) -> int:
    """N, the length a header's JSON of `json_bytes` bytes takes once closed and padded to 8."""
    return json_bytes + 1 + (-(json_bytes + 1) % 8)


def fits(json_bytes: int, limit: int | None = None) -> bool:
    """Whether a header's JSON of `json_bytes` bytes, closed and padded, is one safetensors readers open
    (MAX_HEADER), or with `limit`, at most that long."""
    return header_length(json_bytes) <= (MAX_HEADER if limit is None else limit)


def _json(entries, metadata):
    """The header's JSON but its closing brace, in parts: its start, then entry by entry."""
    yield header_start(metadata)
    at = 0
    for name, dt, shape, nbytes in entries:
        yield header_entry(name, dt, shape, at, nbytes)
        at += nbytes


def header_size(entries, metadata=None) -> int:
    """Bytes of the header for [(name, DType, shape, nbytes)] in data order, length prefix included,
    without building it; refused (BadInput) past MAX_HEADER."""
    return 8 + _checked_length(sum(map(len, _json(entries, metadata))), metadata)


def too_long(json_bytes: int) -> str:
    """Why a header's JSON of `json_bytes` bytes cannot be written (it does not fit)."""
    return (f"a safetensors header of {header_length(json_bytes)} bytes would be needed, more than the "
            f"{MAX_HEADER} bytes safetensors readers accept")


def _checked_length(json_bytes: int, metadata) -> int:
    if not fits(json_bytes):  # no safetensors reader would open the file
        raise BadInput(too_long(json_bytes) + " (too many tensors or names too long for one file"
                       + (", or the non-tensor state is too large to keep in the file's metadata: write a "
                          "directory instead)" if metadata else ")"))
    return header_length(json_bytes)


def header_pieces(entries, size: int, metadata=None, piece: int = 1 << 20):
    """The header for [(name, DType, shape, nbytes)] in data order, of `size` bytes (header_size of
    the same entries): the length prefix, the JSON written entry by entry (the same bytes json.dumps
    gives for the whole object), padded to 8, in pieces of about `piece` bytes: a million tensors'
    header is never held whole, nor first built as a million dicts."""
    text, total = bytearray(struct.pack("<Q", size - 8)), 0
    for part in _json(entries, metadata):
        text += part
        if len(text) >= piece:
            total += len(text)
            yield bytes(text)
            text = bytearray()
    text += b"}"
    if not 0 <= size - total - len(text) < 8:
        raise AssertionError("a header's entries changed between its size and its bytes")
    yield bytes(text + b" " * (size - total - len(text)))
