"""Every on-disk format ckptconv reads or writes, each in one module, both directions: safetensors
headers, the output directory's metadata (index, manifest, resume journal), SHA256SUMS, and a
reshard output's mesh.json with its rank directories. Other modules take file names and format
tags from here, never spelling them out."""
import os

from .. import safejson
from ..errors import BadInput
from ..storage import files as storage
from .manifest import MANIFEST, SINGLE_KEY, is_index
from .mesh import MESH
from .pipeline import MODEL_INDEX
from .safetensors import MAX_HEADER
from .sums import NAME as SUMS, parse_sums

MARKERS = (MANIFEST, MESH)  # a directory holding one of these (with our format tag) is ours


def not_ours(out, single_file: bool) -> str | None:
    """Why an existing OUT (a path, or a URL: storage/files.py) is not a previous ckptconv output that
    --overwrite may replace, or None."""
    if single_file:
        return None if _ours_file(out) else f"no {SINGLE_KEY!r} in its safetensors metadata"
    place = storage.place(out)
    return None if any(_ours(place / m) for m in MARKERS) else f"no {' or '.join(MARKERS)} of ckptconv's"


def pointer(names) -> str | None:
    """The file a consumer opens first, of an output's top-level file names (docs/storage.md):
    mesh.json (a reshard output), model_index.json (a pipeline), the index, or the one weights file;
    None when the names hold none of them. In a store it is written last, create-only: an output
    whose pointer is there is published, whole."""
    names = {n for n in names if "/" not in n}
    for name in (MESH, MODEL_INDEX):
        if name in names:
            return name
    indexes = sorted(n for n in names if is_index(n))
    if indexes:
        return indexes[0]
    weights = sorted(n for n in names if n.endswith(".safetensors"))
    return weights[0] if len(weights) == 1 else None


def published(out, names) -> str | None:
    """The pointer of the output under the prefix `out` (a URL) when it is published there — its
    SHA256SUMS is among `names` (what the prefix holds) and so is the pointer that list implies — else
    None: nothing, or what a run that is writing it, or was killed, has put there so far."""
    if SUMS not in names:
        return None
    try:
        listed, _ = parse_sums(storage.read_bytes(storage.join(out, SUMS), SUMS, 1 << 30), paths=True)
    except BadInput:
        return None
    first = pointer(listed)
    return first if first is not None and first in names else None


def _ours_file(path) -> bool:
    """A safetensors file ckptconv wrote (its header's metadata holds the manifest facts). Opened
    without following a link or waiting on a FIFO; anything but a regular file is not ours."""
    try:
        if isinstance(path, storage.RemotePath):
            f = storage.open_file(path)
            n = int.from_bytes(f.read(0, min(8, f.size)).ljust(8, b"\0"), "little")
            header = safejson.loads(f.read(8, n), path, "safetensors header") \
                if 0 < n <= min(MAX_HEADER, f.size - 8) else None
        else:
            with safejson.open_regular(path, follow=False) as fd:
                n = int.from_bytes(os.pread(fd, 8, 0).ljust(8, b"\0"), "little")
                header = safejson.loads(os.pread(fd, n, 8), path, "safetensors header") if 0 < n <= MAX_HEADER \
                    else None
    except (OSError, BadInput):
        return False
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(meta, dict) and SINGLE_KEY in meta


def _ours(marker) -> bool:
    """A ckptconv manifest.json or mesh.json: a regular file holding a JSON object whose format is
    ckptconv's (a web app's manifest.json is not)."""
    try:
        doc = safejson.loads(storage.read_bytes(marker, "file", 256 << 20, follow=False), marker)
    except BadInput:
        return False
    return isinstance(doc, dict) and str(doc.get("format", "")).startswith("ckptconv.")
