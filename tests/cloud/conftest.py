"""Azure Blob Storage for `make test-cloud`: Azurite (the emulator, from npm) on a free 127.0.0.1 port,
started by the tests, and a container per test made with azure-storage-blob. Skipped unless
CKPTCONV_AZURITE names the folder `make test-cloud` installed them in."""
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.storage.server import _die_with_parent, _free_port

ACCOUNT = "devstoreaccount1"   # Azurite's well-known development account and key (not a secret)
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@pytest.fixture(scope="session")
def azurite(tmp_path_factory):
    root = os.environ.get("CKPTCONV_AZURITE")
    if not root:
        pytest.skip("make test-cloud runs these (Azurite)")
    sys.path.insert(0, str(Path(root) / "py"))
    port = _free_port()
    work = tmp_path_factory.mktemp("azurite")
    log = open(work / "azurite.log", "wb")
    server = subprocess.Popen([str(Path(root) / "node_modules" / ".bin" / "azurite-blob"), "--blobHost", "127.0.0.1",
                               "--blobPort", str(port), "--location", str(work), "--skipApiVersionCheck", "--loose"],
                              stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    import time
    import urllib.request
    url = f"http://127.0.0.1:{port}/{ACCOUNT}"
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{url}?comp=list", timeout=1).close()
            break
        except urllib.error.HTTPError:
            break    # it answers (unauthenticated)
        except OSError:
            assert server.poll() is None, "Azurite did not start"
            time.sleep(0.1)
    try:
        yield url
    finally:
        server.kill()
        server.wait(10)
        log.close()


@dataclass
class Azure:
    endpoint: str
    container: str
    client: object   # azure-storage-blob's ContainerClient

    def url(self, key: str) -> str:
        return f"az://{self.container}/{key}"

    def upload(self, local: Path, prefix: str) -> str:
        if local.is_file():
            with open(local, "rb") as f:
                self.client.upload_blob(prefix, f)
        else:
            for p in sorted(local.rglob("*")):
                if p.is_file():
                    with open(p, "rb") as f:
                        self.client.upload_blob(f"{prefix}/{p.relative_to(local).as_posix()}", f)
        return self.url(prefix)

    def names(self, prefix: str = "") -> list:
        return sorted(b.name for b in self.client.list_blobs(name_starts_with=prefix))


@pytest.fixture
def az(azurite, monkeypatch):
    from azure.storage.blob import BlobServiceClient
    for name in list(os.environ):
        if name.startswith(("AWS_", "AZURE_", "GOOGLE_")):
            monkeypatch.delenv(name)
    # obstore's Azure store reads these (object_store's AzureConfigKey): the emulator's endpoint and key
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", KEY)
    monkeypatch.setenv("AZURE_STORAGE_USE_EMULATOR", "true")
    monkeypatch.setenv("AZURITE_BLOB_STORAGE_URL", azurite.rsplit("/", 1)[0])
    service = BlobServiceClient(account_url=azurite, credential={"account_name": ACCOUNT, "account_key": KEY})
    name = f"t{uuid.uuid4().hex[:20]}"
    client = service.create_container(name)
    try:
        yield Azure(azurite, name, client)
    finally:
        client.delete_container()
