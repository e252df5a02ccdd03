"""TOML read from files a user names (`--rules`): the same bounds as JSON from a file we do not trust
(safejson), checked before tomllib sees the text.

tomllib recurses once per nested array or inline table (20,000 of them: RecursionError) and takes
time quadratic in the parts of a dotted key (`a.a.a…` of 20,000 parts: 10 s for 40 KB). So the text
is scanned first, in time linear in its size: strings and comments dropped, then the nesting of
brackets and braces, and the dots of every key, must stay within `limits.MAX_DEPTH`.
"""
import re

import numpy as np

from .errors import BadInput
from .limits import MAX_DEPTH

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

# strings (multi-line first) and comments; what they hold is no structure. A multi-line string may end
# in one or two quotes of its own before its closing three (`'''q''''` holds `q'`): the closing run
# is three to five quotes, taken whole.
_NOT_STRUCTURE = re.compile(r'"""(?:[^"\\]|\\.|"{1,2}(?!"))*"{3,5}|\'\'\'(?:[^\']|\'{1,2}(?!\'))*\'{3,5}'
                            r'|"(?:[^"\\\n]|\\.)*"' r"|'[^'\n]*'|#[^\n]*", re.S)
_KEY = re.compile(r"[^=\[\]{},\n]*[=\]]")   # a key: what stands before '=' (or inside a [table] header)
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")


def depth(text: str) -> int:
    """How deep a TOML text nests: arrays, inline tables and dotted keys, whichever is deepest."""
    bare = _NOT_STRUCTURE.sub(" ", text)
    dots = max((m.group().count(".") for m in _KEY.finditer(bare)), default=0)
    marks = np.frombuffer(bare.encode("utf-8", "surrogatepass").translate(None, _BRACKETS), np.uint8)
    nested = 0
    if len(marks):
        step = ((marks == 0x5B) | (marks == 0x7B)).astype(np.int32) - ((marks == 0x5D) | (marks == 0x7D))
        nested = int(np.cumsum(step).max())
    return max(dots + 1, nested)


def loads(data: bytes, where, what="TOML") -> dict:
    """The document in `data` (UTF-8 TOML), or BadInput naming `where`: not UTF-8, not TOML, nested
    deeper than MAX_DEPTH (checked before parsing), or a number Python will not read."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"{where}: the {what} is not UTF-8 text (byte {e.start})") from None
    if depth(text) > MAX_DEPTH:
        raise BadInput(f"{where}: the {what} nests deeper than {MAX_DEPTH} levels (arrays, tables or dotted keys)")
    try:
        return tomllib.loads(text)
    except (tomllib.TOMLDecodeError, ValueError, RecursionError) as e:   # (an integer of 4,300+ digits)
        raise BadInput(f"{where}: cannot read TOML: {str(e)[:300]}") from None
