"""--ray with a bucket SRC and OUT (moto's S3 API on a port of its own, behind the fault proxy): the
storage options reach every Ray task (issue 47: tasks listed AWS's own endpoint), the output is
--workers 1's byte for byte, the tasks upload their shards into OUT themselves and the driver
publishes it pointer last; a task's failed upload leaves nothing. `make test-ray`."""
import os
import subprocess
import sys
import uuid

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from tests.helpers import ROOT  # noqa: E402
from tests.storage.conftest import CREDENTIALS  # noqa: E402
from tests.storage.proxy import Fault, FaultProxy  # noqa: E402
from tests.storage.server import start_moto, stop_moto  # noqa: E402

ENV = {**{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RAY_ADDRESS"))}, **CREDENTIALS,
       "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}
PART = 256 << 10


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                     "env_vars": {k: ENV[k] for k in CREDENTIALS}})
    c.add_node(num_cpus=1, env_vars={k: ENV[k] for k in CREDENTIALS})
    c.wait_for_nodes()
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    import boto3
    server, url = start_moto(tmp_path_factory.mktemp("moto") / "moto.log")
    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id=CREDENTIALS[
        "AWS_ACCESS_KEY_ID"], aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
    bucket = f"t-{uuid.uuid4().hex[:20]}"
    client.create_bucket(Bucket=bucket)
    proxy = FaultProxy(url)
    yield client, bucket, proxy
    proxy.close()
    stop_moto(server)


@pytest.fixture(scope="module")
def model(tmp_path_factory, s3):
    import torch
    client, bucket, _ = s3
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("m") / "m.pt"
    torch.save({f"layers.{i}.w": torch.randn(256, 512) for i in range(6)}, path)
    client.upload_file(str(path), bucket, "src/m.pt")
    return path, f"s3://{bucket}/src/m.pt"


def cli(*args):
    return subprocess.run([sys.executable, "-m", "ckptconv.cli", *map(str, args)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)


def flags(proxy):
    return ["--quiet", "--endpoint-url", proxy.endpoint, "--part-size", "256KiB", "--concurrency", "2",
            "--retries", "1", "--stall-timeout", "5", "--max-shard-size", "600KB"]


def objects(client, bucket, prefix) -> dict:
    found = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix):]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in found}


def test_a_bucket_src_and_out_through_ray_are_one_worker_s_bytes(cluster, s3, model, tmp_path):
    client, bucket, proxy = s3
    _, url = model
    ray_flag = f"--ray={cluster.address}"
    r = cli("convert", url, tmp_path / "local-1", *flags(proxy), "--workers", "1")
    assert r.returncode == 0, r.stderr
    r = cli("convert", url, tmp_path / "local-ray", *flags(proxy), ray_flag)
    assert r.returncode == 0, r.stderr
    for name in sorted(p.name for p in (tmp_path / "local-1").iterdir()):
        assert (tmp_path / "local-1" / name).read_bytes() == (tmp_path / "local-ray" / name).read_bytes(), name
    for out, how in (("out/one", ["--workers", "1"]), ("out/ray", [ray_flag])):
        r = cli("convert", url, f"s3://{bucket}/{out}", *flags(proxy), *how)
        assert r.returncode == 0, r.stderr
        r = cli("reshard", url, f"s3://{bucket}/{out}-tp2", "--tp", "2", "--rules", _rules(tmp_path), *flags(proxy),
                *how)
        assert r.returncode == 0, r.stderr
    assert objects(client, bucket, "out/one/") == objects(client, bucket, "out/ray/")
    assert len(objects(client, bucket, "out/one/")) >= 5
    assert objects(client, bucket, "out/one-tp2/") == objects(client, bucket, "out/ray-tp2/")
    v = cli("verify", f"s3://{bucket}/out/ray", "--against", url, *flags(proxy)[:-2], ray_flag)
    assert v.returncode == 0, v.stdout + v.stderr
    assert max(end - start for _, start, end in proxy.ranges) <= PART   # (every task used the part size given)
    assert proxy.signers == {CREDENTIALS["AWS_ACCESS_KEY_ID"]}


def test_a_ray_task_s_refused_upload_leaves_nothing(cluster, s3, model, tmp_path):
    client, bucket, proxy = s3
    _, url = model
    proxy.add(Fault("status", method="PUT", match=lambda p: "model-00003" in p, times=-1, status=403,
                    code="AccessDenied"))
    r = cli("convert", url, f"s3://{bucket}/out/failed", *flags(proxy), f"--ray={cluster.address}")
    proxy.faults.clear()
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "AccessDenied" in r.stderr, r.stderr
    assert objects(client, bucket, "out/failed") == {}
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def _rules(tmp_path):
    path = tmp_path / "rules.toml"
    path.write_text('layout = "torch"\n[[rule]]\npattern = ".*"\naxis = 0\n')
    return path
