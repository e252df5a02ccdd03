"""The S3 calls obstore does not make: list the multipart uploads pending under a prefix
(ListMultipartUploads) and abort one (AbortMultipartUpload); and a multipart upload of our own
(`Multipart`: CreateMultipartUpload, UploadPart, CompleteMultipartUpload with `If-None-Match: *`).
obstore aborts the uploads it fails itself (obstore/src/put.rs, put_multipart_inner), but a killed
run leaves its uploads pending, invisible to a listing of objects and billed; `--resume`/`--overwrite`
abort them through these. obstore 0.12 completes a multipart upload unconditionally (its create-only
mode is one PUT); S3 takes `If-None-Match: *` on CompleteMultipartUpload (since August 2024; moto
too) and answers 412 when the key exists, so an output's pointer larger than one PUT is still
written create-only (writer.PointerWriter).

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
import threading
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import quote, urlsplit

from ..errors import OutputError
from .urls import Location, Retry, StorageOptions, endpoint, failure

MAX_ANSWER = 16 << 20   # bytes of one XML answer read
MAX_PAGES = 1000        # of 1,000 uploads each
UNSIGNED = "UNSIGNED-PAYLOAD"   # a part's body is not hashed for the signature (its bytes are the file's digest's)


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


def sign(method: str, url: str, creds: Credentials, where: str, now: Optional[float] = None,
         payload: Optional[str] = None, extra: Optional[dict] = None) -> dict:
    """The headers that sign a request for S3 in region `where` (SigV4, header form): `payload` is the
    body's SHA-256 hex (an empty body's by default) or UNSIGNED; `extra` headers are signed too."""
    parts = urlsplit(url)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    payload = payload or hashlib.sha256(b"").hexdigest()
    headers = {"host": parts.netloc, "x-amz-content-sha256": payload, "x-amz-date": stamp,
               **{k.lower(): v for k, v in (extra or {}).items()}}
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


class Refused(OutputError):
    """The store answered a definite no (`status`), not worth trying again."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def _request(method: str, url: str, options: StorageOptions, what: str, body=b"", headers=None,
             signed: bool = True, answer_headers: Optional[dict] = None) -> bytes:
    """The answer's body (and its headers into `answer_headers`); retried on connection failures, 5xx,
    408 and 429 within the options' budget; OutputError (Refused for a definite answer) otherwise.
    `signed=False`: the body is sent UNSIGNED (a part's megabytes are not hashed twice)."""
    creds, where = credentials(), region()
    retry = Retry(options)
    payload = hashlib.sha256(body).hexdigest() if signed else UNSIGNED
    while True:
        parts = urlsplit(url)
        conn_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        status = None
        try:
            conn = conn_type(parts.hostname, parts.port, timeout=options.stall_seconds)
            try:
                sent = sign(method, url, creds, where, payload=payload, extra=headers)
                if body:
                    sent["content-length"] = str(len(body))
                conn.request(method, url[len(f"{parts.scheme}://{parts.netloc}"):], body=body or None, headers=sent)
                answer = conn.getresponse()
                data = answer.read(MAX_ANSWER + 1)
            finally:
                conn.close()
            status = answer.status
            # (CompleteMultipartUpload may answer 200 with an <Error> body: S3's documented quirk)
            failed_inside = status == 200 and data.lstrip()[:200].find(b"<Error>") >= 0
            if status < 300 and len(data) <= MAX_ANSWER and not failed_inside:
                if answer_headers is not None:
                    answer_headers.update({k.lower(): v for k, v in answer.getheaders()})
                return data
            problem = f"status code: {status} {answer.reason}: {data[:2000].decode('utf-8', 'replace')}"
            retryable = status >= 500 or status in (408, 429) or failed_inside
        except (OSError, http.client.HTTPException) as e:
            problem, retryable = f"{type(e).__name__}: {e}", True
        if not (retryable and retry.again()):
            message = f"{what}: {failure(Exception(problem))}"
            raise Refused(message, status) if status and not retryable else OutputError(message)


def _text(node, name: str) -> str:
    for child in node:
        if child.tag.rsplit("}", 1)[-1] == name:
            return child.text or ""
    return ""


