"""A fault-injecting HTTP proxy between ckptconv and the S3 server the tests start (moto's): it
forwards each request and can, for the requests a Fault matches, cut the response after N bytes of
body, cut the request mid-way (an upload whose connection drops), answer 503 SlowDown (or another error) instead of forwarding, or stall mid-body.

    proxy = FaultProxy("http://127.0.0.1:PORT")        # moto's endpoint
    proxy.add(Fault("cut", method="GET", after=1000))   # the next GET: 1000 bytes of body, then closed
    ... ckptconv with endpoint_url=proxy.endpoint ...
    proxy.close()
"""
import http.client
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional
from urllib.parse import urlsplit

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}


@dataclass
class Fault:
    """What to do to the requests it matches (`method`, and `match(path_and_query)` when given),
    `times` times (-1: always). kind: "cut" (forward, send the headers and `after` bytes of the body,
    close), "drop" (read `after` bytes of the request's body, close: never forwarded, never answered),
    "lose" (forward, then close without answering: done, and the client cannot know it),
    "stall" (the same, then wait `seconds` before closing), "trickle" (the same, then one byte
    every `seconds`), "status" (answer `status` with an S3
    error `code` without forwarding: 503 SlowDown by default), "endless" (answer a ListObjectsV2 page
    of 1,000 new keys under the prefix `code` that says more follow, without forwarding)."""

    kind: str
    method: Optional[str] = None
    match: Optional[Callable[[str], bool]] = None
    times: int = 1
    after: int = 0
    seconds: float = 5.0
    status: int = 503
    code: str = "SlowDown"

    def matches(self, method: str, target: str) -> bool:
        return self.times != 0 and (self.method in (None, method)) and (self.match is None or self.match(target))


class FaultProxy:
    def __init__(self, upstream: str):
        self.upstream = urlsplit(upstream)
        self.faults: list = []
        self.seen: list = []      # (method, path and query, what was done)
        self.signers: set = set()  # the access key ids requests were signed with
        self.ranges: list = []     # (path, start, end) of every ranged GET
        self.lock = threading.Lock()
        self.stop = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                        if size == 0:
                            return bytes(out)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self):
                fault = proxy._take(self.command, self.path)
                if fault is not None and fault.kind == "drop":   # `after` bytes of the request's body, then closed
                    self.rfile.read(min(fault.after, int(self.headers.get("Content-Length") or 0)))
                    with proxy.lock:
                        proxy.seen.append((self.command, self.path, "drop"))
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                body = self._body()
                signer = re.search(r"Credential=([^/,]+)/", self.headers.get("Authorization", ""))
                with proxy.lock:
                    proxy.seen.append((self.command, self.path, fault.kind if fault else "forwarded"))
                    proxy.signers.update([signer.group(1)] if signer else [])
                    asked = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
                    if asked:
                        proxy.ranges.append((self.path, int(asked.group(1)), int(asked.group(2)) + 1))
                if fault is not None and fault.kind == "endless":   # a listing page: 1,000 new keys, more follow
                    from urllib.parse import parse_qs, urlsplit as split
                    token = int((parse_qs(split(self.path).query).get("continuation-token") or ["0"])[0])
                    keys = "".join(f"<Contents><Key>{fault.code}/k{token * 1000 + i:09d}</Key><Size>1</Size>"
                                   f"<ETag>\"e\"</ETag><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
                                   "<StorageClass>STANDARD</StorageClass></Contents>" for i in range(1000))
                    xml = ('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>b</Name>'
                           f"<Prefix>{fault.code}/</Prefix><KeyCount>1000</KeyCount><MaxKeys>1000</MaxKeys>"
                           f"<IsTruncated>true</IsTruncated><NextContinuationToken>{token + 1}</NextContinuationToken>"
                           f"{keys}</ListBucketResult>").encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(xml)))
                    self.end_headers()
                    self.wfile.write(xml)
                    return
                if fault is not None and fault.kind == "status":
                    xml = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{fault.code}</Code>'
                           f'<Message>injected by the test proxy</Message></Error>').encode()
                    self.send_response(fault.status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(xml)))
                    self.end_headers()
                    self.wfile.write(xml)
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                conn.request(self.command, self.path, body=body if body or self.command in ("PUT", "POST") else None,
                             headers=headers)
                answer = conn.getresponse()
                data = answer.read()
                conn.close()
                if fault is not None and fault.kind == "lose":   # done upstream, its answer never comes
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.send_response(answer.status, answer.reason)
                for k, v in answer.getheaders():
                    if k.lower() not in HOP:
                        self.send_header(k, v)
                length = answer.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length or "0")
                self.end_headers()
                if fault is None:
                    self.wfile.write(data)
                    return
                self.wfile.write(data[:fault.after])
                self.wfile.flush()
                if fault.kind == "trickle":   # then one byte every `seconds`: never a stall, never done
                    for b in data[fault.after:]:
                        if proxy.stop.wait(fault.seconds):
                            break
                        try:
                            self.wfile.write(bytes([b]))
                            self.wfile.flush()
                        except OSError:
                            return
                if fault.kind == "stall":
                    proxy.stop.wait(fault.seconds)
                self.close_connection = True
                self.connection.shutdown(2)   # the rest never comes: the client sees the body cut

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass   # a client that gave up on a request (an aborted upload's parts) is not news

        self.server = Server(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, fault: Fault) -> Fault:
        with self.lock:
            self.faults.append(fault)
        return fault

    def _take(self, method: str, target: str) -> Optional[Fault]:
        with self.lock:
            for fault in self.faults:
                if fault.matches(method, target):
                    if fault.times > 0:
                        fault.times -= 1
                    return fault
        return None

    def done(self, kind: str) -> int:
        """How many requests got the fault `kind`."""
        with self.lock:
            return sum(1 for s in self.seen if s[2] == kind)

    def close(self):
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()
