"""The two S3 calls obstore does not make: list the multipart uploads pending under a prefix
(ListMultipartUploads) and abort one (AbortMultipartUpload). obstore aborts the uploads it fails
itself (obstore/src/put.rs, put_multipart_inner), but a killed run leaves its uploads pending,
invisible to a listing of objects and billed; `--resume`/`--overwrite` abort them through these.

Requests are signed here with AWS Signature Version 4 (the canonical request, the string to sign,
the derived key: docs.aws.amazon.com/IAM/latest/UserGuide/create-signed-request.html), path-style,
to the explicit endpoint or `s3.REGION.amazonaws.com`. Credentials: the environment's
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN), else boto3's chain when boto3 is
installed; obstore keeps the ones it resolves itself (instance identity) to itself.
"""
import hashlib
import hmac
import http.client
import os
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import quote, urlsplit

from ..errors import OutputError
from .urls import Location, Retry, StorageOptions, endpoint, failure

MAX_ANSWER = 16 << 20   # bytes of one XML answer read
MAX_PAGES = 1000        # of 1,000 uploads each


@dataclass(frozen=True)
class Credentials:
    key_id: str
    secret: str = field(repr=False)
    token: Optional[str] = field(default=None, repr=False)


@dataclass(frozen=True)
class Pending:
    """A multipart upload begun and neither completed nor aborted."""

    key: str
    upload_id: str
    initiated: str


def credentials() -> Credentials:
    key_id, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key_id and secret:
        return Credentials(key_id, secret, os.environ.get("AWS_SESSION_TOKEN"))
    try:
        import boto3
        found = boto3.Session().get_credentials()
    except ImportError:
        found = None
    if found is None:
        raise OutputError("cannot list the multipart uploads pending under OUT: no AWS credentials ckptconv can sign "
                          "with (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or boto3's chain with boto3 installed)")
    frozen = found.get_frozen_credentials()
    return Credentials(frozen.access_key, frozen.secret_key, frozen.token)


def region() -> str:
    named = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if not named:
        try:
            import boto3
            named = boto3.Session().region_name
        except ImportError:
            pass
    return named or "us-east-1"


def _quote(text: str, safe: str = "-_.~") -> str:
    return quote(text, safe=safe)


def sign(method: str, url: str, creds: Credentials, where: str, now: Optional[float] = None) -> dict:
    """The headers that sign an empty-bodied request for S3 in region `where` (SigV4, header form)."""
    parts = urlsplit(url)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    payload = hashlib.sha256(b"").hexdigest()
    headers = {"host": parts.netloc, "x-amz-content-sha256": payload, "x-amz-date": stamp}
    if creds.token:
        headers["x-amz-security-token"] = creds.token
    query = []
    for item in parts.query.split("&") if parts.query else ():
        k, _, v = item.partition("=")
        query.append((k, v))   # already encoded the way canonical_query wants (see _url)
    names = sorted(headers)
    canonical = "\n".join([method, parts.path or "/", "&".join(f"{k}={v}" for k, v in sorted(query)),
                           "".join(f"{n}:{headers[n].strip()}\n" for n in names), ";".join(names), payload])
    scope = f"{stamp[:8]}/{where}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + creds.secret).encode()
    for step in (stamp[:8], where, "s3", "aws4_request"):
        key = hmac.new(key, step.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={creds.key_id}/{scope}, "
                                f"SignedHeaders={';'.join(names)}, Signature={signature}")
    return headers


def _url(base: str, bucket: str, key: str = "", query: dict = None) -> str:
    path = "/" + _quote(bucket) + ("/" + _quote(key, safe="-_.~/") if key else "")
    q = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted((query or {}).items()))
    return f"{base}{path}" + (f"?{q}" if q else "")


def _request(method: str, url: str, options: StorageOptions, what: str) -> bytes:
    creds, where = credentials(), region()
    retry = Retry(options)
    while True:
        parts = urlsplit(url)
        conn_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        try:
            conn = conn_type(parts.hostname, parts.port, timeout=options.stall_seconds)
            try:
                conn.request(method, url[len(f"{parts.scheme}://{parts.netloc}"):],
                             headers=sign(method, url, creds, where))
                answer = conn.getresponse()
                body = answer.read(MAX_ANSWER + 1)
            finally:
                conn.close()
            if answer.status < 300 and len(body) <= MAX_ANSWER:
                return body
            problem = f"status code: {answer.status} {answer.reason}: {body[:2000].decode('utf-8', 'replace')}"
            retryable = answer.status >= 500 or answer.status in (408, 429)
        except (OSError, http.client.HTTPException) as e:
            problem, retryable = f"{type(e).__name__}: {e}", True
        if not (retryable and retry.again()):
            raise OutputError(f"{what}: {failure(Exception(problem))}")


def _text(node, name: str) -> str:
    for child in node:
        if child.tag.rsplit("}", 1)[-1] == name:
            return child.text or ""
    return ""


def _base(location: Location, options: StorageOptions) -> str:
    return endpoint(options) or f"https://s3.{region()}.amazonaws.com"


def pending(location: Location, options: StorageOptions) -> list:
    """The multipart uploads pending under `location`'s key as a prefix ("OUT/")."""
    prefix = f"{location.key}/" if location.key else ""
    found, marker = [], {}
    for _ in range(MAX_PAGES):
        body = _request("GET", _url(_base(location, options), location.bucket, "",
                                    {"uploads": "", "prefix": prefix, **marker}), options,
                        f"{location}: listing its pending multipart uploads")
        try:
            root = ET.fromstring(body)
        except ET.ParseError as e:
            raise OutputError(f"{location}: the store's list of pending uploads is not XML ({e})") from None
        for node in root:
            if node.tag.rsplit("}", 1)[-1] == "Upload":
                found.append(Pending(_text(node, "Key"), _text(node, "UploadId"), _text(node, "Initiated")))
        if _text(root, "IsTruncated") != "true":
            return found
        marker = {"key-marker": _text(root, "NextKeyMarker"), "upload-id-marker": _text(root, "NextUploadIdMarker")}
    raise OutputError(f"{location}: more than {MAX_PAGES * 1000:,} multipart uploads pending; abort them with the "
                      "store's own tools or a lifecycle rule")


def abort(location: Location, upload: Pending, options: StorageOptions):
    """Abort one pending upload (its parts are deleted; a key that was never completed stays absent)."""
    _request("DELETE", _url(_base(location, options), location.bucket, upload.key, {"uploadId": upload.upload_id}),
             options, f"{location.kind}://{location.bucket}/{upload.key}: aborting its pending multipart upload")
