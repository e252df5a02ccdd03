"""Hostile and broken input, interrupted and concurrent runs, full disks: refused with exit 2 and one
line, nothing executed, nothing lost, nothing half-written, no OUT left. (Issue 12's classes of attack
are in test_trust.py; hostile outputs handed to verify in test_verify_hostile.py.)"""
import io
import json
import os
import pickle
import resource
import signal
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from ckptconv.errors import BadInput, UnsafePickle
from ckptconv.limits import Budget
from ckptconv.io.mapped import MappedFile
from ckptconv.readers import ziparchive
from ckptconv.readers.pickle import unpickler
from tests.fixtures import attacks
from tests.fixtures.attacks import Reduce
from tests.helpers import ROOT, run


# --- pickles and containers that ask for code, lie about sizes or are cut short

def _attacks(canary):
    import builtins
    import subprocess
    cmd = f"touch {canary}"
    return {
        "os.system": Reduce(os.system, (cmd,)),
        "posix.system": Reduce(__import__("posix").system, (cmd,)),
        "subprocess": Reduce(subprocess.call, (["touch", str(canary)],)),
        "builtins.exec": Reduce(builtins.exec, (f"open({str(canary)!r}, 'w')",)),
        "builtins.eval": Reduce(builtins.eval, (f"open({str(canary)!r}, 'w')",)),
    }


@pytest.mark.parametrize("attack", ["os.system", "posix.system", "subprocess", "builtins.exec", "builtins.eval"])
@pytest.mark.parametrize("legacy", [False, True])
def test_malicious_torch_file_refused(tmp_path, attack, legacy):
    canary = tmp_path / "canary"
    src = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(3), "payload": _attacks(canary)[attack]}, src,
               _use_new_zipfile_serialization=not legacy)
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("ckptconv: error: ")
    assert str(src) in r.stderr and "not on the allowlist" in r.stderr and "offset" in r.stderr
    assert not canary.exists()
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.pt"]


