"""An output's identity: one SHA-256 that names exactly one output, for a producer to publish and a
consumer to check (`ckptconv verify OUT --expect DIGEST`, docs/output.md#identity).

- A directory: the SHA-256 of its top-level SHA256SUMS, followed, for a reshard output, by every rank
  directory's SHA256SUMS in rank order (`cat OUT/SHA256SUMS OUT/rank-*/SHA256SUMS | sha256sum`).
  Those lists name every file of the output with its digest, and verify checks every file against
  them, so an output that verifies and has this identity is that output.
- A single file: the SHA-256 of its header (the 8-byte length and the JSON it counts), which holds
  every tensor's name, dtype, shape and place and, in `__metadata__`, every tensor's digest: verify
  checks the data against those, so the header names the whole file.
"""
import hashlib
import os
import struct

from .. import safejson
from ..errors import BadInput
from ..storage import files as storage
from .mesh import MESH, rank_dirs
from .safetensors import MAX_HEADER
from .sums import NAME as SUMS

PREFIX = "sha256:"


def identity(path) -> str:
    """`sha256:HEX` of the output at `path` (a local path, or a URL: storage/files.py); BadInput if it
    has no SHA256SUMS (or header) to name it."""
    h = hashlib.sha256()
    if storage.is_dir(path):
        lists = [storage.join(path, SUMS)]
        if storage.exists(storage.join(path, MESH)):
            lists += [storage.join(path, name, SUMS) for _, name in sorted(rank_dirs(path).items())]
        for p in lists:
            h.update(storage.read_bytes(p, SUMS, limit=1 << 30, follow=False))
        return PREFIX + h.hexdigest()
    if isinstance(path, storage.RemotePath):
        f = storage.open_file(path)
        head = f.read(0, min(8, f.size))
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        body = f.read(8, min(n, f.size - 8)) if len(head) == 8 and n <= MAX_HEADER else b""
    else:
        with safejson.open_regular(path, "safetensors file", follow=False) as fd:
            head = os.pread(fd, 8, 0)
            body = os.pread(fd, int.from_bytes(head, "little"), 8) if len(head) == 8 and \
                int.from_bytes(head, "little") <= MAX_HEADER else b""
    if len(head) < 8:
        raise BadInput(f"{path}: too short to be a safetensors file")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER:
        raise BadInput(f"{path}: a header of {n} bytes, more than the {MAX_HEADER} read")
    if len(body) < n:
        raise BadInput(f"{path}: truncated inside its header")
    h.update(head + body)
    return PREFIX + h.hexdigest()
