"""Coverage-guided fuzzing of the parsers that face untrusted bytes (`make fuzz`, not in CI).

Every input goes through the unpickler (torch, numpy and DCP allowlists), the torch zip and legacy
readers, the safetensors header parser, the Grok-1 reader and the numpy reader (.npy, .npz). The only acceptable failure is the
project's own CkptError; anything else is a bug, and atheris reports the input that caused it.
"""
import sys
import tempfile
from pathlib import Path

from ckptconv.readers.pickle import unpickler
from ckptconv.errors import CkptError
from ckptconv.io.mapped import MemoryFile
from ckptconv.readers import ReadOptions, dcp, grok, npy, torch_pickle
from ckptconv.formats.safetensors import parse_header
from ckptconv.readers.pickle.torch_globals import torch_globals

_TORCH, _DCP, _GROK = torch_globals(), dcp.allowlist(), grok.allowlist()
_DIR = Path(tempfile.mkdtemp(prefix="ckptconv-fuzz-"))


def parse_any(data: bytes):
    """Feed `data` to every parser; return normally or raise CkptError, nothing else."""
    for allow in (_TORCH, _DCP, _GROK):
        try:
            unpickler.load(data, allow, "<fuzz>")
        except CkptError:
            pass
    m = MemoryFile(data, "<fuzz>")
    for fn in (lambda: torch_pickle.load_zip(m, _TORCH), lambda: parse_header(m.view, m.size, "<fuzz>")):
        try:
            fn()
        except CkptError:
            pass
    path = _DIR / "input.pt"
    path.write_bytes(data)
    for reader in (torch_pickle,):
        try:
            ckpt = reader.load(path, ReadOptions())
            for t in ckpt.tensors:  # touching every tensor's bytes must stay inside the file
                t.region()
        except CkptError:
            pass
    path = _DIR / "input.array"   # (no suffix: an .npy by its magic, else an .npz)
    path.write_bytes(data)
    try:
        for t in npy.load(path, ReadOptions()).tensors:   # (a deflated member is inflated here)
            t.region()
    except CkptError:
        pass
    grok_dir = _DIR / "ckpt-0"
    grok_dir.mkdir(exist_ok=True)
    (grok_dir / "tensor00000_000").write_bytes(data)
    try:
        for t in grok.load(grok_dir, ReadOptions()).tensors:
            t.region()
    except CkptError:
        pass


def main():
    import atheris

    def one(data):
        parse_any(data)

    atheris.instrument_all()  # coverage feedback from every loaded module, ckptconv's parsers included
    atheris.Setup(sys.argv, one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
