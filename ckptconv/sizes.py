"""Human byte sizes: `500MB`, `5GB` (powers of 1000, as Hugging Face uses) and `1GiB` (powers of 1024)."""
import re

from .errors import UsageError, brief

MAX_SIZE = 2**62   # bytes: beyond any disk, within every offset type

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


def parse_size(text) -> int:
    """Parse `5GB`, `500MB`, `1GiB`, `1.5GB` or a plain byte count into bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d{1,30}(?:\.\d{1,30})?)\s*([A-Za-z]*)\s*", str(text)[:100])
    if not m or m.group(2).upper() not in _UNITS:
        raise UsageError(f"invalid size {brief(text, 100)}: use a number with an optional unit such as 500MB, 5GB or 1GiB")
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0 or value > MAX_SIZE:
        raise UsageError(f"invalid size {brief(text, 100)}: must be positive and at most 2**62 bytes")
    return value


def format_size(n: int) -> str:
    """Format bytes for people: `2.11 GB`."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
