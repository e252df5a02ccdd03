"""Progress in bytes on stderr: shown on a terminal, silent otherwise or with --quiet."""
import contextlib
import sys


@contextlib.contextmanager
def byte_progress(total: int, desc: str, quiet: bool = False):
    """Yield an `update(nbytes)` callable, or None when no bar should be drawn."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm  # imported only when a bar is drawn: it costs ~35 ms of start-up

    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=desc, file=sys.stderr,
              dynamic_ncols=True, leave=False) as bar:
        yield bar.update
