"""A damaged DCP training state in a bucket (moto's S3 API on 127.0.0.1) is said as on a local disk
(readers/test_damaged_sources.py): the object's size from the listing against what .metadata places
in it, the same records, and the one line naming the object's URL."""
import json
import shutil

from tests.helpers import DATA, run
from tests.readers.test_damaged_sources import cut, line, model
from tests.storage.test_bucket_sources import upload


def test_a_cut_in_the_optimizers_part_is_said_from_a_bucket(s3, tmp_path):
    src = tmp_path / "fsdp1"
    shutil.copytree(DATA / "training_dcp" / "fsdp1", src)
    record = cut(src, "__0_0.distcp", model)
    url = upload(s3, src, "runs/fsdp1")
    r = run("convert", url, tmp_path / "out", "--endpoint-url", s3.endpoint, "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["damaged"] == [record]
    assert r.stderr == f"ckptconv: warning: {line(url, record)}\n"
    local = run("convert", src, tmp_path / "local", "--json")
    assert json.loads(local.stdout)["damaged"] == [record]
