"""The project's error types: every expected failure is one of these, so the CLI can print one line."""


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
