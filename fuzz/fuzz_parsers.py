"""Coverage-guided fuzzing of the parsers that face untrusted bytes (`make fuzz`, not in CI).

Every input goes through the unpickler (torch, numpy and DCP allowlists), the torch zip reader, the
safetensors header parser, the OCDBT manifest parser, and every registered reader, each loading the bytes placed where it reads
them (`Reader.fuzz`: a minimal source; a new reader is fuzzed once it declares one). The only
acceptable failure is the project's own CkptError; anything else is a bug, and atheris reports the
input that caused it.
"""
import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ckptconv.readers.pickle import unpickler
from ckptconv.errors import CkptError
from ckptconv.io.mapped import MemoryFile
from ckptconv.readers import ReadOptions, dcp, grok, ocdbt, readers, torch_pickle
from ckptconv.formats.safetensors import parse_header
from ckptconv.readers.pickle.torch_globals import torch_globals

_TORCH, _DCP, _GROK = torch_globals(), dcp.allowlist(), grok.allowlist()
# the readers' sources are rewritten for every input: on a memory file system where there is one (half
# the time of an input went to opening files on a disk's)
_DIR = Path(tempfile.mkdtemp(prefix="ckptconv-fuzz-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
atexit.register(shutil.rmtree, _DIR, True)


def _place(reader, data: bytes) -> Path:
    """The reader's minimal source under _DIR/<reader>, `data` in each of its fuzzed files."""
    root = _DIR / reader.name
    for rel, fixed in reader.fuzz:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if fixed is None else fixed)
    return root / reader.fuzz[0][0] if len(reader.fuzz) == 1 else root


def parse_any(data: bytes):
    """Feed `data` to every parser and reader; return normally or raise CkptError, nothing else."""
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
    store = _DIR / "ocdbt"          # an OCDBT manifest (readers/ocdbt.py: a format, not a reader)
    store.mkdir(exist_ok=True)
    (store / ocdbt.MANIFEST).write_bytes(data)
    try:
        ocdbt.OcdbtStore(store)
    except CkptError:
        pass
    for reader in readers().values():
        try:
            ckpt = reader.load(_place(reader, data), ReadOptions())
            for t in ckpt.tensors:  # touching every tensor's bytes must stay inside the file
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
