"""Storage URLs: what is one, what it names, the store it opens, and that no credential is ever
repeated (docs/security.md, "Bounds": object storage)."""
import sys

import pytest

from ckptconv.errors import UsageError
from ckptconv.storage import s3api
from ckptconv.storage.urls import Location, StorageOptions, failure, is_url, open_store, parse, redact


def test_what_is_a_url():
    assert is_url("s3://b/k") and is_url("gs://b/k") and is_url("hf://org/model") and is_url("HTTP://x")
    assert not is_url("model.pt") and not is_url("dir/s3:/x") and not is_url(None) and not is_url("C:\\x")


@pytest.mark.parametrize("url, where", [
    ("s3://bucket/models/llama", Location("s3", "bucket", "models/llama")),
    ("s3://bucket/models/llama/", Location("s3", "bucket", "models/llama")),
    ("s3://bucket", Location("s3", "bucket", "")),
    ("gs://my.bucket_1/a/b.safetensors", Location("gs", "my.bucket_1", "a/b.safetensors")),
    ("az://container/path/x", Location("az", "container", "path/x")),
    ("abfss://cont@acct01.dfs.core.windows.net/p/q", Location("abfss", "cont", "p/q", "acct01")),
])
def test_urls_parse_to_locations_and_back(url, where):
    assert parse(url) == where
    assert parse(str(where)) == where
    assert where.kind == {"abfss": "az"}.get(where.scheme, where.scheme)


def test_children_and_siblings():
    out = parse("s3://bkt/runs/out")
    assert out.child("model.safetensors").key == "runs/out/model.safetensors"
    assert out.sibling(".out.ckptconv-lock").key == "runs/.out.ckptconv-lock"
    with pytest.raises(UsageError, match="plain names"):
        out.child("../escape")


@pytest.mark.parametrize("url, says", [
    ("ftp://host/x", "not a storage URL"),
    ("s3://bkt/a//c", "plain names"),
    ("s3://bkt/a/../c", "plain names"),
    ("s3://B/x", "not a bucket"),
    ("s3:///x", "no bucket"),
    ("abfs://cont@acct.blob.core.windows.net/x", "abfs://CONTAINER@ACCOUNT"),
])
def test_bad_urls_are_one_usage_line(url, says):
    with pytest.raises(UsageError, match=says) as e:
        parse(url)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("url", [
    "s3://AKIAEXAMPLEKEY:wJalrXUtnFEMIsecretKEY@bucket/key",
    "s3://bucket/key?X-Amz-Signature=deadbeefsecretsig&X-Amz-Credential=AKIAEXAMPLEKEY",
    "az://container/blob?sv=2024&sig=sasSECRETsignature",
    "s3://bucket/key#tail-secretKEY",
])
def test_a_url_carrying_credentials_is_refused_without_repeating_them(url):
    with pytest.raises(UsageError) as e:
        parse(url)
    text = str(e.value)
    assert "may not carry" in text
    for secret in ("secretKEY", "AKIAEXAMPLEKEY", "deadbeef", "sasSECRET", "tail-"):
        assert secret not in text


def test_a_url_without_the_client_library_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "obstore", None)   # as if not installed
    where = parse("s3://bucket/model")                   # parsing needs no library
    with pytest.raises(UsageError, match=r"pip install 'ckptconv\[cloud\]'") as e:
        open_store(where)
    assert "\n" not in str(e.value)


