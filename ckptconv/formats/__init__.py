"""Every on-disk format ckptconv reads or writes, each in one module, both directions: safetensors
headers, the output directory's metadata (index, manifest, resume journal), SHA256SUMS, and a
reshard output's mesh.json with its rank directories. Other modules take file names and format
tags from here, never spelling them out."""
import os
from pathlib import Path

from .. import safejson
from ..errors import BadInput
from .manifest import MANIFEST, SINGLE_KEY
from .mesh import MESH
from .safetensors import MAX_HEADER

MARKERS = (MANIFEST, MESH)  # a directory holding one of these (with our format tag) is ours


def not_ours(out: Path, single_file: bool) -> str | None:
    """Why an existing OUT is not a previous ckptconv output that --overwrite may replace, or None."""
    if single_file:
        return None if _ours_file(out) else f"no {SINGLE_KEY!r} in its safetensors metadata"
    return None if any(_ours(out / m) for m in MARKERS) else f"no {' or '.join(MARKERS)} of ckptconv's"


def _ours_file(path: Path) -> bool:
    """A safetensors file ckptconv wrote (its header's metadata holds the manifest facts). Opened
    without following a link or waiting on a FIFO; anything but a regular file is not ours."""
    try:
        with safejson.open_regular(path, follow=False) as fd:
            n = int.from_bytes(os.pread(fd, 8, 0).ljust(8, b"\0"), "little")
            header = safejson.loads(os.pread(fd, n, 8), path, "safetensors header") if 0 < n <= MAX_HEADER else None
    except (OSError, BadInput):
        return False
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(meta, dict) and SINGLE_KEY in meta


def _ours(marker: Path) -> bool:
    """A ckptconv manifest.json or mesh.json: a regular file holding a JSON object whose format is
    ckptconv's (a web app's manifest.json is not)."""
    try:
        doc = safejson.loads(safejson.read(marker, limit=256 << 20, follow=False), marker)
    except BadInput:
        return False
    return isinstance(doc, dict) and str(doc.get("format", "")).startswith("ckptconv.")