def test_truncated_zip_refused_and_no_output(tmp_path):
    src = tmp_path / "w.pt"
    torch.save({"w": torch.arange(100000, dtype=torch.float32)}, src)
    data = src.read_bytes()
    for cut in (len(data) // 2, len(data) - 10, 100):
        bad = tmp_path / f"cut{cut}.pt"
        bad.write_bytes(data[:cut])
        r = run("convert", bad, tmp_path / "out", "--from", "torch")
        assert r.exit_code == 2, r.stderr
        assert str(bad) in r.stderr and r.stderr.count("\n") == 1
        assert not (tmp_path / "out").exists()


def test_compressed_entry_refused(tmp_path):
    src = tmp_path / "w.pt"
    torch.save({"w": torch.ones(10)}, src)
    repacked = tmp_path / "repacked.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(repacked, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            zout.writestr(item.filename, zin.read(item))
    r = run("convert", repacked, tmp_path / "out")
    assert r.exit_code == 2 and "compressed" in r.stderr and r.stderr.count("\n") == 1


def test_deflated_pickle_refused_and_inflation_capped(tmp_path):
    """A repacked archive whose data.pkl is deflated is refused (an inflated pickle builds objects in
    proportion to its inflated size, not to the file). Entries that are read inflated (TorchScript
    source) inflate no further than their declared size and 64x their bytes, to exactly that size."""
    src = tmp_path / "w.pt"
    torch.save({"w": torch.arange(10.0), "note": "x" * 100}, src)
    repacked = tmp_path / "repacked.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(repacked, "w") as zout:
        for item in zin.infolist():
            zout.writestr(item.filename, zin.read(item),
                          zipfile.ZIP_DEFLATED if item.filename.endswith("data.pkl") else zipfile.ZIP_STORED)
    r = run("convert", repacked, tmp_path / "out")
    assert r.exit_code == 2 and "data.pkl is compressed" in r.stderr and r.stderr.count("\n") == 1, r.stderr

    def deflated(name, body, declared=None, tail=b""):
        path = tmp_path / name
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("a/code/x.py", body, zipfile.ZIP_DEFLATED)
        data = bytearray(path.read_bytes())
        if declared is not None:   # the central directory's uncompressed size
            at = data.rindex(b"a/code/x.py") - 46 + 24
            data[at:at + 4] = struct.pack("<I", declared)
        if tail:   # bytes after the deflate stream, inside the entry: the sizes grow to hold them
            entries = ziparchive.read_entries(MappedFile(_written(path, data)))
            e = entries["a/code/x.py"]
            data[e.offset + e.stored:e.offset + e.stored] = tail
            for at in (data.index(b"a/code/x.py") - 30 + 18, data.rindex(b"a/code/x.py") - 46 + 20):
                data[at:at + 4] = struct.pack("<I", e.stored + len(tail))
            cd = data.rindex(b"PK\x01\x02")   # the central directory and its end record move too
            end = data.rindex(b"PK\x05\x06")
            data[end + 16:end + 20] = struct.pack("<I", cd)
        return MappedFile(_written(path, data))

    body = b"#" + b" " * (1 << 20)
    m = deflated("ok.zip", body)
    assert bytes(ziparchive.read_small(m, ziparchive.read_entries(m)["a/code/x.py"])) == body
    for m, fragment in [(deflated("bomb.zip", body, declared=1 << 30), "claims to inflate"),
                        (deflated("tail.zip", body, tail=b"garbage"), "does not inflate to exactly")]:
        with pytest.raises(BadInput, match=fragment):
            ziparchive.read_small(m, ziparchive.read_entries(m)["a/code/x.py"])


def _written(path, data):
    path.write_bytes(bytes(data))
    return path


def test_tensor_reaching_past_its_storage_refused(tmp_path):
    src = tmp_path / "w.pt"
    torch.save({"w": torch.ones(10)}, src)
    buf = io.BytesIO()
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zout:
        for item in zin.infolist():
            body = zin.read(item)
            if item.filename.endswith("data.pkl"):
                assert body.count(b"K\n\x85") == 1
                body = body.replace(b"K\n\x85", b"K\x64\x85")  # size (10,) -> (100,), storage stays 10
            zout.writestr(item.filename, body)
    bad = tmp_path / "lying.pt"
    bad.write_bytes(buf.getvalue())
    r = run("convert", bad, tmp_path / "out")
    assert r.exit_code == 2 and "beyond its storage" in r.stderr


# --- the unpickler itself


PLAIN = [
    None, True, 1, -7, 2**70, 1.5, "text", "ünï", b"bytes", bytearray(b"ba"), (), (1,), (1, 2), (1, 2, 3),
    [1, [2, 3]], {"a": {"b": [1, 2]}}, {1, 2}, frozenset({3}), {"k": (1.0, "x", None)},
    [[[]], [(), [1, frozenset({(1, "a")})]], {"s": {(2, 3)}, "t": (([],), {})}],  # marks inside marks
]


@pytest.mark.parametrize("protocol", range(0, 6))
def test_plain_values_round_trip_every_protocol(protocol):
    for value in PLAIN:
        got = unpickler.load(pickle.dumps(value, protocol=protocol), unpickler.BENIGN, "<mem>")
        assert got == value and type(got) is type(value), (protocol, value, got)


@pytest.mark.parametrize("protocol", range(0, 6))
def test_shared_references_preserved(protocol):
    shared = [1, 2]
    got = unpickler.load(pickle.dumps({"a": shared, "b": shared, "t": (shared, "x"), "u": ("x",)},
                                      protocol=protocol), {}, "<mem>")
    assert got["a"] is got["b"] is got["t"][0] and got["u"] == ("x",)


def test_only_memo_entries_read_back_are_kept():
    """torch.save memoizes ~8 objects per tensor and reads back a handful: the run keeps only the
    keys the stream ever GETs (fetched_memo steps over the opcodes, building nothing)."""
    buf = io.BytesIO()
    torch.save({f"t{i}": torch.zeros(2) for i in range(500)}, buf)
    with zipfile.ZipFile(buf) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    keys = unpickler.fetched_memo(memoryview(data))
    puts = sum(1 for op, _, _ in __import__("pickletools").genops(data) if "PUT" in op.name)
    assert keys is not None and len(keys) < 20 < 4000 < puts
    shared = [1]
    data = pickle.dumps([shared, shared, {"k": shared}], protocol=4)   # MEMOIZE, no PUT
    assert unpickler.fetched_memo(memoryview(data)) == {1}
    got = unpickler.load(data, {}, "<mem>")
    assert got[0] is got[1] is got[2]["k"]


def test_memo_bound_counts_the_entries_kept():
    """max_memo bounds memory: entries never read back are not kept, so they do not count."""
    unread = b"\x80\x04]" + b"N\x940" * 20 + b"."        # 20 MEMOIZEs, no GET
    assert unpickler.load_prefix(unread, unpickler.BENIGN, "x", max_memo=10)[0] == []
    read_back = b"\x80\x02]" + b"".join(b"Nq%c0h%c0" % (i, i) for i in range(20)) + b"."   # 20 PUTs, each GET
    with pytest.raises(BadInput, match="memo index 10 out of range"):
        unpickler.load_prefix(read_back, unpickler.BENIGN, "x", max_memo=10)


def test_records_of_tuples_nothing_holds_are_let_go():
    """Every call's arguments (a nested tuple per tensor in torch.save) have their depth and size
    recorded; once nothing but the record holds one it is dropped, and one still held stays."""
    transient = b"".join(b"K\x01\x85\x850" for _ in range(20000))     # (1,) in a 1-tuple, popped
    ctx = unpickler.Context("x", 0, Budget("x", 10 ** 6))
    held = ctx.tuple([ctx.tuple([1]), 2])
    for _ in range(20000):
        ctx.tuple([(1,), 2])
    from ckptconv.readers.pickle import context
    assert len(ctx._shape) < 2 * context._SWEEP_MIN and ctx._shape[id(held)][0] is held
    # a tuple shared on the stack (DUP) is still held: sweeps in between do not hide its expansion
    bomb = b"\x80\x02" + transient + b"N" + b"2\x86" * 64 + b"."
    with pytest.raises(BadInput, match="expands to"):
        unpickler.load(bomb, {}, "bomb.pkl")
    assert unpickler.load(b"\x80\x02" + transient + b"N.", {}, "ok.pkl") is None


@pytest.mark.parametrize("data, expect", [
    (b"\x80\x04]\x94}q\x0700h\x00.", []),       # MEMOIZE (key 0) beside a PUT (key 7): everything stored
    (b"\x80\x02]q\x00h\x00", None),              # no STOP: the run reports it
    (b"\x80\x02\xff.", None),                      # not an opcode
    (b"\x80\x02X\xff\xff\xff\x7f.", None),      # a length past the end
])
def test_memo_scan_falls_back_to_storing_everything(data, expect):
    assert unpickler.fetched_memo(memoryview(data)) is None
    if expect is not None:
        assert unpickler.load(data, {}, "<mem>") == expect
    else:
        with pytest.raises(BadInput):
            unpickler.load(data, {}, "<mem>")


@pytest.mark.parametrize("data, needle", [
    (b"\x80\x02cos\nsystem\nq\x00.", "'os.system' is not on the allowlist"),
    (b"\x80\x04\x8c\x08builtins\x94\x8c\x04exec\x94\x93\x94.", "'builtins.exec'"),
    (b"\x80\x02\x82\x01.", "EXT1"),
    (b"\x80\x02K\x01Q.", "persistent id"),
    (b"\x80\x05\x97.", "out-of-band"),
    (b"\x80\x02(i__main__\nEvil\n.", "'__main__.Evil'"),
    (b"\x80\x02K\x01)R.", "REDUCE on a int"),
    (b"\x80\x02}K\x01b.", "BUILD"),
])
def test_hostile_opcodes_refused(data, needle):
    with pytest.raises(UnsafePickle) as e:
        unpickler.load(data, {}, "evil.pkl")
    assert needle in str(e.value) and "evil.pkl" in str(e.value) and "offset" in str(e.value)


@pytest.mark.parametrize("data", [b"", b"\x80\x02", b"\x80\x02K", b"\x80\x02B\xff\xff\xff\x7f", b"\x80\x02h\x05.",
                                  b"\x80\x02(.", b"\x80\x02e.", b"\x80\x02\x8e\xff\xff\xff\xff\xff\xff\xff\xff."])
def test_malformed_pickles_are_clean_errors(data):
    with pytest.raises(BadInput):
        unpickler.load(data, {}, "bad.pkl")


# --- interrupted, concurrent and starved runs

@pytest.fixture(scope="module")
def dcp_template(tmp_path_factory):
    import torch.distributed.checkpoint as dcp
    d = tmp_path_factory.mktemp("dcp-template") / "ckpt"
    dcp.save({"w": torch.ones(4), "step": 5}, checkpoint_id=d)
    return d


ATTACKS = list(attacks.attacks(Path("/nonexistent")))
# What the one-line refusal must name for each attack: the global or opcode that gives it away.
NAMED = {"os.system": "'os.system'", "posix.system": "'posix.system'", "subprocess": "'subprocess.call'",
         "builtins.exec": "'builtins.exec'", "builtins.eval": "'builtins.eval'", "getattr-chain": "'builtins.getattr'",
         "importlib": "'importlib.import_module'", "runpy": "'runpy._run_code'",
         "marshal-function": "'types.FunctionType'", "nested-pickle.loads": "'pickle.loads'",
         "numpy-build-setattr": "'os.system'", "memo-stack-global": "'os.system'", "inst-unknown-class": "'os.system'",
         "obj-unknown-class": "'os.system'", "newobj_ex-allowlisted-function": "collections.OrderedDict",
         "ext-opcode": "EXT1", "persid-unexpected": "persistent id 'os.system'",
         "binpersid-unexpected": "persistent id ('module', 'os')"}


@pytest.mark.parametrize("container", attacks.CONTAINERS)
@pytest.mark.parametrize("attack", ATTACKS)
def test_attack_corpus_refused_everywhere(tmp_path, dcp_template, container, attack):
    canary = tmp_path / "canary"
    pkl = attacks.attacks(canary)[attack]
    src = attacks.write_container(container, pkl, tmp_path / "src", dcp_template)
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("ckptconv: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert str(tmp_path / "src") in r.stderr, r.stderr
    assert NAMED[attack] in r.stderr and "refused" in r.stderr and "offset" in r.stderr, r.stderr
    assert not canary.exists()
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


# --- zip container abuse


def _zip(entries, **kw) -> bytes:
    import io
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in entries:
            if kw.get("zip64"):
                with z.open(name, "w", force_zip64=True) as f:
                    f.write(data)
            else:
                z.writestr(name, data)
    return buf.getvalue()


def _entries(data: bytes, tmp_path):
    p = tmp_path / "x.pt"
    p.write_bytes(data)
    return ziparchive.read_entries(MappedFile(p))


@pytest.mark.parametrize("names, needle", [
    (["archive/../evil.pkl"], "escapes the archive"),
    (["/abs/data.pkl"], "absolute"),
    (["archive/data.pkl", "archive/data.pkl"], "appears twice"),
    (["archive/data.pkl", "archive/data/0", "archive/data/0"], "appears twice"),   # a numbered storage
])
def test_zip_bad_names(tmp_path, names, needle):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = _zip([(n, b"x") for n in names])
    with pytest.raises(BadInput, match=needle):
        _entries(data, tmp_path)


def test_zip_central_directory_disagrees_with_local_header(tmp_path):
    data = bytearray(_zip([("archive/a", b"aaaa"), ("archive/b", b"bbbb")]))
    cd = data.rfind(b"PK\x01\x02")  # the second central record: point it at the first local header
    struct.pack_into("<I", data, cd + 42, 0)
    with pytest.raises(BadInput, match="disagrees"):
        _entries(bytes(data), tmp_path)


def test_zip_size_beyond_file(tmp_path):
    data = bytearray(_zip([("archive/a", b"aaaa")]))
    cd = data.rfind(b"PK\x01\x02")
    struct.pack_into("<II", data, cd + 20, 10**9, 10**9)
    with pytest.raises(BadInput, match="beyond the end of the file"):
        _entries(bytes(data), tmp_path)


def test_zip_overlapping_entries(tmp_path):
    data = bytearray(_zip([("archive/a", b"a" * 100), ("archive/b", b"bbbb")]))
    cd = data.find(b"PK\x01\x02")
    struct.pack_into("<II", data, cd + 20, 200, 200)  # a's data now runs over b's local header
    with pytest.raises(BadInput, match="overlap|disagree|beyond"):
        _entries(bytes(data), tmp_path)


def test_zip64_accepted_and_broken_zip64_refused(tmp_path):
    data = _zip([("archive/data.pkl", b"\x80\x02}q\x00."), ("archive/version", b"3\n")], zip64=True)
    entries = _entries(data, tmp_path)
    assert entries["archive/data.pkl"].size == 6
    broken = bytearray(data)
    cd = broken.find(b"PK\x01\x02")
    struct.pack_into("<II", broken, cd + 20, 0xFFFFFFFF, 0xFFFFFFFF)  # needs a ZIP64 field it does not have
    struct.pack_into("<H", broken, cd + 30, 0)  # drop the extra field length
    with pytest.raises(BadInput):
        _entries(bytes(broken), tmp_path)


# --- safetensors header abuse


F4 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize("header, data, claimed, needle", [
    ({"a": F4}, b"\0" * 8, 10**6, "claims"),
    (None, b"", None, "not valid JSON"),
    ({"a": F4, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, None, "overlaps"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 80]}}, b"\0" * 8, None, "outside"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None, "needs 12 bytes"),
    ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "invalid shape"),
    ({"a": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 8]}}, b"\0" * 8, None, "invalid shape"),
    ({"a": {"dtype": "Q8", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "unknown dtype"),
])
def test_safetensors_header_abuse(tmp_path, header, data, claimed, needle):
    p = tmp_path / "bad.safetensors"
    if header is None:
        p.write_bytes(struct.pack("<Q", 5) + b"{nope" + data)
    else:
        p.write_bytes(attacks.safetensors_file(header, data, claimed))
    r = run("convert", p, tmp_path / "out", "--from", "safetensors")
    assert r.exit_code == 2 and needle in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_safetensors_duplicate_names(tmp_path):
    p = tmp_path / "dup.safetensors"
    text = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}'
    p.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 8)
    r = run("inspect", p)
    assert r.exit_code == 2 and "names 'a' twice" in r.stderr


