"""What tests share besides fixtures: running the CLI (in-process, in a fresh process, or the way an
attacker's victim does: under a memory cap and a time limit with every file it opens recorded),
reading outputs back with the real safetensors library, comparing tensors bit for bit, and the
assertions every refusal must meet."""
import json
import os
import re
import resource
import struct
import subprocess
import sys
import sysconfig
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from click.testing import CliRunner

from ckptconv.cli import main

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "fixtures" / "data"   # recorded inputs and expectations


class Result:
    def __init__(self, code, stdout, stderr):
        self.exit_code, self.stdout, self.stderr = code, stdout, stderr


def run(*args) -> Result:
    """Run the CLI in-process (fast); stdout and stderr kept apart."""
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return Result(r.exit_code, r.stdout, r.stderr)


def run_subprocess(*args, **kw) -> subprocess.CompletedProcess:
    """Run the real console entry point in a fresh process (for exit codes and signals)."""
    return subprocess.run([sys.executable, "-m", "ckptconv.cli", *[str(a) for a in args]],
                          capture_output=True, text=True, cwd=kw.pop("cwd", None), **kw)


def split_all_rules(directory) -> Path:
    """A --rules file that splits every tensor on its first axis (for sources with no model type)."""
    path = Path(directory) / "split-all.toml"
    path.write_text('layout = "torch"\n[[rule]]\npattern = ".*"\naxis = 0\n')
    return path


def output_files(out) -> dict:
    """{tensor: shard file} of an output dir, found as Hugging Face loaders find them: its one
    `*.safetensors.index.json`, or without one its one `.safetensors` file."""
    from safetensors import safe_open
    out = Path(out)
    indexes = sorted(out.glob("*.safetensors.index.json"))
    if indexes:
        assert len(indexes) == 1, indexes
        return json.loads(indexes[0].read_text())["weight_map"]
    (single,) = sorted(out.glob("*.safetensors"))
    with safe_open(single, framework="np") as f:
        return {name: single.name for name in f.keys()}


def load_output(out) -> dict:
    """Every tensor of an output dir, read by the real safetensors library (torch tensors)."""
    from safetensors import safe_open
    tensors = {}
    for name, file in output_files(out).items():
        with safe_open(Path(out) / file, framework="pt") as f:
            tensors[name] = f.get_tensor(name)
    return tensors


def bits(t):
    """A torch tensor's exact bytes, whatever its dtype (for bit-for-bit comparison)."""
    import torch
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same(a, b, name=""):
    assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
    assert tuple(a.shape) == tuple(b.shape), (name, a.shape, b.shape)
    assert bits(a) == bits(b), name


# A normal run of the small checkpoints in the tests needs about 0.25 GiB of address space.
MEMORY_CAP = 1536 << 20

_DRIVER = """
import os, sys
log = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
def hook(event, args):
    if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes, os.PathLike)):
        kind = b"open " if event == "open" else b"list "
        os.write(log, kind + os.fsencode(os.path.abspath(args[0])) + b"\\n")
sys.addaudithook(hook)
from ckptconv.cli import main
main(sys.argv[2:], prog_name="ckptconv")
"""


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    opened: set = field(default_factory=set)   # absolute paths of the files the process opened
    listed: set = field(default_factory=set)   # ... and of the directories it listed


def cli(*args, cwd=ROOT, timeout=120, cap=MEMORY_CAP, env=None, preexec=None, log_dir=None) -> Run:
    """`ckptconv ARGS` in a fresh process with its address space capped and its file opens audited
    (the log goes to `log_dir`, by default beside the process's working directory's tmp)."""
    log = Path(log_dir or os.environ.get("TMPDIR", "/tmp")) / f"ckptconv-opened-{os.getpid()}-{id(args)}.log"
    log.unlink(missing_ok=True)

    def limit():
        if cap:
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        if preexec:
            preexec()

    r = subprocess.run([sys.executable, "-c", _DRIVER, str(log), *map(str, args)], cwd=cwd, capture_output=True,
                       text=True, timeout=timeout, preexec_fn=limit, env=env)
    events = log.read_bytes().decode("utf-8", "surrogateescape").splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return Run(r.returncode, r.stdout, r.stderr, {e[5:] for e in events if e.startswith("open ")},
               {e[5:] for e in events if e.startswith("list ")})


def assert_clean(text: str):
    """No crash: the catch-all says "error: unexpected <Exception>"; no traceback either."""
    assert "error: unexpected" not in text and "Traceback" not in text, text


def assert_refused(r, out: Path, *fragments, code=2, src=None):
    """Exit `code`, exactly one stderr line holding every fragment, and nothing left beside OUT: no
    OUT (unless it existed before: then the caller checks it is untouched), no temporary directory,
    no lock. With `src`, nothing outside SRC and OUT was opened (a `cli` run)."""
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptconv: error: "), r.stderr[-2000:]
    assert_clean(r.stderr)
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert not (out.parent / f".{out.name}.ckptconv-tmp").exists()
    assert not (out.parent / f".{out.name}.ckptconv-lock").exists()
    assert not (out.parent / f".{out.name}.ckptconv-old").exists()
    if src is not None:
        assert opened_outside(r, src, out, out.parent / f".{out.name}.ckptconv-tmp",
                              out.parent / f".{out.name}.ckptconv-lock") == []


_OWN = [Path(p).resolve() for p in {sys.prefix, sys.base_prefix, sysconfig.get_paths()["purelib"],
                                    sysconfig.get_paths()["stdlib"], ROOT / "ckptconv"}]


def opened_outside(r: Run, *allowed) -> list:
    """Files the process opened, or directories it listed, outside `allowed` (and outside Python's
    and ckptconv's own). Listing or opening (to fsync) a directory that holds an allowed one (OUT's
    parent, where its temporary directory and lock live; the working directory, for imports) reads
    nothing of what else it holds."""
    roots = [Path(a).resolve() for a in allowed] + _OWN
    ancestors = {parent for root in roots for parent in root.parents} | {Path.cwd().resolve(), ROOT.resolve()}

    def inside(p):
        return any(Path(p).resolve().is_relative_to(root) for root in roots)

    return sorted(p for p in r.opened | r.listed if not inside(p) and Path(p).resolve() not in ancestors)


def patch_pickle(path, edit):
    """Rewrite the data.pkl of a torch zip in place with `edit(bytes) -> bytes` (same length), its
    CRC-32 fixed in the local header and the central directory, as if the producer had written it."""
    data = bytearray(Path(path).read_bytes())
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    old = bytes(data[start:start + info.file_size])
    new = edit(old)
    assert len(new) == len(old) and new != old
    data[start:start + len(new)] = new
    crc = zlib.crc32(new)
    struct.pack_into("<I", data, info.header_offset + 14, crc)
    for m in re.finditer(rb"PK\x01\x02", bytes(data)):
        at = m.start()
        n = struct.unpack_from("<H", data, at + 28)[0]
        if bytes(data[at + 46:at + 46 + n]) == info.filename.encode():
            struct.pack_into("<I", data, at + 16, crc)
            break
    else:
        raise AssertionError(f"no central directory entry for {info.filename}")
    Path(path).write_bytes(bytes(data))
