"""Shard files written with O_DIRECT through the staging pool: the bytes, the fallbacks, the errors."""
import contextlib
import errno
import itertools
import os
import random

import pytest

from ckptconv.io import outfile
from ckptconv.errors import OutputError
from ckptconv.io.outfile import ALIGN, OutFile, StagingPool


def _pieces(seed, count, largest):
    rng = random.Random(seed)
    sizes = [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, 3 * ALIGN] + [rng.randrange(largest) for _ in range(count)]
    rng.shuffle(sizes)
    return [rng.randbytes(n) for n in sizes]


def write(f, data):
    """What Pipeline.push does, less the hashing: the bytes staged a buffer at a time."""
    data, done = memoryview(data), 0
    while done < len(data):
        def copy(view, start=done):
            view[:] = data[start:start + len(view)]
        staged, lease = f.stage(copy, len(data) - done)
        lease.let_go()
        done += len(staged)


@pytest.fixture
def pool():
    pool = StagingPool(buffers=2, size=4 * ALIGN, threads=2)  # tiny, so pieces cross buffers and wait for them
    yield pool
    pool.close()


def test_direct_writes_every_byte_in_order(tmp_path, pool):
    path = tmp_path / "shard"
    f = OutFile(path, pool)
    if not f.direct:
        pytest.skip("this filesystem has no O_DIRECT")
    pieces = _pieces(0, 60, 9 * ALIGN)
    for p in pieces:
        write(f, p)
    f.close()
    assert path.read_bytes() == b"".join(pieces)


def test_many_files_interleaved_share_a_small_pool(tmp_path, pool):
    """Writes to twenty files in turn through two buffers: no deadlock, each file exact (reshard
    writes every rank's file side by side, and memory must not grow with their number)."""
    files = [OutFile(tmp_path / f"f{i}", pool) for i in range(20)]
    expected = [[] for _ in files]
    for round_, piece in enumerate(_pieces(1, 200, 6 * ALIGN)):
        i = round_ % len(files)
        write(files[i], piece)
        expected[i].append(piece)
    for f in files:
        f.close(fsync=True)
    for i in range(len(files)):
        assert (tmp_path / f"f{i}").read_bytes() == b"".join(expected[i])


def test_plain_writes(tmp_path, pool):
    path = tmp_path / "shard"
    f = OutFile(path, pool, direct=False)
    assert not f.direct
    pieces = _pieces(2, 20, 3 * ALIGN)
    for p in pieces:
        write(f, p)
    f.close()
    assert path.read_bytes() == b"".join(pieces)


def test_filesystem_refusing_direct_io_at_open_gets_plain_writes(tmp_path, pool, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    f = OutFile(tmp_path / "shard", pool)
    assert not f.direct
    write(f, b"x" * (5 * ALIGN + 3))
    f.close()
    assert (tmp_path / "shard").read_bytes() == b"x" * (5 * ALIGN + 3)


def test_direct_write_refused_or_short_finishes_through_the_page_cache(tmp_path, pool, monkeypatch):
    """EINVAL from a direct write (an alignment the device will not take) and a short, unaligned
    write both leave the rest to a plain descriptor at the right offset."""
    path = tmp_path / "shard"
    f = OutFile(path, pool)
    if not f.direct:
        pytest.skip("this filesystem has no O_DIRECT")
    real_pwrite, direct_fd, calls = os.pwrite, f.fd, itertools.count()
    side = os.open(path, os.O_WRONLY)

    def flaky(fd, data, offset):
        n = next(calls)
        if fd == direct_fd and n % 3 == 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        if fd == direct_fd and n % 3 == 2:
            return real_pwrite(side, memoryview(data)[:100], offset)  # the kernel took 100 bytes
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", flaky)
    pieces = _pieces(3, 40, 9 * ALIGN)
    for p in pieces:
        write(f, p)
    f.close()
    os.close(side)
    assert path.read_bytes() == b"".join(pieces)
    assert next(calls) > 3


def test_a_failed_write_is_one_error_naming_the_file(tmp_path, pool, monkeypatch):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    path = tmp_path / "shard"
    f = OutFile(path, pool)
    if not f.direct:
        pytest.skip("this filesystem has no O_DIRECT")
    with pytest.raises(OutputError, match=f"{path}: write failed: No space left on device"):
        for _ in range(100):  # the failure surfaces at a later write or at close
            write(f, b"y" * (4 * ALIGN))
        f.close()
    f.close()  # after a failure, close only lets go of the descriptors
    assert f.fd is None


def test_pool_memory_does_not_grow_with_files(tmp_path, monkeypatch):
    """The staging memory is the pool's: opening more files allocates nothing more."""
    made = []
    real_mmap = outfile.mmap.mmap
    monkeypatch.setattr(outfile.mmap, "mmap", lambda *a, **k: made.append(a) or real_mmap(*a, **k))
    pool = StagingPool(buffers=3, size=2 * ALIGN, threads=1)
    files = [OutFile(tmp_path / f"f{i}", pool) for i in range(16)]
    for f in files:
        write(f, b"z" * (5 * ALIGN + 1))
    for f in files:
        f.close()
    pool.close()
    assert len(made) == 3


def test_write_modes_give_the_same_bytes(torch_fixtures, hf_llama, tmp_path, monkeypatch):
    """Direct and page-cache writes, staging buffers far smaller than the tensors (every piece read
    or gathered a byte range at a time), and hashlib instead of the compiled digests are one output:
    convert and reshard, file for file (manifests and mesh.json included), and the shards pass
    `sha256sum -c`."""
    import subprocess
    from tests.helpers import run
    from ckptconv.io import sha256
    small = (2, 2 * ALIGN, 2)
    for job, src, args in (("convert", torch_fixtures["train"], ["--max-shard-size", "300"]),
                           ("reshard", hf_llama["dir"], ["--tp", "2", "--max-shard-size", "100KB"])):
        outs = []
        for mode, pool, fast in (([], None, sha256.FAST), (["--buffered-io"], None, sha256.FAST),
                                 ([], small, sha256.FAST), ([], None, False)):  # the last: hashlib digests
            if pool:
                monkeypatch.setattr(StagingPool.__init__, "__defaults__", pool)
            monkeypatch.setattr(sha256, "FAST", fast)
            out = tmp_path / f"{job}{len(outs)}"
            r = run(job, src, out, "--quiet", *args, *mode)
            monkeypatch.undo()
            assert r.exit_code == 0, r.stderr
            outs.append(out)
        files = [sorted(p.relative_to(o) for p in o.rglob("*") if p.is_file()) for o in outs]
        assert all(f == files[0] for f in files) and sum(p.suffix == ".safetensors" for p in files[0]) >= 2
        for p in files[0]:
            assert len({(o / p).read_bytes() for o in outs}) == 1, p
        for sums in outs[0].rglob("SHA256SUMS"):
            subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=sums.parent, check=True)


