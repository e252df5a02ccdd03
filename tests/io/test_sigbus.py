"""A source truncated while it is read through its mapping: exit 2 and one line, never death by SIGBUS.

Each case runs the CLI in a fresh process (a driver: `sys.executable -c`) that patches one function
to truncate a file once, at a known point of the run, then calls `ckptconv.cli.main`; the driver
writes its exit status and `mapped.changed_files()` to a JSON file, so the test also sees that the
read went through the guard (the file is named there) and not only that the run failed.
"""
import importlib.util
import json
import mmap
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from ckptconv import cli
from ckptconv.io import mapped
from tests.fixtures import grok as gf
from tests.helpers import ROOT, run

needs_guard = pytest.mark.skipif(not mapped.GUARDED, reason="ckptconv._mapguard is not built (no C compiler, "
                                 "or not Linux): mapped inputs are unguarded")

# The driver. argv: RESULT TARGET HOOK CLI-ARGS...; HOOK says when TARGET is cut to 4096 bytes:
#   blocks: after the first block the writer gathered from a mapping (layouts/files.py iter_blocks)
#   feed:   after the first chunk verify handed to the hash threads (HashLanes.feed)
DRIVER = r"""
import json, os, sys
from ckptconv import cli
from ckptconv.io import hashing, mapped
from ckptconv.layouts import files as writer
result, target, hook, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
cut = []

def truncate_once():
    if not cut:
        cut.append(os.path.getsize(target))
        os.truncate(target, 4096)

if hook == "blocks":
    real_blocks = writer.iter_blocks
    def iter_blocks(t, limit):
        for block in real_blocks(t, limit):
            yield block
            truncate_once()
    writer.iter_blocks = iter_blocks
else:
    real_feed = hashing.HashLanes.feed
    def feed(self, *a, **kw):
        futures = real_feed(self, *a, **kw)
        truncate_once()
        return futures
    hashing.HashLanes.feed = feed

code = 0
try:
    cli.main(args, prog_name="ckptconv")
except SystemExit as e:
    code = e.code
finally:
    with open(result, "w") as f:
        json.dump({"code": code, "cut_from": cut, "changed": mapped.changed_files()}, f)
sys.exit(code)
"""

# Whether cli.py maps whatever a command raised (or reported) after the guard read zeros to
# "FILE: changed while it was being read" (`mapped.changed_files()`); until it does, the one case
# where nothing else notices the change (verify, which reports the wrong digests and exits 1) is
# an expected failure.
CLI_MAPS_CHANGES = "changed_files" in Path(cli.__file__).read_text()


