"""Issue 12's classes of attack and fault, each built as a hostile input or an unlucky operator's run
and checked on the real CLI in a fresh process (tests/helpers.py): exit 2 and one line, nothing
executed, memory and time bounded, nothing left beside OUT, nothing outside SRC and OUT touched.
(DCP metadata: test_dcp_hostile.py; verify: test_verify_hostile.py; truncation: io/test_sigbus.py.)"""
import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.fixtures import grok as grok_fixtures
from tests.helpers import ROOT, load_output, run
from tests.helpers import assert_clean, assert_refused, cli, opened_outside


def _u(text: str) -> bytes:
    b = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(b)) + b


def _tensor(storage="0", numel=4) -> bytes:
    """Opcodes of `torch._utils._rebuild_tensor_v2` over FloatStorage `storage` (protocol 2)."""
    return (b"ctorch._utils\n_rebuild_tensor_v2\n((" + _u("storage") + b"ctorch\nFloatStorage\n" + _u(storage)
            + _u("cpu") + b"J" + struct.pack("<i", numel) + b"tQK\x00(J" + struct.pack("<i", numel)
            + b"t(K\x01t\x89ccollections\nOrderedDict\n)RtR")


def torch_file(path: Path, body: bytes, storage=b"\0" * 16) -> Path:
    """A torch zip archive whose data.pkl is `{"w": <a 4-float tensor>, <body items>}`."""
    import io
    import zipfile
    pkl = b"\x80\x02}(" + _u("w") + _tensor() + body + b"u."
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/data/0", storage)
        z.writestr("archive/data/1", storage)
        z.writestr("archive/version", "3\n")
    path.write_bytes(buf.getvalue())
    return path


def safetensors_file(path: Path, header: dict, data: bytes = b"") -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


F4 = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
F4_2 = {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}
DEEP = 200_000


