"""readers/ocdbt.py from an object store: the same keys and values as from a disk, and the same
refusal for a hostile store (moto's S3 behind the fault proxy; tests/storage/conftest.py)."""
import base64
import json
import shutil
from pathlib import Path

import pytest

from ckptconv.errors import BadInput
from ckptconv.readers.ocdbt import OcdbtStore
from ckptconv.storage import files as storage
from tests.storage.test_bucket_sources import upload

DATA = Path(__file__).parent.parent / "fixtures" / "data" / "ocdbt"


@pytest.fixture
def bucket(s3):
    return s3


@pytest.mark.parametrize("name", ["orbax2", "deep"])
def test_a_store_in_a_bucket_reads_as_on_disk(bucket, name):
    url = upload(bucket, DATA / name, f"in/{name}")
    store = OcdbtStore(storage.locate(url, bucket.options()))
    want = json.loads((DATA / name / "truth.json").read_text())
    assert store.keys() == sorted(want)
    for key, value in want.items():
        assert bytes(store.read(key)) == base64.b64decode(value), key


def test_a_missing_data_file_is_refused_in_a_bucket(bucket, tmp_path):
    src = tmp_path / "s"
    shutil.copytree(DATA / "small", src)
    url = upload(bucket, src, "in/s")
    local = OcdbtStore(src)
    remote = OcdbtStore(storage.locate(url, bucket.options()))
    assert local.keys() == remote.keys()
    # a missing data file: the same line, but for the path
    (src / "d").rename(tmp_path / "gone")
    with pytest.raises(BadInput, match="is missing"):
        OcdbtStore(src)
    for key in bucket.keys("in/s/d/"):
        bucket.client.delete_object(Bucket=bucket.bucket, Key=key)
    with pytest.raises(BadInput, match="is missing"):   # (a new session: nothing listed before the deletion)
        OcdbtStore(storage.locate(url, bucket.options()))
