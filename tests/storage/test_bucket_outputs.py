"""Outputs written to a bucket (moto's S3 API through the fault proxy): byte for byte the local output,
the pointer (the file a consumer opens first) last and create-only, nothing partial ever left by a
failure or a signal, a killed run resumed, one of two racing runs publishing, --overwrite replacing
only a ckptconv output, and verify reading a bucket OUT (docs/storage.md)."""
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckptconv import cli_options
from tests.helpers import ROOT, run
from tests.storage.conftest import CREDENTIALS
from tests.storage.proxy import Fault

MIB = 1 << 20
TOKEN = "IQoJb3JpZ2luX2VjEXAMPLEsessiontoken0"   # a session token: never in an object, a line or an error
SECRETS = [CREDENTIALS["AWS_SECRET_ACCESS_KEY"], CREDENTIALS["AWS_ACCESS_KEY_ID"], TOKEN]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """28 tensors of 1 MiB (and a small one): shards and single files of several 5 MiB parts."""
    import torch
    g = torch.Generator().manual_seed(3)
    state = {f"layer.{i:02d}.weight": torch.randn(256, 1024, generator=g) for i in range(28)}
    state["norm"] = torch.ones(4)
    path = tmp_path_factory.mktemp("src") / "m.pt"
    torch.save(state, path)
    (path.parent / "split.toml").write_text('layout = "torch"\n[[rule]]\npattern = ".*"\naxis = 0\n')
    return path


@pytest.fixture(autouse=True)
def token(monkeypatch):
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)


def store(s3, monkeypatch, **kw):
    """The CLI's storage options with a short retry budget (what --endpoint-url etc. would give, and
    retries a test can wait for)."""
    options = s3.options(stall_seconds=20.0, **kw)
    monkeypatch.setattr(cli_options, "_storage", lambda *given: options)


