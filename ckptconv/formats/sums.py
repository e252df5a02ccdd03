"""`SHA256SUMS`: the coreutils checksum list beside every output (`sha256sum -c SHA256SUMS` passes there).

Format, exactly as written: one line per file, `{sha256 hex, lowercase}  {name}\\n`, sorted by name.
Every name is a plain file name in the same directory (no `/`, not `.` or `..`, no NUL or control
characters), so the list can never point a checker outside the directory; a diffusers pipeline's
list covers its tree, each name a plain file name or `FOLDER/FILE` of two plain names (`paths`). The
parser is strict: a
line that is not in that form, a name that is not plain, or a name listed twice is a problem, and
such a name is never returned (so never opened).
"""
import os
import re

from ..errors import BadInput

NAME = "SHA256SUMS"
_DIGEST = re.compile(r"[0-9a-f]{64}")
_LINE = re.compile(rb"([0-9a-f]{64})  (.+)", re.DOTALL)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
NAME_MAX = 255   # bytes in a file name (Linux): a longer one names no file, whatever it holds
DEPTH = 2        # names in a path a tree's SHA256SUMS lists: `FOLDER/FILE` (a diffusers pipeline's components)


def is_digest(value) -> bool:
    """A SHA-256 hex digest as ckptconv writes it (64 lowercase hex digits)."""
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


def unsafe_name(name) -> str | None:
    """Why `name` is not a plain file name inside its directory, or None when it is one."""
    if not isinstance(name, str):
        return f"a {type(name).__name__}, not a file name"
    if name in ("", ".", ".."):
        return "not a file name"
    if len(name) > NAME_MAX or len(name.encode("utf-8", "surrogatepass")) > NAME_MAX:
        return f"longer than the {NAME_MAX} bytes of a file name"   # (checked first: it may be megabytes)
    if "/" in name:
        return "an absolute path" if name.startswith("/") else "a path, not a file name"
    if _CONTROL.search(name):
        return "it holds a control character"
    return None


def unsafe_path(name) -> str | None:
    """Why `name` is not a plain file name, or a plain folder name and a plain file name joined by `/`
    (`unet/config.json`: what the SHA256SUMS of a tree lists, at most DEPTH names deep), or None."""
    if not isinstance(name, str):
        return f"a {type(name).__name__}, not a file name"
    if len(name.encode("utf-8", "surrogatepass")) > DEPTH * (NAME_MAX + 1):
        return f"longer than a path of {DEPTH} names"   # (checked first: it may be megabytes)
    if name.startswith("/"):
        return "an absolute path"
    parts = name.split("/")
    if len(parts) > DEPTH:
        return f"a path more than {DEPTH - 1} folder deep"
    for part in parts:
        why = unsafe_name(part)
        if why is not None:
            return why
    return None


def format_sums(digests, paths: bool = False) -> bytes:
    """The file's bytes for {name: hex digest}: sorted by name, two spaces, one line each. `paths`:
    names may be `FOLDER/FILE` (unsafe_path), as a tree's SHA256SUMS lists them."""
    unsafe = unsafe_path if paths else unsafe_name
    for name, digest in digests.items():
        why = unsafe(name)
        if why is not None:
            raise BadInput(f"{name!r} cannot be listed in {NAME}: {why}")
        if not is_digest(digest):
            raise BadInput(f"{name!r}: {digest!r} is not a SHA-256 hex digest")
    return b"".join(f"{digests[name]}  ".encode() + os.fsencode(name) + b"\n" for name in sorted(digests))


def write_sums(out_dir, digests, paths: bool = False) -> bytes:
    """Write `out_dir/SHA256SUMS` (`out_dir` a local directory or an output's Target,
    storage/targets.py) for {name: hex digest}; returns the bytes written."""
    from ..storage.targets import as_target
    data = format_sums(digests, paths)
    as_target(out_dir).put(NAME, data)
    return data


def parse_sums(data: bytes, paths: bool = False) -> tuple:
    """({name: digest}, [problem sentences]) from a SHA256SUMS file's bytes; `paths` as in format_sums."""
    unsafe = unsafe_path if paths else unsafe_name
    sums, problems = {}, []
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    elif data:
        problems.append("does not end with a newline")
    for n, line in enumerate(lines, 1):
        m = _LINE.fullmatch(line)
        if m is None:
            problems.append(f"line {n} is not in `sha256sum` format (`<64 hex digits>  <file name>`)")
            continue
        name = os.fsdecode(m.group(2))
        why = unsafe(name)
        if why is not None:
            problems.append(f"line {n} names {name!r}, which is not a plain {'path' if paths else 'file name'} in "
                            f"this directory ({why}); not opened")
        elif name in sums:
            problems.append(f"line {n} lists {name!r} a second time")
        else:
            sums[name] = m.group(1).decode()
    return sums, problems