def test_plain_http_only_for_an_endpoint_given_explicitly(monkeypatch):
    pytest.importorskip("obstore")
    where = parse("s3://bucket/model")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")   # obstore's own switch: not ours to honour
    def http(options=StorageOptions()):
        return str(open_store(where, options).handle.client_options["allow_http"]).lower() == "true"
    assert not http()
    assert http(StorageOptions(endpoint_url="http://127.0.0.1:9000"))
    assert not http(StorageOptions(endpoint_url="https://minio.local"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9001")
    assert http() and open_store(where).handle.config["endpoint"] == "http://127.0.0.1:9001"
    with pytest.raises(UsageError, match="may not carry credentials") as e:
        open_store(where, StorageOptions(endpoint_url="http://user:hunter2secret@127.0.0.1:9000"))
    assert "hunter2secret" not in str(e.value)
    with pytest.raises(UsageError, match="s3:// and gs:// URLs only"):
        open_store(parse("az://container/x"), StorageOptions(endpoint_url="http://127.0.0.1:9000"))


def test_a_gcs_endpoint_is_obstore_s_base_url_and_plain_http_only_when_given(monkeypatch):
    """An emulator or a private GCS endpoint (docs/storage.md): `--endpoint-url`, else GOOGLE_BASE_URL;
    AWS's endpoint variables are S3's only."""
    pytest.importorskip("obstore")
    where = parse("gs://bucket/model")
    monkeypatch.delenv("GOOGLE_BASE_URL", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9001")

    def opened(options=StorageOptions()):
        handle = open_store(where, options).handle
        return handle.config.get("base_url"), str(handle.client_options["allow_http"]).lower() == "true"
    assert opened() == (None, False)
    assert opened(StorageOptions(endpoint_url="http://127.0.0.1:4443")) == ("http://127.0.0.1:4443", True)
    assert opened(StorageOptions(endpoint_url="https://gcs.internal/")) == ("https://gcs.internal", False)
    monkeypatch.setenv("GOOGLE_BASE_URL", "http://127.0.0.1:4444")
    assert opened() == ("http://127.0.0.1:4444", True)
    with pytest.raises(UsageError, match="may not carry credentials") as e:
        open_store(where, StorageOptions(endpoint_url="http://user:hunter2secret@127.0.0.1:4443"))
    assert "hunter2secret" not in str(e.value)


def test_options_are_checked():
    for bad in (dict(concurrency=0), dict(part_size=1), dict(retries=-1), dict(stall_seconds=0)):
        with pytest.raises(UsageError):
            StorageOptions(**bad)


def test_messages_never_hold_a_credential(monkeypatch):
    monkeypatch.setenv("AWS_SESSION_TOKEN", "FwoGZXIvYXdzEXAMPLEsessiontoken")
    text = ("Error performing GET https://s3.amazonaws.com/b/k?X-Amz-Signature=abc123&X-Amz-Security-Token=tok "
            "with test-secret-never-printed-0123 and FwoGZXIvYXdzEXAMPLEsessiontoken\nDebug source: ...")
    line = failure(RuntimeError(text))
    assert "\n" not in line and "abc123" not in line and "tok " not in line
    assert "test-secret-never-printed-0123" not in line and "FwoGZXIvYXdzEXAMPLEsessiontoken" not in line
    assert redact("a AKIATESTKEYID0000000 b") == "a *** b"
    assert "test-secret" not in repr(s3api.Credentials("id", "test-secret-never-printed-0123", "tok"))
    answer = ("x - Server returned non-2xx status code: 503 Service Unavailable: <?xml version='1.0'?>"
              "<Error><Code>SlowDown</Code></Error>")
    assert failure(RuntimeError(answer)) == "the server answered HTTP 503 Service Unavailable (SlowDown)"


def test_sigv4_signatures_are_botocore_s(monkeypatch):
    """The two requests obstore does not make are signed exactly as botocore signs them."""
    auth = pytest.importorskip("botocore.auth")
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials
    import datetime
    now = datetime.datetime(2026, 11, 30, 12, 34, 56)
    monkeypatch.setattr(auth, "get_current_datetime", lambda *a, **k: now, raising=False)
    creds = s3api.Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "session/token+=")
    for method, url in [
        ("GET", s3api._url("https://s3.eu-west-1.amazonaws.com", "bkt", "", {"uploads": "", "prefix": "out dir/ä~+"})),
        ("GET", s3api._url("http://127.0.0.1:9000", "bkt", "", {"uploads": "", "prefix": "p/", "key-marker": "a=b&c",
                                                                "upload-id-marker": "x/y"})),
        ("DELETE", s3api._url("https://s3.eu-west-1.amazonaws.com", "bkt", "out/model 1+é.safetensors",
                              {"uploadId": "2~abc/def+=="})),
    ]:
        ours = s3api.sign(method, url, creds, "eu-west-1", now=now.replace(tzinfo=datetime.timezone.utc).timestamp())
        request = AWSRequest(method=method, url=url, headers={"x-amz-content-sha256": ours["x-amz-content-sha256"]})
        signer = auth.S3SigV4Auth(Credentials(creds.key_id, creds.secret, creds.token), "s3", "eu-west-1")
        signer._timestamp = lambda: now.strftime("%Y%m%dT%H%M%SZ")
        request.context["timestamp"] = now.strftime("%Y%m%dT%H%M%SZ")
        signer.add_auth(request)
        assert ours["authorization"] == request.headers["Authorization"], url


def test_commands_refuse_urls_in_one_line_and_write_nothing(tmp_path, monkeypatch):
    """A URL a command cannot use (credentials or a query in it, a bad bucket name), as SRC, OUT or
    PATH, is one line (exit 2) without its user, password or query, and never a local directory
    named `s3:`."""
    import torch
    from tests.helpers import run
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2secret")
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    cases = [("inspect", "s3://u:pw@bkt/model.safetensors?X-Amz-Signature=abc", "may not carry a query"),
             ("inspect", "s3://u:pw@bkt/model.safetensors", "may not carry credentials"),
             ("convert", "m.pt", "s3://u:pw@bkt/out", "may not carry credentials"),
             ("reshard", "m.pt", "gs://Bkt/out", "--tp", "2", "--allow-replicate", ".*", "is not a bucket"),
             ("verify", "s3://bkt/out?X-Amz-Signature=abc&t=hunter2secret", "may not carry a query"),
             ("plan", "abfs://c@acct.dfs.core.windows.net/x", "is not a bucket or container name")]
    for *args, said in cases:
        r = run(*args)
        assert r.exit_code == 2 and r.stderr.count("\n") == 1, (args, r.stderr)
        assert said in r.stderr and "pw@" not in r.stderr and "abc" not in r.stderr, r.stderr
        assert "hunter2secret" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]
