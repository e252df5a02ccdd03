"""Issue 28's classes (the third outside attack), each as the attack was run: on the real CLI in a
fresh process (tests/helpers.py) or through the Python API. Every refusal is exit 2 and one line,
nothing is left beside OUT, and no exception but a CkptError leaves the API."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptconv
from ckptconv.errors import CkptError
from tests.helpers import ROOT, assert_refused, cli


@pytest.fixture
def model(tmp_path) -> Path:
    path = tmp_path / "m.pt"
    torch.save({"model.layers.0.mlp.up_proj.weight": torch.arange(32.0).reshape(8, 4)}, path)
    return path


# --- class 1: files named on the command line are held to the rules of files inside SRC

HOSTILE_TOML = {
    "arrays": "x = " + "[" * 20_000 + "]" * 20_000 + "\n",
    "inline tables": "x = " + "{a=" * 20_000 + "1" + "}" * 20_000 + "\n",
    "dotted key": "a" + ".a" * 20_000 + " = 1\n",     # tomllib: quadratic (10 s for these 40 KB)
    "table header": "[" + ".".join(["a"] * 20_000) + "]\nx = 1\n",
    "huge integer": "layout = 'torch'\n[[rule]]\npattern = '.*'\naxis = " + "9" * 5000 + "\n",
    "not utf-8": b"layout = '\xff'\n",
}


@pytest.mark.parametrize("case", sorted(HOSTILE_TOML))
def test_a_hostile_rules_file_is_one_line_quickly(model, tmp_path, case):
    rules = tmp_path / "rules.toml"
    body = HOSTILE_TOML[case]
    rules.write_bytes(body if isinstance(body, bytes) else body.encode())
    started = time.monotonic()
    r = cli("reshard", model, tmp_path / "out", "--tp", 2, "--rules", rules, timeout=60)
    assert_refused(r, tmp_path / "out", f"--rules {rules}")
    assert time.monotonic() - started < 30


def test_the_api_raises_only_ckpt_errors_for_a_hostile_rules_file(model, tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text(HOSTILE_TOML["arrays"])
    with pytest.raises(CkptError, match="nests deeper than 100"):
        ckptconv.reshard(model, tmp_path / "out", 2, rules=rules)


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "too big"])
def test_a_rules_file_that_is_not_a_small_regular_file_is_refused_without_reading_it(model, tmp_path, kind):
    rules = tmp_path / "rules.toml"
    if kind == "fifo":
        os.mkfifo(rules)        # no writer: open() would wait forever
    elif kind == "device":
        rules = Path("/dev/zero")   # would be read until memory runs out
    elif kind == "directory":
        rules.mkdir()
    else:
        rules.write_bytes(b"# " + b"x" * (2 << 20) + b"\n")
    r = cli("reshard", model, tmp_path / "out", "--tp", 2, "--rules", rules, timeout=30)
    assert_refused(r, tmp_path / "out", str(rules))


STUCK = """
import sys, threading, time
import ckptconv.io.output as output
from ckptconv import cli
real = output.atomic_output

def stuck(*args, **kwargs):   # the run waits where no checkpoint comes: a join in the standard library
    manager = real(*args, **kwargs)
    tmp = manager.__enter__()
    print("waiting", flush=True)
    waiter = threading.Thread(target=time.sleep, args=(60,), daemon=True)
    waiter.start()
    waiter.join()

output.atomic_output = stuck
import ckptconv.cluster
ckptconv.cluster.atomic_output = stuck
cli.main(sys.argv[1:], prog_name="ckptconv")
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_one_signal_ends_a_run_that_waits_outside_our_code(model, tmp_path, sig):
    """Python runs a handler between bytecodes only, and ours leaves a signal pending outside our own
    code: a run waiting there would never see it. The watcher ends it, cleaning up, in GRACE_S."""
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-c", STUCK, "convert", str(model), str(out), "--quiet"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "waiting\n"
    assert (tmp_path / ".out.ckptconv-tmp").is_dir() and (tmp_path / ".out.ckptconv-lock").exists()
    sent = time.monotonic()
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    assert time.monotonic() - sent < 10
    assert p.returncode == 128 + sig
    assert err == f"ckptconv: error: interrupted by {sig.name} while waiting outside ckptconv's code; " \
                  "no output was published\n"
    assert sorted(q.name for q in tmp_path.iterdir()) == ["m.pt"]


# --- rule 2: no exception but a CkptError leaves the API, and the CLI says one line, for hostile options

