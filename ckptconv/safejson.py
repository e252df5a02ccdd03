"""JSON read from files we do not trust (safetensors headers, indexes, mesh.json, config.json): depth
bounded before the parser recurses, duplicate keys refused, and every failure a BadInput naming the
file, in time linear in the size.
"""
import contextlib
import errno
import gc
import json
import os
import re
import stat

import numpy as np

from .errors import BadInput, printable
from .limits import MAX_DEPTH

_ESCAPE = re.compile(rb"\\.", re.S)
_KEEP = bytes(range(256)).translate(None, b'"[]{}')  # every byte but these: deleted


def depth(data, piece: int = 16 << 20) -> int:
    """How deep arrays and objects nest in JSON text (bytes, or str that must encode as UTF-8),
    without parsing it (a 60 MB header in about a second): escape sequences dropped, then only quotes
    and brackets kept; brackets between a pair of quotes are inside a string and do not count. Read
    `piece` bytes or characters at a time (a 230 MB manifest is not copied whole), each piece ending
    after one that is not a backslash, so that no escape sequence is cut in two."""
    text = isinstance(data, str)
    view, at = data if text else memoryview(data).cast("B"), 0
    backslash = "\\" if text else 0x5C
    quotes, level, deepest = 0, 0, 0   # carried from piece to piece: quotes so far (mod 2), the depth
    while at < len(view):
        end = min(at + piece, len(view))
        while end < len(view) and view[end - 1] == backslash:   # the piece takes what it escapes
            end += 1
        chunk = view[at:end].encode("utf-8") if text else view[at:end]
        marks = np.frombuffer(_ESCAPE.sub(b"", chunk).translate(None, _KEEP), np.uint8)
        at = end
        if not len(marks):
            continue
        # (a running count of quotes in uint8 wraps at 256, an even number: its parity is exact)
        seen = np.cumsum(marks == 0x22, dtype=np.uint8) + np.uint8(quotes)
        outside = (seen & 1) == 0
        step = ((marks == 0x5B) | (marks == 0x7B)).astype(np.int8) - ((marks == 0x5D) | (marks == 0x7D))
        running = np.cumsum(step * outside, dtype=np.int64) + level
        deepest, level, quotes = max(deepest, int(running.max())), int(running[-1]), int(seen[-1]) & 1
    return max(0, deepest)


