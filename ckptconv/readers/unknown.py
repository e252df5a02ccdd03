"""What a source no reader recognises looked like, in one short line (docs/formats.md#detection).

`unrecognised(path, readers)` says what SRC is (a JSON object, a text file, a zip archive, a pickle,
a directory of such files), the format it comes closest to (by the reader that declares its suffix,
or, for a directory, the file in it that does) and why it is not that, and where the full list of
formats is. Only the first bytes of a file (HEAD) and the names of a directory's first entries
(MAX_LISTED) are looked at; it never raises.
"""
from pathlib import Path

from ..errors import BadInput, printable
from ..storage import files as storage

HEAD = 4096          # bytes of a file looked at
MAX_LISTED = 4096    # entries of a directory looked at
FORMATS = "formats: `ckptconv inspect --formats`"


def unrecognised(path: Path, readers) -> str:
    """The line for a `path` that no reader recognises; `readers` are the registered readers."""
    what = _directory(path, readers) if path.is_dir() else _file(path, readers)
    return f"{path}: not a checkpoint ckptconv reads: {what}; {FORMATS}"


def _closest(name: str, readers):
    """The reader whose weight-file suffix `name` ends with (the longest such suffix; of readers that
    declare the same one, the last in detection order, the most general: torch before Megatron for
    `.pt`), or None."""
    best = None
    for r in readers:
        for s in r.suffixes:
            if name.endswith(s) and (best is None or len(s) >= best[0]):
                best = (len(s), r)
    return best[1] if best else None


def _expects(reader) -> str:
    """What the reader reads, from what it looks for: its first clause (up to a comma or semicolon
    outside parentheses), at most 90 characters."""
    depth, text = 0, reader.looks_for
    for i, c in enumerate(text):
        depth += c == "("
        depth -= c == ")"
        if c in ",;" and depth == 0:
            text = text[:i]
            break
    return printable(text, 90)


def _file(path: Path, readers) -> str:
    try:
        size = storage.size(path)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    except BadInput:
        return "cannot be read (no such object)"
    head = storage.head(path, HEAD)
    if size and not head:
        return "cannot be read"
    kind = _kind(head, size)
    reader = _closest(path.name, readers)
    if reader is not None:
        return f"{kind}, named like a {reader.name} file, which is {_expects(reader)}"
    return kind


def _kind(head: bytes, size: int) -> str:
    """What the first bytes of a file of `size` bytes say it is."""
    if size == 0:
        return "an empty file"
    text = None
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:   # (cut inside a character at HEAD: still text)
        if e.start >= len(head) - 3 and size > len(head):
            text = head[:e.start].decode("utf-8", "replace")
    if text is not None and all(c.isprintable() or c in "\t\r\n" for c in text):
        stripped = text.lstrip()
        if stripped.startswith("{"):
            config = '"model_type"' in text or '"architectures"' in text
            return (f"a JSON object of {size} bytes" + (" (a model config)" if config else "")
                    + ", not a shapes description (a \"tensors\" list)")
        if stripped.startswith("["):
            return f"a JSON array of {size} bytes"
        return f"a text file of {size} bytes"
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return f"a zip archive of {size} bytes"
    if len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return f"a Python pickle of {size} bytes"
    if head.startswith(b"\x1f\x8b"):
        return f"a gzip file of {size} bytes"
    if head.startswith(b"\x89HDF"):
        return f"an HDF5 file of {size} bytes (Keras?)"
    return f"a binary file of {size} bytes (it starts {head[:8].hex()})"


def _directory(path: Path, readers) -> str:
    try:
        names = storage.listdir(path)[:MAX_LISTED]
    except OSError as e:
        return f"a directory that cannot be listed ({e.strerror})"
    except BadInput:
        return "a directory that cannot be listed"
    visible = sorted(n for n in names if not n.startswith("."))
    if not visible:
        return "an empty directory"
    count = f"{len(visible)}{'+' if len(names) >= MAX_LISTED else ''} entr{'y' if len(visible) == 1 else 'ies'}"
    shown = ", ".join(printable(n, 40) for n in visible[:3]) + (", ..." if len(visible) > 3 else "")
    weights = [n for n in visible if _closest(n, readers) is not None]
    if weights:
        reader = _closest(weights[0], readers)
        return (f"a directory of {count} ({shown}); {printable(weights[0], 60)} is named like a {reader.name} file "
                f"but is not one")
    return f"a directory of {count} ({shown}), none named like a weights file"
