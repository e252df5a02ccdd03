"""az:// sources (Azurite) convert exactly as the same files on a local disk, as s3:// ones do against
moto in `make test` (tests/storage/)."""
import numpy as np

from tests.helpers import run
from tests.storage.test_bucket_sources import same_tree


def _model(d):
    from safetensors.numpy import save_file
    rng = np.random.default_rng(5)
    save_file({f"w{i}": rng.standard_normal((128, 512)).astype(np.float32) for i in range(4)}, d / "model.safetensors")
    (d / "config.json").write_text('{"model_type": "none"}')
    return d


def test_an_azure_source_converts_as_locally(az, tmp_path):
    (tmp_path / "src").mkdir()
    src = _model(tmp_path / "src")
    url = az.upload(src, "runs/src")   # (the manifest records the source's name: the same here)
    r = run("convert", url, tmp_path / "remote", "--quiet", "--part-size", "256KiB")
    assert r.exit_code == 0, r.stderr
    assert run("convert", src, tmp_path / "local", "--quiet").exit_code == 0
    same_tree(tmp_path / "remote", tmp_path / "local")


def test_a_missing_blob_is_one_line(az):
    r = run("inspect", az.url("nothing/model.safetensors"))
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr


def test_an_azure_output_is_the_local_output_and_verifies(az, tmp_path):
    (tmp_path / "src").mkdir()
    src = _model(tmp_path / "src")
    r = run("convert", src, az.url("out/m"), "--quiet", "--max-shard-size", "300KB")
    assert r.exit_code == 0, r.stderr
    assert run("convert", src, tmp_path / "local", "--quiet", "--max-shard-size", "300KB").exit_code == 0
    names = az.names("out/m/")
    assert sorted(n.removeprefix("out/m/") for n in names) == sorted(p.name for p in (tmp_path / "local").iterdir())
    for n in names:
        assert az.client.download_blob(n).readall() == (tmp_path / "local" / n.removeprefix("out/m/")).read_bytes(), n
    assert run("verify", az.url("out/m")).exit_code == 0
    again = run("convert", src, az.url("out/m"), "--quiet")
    assert again.exit_code == 2 and "already exists" in again.stderr