# --- interrupted, concurrent and failing runs


def _tmp_bytes(tmp: Path) -> int:
    try:
        return sum(f.stat().st_size for f in tmp.iterdir())
    except FileNotFoundError:
        return 0


@pytest.mark.parametrize("kill_after_mb", [1, 60, 130, 190])
def test_sigkill_leaves_nothing_that_looks_finished(big_pt, tmp_path, kill_after_mb):
    out = tmp_path / "out"
    tmp = tmp_path / ".out.ckptconv-tmp"
    proc = subprocess.Popen([sys.executable, "-m", "ckptconv.cli", "convert", big_pt, out, "--quiet",
                             "--max-shard-size", "16MiB"], cwd=ROOT)
    while proc.poll() is None and _tmp_bytes(tmp) < kill_after_mb * 2**20:
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if out.exists():  # it finished before the kill: then it must be complete
        assert run("verify", out).exit_code == 0
    else:
        assert not (out / "manifest.json").exists()
    # the next run recognises the leftovers, cleans them up and succeeds
    r = run("convert", big_pt, out, "--quiet", "--max-shard-size", "16MiB", "--overwrite")
    assert r.exit_code == 0, r.stderr
    assert run("verify", out).exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_resume_reuses_verified_shards(big_pt, tmp_path):
    out = tmp_path / "out"
    tmp = tmp_path / ".out.ckptconv-tmp"
    proc = subprocess.Popen([sys.executable, "-m", "ckptconv.cli", "convert", big_pt, out, "--quiet",
                             "--max-shard-size", "16MiB"], cwd=ROOT)
    while proc.poll() is None and not (tmp / ".ckptconv-journal.json").exists():
        time.sleep(0.001)
    while proc.poll() is None and _tmp_bytes(tmp) < 100 * 2**20:
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if out.exists():
        pytest.skip("the conversion finished before it could be killed")
    journal = json.loads((tmp / ".ckptconv-journal.json").read_text())
    # corrupt one finished shard: resume must re-verify and redo it, not trust it
    first, *rest = sorted(journal["files"])
    with open(tmp / first, "r+b") as f:
        f.seek(1000)
        f.write(b"\xff")
    # and give another well-formed but wrong tensor digests (rotated): they are recomputed, not believed
    redone = {first}
    if rest:
        row = journal["digests"][rest[0]]
        journal["digests"][rest[0]] = row[64:] + row[:64] if len(row) > 64 else "0" * 64
        (tmp / ".ckptconv-journal.json").write_text(json.dumps(journal))
        redone.add(rest[0])
    r = run("convert", big_pt, out, "--max-shard-size", "16MiB", "--resume", "--json")
    assert r.exit_code == 0, r.stderr
    summary = json.loads(r.stdout)
    expected = sum(v["size"] for k, v in journal["files"].items() if k not in redone)
    assert summary["resumed_bytes"] == expected and expected > 0
    assert run("verify", out).exit_code == 0
    fresh = tmp_path / "fresh"
    assert run("convert", big_pt, fresh, "--quiet", "--max-shard-size", "16MiB").exit_code == 0
    for f in sorted(fresh.iterdir()):
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name