@contextlib.contextmanager
def no_gc():
    """Parsed JSON holds no reference cycles, yet a million new containers make the cyclic collector
    scan them again and again (measured: half the time of parsing a 62 MB safetensors header)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_SHARED_TEXT = 40   # string values up to this long are kept once per document (dtypes, file names)


def _objects():
    """The object hook of one parse: duplicate keys refused, and short string values shared: a
    manifest or index of a million tensors names one shard file and one dtype a million times, and
    the parser makes a new string each time (keys it already shares). Digests (64) stay apart."""
    shared = {}

    def hook(pairs):
        obj = dict(pairs)
        if len(obj) != len(pairs):
            seen = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise ValueError(f"names {dup!r} twice")
        for k, v in pairs:
            if v.__class__ is str and len(v) <= _SHARED_TEXT:
                obj[k] = shared.setdefault(v, v)
        return obj
    return hook


def decode(data, where, what="JSON") -> str:
    """UTF-8 bytes as text; BadInput "`where`: `what` is not valid UTF-8" when they are not. (A
    caller that lets the bytes go once they are text holds one copy of a large document, not two.)"""
    try:
        return str(data, "utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"{where}: {what} is not valid UTF-8") from None


def _text(data, where, what) -> str:
    """`data` (bytes or str) as text, once it is known to be UTF-8 and no deeper than MAX_DEPTH."""
    try:
        levels = depth(data)
    except UnicodeEncodeError:
        raise BadInput(f"{where}: {what} is not valid UTF-8") from None
    if levels > MAX_DEPTH:
        raise BadInput(f"{where}: {what} nests {levels} levels deep; at most {MAX_DEPTH} are accepted")
    return data if isinstance(data, str) else decode(data, where, what)


def loads(data, where, what="JSON") -> object:
    """Parse `data` (bytes or str); BadInput "`where`: `what` ..." when it is not valid UTF-8 JSON,
    nests deeper than MAX_DEPTH, or repeats a key within an object."""
    text = _text(data, where, what)
    try:
        with no_gc():
            return json.loads(text, object_pairs_hook=_objects())
    except ValueError as e:
        raise BadInput(f"{where}: {what} is not valid JSON: {e}") from None


_SPACE = re.compile(r"[ \t\n\r]*")
_COLON = re.compile(r"[ \t\n\r]*:[ \t\n\r]*")
_NEXT = re.compile(r"[ \t\n\r]*([,}])[ \t\n\r]*")   # after a member: the next one, or the object's end


def members(data, where, what="JSON", nested: str | None = None, nested_keys=None):
    """The members of the JSON object `data` (bytes or str) as (key, value), one at a time: the
    checks and errors of `loads` without the whole object built first (a safetensors header of a
    million tensors is a million small objects, each a dict, a list and its numbers, before any
    is checked). Each value is parsed by the C decoder; the caller keeps what it needs of it. The
    value of the top-level member `nested`, when it is an object, comes as Members: an iterator of
    its own members, read as the caller goes (a manifest's "tensors"). `nested_keys`: a container
    the caller puts every key of `nested` in as it reads it; a repeated key is then looked for there
    rather than in a set of a million keys of its own. A document that is not an object: BadInput
    "... is not a JSON object" (when it is valid JSON)."""
    text = _text(data, where, what)
    at = _SPACE.match(text).end()
    if text[at:at + 1] != "{":
        loads(text, where, what)   # the same error as loads for text that is not JSON
        raise NotAnObject(f"{where}: {what} is not a JSON object")
    yield from _Walk(text, at + 1, where, what, nested, nested_keys).object(True)


class _Walk:
    """members' walk of one document: `at` is where it is; each object's members come from `object`."""

    def __init__(self, text: str, at: int, where, what: str, nested, nested_keys):
        self.text, self.at, self.where, self.what = text, at, where, what
        self.nested, self.nested_keys = nested, nested_keys
        self.scan = json.JSONDecoder(object_pairs_hook=_objects()).scan_once

    def object(self, top: bool):
        """The members of the object whose '{' is just before `at`; leaves `at` after its '}'."""
        try:
            yield from self._members(top)
        except ValueError as e:
            raise BadInput(f"{self.where}: {self.what} is not valid JSON: {e}") from None

    def _members(self, top: bool):
        text, scan = self.text, self.scan
        seen, repeated = set(), None   # a repeated key is refused when its object closes, as loads does
        kept = not top and self.nested_keys is not None   # (the caller keeps the keys: they are looked for there)
        if kept:
            seen = self.nested_keys
        at = _SPACE.match(text, self.at).end()
        closed = text[at:at + 1] == "}"
        at += closed
        while not closed:
            key, at = self._key(at)
            if key in seen and repeated is None:
                repeated = key
            if not kept:
                seen.add(key)
            if top and key == self.nested and text[at:at + 1] == "{" and repeated is None:
                self.at = at + 1
                inner = Members(self.object(False))
                yield key, inner
                inner.finish()
                at = self.at
            else:
                try:
                    value, at = scan(text, at)
                except StopIteration as stop:   # (where inside the value it failed, as json.loads says)
                    raise json.JSONDecodeError("Expecting value", text, stop.value) from None
                if repeated is None:
                    yield key, value
            after = _NEXT.match(text, at)
            if after is None:
                raise json.JSONDecodeError("Expecting ',' delimiter", text, _SPACE.match(text, at).end())
            at, closed = after.end(), after[1] == "}"
        if repeated is not None:
            raise ValueError(f"names {repeated!r} twice")
        self.at = at
        if top and _SPACE.match(text, at).end() != len(text):
            raise json.JSONDecodeError("Extra data", text, _SPACE.match(text, at).end())

    def _key(self, at: int) -> tuple:
        """(a member's key, where its value starts)."""
        text = self.text
        if text[at:at + 1] != '"':
            raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, at)
        key, at = json.decoder.scanstring(text, at + 1, True)
        colon = _COLON.match(text, at)
        if colon is None:
            raise json.JSONDecodeError("Expecting ':' delimiter", text, _SPACE.match(text, at).end())
        return key, colon.end()


class NotAnObject(BadInput):
    """Valid JSON, but not the object `members` reads."""


class Members:
    """The members of a nested object (see `members`), as (key, value); what the caller does not
    read is read (and checked) before the next top-level member."""

    def __init__(self, walk):
        self._walk = walk

    def __iter__(self):
        return self._walk

    def finish(self):
        for _ in self._walk:
            pass


@contextlib.contextmanager
def open_regular(path, what="file", follow: bool = True):
    """A descriptor of `path`, which must be a regular file: a FIFO or device is refused without
    blocking on it (O_NONBLOCK, then fstat); with `follow=False` a symbolic link is refused without
    being followed (an output's own files: verify never leaves OUT). BadInput otherwise."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise BadInput(f"{path}: is a symbolic link, not a regular file (not followed)") from None
        raise BadInput(f"{path}: cannot open the {what}: {e.strerror}") from None
    except ValueError:   # a NUL in the name
        raise BadInput(f"{printable(path, 300)}: cannot open the {what}: the name holds a NUL byte") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadInput(f"{path}: the {what} is not a regular file")
        yield fd
    finally:
        os.close(fd)


def read(path, what="file", limit: int = 1 << 30, follow: bool = True) -> bytes:
    """The bytes of `path`, a regular file (`open_regular`) of at most `limit` bytes."""
    with open_regular(path, what, follow) as fd:
        return _read_limited(fd, path, what, limit)


def _read_limited(fd, path, what, limit) -> bytes:
    try:
        st = os.fstat(fd)
        if st.st_size > limit:
            raise BadInput(f"{path}: the {what} has {st.st_size} bytes, more than the {limit} accepted")
        chunks, left = [], limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise BadInput(f"{path}: the {what} grew past the {limit} bytes accepted while it was read")
        return b"".join(chunks)
    except OSError as e:
        raise BadInput(f"{path}: cannot read the {what}: {e.strerror}") from None