def _base(location: Location, options: StorageOptions) -> str:
    return endpoint(options) or f"https://s3.{region()}.amazonaws.com"


def pending(location: Location, options: StorageOptions, exact: bool = False) -> list:
    """The multipart uploads pending under `location`'s key as a prefix ("OUT/"), or with `exact`, of
    that key alone (a single-file OUT)."""
    prefix = location.key if exact else f"{location.key}/" if location.key else ""
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
            if node.tag.rsplit("}", 1)[-1] == "Upload" and (not exact or _text(node, "Key") == location.key):
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


class Multipart:
    """One multipart upload of ours: `part(n, data)` uploads part n in the background (at most
    `upload_concurrency` parts in flight, each retried within the options' budget; the caller waits
    when that many are), `complete(create_only)` waits for every part and completes it, with
    `If-None-Match: *` when `create_only` (Refused with status 412 when the key exists), `abort()`
    leaves nothing. Parts may be uploaded in any order (part 1 last: writer.PointerWriter)."""

    def __init__(self, location: Location, options: StorageOptions):
        self.location, self.options = location, options
        self.where = f"{location.kind}://{location.bucket}/{location.key}"
        self._base = _url(_base(location, options), location.bucket, location.key)
        body = _request("POST", self._base + "?uploads=", options, f"{self.where}: starting its multipart upload")
        try:
            self.upload_id = _text(ET.fromstring(body), "UploadId")
        except ET.ParseError as e:
            raise OutputError(f"{self.where}: the store's answer to a new upload is not XML ({e})") from None
        if not self.upload_id:
            raise OutputError(f"{self.where}: the store's answer to a new upload names no upload")
        self._etags: dict = {}
        self._slots = threading.Semaphore(options.upload_concurrency)
        self._pool = ThreadPoolExecutor(options.upload_concurrency, thread_name_prefix="ckptconv-part")
        self._futures: list = []

    def __repr__(self) -> str:
        return f"Multipart({self.where!r}, {len(self._etags)} parts done)"

    def _query(self, **more) -> str:
        return self._base + "?" + "&".join(f"{_quote(k)}={_quote(str(v))}"
                                           for k, v in sorted({"uploadId": self.upload_id, **more}.items()))

    def _put(self, n: int, data):
        try:
            headers = {}
            _request("PUT", self._query(partNumber=n), self.options, f"{self.where}: uploading part {n}",
                     body=data, signed=False, answer_headers=headers)
            if not headers.get("etag"):
                raise OutputError(f"{self.where}: the store gave part {n} no ETag")
            self._etags[n] = headers["etag"]
        finally:
            self._slots.release()

    def part(self, n: int, data):
        """Upload part `n` (1 to 10,000) of `data`, a buffer the caller no longer changes."""
        self._failed()
        while not self._slots.acquire(timeout=0.2):
            from ..signals import check
            check()   # (a signal that came while we waited: signals.py)
            self._failed()
        self._futures.append(self._pool.submit(self._put, n, data))

    def _failed(self):
        for f in [f for f in self._futures if f.done()]:
            f.result()
            self._futures.remove(f)

    def complete(self, create_only: bool = True) -> dict:
        """Wait for every part and complete the upload; {"e_tag"} of the object."""
        for f in self._futures:
            f.result()
        self._futures = []
        self._pool.shutdown(wait=True)
        body = ("<CompleteMultipartUpload>" + "".join(
            f"<Part><PartNumber>{n}</PartNumber><ETag>{self._etags[n]}</ETag></Part>" for n in sorted(self._etags))
            + "</CompleteMultipartUpload>").encode()
        answer = _request("POST", self._query(), self.options, f"{self.where}: completing its multipart upload",
                          body=body, headers={"If-None-Match": "*"} if create_only else None)
        try:
            etag = _text(ET.fromstring(answer), "ETag")
        except ET.ParseError:
            etag = ""
        return {"e_tag": etag or None}

    def abort(self):
        """Stop sending, wait for the parts in flight, abort the upload (its parts are deleted)."""
        for f in self._futures:
            f.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._futures = []
        abort(self.location, Pending(self.location.key, self.upload_id, ""), self.options)
