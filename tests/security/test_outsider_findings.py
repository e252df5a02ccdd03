"""What an outside attack on the writers restructuring found (issue 13), each fixed and kept fixed:
state that refers to the same text or bytes many times, something appearing at OUT during a run, a
FIFO at OUT, a tensor named like safetensors' metadata, directories with several indexes, an ignored
SIGINT, and --name where it cannot apply."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckptconv
from ckptconv.errors import OutputError
from ckptconv.limits import Budget
from tests.helpers import ROOT, assert_refused, cli, run, run_subprocess


def test_text_referenced_many_times_is_charged_by_its_length(tmp_path):
    src = tmp_path / "amp.pt"
    torch.save({"w": torch.ones(2), "x": ["a" * 1950] * 50_000}, src)     # 100 KB asking for 97 MB of JSON
    out = tmp_path / "out"
    r = cli("convert", src, out, "--quiet")
    assert_refused(r, out, "expands far beyond")
    assert not out.exists()


def test_bytes_referenced_many_times_are_hashed_once(tmp_path, monkeypatch):
    from ckptconv.readers.pickle import extras
    real, hashed = extras.hashlib.sha256, []
    monkeypatch.setattr(extras.hashlib, "sha256", lambda data=b"": hashed.append(len(data)) or real(data))
    blob = b"a" * (1 << 20)
    made = extras.extras_json({"x": [blob] * 3000}, Budget("blob", 1 << 20))
    assert hashed == [1 << 20] and len(made["x"]) == 3000      # one digest, however often it is reached
    src = tmp_path / "blob.pt"
    torch.save({"w": torch.ones(2), "x": [blob] * 3000}, src)              # 3 GB to hash, were each reference hashed
    out = tmp_path / "out"
    r = cli("convert", src, out, "--quiet", timeout=60)
    assert r.returncode == 0, r.stderr
    kept = json.loads((out / "manifest.json").read_text())["extras"]
    records = kept["x"]
    assert len(records) == 3000 and all(v == records[0] for v in records) and records[0]["__bytes__"] == 1 << 20


def test_a_header_no_reader_accepts_is_never_written(tmp_path):
    src = tmp_path / "meta.pt"
    torch.save({"w": torch.ones(2), "x": [f"{i}" + "a" * (1 << 20) for i in range(7)] * 15}, src)  # 105 MB of text
    out = tmp_path / "big.safetensors"
    r = cli("convert", src, out, "--quiet", "--max-extras", "1GB", timeout=120, cap=None)   # (else summarised)
    assert_refused(r, out, "more than the 100000000 bytes")
    assert not out.exists()


@pytest.mark.parametrize("one_file", [True, False])
def test_something_appearing_at_out_during_the_run_is_never_replaced(big_pt, tmp_path, one_file):
    out = tmp_path / ("y.safetensors" if one_file else "y")

    @contextlib.contextmanager
    def progress(total):
        def update(n):
            if not os.path.lexists(out):
                if one_file:
                    out.write_text("precious")
                else:
                    out.mkdir()
                    (out / "file").write_text("precious")
        yield update

    with pytest.raises(OutputError, match="already exists|appeared"):
        ckptconv.convert(big_pt, out, progress=progress)
    assert (out if one_file else out / "file").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_a_fifo_at_out_is_refused_without_waiting(tmp_path):
    src = tmp_path / "s.pt"
    torch.save({"w": torch.ones(2)}, src)
    fifo = tmp_path / "f.safetensors"
    os.mkfifo(fifo)
    r = run_subprocess("convert", src, fifo, "--overwrite", "--quiet", timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not a single-file ckptconv output" in r.stderr


@pytest.mark.parametrize("out_name", ["m.safetensors", "m"])
def test_a_tensor_named_like_the_metadata_is_refused(tmp_path, out_name):
    src = tmp_path / "s.pt"
    torch.save({"__metadata__": torch.ones(3), "w": torch.zeros(2)}, src)
    out = tmp_path / out_name
    assert_refused(cli("convert", src, out, "--quiet"), out, "'__metadata__'", "reserves")
    src2 = tmp_path / "p.pt"
    torch.save({"x.__metadata__": torch.ones(3)}, src2)          # the name only appears after --strip-prefix
    assert_refused(cli("convert", src2, out, "--quiet", "--strip-prefix", "x."), out, "'__metadata__'")


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_a_directory_with_two_indexes_is_refused_naming_them(tmp_path, kind):
    d = tmp_path / "d"
    d.mkdir()
    if kind == "safetensors":
        save_file({"w": torch.ones(1)}, d / "model-00001-of-00001.safetensors")
        save_file({"w": torch.full((1,), 666.0)}, d / "a-00001-of-00001.safetensors")
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
        (d / "a.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "a-00001-of-00001.safetensors"}}))
    else:
        torch.save({"w": torch.ones(1)}, d / "pytorch_model.bin")
        torch.save({"w": torch.full((1,), 666.0)}, d / "a.bin")
        (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"w": "pytorch_model.bin"}}))
        (d / "a.bin.index.json").write_text(json.dumps({"weight_map": {"w": "a.bin"}}))
    out = tmp_path / "out"
    assert_refused(cli("convert", d, out, "--quiet"), out, "holds 2 indexes", "give the one to read as SRC")
    index = next(d.glob("model.safetensors.index.json")) if kind == "safetensors" else d / "pytorch_model.bin.index.json"
    assert run("convert", index, out, "--quiet").exit_code == 0
    assert load_file(out / "model.safetensors")["w"].item() == 1.0


def test_unindexed_safetensors_files_are_all_read_before_a_bin(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    save_file({"a": torch.ones(1)}, d / "one.safetensors")
    save_file({"b": torch.ones(1)}, d / "two.safetensors")
    torch.save({"a": torch.zeros(1)}, d / "pytorch_model.bin")
    r = run("convert", d, tmp_path / "out", "--quiet")
    assert r.exit_code == 0 and "also holds torch weights" in r.stdout
    assert sorted(load_file(tmp_path / "out" / "model.safetensors")) == ["a", "b"]


def test_an_ignored_sigint_stays_ignored(big_pt, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "ckptconv.cli", "convert", big_pt, out, "--quiet"], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.is_dir()


def test_name_is_refused_for_one_file(tmp_path):
    src = tmp_path / "s.pt"
    torch.save({"w": torch.ones(2)}, src)
    r = run_subprocess("convert", src, tmp_path / "x.safetensors", "--name", "adapter_model")
    assert r.returncode == 2 and "--name" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.pt"]


# --- found by the outside attack on issue 14's additions


def test_a_shared_argument_copied_by_many_calls_is_charged(tmp_path):
    from tests.fixtures.attacks import Reduce
    big = list(range(100_000))
    src = tmp_path / "copies.pt"
    torch.save({"w": torch.ones(1), "x": [Reduce(list, (big,)) for _ in range(3000)]}, src)  # 300M copies asked
    out = tmp_path / "out"
    assert_refused(cli("convert", src, out, "--quiet", timeout=60), out, "expands far beyond")


@pytest.mark.parametrize("module, name", [("pathlib", "os.system"), ("_operator", "attrgetter"),
                                          ("_posixsubprocess", "fork_exec"), ("torch.hub", "load"),
                                          ("builtins", "exit")])
def test_other_spellings_of_code_are_refused_even_in_dropped_state(tmp_path, module, name):
    from tests.fixtures.attacks import _u, torch_zip
    pkl = (b"\x80\x04}(" + _u("state_dict") + b"}" + _u("callbacks") + _u(module) + _u(name) + b"\x93" + _u("x")
           + b"\x85Ru.")
    src = tmp_path / "evil.pt"
    src.write_bytes(torch_zip(pkl))
    out = tmp_path / "out"
    assert_refused(cli("convert", src, out, "--quiet", "--allow-global", f"{module.lstrip('_') or 'x'}.*"), out,
                   "can run code")


def test_a_class_on_no_allowlist_cannot_hide_in_a_key(tmp_path):
    """An instance as a dict key is an inert record like any other (issue 30): it is named, in the key
    and in the summary's placeholders, never hidden and never called."""
    from tests.fixtures.lightning import ModelCheckpoint
    src = tmp_path / "key.pt"
    torch.save({"w": torch.ones(1), "meta": {ModelCheckpoint(): 1}}, src)
    out = tmp_path / "out"
    r = cli("convert", src, out, "--quiet")
    assert r.returncode == 0, r.stderr
    assert "tests.fixtures.lightning.ModelCheckpoint (x1)" in r.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["extras"] == {"meta.<tests.fixtures.lightning.ModelCheckpoint>": 1}
    assert manifest["source"]["placeholders"] == [{"global": "tests.fixtures.lightning.ModelCheckpoint", "count": 1}]