def test_lock_stops_a_second_run_and_stale_locks_are_taken_over(big_pt, tmp_path):
    out = tmp_path / "out"
    lock = tmp_path / ".out.ckptconv-lock"
    lock.write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename}))
    r = run("convert", big_pt, out)
    assert r.exit_code == 2 and f"pid {os.getpid()}" in r.stderr and not out.exists()
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock.write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename}))
    (tmp_path / ".out.ckptconv-tmp").mkdir()
    (tmp_path / ".out.ckptconv-tmp" / "junk").write_text("left by a killed run")
    r = run("convert", big_pt, out, "--quiet")
    assert r.exit_code == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_source_changing_during_conversion_is_detected(big_pt, tmp_path):
    import contextlib
    import ckptconv
    src = tmp_path / "src.pt"
    src.write_bytes(big_pt.read_bytes())
    calls = []

    @contextlib.contextmanager
    def touching_progress(total, desc, quiet=False):
        def update(n):
            if not calls:
                with open(src, "ab") as f:
                    f.write(b"appended while converting")
            calls.append(n)
        yield update

    with pytest.raises(BadInput, match="changed while it was being read"):
        ckptconv.convert(src, tmp_path / "out", progress=lambda total: touching_progress(total, ""))
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.ckptconv-tmp").exists()


