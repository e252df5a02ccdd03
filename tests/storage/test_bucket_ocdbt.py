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
from ckptconv.storage.urls import StorageOptions
from tests.storage.test_bucket_sources import upload

DATA = Path(__file__).parent.parent / "fixtures" / "data" / "ocdbt"


@pytest.fixture
def bucket(s3):
    storage.configure(s3.options())
    yield s3
    storage.configure(StorageOptions())


@pytest.mark.parametrize("name", ["orbax2", "deep"])
def test_a_store_in_a_bucket_reads_as_on_disk(bucket, name):
    url = upload(bucket, DATA / name, f"in/{name}")
    store = OcdbtStore(storage.place(url))
    want = json.loads((DATA / name / "truth.json").read_text())
    assert store.keys() == sorted(want)
    for key, value in want.items():
        assert bytes(store.read(key)) == base64.b64decode(value), key


def test_a_missing_data_file_is_refused_in_a_bucket(bucket, tmp_path):
    src = tmp_path / "s"
    shutil.copytree(DATA / "small", src)
    url = upload(bucket, src, "in/s")
    local = OcdbtStore(src)
    remote = OcdbtStore(storage.place(url))
    assert local.keys() == remote.keys()
    # a missing data file: the same line, but for the path
    (src / "d").rename(tmp_path / "gone")
    with pytest.raises(BadInput, match="is missing"):
        OcdbtStore(src)
    for key in bucket.keys("in/s/d/"):
        bucket.client.delete_object(Bucket=bucket.bucket, Key=key)
    storage.configure(bucket.options())      # forget the listing cached before the deletion
    with pytest.raises(BadInput, match="is missing"):
        OcdbtStore(storage.place(url))
