"""The local executor (run/executors.py): --workers N tasks in flight, one output file or rank
directory each, in worker processes. The same bytes as --workers 1; a task's bad input stops the run
at once; a task that read other inputs than the plan is refused. Signals and the processes of a run:
test_worker_processes.py."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptconv.errors import BadInput, OutputError
from ckptconv.jobs import convert as convert_job
from ckptconv.layouts.base import WriteOptions
from ckptconv.readers import ReadOptions, Source
from ckptconv.run import executors, runner, tasks
from tests.helpers import ROOT, run

SHARDS = ("--max-shard-size", "60KB", "--quiet")


def same_tree(a: Path, b: Path):
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_convert_reshard_and_verify_at_one_and_two_workers_are_byte_identical(hf_llama, tmp_path):
    outputs = {}
    for w in (1, 2):
        for job, args in (("convert", ["convert", hf_llama["dir"]]), ("reshard", ["reshard", hf_llama["dir"]]),
                          ("vllm", ["reshard", hf_llama["dir"]])):
            out = tmp_path / f"{job}-{w}"
            extra = {"convert": [], "reshard": ["--tp", "2"], "vllm": ["--tp", "2", "--target", "vllm"]}[job]
            r = run(*args, out, *extra, *SHARDS, "--workers", w)
            assert r.exit_code == 0, r.stderr
            outputs[job, w] = out
    assert len(list(outputs["convert", 2].glob("*.safetensors"))) > 2   # (several tasks)
    for job in ("convert", "reshard", "vllm"):
        same_tree(outputs[job, 1], outputs[job, 2])
        # verify's findings the same at either count, clean and (a shard changed) not
        clean = [run("verify", outputs[job, 1], "--workers", w) for w in (1, 2)]
        assert clean[0].exit_code == clean[1].exit_code == 0 and clean[0].stdout == clean[1].stdout
    shard = sorted(outputs["convert", 2].glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 1
    shard.write_bytes(bytes(data))
    broken = [run("verify", outputs["convert", 2], "--workers", w) for w in (1, 2)]
    assert broken[0].exit_code == broken[1].exit_code == 1 and broken[0].stdout == broken[1].stdout
    assert f"{shard}: sha256 differs" in broken[0].stdout


# -- faults, through the executor with a planted task (a module-level function: workers import it) --

def planted(kind, source, out, options, write):
    """convert's task as jobs/convert.prepared makes it, with its write replaced: the first unit
    fails (`kind`), every other one waits for good (a run that waited for them would never end)."""
    made = convert_job.prepared(source, out, options, write)
    first = made.writer.plan(made.tensors)[0].name

    def write_(units, tmp, progress=None, share=(0, 1)):
        if units[0].name == first:
            if kind == "bad":
                raise BadInput(f"{units[0].name}: planted bad input")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)
    made.writer.write = write_
    return made


def other_inputs(source, out, options, write):
    """convert's task, reading a file the driver did not (another copy of SRC, as a task sees it)."""
    made = convert_job.prepared(source, out, options, write)
    made.inputs = [*made.inputs.files, __file__]
    return made


def _run(prepare_args, src, out, workers=2):
    source = Source(str(src), None, ReadOptions())
    options, write = convert_job.ConvertOptions(), WriteOptions(max_shard_size=60_000)
    ckpt, writer, tensors, _, _ = convert_job._opened(source, out, options, write)
    prepare, *first = prepare_args
    job = tasks.Job(prepare, (*first, tasks.with_read_workers(source, 1), out, options, write))
    return runner.run(writer, tensors, out, write, ckpt.reads(source.path), ckpt.check_unchanged, job=job,
                      executor=executors.make("local", workers=workers))


def _nothing_left(out: Path):
    assert not out.exists()
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