def download(s3, prefix: str, to: Path) -> Path:
    """Every object under `prefix` (or the one object `prefix`) into `to`; `to`."""
    keys = s3.keys(prefix)
    for key in keys:
        rel = key[len(prefix):].lstrip("/") or Path(prefix).name
        (to / rel).parent.mkdir(parents=True, exist_ok=True)
        (to / rel).write_bytes(s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    return to


def tree(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def created(s3) -> list:
    """The object-creating requests the proxy saw, in order (a PUT of a whole object, a multipart
    upload's completion), but the lock's."""
    return [p for m, p, _ in s3.proxy.seen if "ckptconv-lock" not in p
            and ((m == "PUT" and "partNumber=" not in p) or (m == "POST" and "uploadId=" in p))]


def no_secret(*texts):
    for text in texts:
        data = text if isinstance(text, bytes) else text.encode()
        for secret in SECRETS:
            assert secret.encode() not in data


KINDS = {   # what the command writes, its extra options, the pointer (published last)
    "sharded": (["convert", "--max-shard-size", "9MB"], "model.safetensors.index.json"),
    "one shard": (["convert"], "model.safetensors"),                 # a 28 MiB pointer: our multipart upload
    "single file": (["convert"], "one.safetensors"),
    "reshard --tp 2": (["reshard", "--tp", "2", "--max-shard-size", "9MB"], "mesh.json"),
}


@pytest.mark.parametrize("kind", KINDS)
def test_an_output_in_a_bucket_is_the_local_output_published_pointer_last(s3, model, tmp_path, monkeypatch, kind):
    (command, *more), pointer = KINDS[kind]
    if command == "reshard":
        more += ["--rules", model.parent / "split.toml"]
    name = "one.safetensors" if kind == "single file" else "out"
    store(s3, monkeypatch)
    r = run(command, model, s3.url(f"runs/{name}"), *more, "--json")
    assert r.exit_code == 0, r.stderr
    local = tmp_path / "local" / name
    local.parent.mkdir()
    here = run(command, model, local, *more, "--json")
    assert here.exit_code == 0, here.stderr
    assert json.loads(r.stdout)["identity"] == json.loads(here.stdout)["identity"]
    got = download(s3, f"runs/{name}", tmp_path / "got")
    if kind == "single file":
        assert (got / name).read_bytes() == local.read_bytes()
    else:
        assert tree(got) == tree(local)
        for sums in got.rglob("SHA256SUMS"):
            assert subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=sums.parent).returncode == 0
    assert created(s3)[-1].split("?")[0] == f"/{s3.bucket}/runs/{name}" + ("" if kind == "single file" else
                                                                            f"/{pointer}")
    assert s3.uploads() == [] and not [k for k in s3.keys() if "ckptconv-lock" in k]
    v = run("verify", s3.url(f"runs/{name}"))
    assert v.exit_code == 0 and v.stdout.startswith(f"{s3.url(f'runs/{name}')}: OK"), v.stdout + v.stderr
    no_secret(r.stdout, r.stderr, v.stdout, v.stderr, *tree(got).values())


@pytest.mark.parametrize("kind", ["reshard --target vllm", "diffusers pipeline"])
def test_engine_and_pipeline_outputs_in_a_bucket_are_the_local_ones(s3, hf_llama, tmp_path_factory, tmp_path,
                                                                    monkeypatch, kind):
    """vLLM's top-level names (copies the store makes of the rank shards, where a disk has hard links)
    and a pipeline's folders, published by mesh.json and model_index.json."""
    if kind == "diffusers pipeline":
        from tests.fixtures import pipelines
        args, pointer = ["convert", pipelines.ddpm(tmp_path_factory.mktemp("ddpm") / "ddpm")], "model_index.json"
    else:
        args, pointer = ["reshard", hf_llama["dir"], "--tp", "2", "--target", "vllm"], "mesh.json"
    store(s3, monkeypatch)
    command, src, *more = args
    r = run(command, src, s3.url("runs/out"), *more)
    assert r.exit_code == 0, r.stderr
    assert run(command, src, tmp_path / "local", *more, "--quiet").exit_code == 0
    got = download(s3, "runs/out", tmp_path / "got")
    assert tree(got) == tree(tmp_path / "local")
    assert created(s3)[-1].split("?")[0] == f"/{s3.bucket}/runs/out/{pointer}"
    assert run("verify", s3.url("runs/out")).exit_code == 0
    assert s3.uploads() == [] and not [k for k in s3.keys() if "ckptconv-lock" in k]


@pytest.mark.parametrize("failing", ["model-00001-of-00002.safetensors", "one.safetensors"])
def test_an_upload_failing_at_part_3_of_5_leaves_no_object_and_no_pending_upload(s3, model, monkeypatch, failing):
    """A shard's upload (obstore's multipart) or the pointer's (ours) fails at part 3: the run stops
    with one line, and every object it made is deleted, every upload aborted, its lock let go."""
    store(s3, monkeypatch, retries=1)
    s3.proxy.add(Fault("status", method="PUT", match=lambda t: failing in t and "partNumber=3&" in t, times=-1,
                       status=500, code="InternalError"))
    out = s3.url("runs/one.safetensors" if failing == "one.safetensors" else "runs/out")
    r = run("convert", model, out, "--max-shard-size", "26MB")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"{failing}: " in r.stderr and "HTTP 500" in r.stderr and "InternalError" in r.stderr, r.stderr
    assert s3.proxy.done("status") == 2   # part 3, tried twice
    assert s3.keys() == [] and s3.uploads() == []
    no_secret(r.stderr)


KILLED = r"""
import sys
from ckptconv.storage import writer as upload
from ckptconv.cli import main
send = upload.ObjectWriter._send

def sending(self, item):   # the second shard's first part is on its way: say so, then go on slowly
    import time
    send(self, item)
    if "model-00002" in self.location.key and not getattr(sending, "said", False):
        sending.said = True
        time.sleep(1.0)   # (its upload begun, the part sent)
        print("writing", flush=True)
    if "model-00002" in self.location.key:
        time.sleep(0.5)
upload.ObjectWriter._send = sending
main(sys.argv[1:], prog_name="ckptconv")
"""


def _start(s3, model, out):
    child = subprocess.Popen([sys.executable, "-c", KILLED, "convert", str(model), s3.url(out), "--max-shard-size",
                              "9MB", "--part-size", "5MiB", "--endpoint-url", s3.endpoint, "--quiet"], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    line = child.stdout.readline()
    assert line == "writing\n", child.stderr.read()
    return child


def test_sigterm_mid_upload_publishes_nothing_and_leaves_nothing(s3, model):
    child = _start(s3, model, "runs/out")
    child.send_signal(signal.SIGTERM)
    assert child.wait(60) == 128 + signal.SIGTERM
    err = child.stderr.read()
    assert err == "ckptconv: error: interrupted by SIGTERM; no output was published\n", err
    assert s3.keys() == [] and s3.uploads() == []


def test_sigkill_mid_upload_publishes_nothing_and_resume_completes_it(s3, model, tmp_path, monkeypatch):
    child = _start(s3, model, "runs/out")
    child.kill()
    child.wait(60)
    left = s3.keys()
    assert "runs/.out.ckptconv-lock" in left and "runs/out/model-00001-of-00004.safetensors" in left
    assert not [k for k in left if k.endswith(("index.json", "manifest.json", "SHA256SUMS"))], left
    assert s3.uploads() == ["runs/out/model-00002-of-00004.safetensors"]   # pending: invisible, billed
    v = run("verify", s3.url("runs/out"), "--endpoint-url", s3.endpoint)
    assert v.exit_code == 1 and "incomplete (not published): SHA256SUMS is not there" in v.stdout, v.stdout
    r = run("convert", model, s3.url("runs/out"), "--max-shard-size", "9MB", "--endpoint-url", s3.endpoint)
    assert r.exit_code == 2 and f"a run that is gone (pid {child.pid} on " in r.stderr, r.stderr
    store(s3, monkeypatch)
    r = run("convert", model, s3.url("runs/out"), "--max-shard-size", "9MB", "--resume", "--json")
    assert r.exit_code == 0, r.stderr
    size = s3.client.head_object(Bucket=s3.bucket, Key="runs/out/model-00001-of-00004.safetensors")["ContentLength"]
    assert json.loads(r.stdout)["resumed_bytes"] == size   # the finished shard, re-hashed and kept
    assert s3.uploads() == [] and "runs/.out.ckptconv-lock" not in s3.keys()
    local = tmp_path / "local"
    assert run("convert", model, local, "--max-shard-size", "9MB", "--quiet").exit_code == 0
    assert tree(download(s3, "runs/out", tmp_path / "got")) == tree(local)


RACE = "import sys\nfrom ckptconv.cli import main\nmain(sys.argv[1:], prog_name='ckptconv')\n"


def test_two_runs_racing_for_one_out_one_publishes_and_the_other_refuses_in_one_line(s3, model, tmp_path):
    runs = [subprocess.Popen([sys.executable, "-c", RACE, "convert", str(model), s3.url("runs/out"),
                              "--max-shard-size", "9MB", "--endpoint-url", s3.endpoint, "--quiet"], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outcomes = [(p.wait(120), p.stderr.read()) for p in runs]
    assert sorted(code for code, _ in outcomes) == [0, 2], outcomes
    refusal = next(err for code, err in outcomes if code == 2)
    assert refusal.count("\n") == 1 and ("another ckptconv run (pid" in refusal or "already exists" in refusal), refusal
    local = tmp_path / "local"
    assert run("convert", model, local, "--max-shard-size", "9MB", "--quiet").exit_code == 0
    assert tree(download(s3, "runs/out", tmp_path / "got")) == tree(local)
    assert s3.uploads() == [] and "runs/.out.ckptconv-lock" not in s3.keys()


def test_overwrite_replaces_a_previous_output_and_refuses_a_prefix_that_is_not_one(s3, model, tmp_path, monkeypatch):
    store(s3, monkeypatch)
    assert run("convert", model, s3.url("runs/out"), "--max-shard-size", "9MB").exit_code == 0
    r = run("convert", model, s3.url("runs/out"))
    assert r.exit_code == 2 and "already exists (use --overwrite" in r.stderr and r.stderr.count("\n") == 1
    r = run("convert", model, s3.url("runs/out"), "--max-shard-size", "20MB", "--overwrite")
    assert r.exit_code == 0, r.stderr
    local = tmp_path / "local"
    assert run("convert", model, local, "--max-shard-size", "20MB", "--quiet").exit_code == 0
    assert tree(download(s3, "runs/out", tmp_path / "got")) == tree(local)   # (no shard of the old one left)
    s3.client.put_object(Bucket=s3.bucket, Key="runs/theirs/notes.txt", Body=b"not ours")
    r = run("convert", model, s3.url("runs/theirs"), "--overwrite")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "runs/theirs: is not a ckptconv output (no manifest.json or mesh.json of ckptconv's)" in r.stderr
    assert s3.keys("runs/theirs") == ["runs/theirs/notes.txt"] and s3.uploads() == []


def test_verify_of_a_bucket_out(s3, model, monkeypatch):
    store(s3, monkeypatch)
    assert run("convert", model, s3.url("runs/out"), "--max-shard-size", "9MB").exit_code == 0
    assert run("verify", s3.url("runs/out")).exit_code == 0
    key = "runs/out/model-00002-of-00004.safetensors"
    data = bytearray(s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    data[-5] ^= 1
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(data))
    r = run("verify", s3.url("runs/out"))
    assert r.exit_code == 1, r.stdout + r.stderr
    assert f"{s3.url(key)}: sha256 differs from manifest.json" in r.stdout
    assert re.search(r"tensor 'layer\.15\.weight': sha256 differs from the manifest", r.stdout), r.stdout
    s3.client.delete_object(Bucket=s3.bucket, Key="runs/out/model.safetensors.index.json")
    r = run("verify", s3.url("runs/out"))
    assert r.exit_code == 1 and r.stdout.splitlines()[0] == (
        f"{s3.url('runs/out')}: incomplete (not published): model.safetensors.index.json is not there (written "
        "last: a run is writing it, or one failed or was killed; --resume or --overwrite completes it)"), r.stdout
    s3.client.put_object(Bucket=s3.bucket, Key="runs/.gone.ckptconv-lock", Body=b"{}")
    r = run("verify", s3.url("runs/gone"))
    assert r.exit_code == 1 and "runs/gone: incomplete (not published): nothing is there but a run's lock" in r.stdout
    r = run("verify", s3.url("runs/nothing"))
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr


def test_out_under_a_source_object_s_key_and_control_characters_are_refused(s3, model, monkeypatch):
    """What the outside attack found: OUT below SRC's own key (SRC would read as a prefix afterwards),
    and a tab in a URL, which URL parsing would have dropped silently (another key)."""
    store(s3, monkeypatch)
    s3.client.upload_file(str(model), s3.bucket, "p/m.pt")
    r = run("convert", s3.url("p/m.pt"), s3.url("p/m.pt/x"))
    assert r.exit_code == 2 and "lies under the input object" in r.stderr and r.stderr.count("\n") == 1
    r = run("convert", model, s3.url("odd/ta\tb"))
    assert r.exit_code == 2 and "may not hold control characters" in r.stderr and r.stderr.count("\n") == 1
    assert s3.keys("p/") == ["p/m.pt"] and s3.keys("odd") == []


def test_an_object_that_appears_under_out_during_the_run_is_never_published(s3, model, monkeypatch):
    """The outside attack: another writer's foo.txt put under a claimed OUT was published inside the
    output. It is now found before the pointer is written: nothing published, the foreign object
    left alone, this run's objects gone."""
    store(s3, monkeypatch)
    state = {"done": False}

    def someone_else_writes(target):
        if not state["done"] and "runs/out/model-" in target:
            state["done"] = True
            s3.client.put_object(Bucket=s3.bucket, Key="runs/out/foo.txt", Body=b"theirs")
        return False
    s3.proxy.add(Fault("status", method="PUT", match=someone_else_writes, times=-1))
    r = run("convert", model, s3.url("runs/out"), "--max-shard-size", "9MB")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "foo.txt appeared under OUT while the run wrote it" in r.stderr and "nothing was published" in r.stderr
    assert s3.keys("runs/") == ["runs/out/foo.txt"] and s3.uploads() == []


def test_a_single_file_out_that_is_also_a_prefix_is_not_published(s3, model, monkeypatch):
    """The outside attack: OUT.safetensors, also a prefix holding objects, was published and then
    reported as failed. Refused before anything is published now, the objects under it left alone."""
    store(s3, monkeypatch)
    s3.client.put_object(Bucket=s3.bucket, Key="runs/one.safetensors/x", Body=b"theirs")
    r = run("convert", model, s3.url("runs/one.safetensors"))
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
    assert s3.keys("runs/") == ["runs/one.safetensors/x"] and s3.uploads() == []