def test_the_suggested_allow_global_is_never_a_command_to_paste(tmp_path):
    """(A reader that refuses classes on no allowlist, Grok-1's, suggests --allow-global: never the
    file's text as a command; a torch.save file records such a class as data instead.)"""
    from tests.fixtures.attacks import _u, write_container
    evil = "x';touch /tmp/never;'"
    src = write_container("grok", b"\x80\x04" + _u(evil) + _u("C") + b"\x93)\x81.", tmp_path / "src")
    out = tmp_path / "out"
    r = cli("convert", src, out, "--quiet")
    assert_refused(r, out, "--allow-global MODULE.NAME")
    assert "--allow-global 'x'" not in r.stderr


def test_a_foreign_output_whose_index_is_a_link_is_a_problem(tmp_path):
    out = tmp_path / "hub"
    out.mkdir()
    save_file({"x": torch.ones(1)}, out / "model.safetensors")
    save_file({"x": torch.full((1,), 666.0)}, out / "evil.safetensors")
    (tmp_path / "idx.json").write_text(json.dumps({"weight_map": {"x": "evil.safetensors"}}))
    (out / "model.safetensors.index.json").symlink_to(tmp_path / "idx.json")
    r = run("verify", out)
    assert r.exit_code == 1 and "symbolic link" in r.stdout, r.stdout


def test_verify_against_says_when_it_compared_a_recorded_selection(tmp_path):
    src = tmp_path / "light.ckpt"
    torch.save({"state_dict": {"a": torch.ones(2), "b": torch.zeros(2)}, "ema": {"a": torch.zeros(2)}}, src)
    out = tmp_path / "ema"
    assert run("convert", src, out, "--state-dict", "ema", "--quiet").exit_code == 0
    r = run("verify", out, "--against", src)
    assert r.exit_code == 0 and "note:" in r.stdout and "--state-dict 'ema'" in r.stdout, r.stdout