def test_ranges_are_hashed_in_reused_staging_buffers(tmp_path):
    """Source ranges read straight into a two-buffer pool and hashed there, three files in turn: a
    buffer handed out again before its hashes and its write were done would show as a wrong digest
    or wrong bytes."""
    import hashlib
    from ckptconv.io import sha256
    from ckptconv.io.hashing import Pipeline
    from ckptconv.io.mapped import MappedFile
    data = random.Random(5).randbytes(300_000)
    (tmp_path / "src").write_bytes(data)
    pipeline = Pipeline()
    pipeline.staging.close()
    pipeline.staging = StagingPool(buffers=2, size=4 * ALIGN, threads=2)
    files = [OutFile(tmp_path / f"out{i}", pipeline.staging) for i in range(3)]
    file_h, expected = [sha256.new() for _ in files], [b"" for _ in files]
    tap, tensors, rng = sha256.new(), [], random.Random(6)
    with MappedFile(tmp_path / "src").reader() as fill_at:
        for k in range(60):
            start = rng.randrange(len(data))
            end = start + rng.randrange(min(5 * ALIGN, len(data) - start) + 1)
            tensor_h = sha256.new()
            pipeline.push_range(files[k % 3], file_h[k % 3], tensor_h, fill_at, start, end - start, tap)
            expected[k % 3] += data[start:end]
            tensors.append((pipeline.hashes.digest("tensor", tensor_h), data[start:end]))
    pipeline.drain()
    for f in files:
        f.close()
    pipeline.close()
    for i in range(3):
        assert (tmp_path / f"out{i}").read_bytes() == expected[i]
        assert file_h[i].hexdigest() == hashlib.sha256(expected[i]).hexdigest()
    assert all(digest.result() == hashlib.sha256(b).hexdigest() for digest, b in tensors)
    assert tap.hexdigest() == hashlib.sha256(b"".join(b for _, b in tensors)).hexdigest()


def test_a_failed_run_leaves_no_descriptor_open(hf_llama, tmp_path, monkeypatch):
    """Reading fails half-way through a reshard and a convert run in this process: every shard file
    that was open is closed (a long-lived process must not collect descriptors of removed files),
    nothing is published."""
    from ckptconv.errors import BadInput
    from ckptconv.io.mapped import MappedFile
    from tests.helpers import run
    real_reader, calls = MappedFile.reader, itertools.count()

    def failing_reader(self):
        if next(calls) == 5:
            raise BadInput(f"{self.path}: cannot read at byte 0: Input/output error")
        return real_reader(self)

    monkeypatch.setattr(MappedFile, "reader", failing_reader)
    before = set(os.listdir("/proc/self/fd"))
    for job, args in (("reshard", ["--tp", "2"]), ("convert", ["--max-shard-size", "50KB"])):
        calls = itertools.count()
        r = run(job, hf_llama["dir"], tmp_path / job, "--quiet", *args)
        assert r.exit_code == 2 and "Input/output error" in r.stderr, r.stderr
        assert not (tmp_path / job).exists()
    held = []
    for fd in set(os.listdir("/proc/self/fd")) - before:
        with contextlib.suppress(OSError):
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
    assert not [p for p in held if p.startswith(str(tmp_path))], held  # (mapped sources may live on in the traceback)
