"""The project's error types: every expected failure is one of these, so the CLI can print one line."""
import itertools


class CkptError(Exception):
    """A failure the user can act on; the CLI prints it as one line and exits with `exit_code`."""

    exit_code = 2


class BadInput(CkptError):
    """The checkpoint is malformed, truncated, inconsistent or hostile (exit 2)."""


class UnsafePickle(BadInput):
    """A pickle asked for something outside the allowlist: a global, an opcode or a call."""


class UsageError(CkptError):
    """The command line asks for something impossible (exit 2)."""


class OutputError(CkptError):
    """The output cannot be written: it exists, is locked, or the disk failed (exit 2)."""


def where(path, offset=None, tensor=None) -> str:
    """Format the location part of a message: `file`, `file @ offset N`, `file: tensor 'x'`."""
    text = str(path)
    if tensor is not None:
        text += f": tensor {tensor!r}"
    if offset is not None:
        text += f" at offset {offset}"
    return text


MAX_LINE = 2000  # characters of one error or report line


def printable(text, limit: int = MAX_LINE) -> str:
    """`text` as part of one printed line: control, format and unpaired surrogate characters escaped
    (a file name or global holding a newline must not forge a second line) and the length bounded."""
    text = str(text)
    if not text.isprintable():
        text = "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                       for c in text)
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text) - limit} more characters)"
    return text


def encodable(text: str) -> bool:
    """Whether UTF-8 can spell `text` (a pickle or JSON escape can hold an unpaired surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def brief(value, limit: int = 200) -> str:
    """A short repr of a value read from a file, for messages: bounded in depth and length (a plain
    repr of a deeply nested or huge value could recurse or run to gigabytes)."""
    def walk(v, depth):
        if isinstance(v, (str, bytes, bytearray)):
            return repr(v[:limit]) + ("..." if len(v) > limit else "")
        if isinstance(v, int) and v.bit_length() > 256:
            return f"<int of {v.bit_length()} bits>"
        if v is None or isinstance(v, (int, float)):
            return repr(v)
        if not isinstance(v, (dict, list, tuple, set, frozenset)):
            return f"<{type(v).__name__}>"
        if depth >= 3:
            return f"<{type(v).__name__} of {len(v)}>"
        if isinstance(v, dict):
            parts = [f"{walk(k, depth + 1)}: {walk(x, depth + 1)}" for k, x in itertools.islice(v.items(), 8)]
        else:
            parts = [walk(x, depth + 1) for x in itertools.islice(v, 8)]
        inner = ", ".join(parts) + (", ..." if len(v) > 8 else "," if type(v) is tuple and len(v) == 1 else "")
        return {dict: "{%s}", list: "[%s]", tuple: "(%s)"}.get(type(v), type(v).__name__ + "({%s})") % inner
    return walk(value, 0)[:limit * 2]