def hf_dir(d: Path, index=None, config=None) -> Path:
    """A safetensors directory with an index (or the given index text) and a config.json."""
    d.mkdir()
    safetensors_file(d / "model-00001-of-00001.safetensors", {"a": F4, "b": F4_2}, b"\0" * 8)
    (d / "model.safetensors.index.json").write_text(index if index is not None else json.dumps(
        {"metadata": {}, "weight_map": {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors"}}))
    (d / "config.json").write_text(config if config is not None else '{"model_type": "llama"}')
    return d


# ---------------------------------------------------------------------------------------------
# 1. Nesting is bounded before Python or C recursion is reached


NESTING = {
    "tuple used as a dict key": (lambda p: torch_file(p / "m.pt", _u("k") + b"}N" + b"\x85" * DEEP + b"K\x01s"),
                                 ["convert"], "tuples nested more than 100 deep"),
    "frozensets in frozensets": (lambda p: torch_file(p / "m.pt", _u("k") + b"(" * DEEP + b"\x91" * DEEP),
                                 ["convert"], "frozensets nested more than 100 deep"),
    "list in argparse.Namespace state": (
        lambda p: torch_file(p / "m.pt", _u("args") + b"cargparse\nNamespace\n)\x81}" + _u("x")
                             + b"]" * DEEP + b"a" * (DEEP - 1) + b"sb"),
        ["convert"], "nested more than 100 deep"),
    "dicts in the tensor tree": (lambda p: torch_file(p / "m.pt", _u("d") + (b"}" + _u("k")) * 5000 + b"N" + b"s" * 5000),
                                 ["convert"], "containers nested more than 100 deep"),
    "safetensors __metadata__": (
        lambda p: safetensors_file(p / "m.safetensors", {"__metadata__": "PLACEHOLDER", "a": F4}, b"\0" * 4),
        ["inspect"], "safetensors header nests 200002 levels deep"),
    "shard index": (lambda p: hf_dir(p / "hf", index="[" * DEEP + "]" * DEEP), ["convert"],
                    "shard index nests 200000 levels deep"),
    "config.json read by reshard": (lambda p: hf_dir(p / "hf", config="[" * DEEP + "]" * DEEP),
                                    ["reshard", "--tp", "2"], "config.json nests 200000 levels deep"),
}


@pytest.mark.parametrize("case", sorted(NESTING))
def test_nesting_is_bounded_everywhere(tmp_path, case):
    build, command, fragment = NESTING[case]
    src = build(tmp_path)
    if src.suffix == ".safetensors":  # a JSON header with a deep value in place of the placeholder
        text = src.read_bytes()[8:].replace(b'"PLACEHOLDER"', b'{"a":' + b"[" * DEEP + b"]" * DEEP + b"}")
        src.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 4)
    out = tmp_path / "out"
    r = cli(command[0], src, *([out] if command[0] != "inspect" else []), *command[1:], timeout=120)
    assert_refused(r, out, str(src.name), fragment, src=src)
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# 2. Work and memory are bounded by the bytes present


def test_shared_tuples_cannot_expand(tmp_path):
    """64 x (DUP, TUPLE2): 2**64 leaves from 140 bytes. Refused when built, in bounded time."""
    src = torch_file(tmp_path / "m.pt", _u("a") + b"N" + b"2\x86" * 64)
    r = cli("convert", src, tmp_path / "out", timeout=60)
    assert_refused(r, tmp_path / "out", "m.pt", "expands to", "more than the pickle's", src=src)


def test_shared_lists_are_recorded_once_as_references(tmp_path):
    """The same DAG of lists: 64 objects built, so 64 written; the repeats are {"__ref__": path}."""
    levels = b"]q\x000" + b"".join(b"(h" + bytes([k]) + b"h" + bytes([k]) + b"lq" + bytes([k + 1]) + b"0"
                                    for k in range(64)) + b"h\x40"
    src = torch_file(tmp_path / "m.pt", _u("a") + levels)
    r = cli("convert", src, tmp_path / "out", timeout=60)
    assert r.returncode == 0, r.stderr
    extras = json.loads((tmp_path / "out" / "manifest.json").read_text())["extras"]
    expected = {"a" + ".0" * k + ".1": {"__ref__": "a" + ".0" * (k + 1)} for k in range(63)}
    expected["a" + ".0" * 63 + ".1"] = expected["a" + ".0" * 64] = []  # empty lists are values, not shared
    assert extras == expected
    assert load_output(tmp_path / "out")["w"].tolist() == [0.0] * 4


def test_self_referencing_state_is_recorded_as_a_reference(tmp_path):
    src = torch_file(tmp_path / "m.pt", _u("cfg") + b"}q\x07" + _u("self") + b"h\x07s" + _u("n") + b"K\x05s")
    assert run("convert", src, tmp_path / "out").exit_code == 0
    extras = json.loads((tmp_path / "out" / "manifest.json").read_text())["extras"]
    assert extras == {"cfg.self": {"__ref__": "cfg"}, "cfg.n": 5}


def test_shared_containers_of_tensors_expand_only_within_the_budget(tmp_path):
    """A DAG whose leaves are tensors would need 2**40 names: refused by the pickle's budget."""
    levels = b"(" + _u("t") + _tensor() + b"dq\x000" + b"".join(
        b"(" + _u("a") + b"h" + bytes([k]) + _u("b") + b"h" + bytes([k]) + b"dq" + bytes([k + 1]) + b"0"
        for k in range(40)) + b"h\x28"
    src = torch_file(tmp_path / "m.pt", _u("x") + levels)
    r = cli("convert", src, tmp_path / "out", timeout=60)
    assert_refused(r, tmp_path / "out", "m.pt", "expands far beyond")


def test_grok_expert_count_must_be_justified_by_bytes(tmp_path):
    params = grok_fixtures.make_params(layers=1)
    params["transformer/decoder_layer_0/moe/linear/w"] = np.empty((10**12, 0, 0), np.float32)
    grok_fixtures.write_dir(tmp_path / "grok", params)
    r = cli("convert", tmp_path / "grok", tmp_path / "out", "--layout", "mixtral", timeout=60)
    assert_refused(r, tmp_path / "out", "moe/linear/w", "[1000000000000, 0, 0] cannot be split into experts")


@pytest.mark.parametrize("shape, fragment", [([0, 2**61, 2**61], "spans more than 2**63 bytes"),
                                             ([0] * 33, "more than the 32")])
def test_shapes_no_consumer_loads_are_refused(tmp_path, shape, fragment):
    src = safetensors_file(tmp_path / "z.safetensors", {"z": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})
    r = cli("convert", src, tmp_path / "out")
    assert_refused(r, tmp_path / "out", "z.safetensors", fragment)


# ---------------------------------------------------------------------------------------------
# 3. Metadata work is O(N log N)


@pytest.mark.slow   # (make test-slow: a check of scale)
def test_a_header_of_80000_tensors_parses_in_linear_time(tmp_path):
    n = 80_000
    header = {f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(n)}
    src = safetensors_file(tmp_path / "big.safetensors", header, b"\0" * 4 * n)
    r = cli("inspect", src, "--json", timeout=120)  # quadratic, this took over 2 minutes
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tensor_count"] == n


# ---------------------------------------------------------------------------------------------
# 4. The one-line error cannot be forged


def test_file_content_in_messages_is_escaped_and_bounded(tmp_path):
    """A global whose name forges a summary line: refused by a reader that refuses classes on no
    allowlist (Grok-1's), in one escaped, bounded line; recorded by the torch reader (issue 30), its
    name escaped on the one summary line that lists it."""
    from tests.fixtures.attacks import write_container
    forged = "os\nwrote out/: 4 tensors in 2 files"
    glob = b"\x8c" + bytes([len(forged)]) + forged.encode() + _u("system" + "x" * 10_000) + b"\x93"
    src = write_container("grok", b"\x80\x04" + glob + b".", tmp_path / "grok")
    r = cli("convert", src, tmp_path / "out")
    assert_refused(r, tmp_path / "out", "refused", "os\\nwrote out/", "more characters)")
    assert len(r.stderr) < 2200
    r = cli("convert", torch_file(tmp_path / "m.pt", _u("x") + glob), tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stdout.splitlines() if "os\\nwrote out/" in line][0].startswith("classes on no")
    assert not any(line.startswith("wrote out/") for line in r.stdout.splitlines())


def test_names_with_control_characters_stay_on_one_line(tmp_path):
    src = safetensors_file(tmp_path / "m.safetensors", {"a\nb\x1b[2J": F4}, b"\0" * 4)
    r = run("inspect", src)
    assert r.exit_code == 0 and "a\\nb\\x1b[2J" in r.stdout
    assert all(line.startswith(("  ", str(src), "dtypes")) for line in r.stdout.splitlines()), r.stdout


# ---------------------------------------------------------------------------------------------
# 5. Malformed input is classified


UNCLASSIFIED = {
    "_rebuild_tensor_v2 over an UntypedStorage": (
        b"ctorch._utils\n_rebuild_tensor_v2\n((" + _u("storage") + b"ctorch.storage\nUntypedStorage\n" + _u("1")
        + _u("cpu") + b"J\x10\x00\x00\x00tQK\x00(K\x04t(K\x01t\x89ccollections\nOrderedDict\n)RtR",
        "names no dtype"),
    "_rebuild_tensor_v3 with torch.strided as dtype": (
        b"ctorch._utils\n_rebuild_tensor_v3\n((" + _u("storage") + b"ctorch.storage\nUntypedStorage\n" + _u("0")
        + _u("cpu") + b"J\x10\x00\x00\x00tQK\x00(K\x04t(K\x01t\x89ccollections\nOrderedDict\n)Rctorch\nstrided\ntR",
        "torch.strided, which is not a torch dtype"),
    "a size that is an int": (_tensor().replace(b"K\x00(J\x04\x00\x00\x00t", b"K\x00J\x04\x00\x00\x00"),
                              "size and stride must be sequences"),
    "a negative size": (_tensor().replace(b"(J\x04\x00\x00\x00t(", b"(J\xfc\xff\xff\xfft("), "non-negative"),
    "torch.Size of a string": (b"ctorch\nSize\n(" + _u("ab") + b"tR", "torch.Size of a str"),
    "a name that is not Unicode": (None, "is not valid Unicode text"),
}


@pytest.mark.parametrize("case", sorted(UNCLASSIFIED))
def test_malformed_pickles_are_classified(tmp_path, case):
    item, fragment = UNCLASSIFIED[case]
    body = _u("\ud800") + _tensor() if item is None else _u("x") + item
    src = torch_file(tmp_path / "m.pt", body)
    r = cli("convert", src, tmp_path / "out")
    assert_refused(r, tmp_path / "out", "m.pt", fragment, src=src)


@pytest.mark.parametrize("index, fragment", [
    ({"weight_map": {"a": ["model-00001-of-00001.safetensors"]}}, "names an invalid shard"),
    ({"weight_map": {"a": "../m.safetensors"}}, "names an invalid shard"),
    ({"weight_map": "x"}, "needs a 'weight_map' object"),
    ([1], "needs a 'weight_map' object"),
])
def test_malformed_indexes_are_classified(tmp_path, index, fragment):
    src = hf_dir(tmp_path / "hf", index=json.dumps(index))
    r = cli("convert", src, tmp_path / "out")
    assert_refused(r, tmp_path / "out", "model.safetensors.index.json", fragment, src=src)


def _hostile_program(rng: random.Random, depth=0) -> bytes:
    """A random pickle expression over torch's allowlisted globals: tensor rebuilds with plausible or
    wrong arguments, inert records, containers, storages of every kind."""
    from ckptconv.readers.pickle.torch_globals import torch_globals
    pick = rng.random()
    if depth > 3 or pick < 0.25:
        return rng.choice([b"N", b"\x88", b"J\x03\x00\x00\x00", b"J\xff\xff\xff\xff", _u("w"), _u("\n"), b"C\x02ab",
                           b"\x8a\x08" + struct.pack("<q", 2**40), b"G" + struct.pack(">d", float("nan"))])
    if pick < 0.45:
        return _tensor(rng.choice(["0", "1"]), rng.choice([0, 4, 5, 64])).replace(
            b"K\x00(J", rng.choice([b"K\x00(J", b"K\x03(J", b"J\xff\xff\xff\xff(J"]), 1)
    if pick < 0.6:
        return b"(" + b"".join(_hostile_program(rng, depth + 1) for _ in range(rng.randint(0, 4))) + rng.choice(
            [b"t", b"l", b"d", b"\x91"])
    if pick < 0.7:
        return b"cargparse\nNamespace\n)\x81}(" + _u("x") + _hostile_program(rng, depth + 1) + b"ub"
    module, name = rng.choice(sorted(torch_globals()))
    args = b"(" + b"".join(_hostile_program(rng, depth + 1) for _ in range(rng.randint(0, 7))) + b"t"
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n" + args + rng.choice([b"R", b"\x81"])


def test_random_programs_over_the_allowlist_fail_cleanly(tmp_path):
    """Items a fuzzer would take days to find: calls of allowlisted globals with wrong arguments.
    Each conversion succeeds or is refused with exit 2; none reaches "unexpected"."""
    rng = random.Random(12)
    outcomes = {0: 0, 2: 0}
    for i in range(150):
        src = torch_file(tmp_path / f"m{i}.pt", b"".join(_u(f"k{j}") + _hostile_program(rng) for j in range(2)))
        r = run("convert", src, tmp_path / f"out{i}", "--quiet", "--skip-unsupported")
        assert r.exit_code in outcomes, (i, r.exit_code, r.stderr)
        assert_clean(r.stderr)
        outcomes[r.exit_code] += 1
    assert outcomes[0] and outcomes[2]  # both kinds happened: the programs reach the tensor code


# ---------------------------------------------------------------------------------------------
# 6. Files carried from SRC: regular, inside SRC, no wider permissions, capped


def test_model_files_leading_outside_are_skipped_and_listed(tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text('{"token": "hunter2"}')
    secret.chmod(0o600)
    big = tmp_path / "huge.md"
    with open(big, "wb") as f:
        f.truncate(20 * 10**9)  # sparse
    src = hf_dir(tmp_path / "hf", config="{}")
    (src / "config.json").unlink()
    (src / "config.json").symlink_to(secret)
    (src / "special_tokens_map.json").symlink_to(secret)
    (src / "README.md").symlink_to(big)
    os.mkfifo(src / "pipe.txt")
    (src / "tokenizer.json").write_text("{}")
    (src / "tokenizer.json").chmod(0o600)
    (src / "generation_config.json").write_text("{}")
    with open(src / "notes.bin.txt", "wb") as f:
        f.truncate(300 * 10**6)  # inside SRC but over --max-extra-size
    out = tmp_path / "out"
    r = cli("convert", src, out)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["SHA256SUMS", "generation_config.json", "manifest.json",
                                                      "model.safetensors", "tokenizer.json"]
    assert (out / "tokenizer.json").stat().st_mode & 0o777 == 0o600
    skipped = json.loads((out / "manifest.json").read_text())["source"]["skipped_files"]
    assert {s["name"]: s["reason"] for s in skipped} == {
        "README.md": "a symbolic link leading outside the source",
        "config.json": "a symbolic link leading outside the source",
        "special_tokens_map.json": "a symbolic link leading outside the source",
        "pipe.txt": "not a regular file",
        "notes.bin.txt": "300000000 bytes, more than --max-extra-size 256000000"}
    assert "not carried into OUT: README.md (a symbolic link leading outside the source)" in r.stdout
    assert opened_outside(r, src, tmp_path / "out", tmp_path / ".out.ckptconv-tmp", tmp_path / ".out.ckptconv-lock") \
        == []
    assert subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=out).returncode == 0
    r = cli("convert", src, tmp_path / "out2", "--max-extra-size", "1B", "--json")
    assert r.returncode == 0 and not (tmp_path / "out2" / "tokenizer.json").exists()
    assert {"name": "tokenizer.json", "reason": "2 bytes, more than --max-extra-size 1"} in \
        json.loads(r.stdout)["skipped_files"]


def test_hugging_face_cache_snapshots_keep_working(tmp_path):
    """Files of `snapshots/REV/` link into the repo's `blobs/`: weights and model files are read."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    built = hf_dir(tmp_path / "built")
    for f in built.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        f.rename(blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    r = cli("convert", snap, tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "config.json").read_text() == '{"model_type": "llama"}'
    assert "skipped_files" not in json.loads((tmp_path / "out" / "manifest.json").read_text())["source"]


def test_weight_files_leading_outside_are_refused_unread(tmp_path):
    outside = safetensors_file(tmp_path / "elsewhere.safetensors", {"a": F4, "b": F4_2}, b"\0" * 8)
    src = hf_dir(tmp_path / "hf")
    (src / "model-00001-of-00001.safetensors").unlink()
    (src / "model-00001-of-00001.safetensors").symlink_to(outside)
    r = cli("convert", src, tmp_path / "out")
    assert_refused(r, tmp_path / "out", "model-00001-of-00001.safetensors", "leads outside the checkpoint")
    assert str(outside) not in r.opened and opened_outside(r, src, tmp_path / "out") == []
    pt = tmp_path / "pt"
    pt.mkdir()
    torch.save({"w": torch.ones(2)}, tmp_path / "real.pt")
    (pt / "pytorch_model.bin").symlink_to(tmp_path / "real.pt")
    r = cli("convert", pt, tmp_path / "out")
    assert_refused(r, tmp_path / "out", "pytorch_model.bin", "leads outside the checkpoint")
    assert opened_outside(r, pt, tmp_path / "out") == []


# ---------------------------------------------------------------------------------------------
# 7. Signals: every catchable terminating signal cleans up and exits 128 + n


SIGNALS = ["SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGVTALRM", "SIGPROF",
           "SIGXCPU", "SIGPWR", "SIGIO", "SIGRTMIN"]


def _signal_during(big_pt, tmp_path, sig, after_bytes, extra=(), preexec=None):
    out = tmp_path / "out"
    tmp = tmp_path / ".out.ckptconv-tmp"
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "ckptconv.cli", "convert", big_pt, out,
                             "--quiet", "--max-shard-size", "16MiB", *extra], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            preexec_fn=preexec)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if sum(f.stat().st_size for f in tmp.iterdir()) >= after_bytes:
                break
        except FileNotFoundError:
            if after_bytes == 0 and (tmp_path / ".out.ckptconv-lock").exists():
                break
        time.sleep(0.001)
    proc.send_signal(getattr(signal, sig))
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:   # a hang: every thread's stack (faulthandler on SIGABRT) says where
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"no exit within 60 s of {sig}; the run's threads:\n{err}") from None
    return proc.returncode, err


@pytest.mark.parametrize("sig", SIGNALS)
def test_every_terminating_signal_cleans_up(big_pt, tmp_path, sig):
    code, err = _signal_during(big_pt, tmp_path, sig, 40 << 20)
    if code == 0:
        pytest.skip("the conversion finished before the signal")
    n = getattr(signal, sig)
    assert code == 128 + n, (code, err)
    assert err.count("\n") == 1 and "interrupted by" in err and "no output was published" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [], sorted(p.name for p in tmp_path.iterdir())


@pytest.mark.parametrize("after", [0, 8 << 20, 150 << 20])
def test_sighup_at_several_points_of_a_run_keeps_an_existing_output(big_pt, tmp_path, after):
    out = tmp_path / "out"
    assert run("convert", big_pt, out, "--quiet", "--max-shard-size", "16MiB").exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.suffix == ".json"}
    code, err = _signal_during(big_pt, tmp_path, "SIGHUP", after, ["--overwrite"])
    if code == 0:
        pytest.skip("the conversion finished before the signal")
    assert code == 128 + signal.SIGHUP, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.suffix == ".json"} == before


def test_an_ignored_sighup_stays_ignored(big_pt, tmp_path):
    """`nohup ckptconv ...`: the run survives a closed terminal."""
    code, err = _signal_during(big_pt, tmp_path, "SIGHUP", 8 << 20,
                               preexec=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    assert code == 0, err
    assert run("verify", tmp_path / "out").exit_code == 0


# ---------------------------------------------------------------------------------------------
# 9. --resume never mixes two checkpoints


def _killed_run(src, out, tmp_path):
    tmp = tmp_path / f".{out.name}.ckptconv-tmp"
    proc = subprocess.Popen([sys.executable, "-m", "ckptconv.cli", "convert", src, out, "--quiet",
                             "--max-shard-size", "16MiB"], cwd=ROOT)
    while proc.poll() is None and not (tmp / ".ckptconv-journal.json").exists():
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if out.exists():
        pytest.skip("the conversion finished before it could be killed")


def test_resume_with_another_source_starts_over(big_pt, tmp_path):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    a.write_bytes(big_pt.read_bytes())
    sd = torch.load(big_pt)
    torch.save({k: v + 1 for k, v in sd.items()}, b)  # same names, dtypes and shapes
    out = tmp_path / "out"
    _killed_run(a, out, tmp_path)
    r = run("convert", b, out, "--max-shard-size", "16MiB", "--resume", "--json")
    assert r.exit_code == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["resumed_bytes"] == 0
    assert summary["resume_note"] == "the interrupted run read a different or changed source; started over"
    assert run("verify", out, "--against", b).exit_code == 0


def test_resume_after_the_source_changed_starts_over(big_pt, tmp_path):
    a = tmp_path / "a.pt"
    a.write_bytes(big_pt.read_bytes())
    out = tmp_path / "out"
    _killed_run(a, out, tmp_path)
    os.utime(a, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns))  # even with the same mtime: ctime moved
    r = run("convert", a, out, "--max-shard-size", "16MiB", "--resume", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["resumed_bytes"] == 0, r.stdout


def test_resume_of_the_same_source_reuses(big_pt, tmp_path):
    a = tmp_path / "a.pt"
    a.write_bytes(big_pt.read_bytes())
    out = tmp_path / "out"
    _killed_run(a, out, tmp_path)
    r = run("convert", a, out, "--max-shard-size", "16MiB", "--resume", "--json")
    assert r.exit_code == 0 and "resume_note" not in json.loads(r.stdout), r.stdout
    assert run("verify", out, "--against", a).exit_code == 0


# ---------------------------------------------------------------------------------------------
# 10. --overwrite replaces only a previous ckptconv output, never an input


def test_out_may_not_be_or_hold_the_source(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    torch.save({"w": torch.ones(3)}, d / "m.pt")
    for src, out, what in [(d / "m.pt", d / "m.pt", "is the input"), (d / "m.pt", d, "holds the input"),
                           (d, d, "is the input"), (d / "m.pt", tmp_path, "holds the input")]:
        for command in (["convert"], ["reshard", "--tp", "1", "--rules", tmp_path / "rules.toml"]):
            (tmp_path / "rules.toml").write_text('[[rule]]\npattern = "w"\naxis = 0\n')
            r = cli(command[0], src, out, *command[1:], "--overwrite")
            assert_refused(r, Path(out), what)
        assert (d / "m.pt").is_file()


def test_overwrite_replaces_only_a_previous_output(tmp_path):
    torch.save({"w": torch.ones(3)}, tmp_path / "m.pt")
    other = tmp_path / "other"
    other.mkdir()
    (other / "thesis.tex").write_text("years of work")
    r = cli("convert", tmp_path / "m.pt", other, "--overwrite")
    assert_refused(r, other, "is not a ckptconv output", "remove it yourself")
    assert (other / "thesis.tex").read_text() == "years of work"
    (tmp_path / "afile").write_text("x")
    assert_refused(cli("convert", tmp_path / "m.pt", tmp_path / "afile", "--overwrite"), tmp_path / "afile",
                   "is not a directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run("convert", tmp_path / "m.pt", empty).exit_code == 0  # the `mkdir out` habit
    assert run("convert", tmp_path / "m.pt", empty).exit_code == 2
    torch.save({"w": torch.zeros(3)}, tmp_path / "m.pt")
    assert run("convert", tmp_path / "m.pt", empty, "--overwrite").exit_code == 0
    assert load_output(empty)["w"].tolist() == [0.0] * 3
    (tmp_path / "link").symlink_to(empty)
    assert_refused(cli("convert", tmp_path / "m.pt", tmp_path / "link", "--overwrite"), tmp_path / "link",
                   "is a symbolic link")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "empty", "link", "m.pt", "other"]


def test_a_run_killed_while_publishing_gives_back_the_previous_output(tmp_path):
    torch.save({"w": torch.ones(3)}, tmp_path / "m.pt")
    out = tmp_path / "out"
    assert run("convert", tmp_path / "m.pt", out).exit_code == 0
    out.rename(tmp_path / ".out.ckptconv-old")  # killed between its two renames
    (tmp_path / ".out.ckptconv-lock").write_text(json.dumps({"pid": 2**22 + 1, "host": os.uname().nodename}))
    r = run("convert", tmp_path / "m.pt", out)
    assert r.exit_code == 2 and "already exists" in r.stderr  # the previous output is back in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt", "out"]
    assert run("verify", out).exit_code == 0


# ---------------------------------------------------------------------------------------------
# 13. No tensor disappears silently


def test_every_index_entry_must_be_found(tmp_path):
    index = {"weight_map": {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors",
                            "ghost": "model-00001-of-00001.safetensors"}}
    src = hf_dir(tmp_path / "hf", index=json.dumps(index))
    r = cli("convert", src, tmp_path / "out")
    assert_refused(r, tmp_path / "out", "tensor 'ghost' is listed in model-00001-of-00001.safetensors, which does "
                                        "not hold it")
    bins = tmp_path / "bins"
    bins.mkdir()
    torch.save({"a": torch.ones(2)}, bins / "pytorch_model-00001-of-00001.bin")
    (bins / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {"a": "pytorch_model-00001-of-00001.bin", "b": "pytorch_model-00001-of-00001.bin"}}))
    r = cli("convert", bins, tmp_path / "out")
    assert_refused(r, tmp_path / "out", "tensor 'b' is listed in pytorch_model-00001-of-00001.bin")


def test_shards_the_index_does_not_name_are_listed(tmp_path):
    src = hf_dir(tmp_path / "hf")
    safetensors_file(src / "model-00002-of-00002.safetensors", {"c": F4}, b"\0" * 4)
    assert run("convert", src, tmp_path / "out").exit_code == 0
    source = json.loads((tmp_path / "out" / "manifest.json").read_text())["source"]
    assert source["unindexed"] == ["model-00002-of-00002.safetensors"]


# ---------------------------------------------------------------------------------------------
# The earlier guarantees still hold against the new inputs: the attack corpus, via make fuzz's seeds


def test_new_hostile_inputs_are_fuzz_seeds():
    from tests.security.test_fuzz import SEEDS
    assert {"deep-tuple-key", "shared-tuples", "forged-newline"} <= set(SEEDS)


def test_a_run_refused_by_the_lock_leaves_the_other_runs_files_alone(tmp_path):
    torch.save({"w": torch.ones(3)}, tmp_path / "m.pt")
    (tmp_path / ".out.ckptconv-lock").write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename}))
    (tmp_path / ".out.ckptconv-tmp").mkdir()
    (tmp_path / ".out.ckptconv-tmp" / "model-00001-of-00002.safetensors").write_text("the other run's work")
    r = run("convert", tmp_path / "m.pt", tmp_path / "out")
    assert r.exit_code == 2 and f"pid {os.getpid()}" in r.stderr
    assert (tmp_path / ".out.ckptconv-tmp" / "model-00001-of-00002.safetensors").read_text() == "the other run's work"
    assert (tmp_path / ".out.ckptconv-lock").exists()


# ---------------------------------------------------------------------------------------------
# Found by an outside attack on the classes above (each was a way through before it was fixed)


def _forge(out: Path, manifest_edit, add=()):
    """Edit an output's manifest (and add files to it) and re-sign everything, as a careful forger."""
    import hashlib
    from ckptconv.formats.sums import format_sums

    def sha(p):
        return hashlib.sha256(p.read_bytes()).hexdigest()

    manifest = json.loads((out / "manifest.json").read_text())
    for name in add:
        manifest["files"][name] = {"sha256": sha(out / name), "size": (out / name).stat().st_size}
    manifest_edit(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    (out / "SHA256SUMS").write_bytes(format_sums({p.name: sha(p) for p in out.iterdir() if p.name != "SHA256SUMS"}))


def test_verify_against_reads_the_output_as_ckptconv_wrote_it(tmp_path):
    """A genuine .pt slipped into a forged OUT and listed in its sums must not be what --against
    compares with the source."""
    torch.save({"w": torch.zeros(4)}, tmp_path / "genuine.pt")
    torch.save({"w": torch.full((4,), 666.0)}, tmp_path / "evil.pt")
    out = tmp_path / "forged"
    assert run("convert", tmp_path / "evil.pt", out).exit_code == 0
    (out / "zz.pt").write_bytes((tmp_path / "genuine.pt").read_bytes())
    _forge(out, lambda m: None, add=["zz.pt"])
    assert run("verify", out).exit_code == 0  # consistent in itself: only --against can tell
    r = run("verify", out, "--against", tmp_path / "genuine.pt")
    assert r.exit_code == 1 and "differs from the source" in r.stdout, r.stdout


def test_verify_against_applies_the_recorded_prefix_as_convert_does(tmp_path):
    src = safetensors_file(tmp_path / "src.safetensors", {"x": F4, "a.x": F4_2}, b"\0" * 8)
    out = tmp_path / "out"
    assert run("convert", tmp_path / "src.safetensors", out).exit_code == 0
    _forge(out, lambda m: m["source"].update(strip_prefix="a."))  # would fold "a.x" onto "x", hiding it
    r = run("verify", out, "--against", src)
    assert r.exit_code == 1 and "makes 'x' and 'a.x' both 'x'" in r.stdout, r.stdout


def test_numbers_chosen_to_collide_cannot_be_keys(tmp_path):
    """Ints hash modulo 2**61 - 1 with no salt: 160,000 keys equal modulo it took minutes (quadratic)."""
    keys = b"".join(b"\x8a\x10" + ((2**61 - 1) * (i + 1)).to_bytes(16, "little", signed=True) + b"N"
                    for i in range(1000))
    src = torch_file(tmp_path / "m.pt", _u("d") + b"}(" + keys + b"u")
    r = cli("convert", src, tmp_path / "out", timeout=60)
    assert_refused(r, tmp_path / "out", "beyond the 2**61 - 1", src=src)


@pytest.mark.parametrize("body, fragment", [
    (_u("dev") + b"ctorch\ndevice\n(]" + b"(" + b"K\x01" * 1000 + b"l" + b"tR", "torch.device/layout of"),
    (_u("ns") + b"cargparse\nNamespace\n" + _u("x" * 100000) + b"R", "instead of a tuple of arguments"),
    (_u("arr") + b"cnumpy.core.multiarray\n_reconstruct\n(cnumpy\nndarray\nK\x00\x85C\x01btR",
     "never set its state"),
])
def test_records_and_stand_ins_take_only_what_they_should(tmp_path, body, fragment):
    src = torch_file(tmp_path / "m.pt", body)
    assert_refused(cli("convert", src, tmp_path / "out"), tmp_path / "out", fragment, src=src)


def test_extras_names_of_any_key_can_be_written(tmp_path):
    """A key Python will not print in decimal, and one UTF-8 cannot spell, still name extras."""
    src = torch_file(tmp_path / "m.pt", _u("d") + b"}(" + _u("\udcff") + b"K\x02" + b"\x8a\x02\x00\x01\x85K\x03u")
    assert run("convert", src, tmp_path / "out").exit_code == 0
    extras = json.loads((tmp_path / "out" / "manifest.json").read_text())["extras"]
    assert extras == {"d.\udcff": 2, "d.(256,)": 3}
    assert b'"d.\\udcff"' in (tmp_path / "out" / "manifest.json").read_bytes()  # valid UTF-8: the JSON escape


def test_views_may_not_describe_far_more_bytes_than_the_file(tmp_path):
    src = torch_file(tmp_path / "m.pt", _u("big") + _tensor().replace(b"(J\x04\x00\x00\x00t(K\x01t",
                                                                        b"(J\x00\x00\x00\x02t(K\x00t"))
    assert_refused(cli("convert", src, tmp_path / "out"), tmp_path / "out", "describe 134217744 bytes", src=src)


@pytest.mark.parametrize("config", ['{"model_type": []}', '{"num_attention_heads": "2"}',
                                    '{"model_type": "llama", "hidden_size": [4], "num_attention_heads": 2}',
                                    '{"model_type": "llama", "num_attention_heads": 2.0, "hidden_size": 8}',
                                    '{"model_type": "llama", "num_attention_heads": 2, "num_key_value_heads": 0.5,'
                                    ' "hidden_size": 8}'])
def test_config_values_are_checked(tmp_path, config):
    src = hf_dir(tmp_path / "hf", config=config)
    r = cli("reshard", src, tmp_path / "out", "--tp", "2")
    assert_refused(r, tmp_path / "out", src=src)


@pytest.mark.parametrize("description", ['{"tensors": [{"name": "a", "shape": [2], "dtype": "__builtins__"}]}',
                                         '{"tensors": [{"name": "a", "shape": "x", "dtype": "F32"}]}',
                                         '{"tensors": [{"name": 5, "shape": [2], "dtype": "F32"}]}',
                                         '{"tensors": [], "config": [1]}',
                                         '{"tensors": [{"name": "a", "dtype": "F32", "shape": ' + str([2**62] * 40)
                                         + '}]}'])
def test_shapes_descriptions_are_checked(tmp_path, description):
    (tmp_path / "shapes.json").write_text(description)
    r = cli("plan", tmp_path / "shapes.json", "--tp", "2", "--from", "shapes")
    assert_refused(r, tmp_path / "out", "shapes.json")


def test_overwrite_needs_a_manifest_of_ckptconvs(tmp_path):
    torch.save({"w": torch.ones(3)}, tmp_path / "m.pt")
    app = tmp_path / "webapp"
    app.mkdir()
    (app / "manifest.json").write_text('{"name": "My PWA"}')
    (app / "index.html").write_text("<html>")
    assert_refused(cli("convert", tmp_path / "m.pt", app, "--overwrite"), app, "is not a ckptconv output")
    assert (app / "index.html").read_text() == "<html>"


def test_a_cast_that_overflows_prints_nothing(tmp_path):
    src = safetensors_file(tmp_path / "a.safetensors", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                           struct.pack("<2f", 1e30, -1e30))
    r = cli("convert", src, tmp_path / "out", "--dtype", "f16", "--quiet")
    assert r.returncode == 0 and r.stderr == ""
    r = cli("verify", tmp_path / "out", "--against", src, "--quiet")
    assert r.returncode == 0 and r.stderr == ""


def test_grok_hosts_must_agree(tmp_path):
    params = grok_fixtures.make_params(layers=1)
    grok_fixtures.write_dir(tmp_path / "g", params, hosts=2, axes=lambda path: 0)
    r = cli("convert", tmp_path / "g", tmp_path / "out", "--host-axis", "5")
    assert_refused(r, tmp_path / "out", "cannot join the hosts'", src=tmp_path / "g")
    one = tmp_path / "one"
    grok_fixtures.write_dir(one, params)
    (one / "ckpt-0" / "tensor\u0660\u0660\u0660\u0660\u0660_\u0660\u0660\u0660").write_bytes(b"not a pickle")
    assert run("convert", one, tmp_path / "out").exit_code == 0  # Arabic-Indic digits do not make a shard name


def test_empty_tensors_split_on_a_later_axis(tmp_path):
    d = tmp_path / "src"
    d.mkdir()
    torch.save({"model.layers.0.self_attn.o_proj.weight": torch.zeros(4, 0),
                "model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4)}, d / "m.pt")
    (d / "config.json").write_text('{"model_type": "llama", "num_attention_heads": 2, "hidden_size": 4}')
    assert run("reshard", d, tmp_path / "out", "--tp", "2").exit_code == 0


def test_recorded_rules_from_a_file_are_not_run_again(tmp_path):
    torch.save({"w": torch.ones(4, 2)}, tmp_path / "m.pt")
    (tmp_path / "rules.toml").write_text('[[rule]]\npattern = "(a|a)+b|w"\naxis = 0\n')
    assert run("reshard", tmp_path / "m.pt", tmp_path / "tp2", "--tp", "2", "--rules", tmp_path / "rules.toml",
               "--quiet").exit_code == 0
    r = run("reshard", tmp_path / "tp2", tmp_path / "again", "--tp", "1")
    assert r.exit_code == 2 and "give them again with --rules FILE" in r.stderr
    assert run("reshard", tmp_path / "tp2", tmp_path / "again", "--tp", "1", "--rules", tmp_path / "rules.toml",
               "--quiet").exit_code == 0
    assert json.loads((tmp_path / "tp2" / "mesh.json").read_text())["rules"]["rules"][0]["axis"] == 0


def test_the_writer_refuses_a_source_that_gives_the_wrong_number_of_bytes(tmp_path):
    from ckptconv import dtypes
    from ckptconv.io.hashing import Pipeline
    from ckptconv.tensor import Computed
    from ckptconv.layouts.files import plan_shards, write_shards
    from ckptconv.errors import BadInput
    liar = Computed("t", dtypes.BY_CODE["F32"], (1024,), lambda index: np.zeros(3, np.float32))
    pipeline = Pipeline()
    try:
        with pytest.raises(BadInput, match="gave 12 bytes where its shape"):
            write_shards(tmp_path, plan_shards([liar], 10**9), pipeline)
    finally:
        pipeline.close()