def test_a_task_with_bad_input_stops_the_run_at_once(hf_llama, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(BadInput, match="planted bad input"):
        _run((planted, "bad"), hf_llama["dir"], out)   # (the other tasks never end: they were ended)
    _nothing_left(out)


def test_a_worker_that_dies_stops_the_run(hf_llama, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(OutputError, match="worker process ended .killed by SIGKILL"):
        _run((planted, "killed"), hf_llama["dir"], out)
    _nothing_left(out)


def test_a_task_that_read_other_inputs_is_refused(hf_llama, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(OutputError, match="its task read other inputs than the run planned with .'test_workers.py' is"):
        _run((other_inputs,), hf_llama["dir"], out)
    _nothing_left(out)


def _children(pid: int) -> list:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:   # (not the resource tracker)
                found.append(int(entry))
    return found


def test_one_progress_bar_fed_by_every_task(hf_llama, tmp_path):
    """The driver's one bar: the same total and the same bytes counted as a run of one process."""
    import contextlib
    from ckptconv import api
    seen = {}

    def progress_of(w):
        @contextlib.contextmanager
        def progress(total):
            seen[w] = [total, 0]

            def update(n):
                seen[w][1] += n
            yield update
        return progress

    for w in (1, 2):
        api.convert(hf_llama["dir"], tmp_path / f"out{w}", max_shard_size="60KB", workers=w, progress=progress_of(w))
    assert seen[1] == seen[2] and seen[2][1] > 0


def test_a_script_using_the_api_without_a_main_guard_runs_once(hf_llama, tmp_path):
    """Workers are spawned without the caller's __main__: the script is not run again in each."""
    script = tmp_path / "script.py"
    script.write_text("import sys\nfrom ckptconv import api\nprint('top level ran')\n"
                      "api.convert(sys.argv[1], sys.argv[2], max_shard_size='60KB', workers=2)\n")
    r = subprocess.run([sys.executable, str(script), str(hf_llama["dir"]), str(tmp_path / "out")], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("top level ran") == 1
    assert run("convert", hf_llama["dir"], tmp_path / "one", *SHARDS, "--workers", 1).exit_code == 0
    same_tree(tmp_path / "out", tmp_path / "one")


# -- verify's shares, and --resume, on the local executor --

def whose(i, progress=None):
    """A call of `map`: which process ran it."""
    if progress is not None:
        progress(10)
    return {"i": i, "pid": os.getpid()}


def bad_first(i, progress=None):
    """A call of `map`: the first fails with bad input, every other waits for good."""
    if i == 0:
        raise BadInput("planted: share 0's input is bad")
    time.sleep(3600)


def test_map_runs_calls_in_worker_processes_in_order_and_feeds_one_bar():
    counted = []
    found = executors.make("local", workers=2).map(whose, [(i,) for i in range(5)], progress=counted.append)
    assert [f["i"] for f in found] == list(range(5))
    assert os.getpid() not in {f["pid"] for f in found} and sum(counted) == 50
    one = executors.make("local", workers=1).map(whose, [(i,) for i in range(3)])
    assert {f["pid"] for f in one} == {os.getpid()}   # (one at a time: in this process, as before)


def test_a_share_with_bad_input_stops_the_map_at_once():
    started = time.monotonic()
    with pytest.raises(BadInput, match="planted: share 0"):
        executors.make("local", workers=2).map(bad_first, [(i,) for i in range(3)])
    assert time.monotonic() - started < 600   # (the sleeping shares were ended, not waited for)


def test_verify_against_the_source_with_two_workers_finds_what_one_does(hf_llama, tmp_path):
    out = tmp_path / "out"
    assert run("convert", hf_llama["dir"], out, *SHARDS).exit_code == 0
    runs = [run("verify", out, "--against", hf_llama["dir"], "--workers", w, "--json") for w in (1, 2)]
    assert runs[0].exit_code == runs[1].exit_code == 0, runs[1].stderr
    assert runs[0].stdout == runs[1].stdout and '"tensor_count": 21' in runs[0].stdout
    # a tensor of the source changed (a copy of the output as the source): both say so, alike
    other = tmp_path / "other"
    other.mkdir()
    for f in out.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    weights = sorted(other.glob("*.safetensors"))[1]
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x40
    weights.write_bytes(bytes(data))
    runs = [run("verify", out, "--against", other, "--workers", w) for w in (1, 2)]
    assert runs[0].exit_code == runs[1].exit_code == 1 and runs[0].stdout == runs[1].stdout
    assert "differs" in runs[0].stdout


def _killed(src, out, records=2):
    """A `convert --workers 2 --resume` of `src` killed (SIGKILL, as a lost host or the OOM killer) once
    `records` tasks kept their answers: its temporary output stays, its workers end with it."""
    tmp = out.parent / f".{out.name}.ckptconv-tmp"
    args = [sys.executable, "-m", "ckptconv.cli", "convert", str(src), str(out), "--max-shard-size", "8MiB",
            "--workers", "2", "--resume"]
    p = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None and len(list((tmp / tasks.DONE).glob("*.json"))) < records:
        time.sleep(0.005)
    workers = _children(p.pid)
    p.kill()
    p.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while [w for w in workers if Path(f"/proc/{w}").exists()] and time.monotonic() < deadline:
        time.sleep(0.05)   # (the workers end with their driver)
    assert not out.exists() and tmp.is_dir()
    return tmp


def _resumed(src, out):
    import json
    r = run("convert", src, out, "--max-shard-size", "8MiB", "--workers", "2", "--resume", "--json")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def test_resume_with_two_workers_keeps_the_finished_tasks(big_pt, tmp_path):
    out = tmp_path / "out"
    tmp = _killed(big_pt, out)
    (tmp / "model-00001-of-00099.safetensors").write_bytes(b"a file of another plan")
    summary = _resumed(big_pt, out)
    kept = int(summary["resume_note"].split(" of ")[0])
    assert kept >= 2 and summary["resume_note"].endswith("task(s) finished by the interrupted run were kept")
    assert summary["resumed_bytes"] > 0
    assert run("convert", big_pt, tmp_path / "one", "--max-shard-size", "8MiB", "--workers", "1").exit_code == 0
    same_tree(out, tmp_path / "one")
    assert run("verify", out).exit_code == 0


def test_resume_rehashes_what_it_keeps(big_pt, tmp_path):
    """A kept shard edited in place (its size and modification time put back), a record whose digest
    was edited, and records of other inputs are redone, as the one-process journal's shards are: only
    bytes that give the recorded digests again are kept."""
    import json
    out = tmp_path / "out"
    tmp = _killed(big_pt, out, records=5)
    records = sorted((tmp / tasks.DONE).glob("*.json"))
    edited = json.loads(records[0].read_text())
    shard = tmp / edited["units"][0][0]
    st = shard.stat()
    with open(shard, "r+b") as f:
        f.seek(st.st_size - 4)
        f.write(b"\x7f\x7f\x7f\x7f")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    forged = json.loads(records[1].read_text())
    name = forged["units"][0][0]
    forged["answer"]["result"]["files"][name]["sha256"] = "0" * 64
    records[1].write_text(json.dumps(forged))
    # records whose inputs are not a table, or another file's: redone (not the run's end)
    for record, inputs in ((records[2], ["x"]), (records[3], {"big.pt": "1 bytes, modified at 0"})):
        data = json.loads(record.read_text())
        data["answer"]["inputs"] = inputs
        record.write_text(json.dumps(data))
    summary = _resumed(big_pt, out)
    assert summary["resume_note"].startswith(f"{len(records) - 4} of "), summary["resume_note"]
    assert run("convert", big_pt, tmp_path / "one", "--max-shard-size", "8MiB", "--workers", "1").exit_code == 0
    same_tree(out, tmp_path / "one")


def test_resume_of_a_source_put_in_the_place_of_another_starts_afresh(big_pt, tmp_path):
    """Another file at SRC's path with SRC's size and modification time (a re-download): another job."""
    src = tmp_path / "src.pt"
    src.write_bytes(big_pt.read_bytes())
    out = tmp_path / "out"
    _killed(src, out)
    other = tmp_path / "other.pt"
    data = bytearray(src.read_bytes())
    data[-200_000] ^= 0x40   # (a tensor's byte: the same archive, another value)
    other.write_bytes(bytes(data))
    st = src.stat()
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, src)
    summary = _resumed(src, out)
    assert "started afresh" in summary["resume_note"] and not summary["resumed_bytes"], summary
    assert run("convert", src, tmp_path / "one", "--max-shard-size", "8MiB", "--workers", "1").exit_code == 0
    same_tree(out, tmp_path / "one")


def test_a_link_planted_for_the_records_is_removed_not_written_through(hf_llama, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "0.json").write_text("precious")
    tmp = tmp_path / ".out.ckptconv-tmp"
    tmp.mkdir()
    (tmp / tasks.DONE).symlink_to(victim)
    r = run("convert", hf_llama["dir"], tmp_path / "out", *SHARDS, "--workers", "2", "--resume")
    assert r.exit_code == 0, r.stderr
    assert sorted(p.name for p in victim.iterdir()) == ["0.json"] and (victim / "0.json").read_text() == "precious"
    assert not os.path.lexists(tmp_path / "out" / tasks.DONE)
    assert run("verify", tmp_path / "out").exit_code == 0
    # a directory planted where a record is written: removed, the run completes
    again = tmp_path / ".again.ckptconv-tmp"
    (again / tasks.DONE / "1.json").mkdir(parents=True)
    r = run("convert", hf_llama["dir"], tmp_path / "again", *SHARDS, "--workers", "2", "--resume")
    assert r.exit_code == 0, r.stderr
    same_tree(tmp_path / "out", tmp_path / "again")


def test_a_task_error_crosses_processes_as_its_class_and_line():
    """What a worker answers with, and what the driver raises from it: a BadInput stays a BadInput
    (exit 2); a system error names its file; a bug is its type and line; an unknown name is an
    OutputError, never a class the answer picks outside ckptconv's errors."""
    assert tasks.failure(BadInput("m.pt: truncated"), "task 3") == ("BadInput", "m.pt: truncated")
    assert tasks.failure(FileNotFoundError(2, "No such file or directory", "/x/m.pt"), "task 3") == \
        ("OutputError", "/x/m.pt: No such file or directory")
    assert tasks.failure(KeyError("w"), "task 3") == ("OutputError", "task 3 failed: KeyError: 'w'")
    e = tasks.raised(*tasks.failure(BadInput("m.pt: truncated"), "task 3"))
    assert type(e) is BadInput and str(e) == "m.pt: truncated"
    for name in ("ValueError", "SystemExit", "OSError", "brief"):
        assert type(tasks.raised(name, "line")) is OutputError