LONG = "x" * 100_000
PATHS = ["", "\0", "/dev/zero", "FIFO", "DIR", "missing", "y" * 5000, b"m.pt", 123, None]
TEXTS = ["", "\0", LONG, "\udcff", "a\nb", 5, None, ["a"]]
NUMBERS = [0, -1, 2**70, "2", 1.5, True, None]
SIZES = ["0", "-1", "1e400", "9" * 400 + "TB", "abc", 0, -5, 1.5, True, None]
API_OPTIONS = {
    "convert": {"format": TEXTS + ["nosuch"], "only": TEXTS + [[1], [LONG]], "strip_prefix": TEXTS,
                "dtype": TEXTS + ["f8"], "state_dict": TEXTS + ["a..b", "model.", "9" * 5000],
                "allow_globals": TEXTS + ["os.system", "builtins.*", "*", ".x", "x.", "a.*.b", "__builtin__.*"],
                "skip_unsupported": NUMBERS, "max_shard_size": SIZES, "name": TEXTS + ["../x", ".x", "a/b"],
                "overwrite": NUMBERS, "resume": NUMBERS, "fsync": NUMBERS, "buffered_io": NUMBERS,
                "copy_extras": NUMBERS, "workers": NUMBERS,
                "reader_options": [{"names": "/dev/zero"}, {"names": "FIFO"}, {"dequantize": "x"}, {"nosuch": 1},
                                   [1], "x", {1: 2}]},
    "reshard": {"tp": NUMBERS, "ep": NUMBERS, "preset": TEXTS + ["nosuch"], "rules": PATHS,
                "heads": NUMBERS, "kv_heads": NUMBERS, "head_dim": NUMBERS, "pad_vocab": NUMBERS,
                "target": TEXTS, "dtype": TEXTS, "allow_replicate": TEXTS + ["(", "(?P<"]},
    "verify": {"against": PATHS, "device": TEXTS + ["gpu"], "allow_fewer_devices": NUMBERS, "format": TEXTS,
               "allow_globals": TEXTS, "state_dict": TEXTS, "workers": NUMBERS, "reader_options": [[1], "x"]},
    "inspect": {"format": TEXTS, "only": TEXTS, "allow_globals": TEXTS, "state_dict": TEXTS, "workers": NUMBERS,
                "reader_options": [{"names": "/dev/zero"}, [1]]},
}


def _value(v, tmp_path):
    if v == "FIFO":
        if not (tmp_path / "fifo").exists():
            os.mkfifo(tmp_path / "fifo")
        return str(tmp_path / "fifo")
    if v == "DIR":
        return str(tmp_path)
    if isinstance(v, dict):
        return {k: _value(x, tmp_path) for k, x in v.items()}
    return v


def test_no_exception_but_a_ckpt_error_leaves_the_api(model, tmp_path):
    escaped = []
    for command, options in API_OPTIONS.items():
        for option, values in options.items():
            for i, value in enumerate(values):
                out = tmp_path / f"out-{command}-{option}-{i}"
                positional = {"convert": (model, out), "reshard": (model, out), "verify": (model,),
                              "inspect": (model,)}[command]
                kwargs = {**({"tp": 1} if command == "reshard" else {}), option: _value(value, tmp_path)}
                try:
                    getattr(ckptconv, command)(*positional, **kwargs)
                except CkptError:
                    pass
                except Exception as e:   # noqa: BLE001 (what this test looks for)
                    escaped.append(f"{command}({option}={value!r:.60}): {type(e).__name__}: {str(e)[:100]}")
    assert escaped == []


CLI_CASES = [
    ["convert", "M", "OUT", "--max-shard-size", "9" * 400 + "TB"],
    ["convert", "M", "OUT", "--max-shard-size", "1e400"],
    ["convert", "M", "OUT", "--name", "a/b"],
    ["convert", "M", "OUT", "--state-dict", "a..b"],
    ["convert", "M", "OUT", "--state-dict", "9" * 5000],
    ["convert", "M", "OUT", "--allow-global", "*"],
    ["convert", "M", "OUT", "--allow-global", "os.system"],
    ["convert", "M", "OUT", "--only", "\x01\n"],
    ["convert", "M", "OUT", "--strip-prefix", ""],
    ["convert", "M", "OUT", "--max-extra-size", "-1"],
    ["convert", "M", "OUT", "--workers", "1000"],
    ["convert", "M", "OUT", "--names", "FIFO"],
    ["convert", "M", "OUT", "--names", "/dev/zero"],
    ["reshard", "M", "OUT", "--tp", "99999999999999999999999"],
    ["reshard", "M", "OUT", "--tp", "2", "--rules", "FIFO"],
    ["reshard", "M", "OUT", "--tp", "2", "--rules", "/dev/zero"],
    ["reshard", "M", "OUT", "--tp", "2", "--allow-replicate", "(?P<"],
    ["reshard", "M", "OUT", "--tp", "2", "--heads", "0"],
    ["verify", "M", "--against", "FIFO"],
    ["verify", "M", "--against", "/dev/zero"],
    ["verify", "FIFO"],
    ["inspect", "FIFO"],
    ["inspect", "/dev/zero"],
    ["plan", "M", "--tp", "3", "--hosts", "0"],
    ["plan", "M", "--rules", "FIFO", "--tp", "2"],
    ["convert", "M", "OUT", "--coordinator", "nohost", "--num-processes", "2", "--process-id", "1",
     "--cluster-timeout", "1"],
]


@pytest.mark.parametrize("case", range(len(CLI_CASES)))
def test_the_cli_answers_hostile_options_in_one_line(model, tmp_path, case):
    if not (tmp_path / "fifo").exists():
        os.mkfifo(tmp_path / "fifo")
    args = [str(model) if a == "M" else str(tmp_path / "out") if a == "OUT" else str(tmp_path / "fifo")
            if a == "FIFO" else a for a in CLI_CASES[case]]
    r = cli(*args, timeout=60)
    assert r.returncode in (0, 1, 2), (r.returncode, r.stderr[-500:])
    if r.returncode:
        assert_refused(r, tmp_path / "out", code=r.returncode)