def test_file_size_limit_gives_exit_2_and_no_output(big_pt, tmp_path):
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20 * 2**20, 20 * 2**20))

    r = subprocess.run([sys.executable, "-m", "ckptconv.cli", "convert", big_pt, tmp_path / "out", "--quiet"],
                       capture_output=True, text=True, preexec_fn=limit, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert "model.safetensors" in r.stderr and "File too large" in r.stderr
    assert r.stderr.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_unreadable_inputs(tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    r = run("convert", tmp_path / "dangling", tmp_path / "out")
    assert r.exit_code == 2 and "no such file" in r.stderr
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    r = run("convert", fifo, tmp_path / "out", "--from", "torch")
    assert r.exit_code == 2 and str(fifo) in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_link_in_the_temporary_directory_is_not_written_through(tmp_path):
    """`--resume` keeps what a killed run left beside OUT; a link put there under a shard's name
    used to be written through (the file it pointed to, outside OUT, was overwritten) and published.
    What --resume cannot reuse is removed first (a link itself, never what it points to): the file
    outside is untouched, and OUT holds a shard of its own."""
    src = tmp_path / "m.pt"
    torch.save({"a": torch.ones(4)}, src)
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep me")
    (tmp_path / ".out.ckptconv-tmp").mkdir()
    (tmp_path / ".out.ckptconv-tmp" / "model.safetensors").symlink_to(outside)
    r = run("convert", src, tmp_path / "out", "--resume")
    assert r.exit_code == 0, r.stderr
    assert outside.read_bytes() == b"keep me"
    shard = tmp_path / "out" / "model.safetensors"
    assert shard.is_file() and not shard.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt", "out", "outside.txt"]