def drive(tmp_path, target, hook, *args):
    result = tmp_path / "result.json"
    r = subprocess.run([sys.executable, "-c", DRIVER, result, target, hook, *map(str, args), "--quiet"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode >= 0, f"killed by signal {-r.returncode}: {r.stderr}"   # -7 was SIGBUS
    info = json.loads(result.read_text())
    assert info["cut_from"], "the hook never ran: nothing was truncated"
    return r, info


def assert_refused(r, info, target):
    """Exit 2, exactly one line naming the file, and the guard saw the vanished pages."""
    assert str(target) in info["changed"], f"the guard recorded no hit for {target}: {info}"
    assert "unexpected" not in r.stderr, r.stderr
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert str(target) in lines[0] and "changed while it was being read" in lines[0], r.stderr


def assert_nothing_left(work):
    """OUT absent, and neither `.OUT.ckptconv-tmp` nor `.OUT.ckptconv-lock`."""
    assert sorted(p.name for p in work.iterdir()) == [], sorted(p.name for p in work.iterdir())


def convert_case(tmp_path, src, target, *options):
    work = tmp_path / "work"
    work.mkdir()
    r, info = drive(tmp_path, target, "blocks", "convert", src, work / "out", *options)
    assert_refused(r, info, target)
    assert_nothing_left(work)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Tensors the writer gathers in two 16 MiB blocks: a transposed float32 one (strided views of
    the mapping, 32 MiB), and a contiguous float32 one in a torch file and in a safetensors file
    (read through the mapping when cast: 48 MiB, 24 MiB once cast to bf16)."""
    torch = pytest.importorskip("torch")
    from safetensors.numpy import save_file
    d = tmp_path_factory.mktemp("sigbus")
    g = torch.Generator().manual_seed(0)
    torch.save({"w": torch.randn(2048, 4096, generator=g).t()}, d / "strided.pt")
    torch.save({"w": torch.randn(6144, 2048, generator=g)}, d / "f32.pt")
    save_file({"w": np.random.default_rng(0).standard_normal((6144, 2048), dtype=np.float32)}, d / "f32.safetensors")
    return d


def copy(sources, tmp_path, name) -> Path:
    (tmp_path / "src").mkdir()
    return Path(shutil.copy(sources / name, tmp_path / "src" / name))


@needs_guard
def test_strided_torch_tensor_truncated_mid_convert(sources, tmp_path):
    src = copy(sources, tmp_path, "strided.pt")
    convert_case(tmp_path, src, src)


@needs_guard
def test_cast_truncated_mid_convert(sources, tmp_path):
    src = copy(sources, tmp_path, "f32.pt")
    convert_case(tmp_path, src, src, "--dtype", "bf16")


@needs_guard
def test_safetensors_cast_truncated_mid_convert(sources, tmp_path):
    src = copy(sources, tmp_path, "f32.safetensors")
    convert_case(tmp_path, src, src, "--dtype", "bf16")


@needs_guard
def test_grok_dequantize_truncated_mid_convert(tmp_path):
    """The first dequantized weight is gathered, then the file of another one (64 KiB of int8 and
    its scales, parsed already) loses everything past its first page."""
    ckpt = gf.write_dir(tmp_path / "src", gf.make_params(layers=1))
    target = ckpt / "tensor00004_000"   # moe/linear_v/w, dequantized after moe/linear/w
    convert_case(tmp_path, ckpt.parent, target, "--dequantize", "bf16")


@needs_guard
def test_verify_with_a_shard_truncated_while_hashed(sources, tmp_path):
    out = tmp_path / "out"
    assert run("convert", sources / "f32.safetensors", out, "--quiet").exit_code == 0
    shard = out / "model.safetensors"
    r, info = drive(tmp_path, shard, "feed", "verify", out)
    assert str(shard) in info["changed"], info
    assert "unexpected" not in r.stderr, r.stderr
    if not CLI_MAPS_CHANGES and r.returncode == 1:
        # Survived, and the guard named the shard, but verify reports the zeros' wrong digests
        # (exit 1): exit 2 and the one line need cli.py to consult mapped.changed_files().
        pytest.xfail("needs the cli.py integration of mapped.changed_files()")
    assert_refused(r, info, shard)


# The guard itself, each in a fresh process (a fault is process-wide; a hit recorded here would
# also be reported to later in-process runs).

GUARD_SCRIPT = r"""
import mmap, os, sys
import numpy as np
from ckptconv.io import mapped
path = sys.argv[1]
with open(path, "wb") as f:
    f.write(os.urandom(1 << 20))
m = mapped.MappedFile(path)
a = np.frombuffer(m.view, np.uint8)
before = a[8000:8192].copy()
assert m.hits == 0 and m.unchanged()
os.truncate(path, 8192)
assert not a[8192:].any() and int(a[-1]) == 0        # pages past the new end read as zeros
assert (a[8000:8192] == before).all()                 # the rest of the file is still there
assert m.hits > 0 and not m.unchanged()
assert mapped.changed_files() == [path]
del a, m                                              # released: still reported, until forgotten
assert mapped.changed_files() == [path]
mapped.forget_changes()
assert mapped.changed_files() == []
if sys.argv[2:] == ["outside"]:                       # a mapping that is not registered
    with open(path, "wb") as f:
        f.write(bytes(1 << 20))
    with open(path, "rb") as f:
        raw = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    os.truncate(path, 0)
    print("faulting", flush=True)
    raw[100000]
    print("survived", flush=True)
print("ok", flush=True)
"""


@needs_guard
def test_guard_reads_zeros_past_the_new_end(tmp_path):
    r = subprocess.run([sys.executable, "-c", GUARD_SCRIPT, tmp_path / "f"], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@needs_guard
@pytest.mark.parametrize("faulthandler", [False, True])
def test_fault_outside_registered_ranges_still_kills(tmp_path, faulthandler):
    """Only registered mappings are guarded: any other SIGBUS goes to the handler that was there
    before (faulthandler's: it prints the traceback) or gets the default action."""
    flags = ["-X", "faulthandler"] if faulthandler else []
    r = subprocess.run([sys.executable, *flags, "-c", GUARD_SCRIPT, tmp_path / "f", "outside"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == -signal.SIGBUS, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.split() == ["faulting"]
    assert ("Fatal Python error: Bus error" in r.stderr) == faulthandler, r.stderr


@needs_guard
def test_full_table_leaves_files_unguarded_but_working(tmp_path):
    from ckptconv import _mapguard
    anon = mmap.mmap(-1, mmap.PAGESIZE)
    held = []
    with pytest.raises(OverflowError, match="table is full"):
        for _ in range(_mapguard.CAPACITY + 1):
            held.append(_mapguard.Guard(anon, "anon"))
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10000)
    m = mapped.MappedFile(path)
    assert m._guard is None and bytes(m.view[9998:]) == b"xx" and m.hits == 0 and m.unchanged()
    held.clear()
    n = mapped.MappedFile(path)
    assert n._guard is not None and bytes(n.view[:2]) == b"xx"
    assert mapped.changed_files() == []


def test_guard_is_built():
    """`make setup` compiles the guard wherever there is a C compiler (CI has one); skipped only
    where the package cannot have it."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the guard is Linux-only")
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}): the package installs unguarded")
    assert importlib.util.find_spec("ckptconv._mapguard") is not None, \
        "ckptconv._mapguard was not built: rerun `.venv/bin/python -m pip install -e .` (make setup)"
    assert mapped.GUARDED
