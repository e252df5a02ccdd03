"""Sources in a bucket (moto's S3 API on 127.0.0.1) convert exactly as the same files on a local disk:
every output file identical, the manifest too (it records what was read by name, not where)."""
import filecmp
import os
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import run


def upload(s3, local: Path, prefix: str) -> str:
    """`local` (a file or a directory tree) under `prefix` in the bucket; its URL."""
    if local.is_file():
        s3.client.upload_file(str(local), s3.bucket, prefix)
    else:
        for p in sorted(local.rglob("*")):
            if p.is_file():
                s3.client.upload_file(str(p), s3.bucket, f"{prefix}/{p.relative_to(local).as_posix()}")
    return s3.url(prefix)


def same_tree(a: Path, b: Path):
    """Two outputs hold the same files with the same bytes."""
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    for n in names:
        assert filecmp.cmp(a / n, b / n, shallow=False), n


@pytest.fixture
def hf_dir(tmp_path):
    from safetensors.numpy import save_file
    d = tmp_path / "hf"
    d.mkdir()
    rng = np.random.default_rng(7)
    a = {"model.a.weight": rng.standard_normal((64, 32)).astype(np.float32)}
    b = {"model.b.weight": rng.integers(0, 100, (300,), dtype=np.int64), "model.c": np.ones((2, 3), np.float16)}
    save_file(a, d / "model-00001-of-00002.safetensors")
    save_file(b, d / "model-00002-of-00002.safetensors")
    import json
    index = {"metadata": {}, "weight_map": {**{k: "model-00001-of-00002.safetensors" for k in a},
                                            **{k: "model-00002-of-00002.safetensors" for k in b}}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "config.json").write_text('{"model_type": "none"}')
    return d


def test_a_safetensors_directory_from_a_bucket_converts_as_locally(s3, hf_dir, tmp_path):
    url = upload(s3, hf_dir, "runs/hf")
    r = run("convert", url, tmp_path / "remote", "--quiet", "--max-shard-size", "10KB", "--endpoint-url", s3.endpoint)
    assert r.exit_code == 0, r.stderr
    assert run("convert", hf_dir, tmp_path / "local", "--quiet", "--max-shard-size", "10KB").exit_code == 0
    same_tree(tmp_path / "remote", tmp_path / "local")


def test_a_safetensors_file_from_a_bucket_converts_as_locally(s3, hf_dir, tmp_path):
    f = hf_dir / "model-00001-of-00002.safetensors"
    url = f"{upload(s3, hf_dir, 'm')}/{f.name}"   # (beside its index: --one-shard, recorded)
    r = run("convert", url, tmp_path / "remote.safetensors", "--quiet", "--one-shard", "--endpoint-url", s3.endpoint)
    assert r.exit_code == 0, r.stderr
    assert run("convert", f, tmp_path / "local.safetensors", "--quiet", "--one-shard").exit_code == 0
    assert (tmp_path / "remote.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()


def test_a_missing_object_is_one_line(s3, tmp_path):
    r = run("inspect", s3.url("nothing/here.safetensors"), "--endpoint-url", s3.endpoint)
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "nothing/here.safetensors" in r.stderr


def test_tensor_bytes_come_in_few_long_gets(s3, tmp_path):
    """The read-ahead window joins the ranges a shard names (each asked once, however often it is
    named) into GETs of --part-size: 64 tensors of 16 KiB are one GET, not 64 (nor 128)."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(11)
    save_file({f"t{i:02d}": rng.standard_normal(4096).astype(np.float32) for i in range(64)}, tmp_path / "m.safetensors")
    url = upload(s3, tmp_path / "m.safetensors", "few/m.safetensors")
    r = run("convert", url, tmp_path / "out", "--quiet", "--endpoint-url", s3.proxy.endpoint)
    assert r.exit_code == 0, r.stderr
    gets = [s for s in s3.proxy.seen if s[0] == "GET" and "few/m.safetensors" in s[1]]
    assert len(gets) <= 4, gets   # the first bytes (detection), the header's length, the header, the data
    assert run("convert", tmp_path / "m.safetensors", tmp_path / "local", "--quiet").exit_code == 0
    same_tree(tmp_path / "out", tmp_path / "local")


def test_verify_against_a_bucket_source_compares_its_carried_files(s3, hf_dir, tmp_path):
    """The outside attack: every carried file was 'not the source's' when the source was a URL."""
    url = upload(s3, hf_dir, "against/hf")
    out = tmp_path / "out"
    assert run("convert", url, out, "--quiet", "--endpoint-url", s3.endpoint).exit_code == 0
    r = run("verify", out, "--against", url, "--endpoint-url", s3.endpoint)
    assert r.exit_code == 0, r.stdout + r.stderr
    s3.client.put_object(Bucket=s3.bucket, Key="against/hf/config.json", Body=b'{"model_type": "other"}')
    r = run("verify", out, "--against", url, "--endpoint-url", s3.endpoint)
    assert r.exit_code == 1 and "is not the source's config.json" in r.stdout + r.stderr
