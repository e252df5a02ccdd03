"""The storage options travel with the job: every worker process of `--workers 2` reaches the
endpoint the command was given (moto behind the fault proxy, on a port of its own), with its part
size and concurrency, and writes what `--workers 1` writes, byte for byte — from a bucket SRC, into
a bucket OUT, for convert, reshard and verify (issue 47: they went to AWS's own endpoint)."""
import pytest

from tests.helpers import run
from tests.storage.test_bucket_sources import same_tree, upload

PART = 256 << 10


@pytest.fixture
def model(tmp_path):
    import torch
    torch.manual_seed(0)
    state = {f"model.layers.{i}.mlp.{k}_proj.weight": torch.randn(256, 512) for i in range(3) for k in ("up", "down")}
    state["model.embed_tokens.weight"] = torch.randn(512, 256)
    path = tmp_path / "m.pt"
    torch.save(state, path)
    return path


def flags(s3, workers):
    return ["--quiet", "--endpoint-url", s3.proxy.endpoint, "--part-size", "256KiB", "--concurrency", "2",
            "--retries", "1", "--stall-timeout", "5", "--workers", str(workers)]


def ranged_gets_fit_the_part_size(s3):
    assert s3.proxy.ranges, "no ranged GET reached the endpoint given"
    assert max(end - start for _, start, end in s3.proxy.ranges) <= PART, "a worker used another part size"
    assert s3.proxy.signers == {"AKIATESTKEYID0000000"}


def test_convert_and_reshard_from_a_bucket_at_two_workers_are_one_worker_s_bytes(s3, model, tmp_path):
    url = upload(s3, model, "src/m.pt")
    for workers in (1, 2):
        r = run("convert", url, tmp_path / f"c{workers}", "--max-shard-size", "600KB", *flags(s3, workers))
        assert r.exit_code == 0, r.stderr
        r = run("reshard", url, tmp_path / f"r{workers}", "--tp", "2", "--rules", _rules(tmp_path),
                *flags(s3, workers))
        assert r.exit_code == 0, r.stderr
    assert len(list((tmp_path / "c2").glob("*.safetensors"))) >= 3
    same_tree(tmp_path / "c1", tmp_path / "c2")
    same_tree(tmp_path / "r1", tmp_path / "r2")
    ranged_gets_fit_the_part_size(s3)


def test_a_bucket_out_and_its_verify_at_two_workers(s3, model, tmp_path, monkeypatch):
    from ckptconv.run import tasks
    adopted, adopt = [], tasks.adopt
    monkeypatch.setattr(tasks, "adopt", lambda target, ts, answers: (adopted.append(len(ts)), adopt(target, ts, answers)))
    url = upload(s3, model, "src/m.pt")
    outs = {}
    for workers in (1, 2):
        out = s3.url(f"out/w{workers}")
        r = run("convert", url, out, "--max-shard-size", "600KB", *flags(s3, workers))
        assert r.exit_code == 0, r.stderr
        outs[workers] = sorted(k.split("/", 2)[2] for k in s3.keys(f"out/w{workers}/"))
        v = run("verify", out, "--against", url, *flags(s3, workers))
        assert v.exit_code == 0, v.stdout + v.stderr
    assert adopted and adopted[0] >= 3   # (--workers 2: the shards written by tasks in worker processes)
    assert outs[1] == outs[2] and len(outs[1]) >= 5
    for name in outs[1]:
        one = s3.client.get_object(Bucket=s3.bucket, Key=f"out/w1/{name}")["Body"].read()
        two = s3.client.get_object(Bucket=s3.bucket, Key=f"out/w2/{name}")["Body"].read()
        assert one == two, name
    ranged_gets_fit_the_part_size(s3)


def test_the_api_takes_the_storage_options(s3, model, tmp_path):
    import ckptconv
    url = upload(s3, model, "src/m.pt")
    storage = ckptconv.StorageOptions(endpoint_url=s3.proxy.endpoint, part_size=PART, concurrency=2, retries=1)
    ckptconv.convert(url, tmp_path / "api", max_shard_size="600KB", workers=2, storage=storage)
    assert run("convert", model, tmp_path / "local", "--quiet", "--max-shard-size", "600KB").exit_code == 0
    same_tree(tmp_path / "api", tmp_path / "local")
    report = ckptconv.verify(tmp_path / "api", against=url, workers=2,
                             storage={"endpoint_url": s3.proxy.endpoint, "part_size": "256KiB", "concurrency": 2})
    assert report.ok, [str(p) for p in report.problems]
    ranged_gets_fit_the_part_size(s3)


def _rules(tmp_path):
    path = tmp_path / "rules.toml"
    path.write_text('layout = "torch"\n[[rule]]\npattern = ".*"\naxis = 0\n')
    return path


def test_a_task_failing_mid_upload_leaves_nothing_under_out(s3, model, tmp_path):
    """A task's upload refused: the run stops in one line, and neither that task's objects, the other
    tasks' shards nor any pending multipart upload is left under OUT (the driver sweeps OUT)."""
    from tests.storage.proxy import Fault
    url = upload(s3, model, "src/m.pt")
    s3.proxy.add(Fault("status", method="PUT", match=lambda p: "model-00003" in p, times=-1, status=403,
                       code="AccessDenied"))
    r = run("convert", url, s3.url("out/failed"), "--max-shard-size", "600KB", *flags(s3, 2))
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "model-00003" in r.stderr and "AccessDenied" in r.stderr, r.stderr
    assert s3.keys("out/") == [] and s3.uploads() == []
