"""The wire between the processes of one job: process 0's key-value service and the others'
connections to it (cluster.py says what travels on it).

A message is 8 bytes of big-endian length and that many bytes of UTF-8 JSON, at most MAX_MESSAGE.
A process other than 0 opens one connection, says hello (its id, the number of processes), then
sends requests and reads one reply for each: `put` a value, `get` one (it is there or not yet),
`beat` (I am alive). A thread of its own beats every `heartbeat / 3` seconds (at most 1 s), so a
process stopped or cut off is noticed after `--heartbeat-timeout`, and one that died when its
connection closes. Sockets have timeouts: no read or write waits longer than the heartbeat.

Anyone who can reach the coordinator's port can connect, as with JAX's coordination service: run a
job on hosts that trust each other (docs/distributed.md). What arrives is read with `safejson`.
"""
import json
import socket
import struct
import threading
import time

from .. import safejson
from ..errors import BadInput

MAX_MESSAGE = 1 << 30   # bytes: a million tensors' digests in hex are 64 MB
MAX_HELLO = 1 << 12     # bytes of a hello, before a connection is known to be a process of the job
HELLO_S = 10            # seconds a connection may take to say hello
_LENGTH = struct.Struct(">Q")


class WireError(Exception):
    """The other side is not there, not answering, or not speaking this protocol."""


def _send(sock, obj):
    data = json.dumps(obj).encode("utf-8", "surrogatepass")
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _receive(sock, where: str, limit: int = MAX_MESSAGE):
    head = _exactly(sock, _LENGTH.size)
    (length,) = _LENGTH.unpack(head)
    if length > limit:
        raise WireError(f"{where} sent a message of {length} bytes, more than the {limit} accepted")
    try:
        return safejson.loads(_exactly(sock, length), where, "a message")
    except BadInput as e:
        raise WireError(str(e)) from None


def _exactly(sock, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("closed")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


class Service:
    """Process 0's side: values by key, and when each process was last heard from."""

    def __init__(self, port: int, processes: int, loopback: bool = False):
        self.processes = processes
        self._values, self._heard, self._left, self._closed = {}, {}, set(), {}
        self._closing = False   # process 0 is ending: a value not there now never comes
        self._lock = threading.Condition()
        # connections that have not said hello yet: a few per process of the job, each with its own
        # thread for at most HELLO_S seconds and MAX_HELLO bytes; more are closed at once
        self._greeting = threading.BoundedSemaphore(max(8, 2 * processes))
        try:
            if loopback:   # (a job on one host: not reachable from the network)
                self._server = socket.create_server(("127.0.0.1", port))
            elif socket.has_dualstack_ipv6():
                self._server = socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
            else:
                self._server = socket.create_server(("", port))
        except OSError as e:
            raise WireError(f"--coordinator port {port}: cannot listen there ({e.strerror})") from None
        threading.Thread(target=self._accept, name="ckptconv-service", daemon=True).start()

    def _accept(self):
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            if not self._greeting.acquire(blocking=False):
                sock.close()   # (too many connections waiting to say hello: not the job's processes)
                continue
            try:
                threading.Thread(target=self._serve, args=(sock,), name="ckptconv-peer", daemon=True).start()
            except RuntimeError:   # (no thread to be had)
                self._greeting.release()
                sock.close()

    def _serve(self, sock):
        me, greeting = None, True
        try:
            sock.settimeout(HELLO_S)
            hello = _receive(sock, "a process connecting", MAX_HELLO)
            me = self._hello(hello)
            _send(sock, {"ok": me is not None} if me is not None else {"error": self._refusal(hello)})
            self._greeting.release()
            greeting = False
            if me is None:
                return
            sock.settimeout(None)   # (a peer that says nothing is the heartbeat's to judge)
            while True:
                request = _receive(sock, f"process {me}")
                self._heard_from(me)
                _send(sock, self._answer(me, request))
                if isinstance(request, dict) and request.get("op") == "bye":
                    with self._lock:
                        self._left.add(me)
                        self._lock.notify_all()
                    return
        except (OSError, ConnectionError, WireError, ValueError):
            pass
        finally:
            if greeting:
                self._greeting.release()
            sock.close()
            if me is not None:
                with self._lock:
                    self._closed.setdefault(me, time.monotonic())
                    self._lock.notify_all()

    def _hello(self, hello) -> int | None:
        ok = isinstance(hello, dict) and hello.get("op") == "hello" and type(hello.get("process")) is int \
            and hello.get("processes") == self.processes and 0 < hello["process"] < self.processes
        with self._lock:
            if not ok or hello["process"] in self._heard:
                return None
            self._heard[hello["process"]] = time.monotonic()
            self._lock.notify_all()
            return hello["process"]

    def _refusal(self, hello) -> str:
        if not isinstance(hello, dict) or hello.get("op") != "hello":
            return "not a ckptconv process"
        if hello.get("processes") != self.processes:
            return f"this job has {self.processes} processes, not {brief_int(hello.get('processes'))}"
        return f"process id {brief_int(hello.get('process'))} is taken or out of range"

    def _heard_from(self, me: int):
        with self._lock:
            self._heard[me] = time.monotonic()

    def _answer(self, me: int, request) -> dict:
        op = request.get("op") if isinstance(request, dict) else None
        if op == "put" and isinstance(request.get("key"), str) and isinstance(request.get("value"), str):
            if not request["key"].endswith(f"/{me}"):   # (a process puts only its own: KEY/ITS_ID)
                return {"error": f"process {me} may not put {request['key'][:100]!r}"}
            self.put(request["key"], request["value"])
            return {"ok": True}
        if op == "get" and isinstance(request.get("key"), str):
            value = self.value(request["key"])
            return {"value": value} if value is not None else {"wait": True, "closing": self._closing}
        if op in ("beat", "bye"):
            return {"ok": True}
        return {"error": "unknown request"}

    def put(self, key: str, value: str):
        with self._lock:
            self._values[key] = value
            self._lock.notify_all()

    def value(self, key: str):
        with self._lock:
            return self._values.get(key)

    def gone(self, process: int, heartbeat_s: float) -> str | None:
        """Why `process` will not answer (None while it may): its connection closed, or no word from
        it for `heartbeat_s` seconds."""
        with self._lock:
            if process in self._left:
                return "ended without sending it (its own error says why)"
            if process in self._closed:
                return "is gone (its connection closed: it was killed, or failed before it could say why)"
            heard = self._heard.get(process)
        if heard is not None and time.monotonic() - heard > heartbeat_s:
            return f"stopped answering (no heartbeat for {heartbeat_s} s: stopped, or its host is gone)"
        return None

    def wait_for_all(self, timeout_s: float, check):
        """Until every other process has said hello; WireError naming those missing after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                missing = [p for p in range(1, self.processes) if p not in self._heard]
            if not missing:
                return
            if time.monotonic() > deadline:
                listed = ", ".join(map(str, missing[:8])) + (" …" if len(missing) > 8 else "")
                raise WireError(f"process(es) {listed} did not join within {timeout_s} s (--cluster-timeout): are "
                                "they running, with the same --coordinator and --num-processes?")
            check()
            time.sleep(0.05)

    def drain(self, timeout_s: float, heartbeat_s: float):
        """Serve until every other process has left, is gone or has gone silent (at most `timeout_s`),
        then stop."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._closing = True
            while time.monotonic() < deadline and any(
                    p not in self._left and p not in self._closed and time.monotonic() - heard <= heartbeat_s
                    for p, heard in self._heard.items()):
                self._lock.wait(0.1)
        self._server.close()


def brief_int(value) -> str:
    return str(value) if type(value) is int and abs(value) < 10**9 else type(value).__name__


class Connection:
    """A process other than 0: its one connection to the service, and its heartbeat."""

    def __init__(self, sock, process: int, processes: int, heartbeat_s: float):
        self.sock, self.process, self.processes, self.heartbeat_s = sock, process, processes, heartbeat_s
        self.broken = None   # why process 0 will not answer, once known
        self._lock = threading.Lock()
        self._done = threading.Event()
        threading.Thread(target=self._beat, name="ckptconv-heartbeat", daemon=True).start()

    @classmethod
    def open(cls, host: str, port: int, process: int, processes: int, timeout_s: float, heartbeat_s: float, check):
        """Connect to process 0 and say hello, trying again (a connection closed before its hello was
        answered: process 0 not ready, or busy with strangers) until `timeout_s` has passed."""
        deadline, why = time.monotonic() + timeout_s, "is process 0 running?"
        while True:
            sock = None
            try:
                sock = socket.create_connection((host, port), timeout=1)
                sock.settimeout(max(heartbeat_s, 1))
                _send(sock, {"op": "hello", "process": process, "processes": processes})
                reply = _receive(sock, "process 0", MAX_HELLO)
                break
            except (OSError, ConnectionError, WireError) as e:
                if sock is not None:
                    sock.close()
                    why = f"it closed the connection ({e}): is it a ckptconv job's process 0?"
                if time.monotonic() > deadline:
                    raise WireError(f"the coordinator {host}:{port} did not answer within {timeout_s} s ({why})") \
                        from None
                check()
                time.sleep(0.2)
        if not (isinstance(reply, dict) and reply.get("ok") is True):
            sock.close()
            why = reply.get("error") if isinstance(reply, dict) else None
            raise WireError(f"process 0 refused process {process}: {why if isinstance(why, str) else 'no reason'}")
        return cls(sock, process, processes, heartbeat_s)

    def request(self, message: dict) -> dict:
        """Send one request and read its reply. WireError (as an OutputError by the caller) when
        process 0 is gone or does not answer within the heartbeat timeout."""
        if self.broken:
            raise WireError(f"process 0 {self.broken}; nothing was published")
        try:
            with self._lock:
                _send(self.sock, message)
                reply = _receive(self.sock, "process 0")
        except socket.timeout:
            self.broken = f"stopped answering (no reply for {self.heartbeat_s} s: stopped, or its host is gone)"
        except (OSError, ConnectionError):
            self.broken = "is gone (its connection closed)"
        else:
            if isinstance(reply, dict) and "error" not in reply:
                return reply
            self.broken = f"refused a request ({reply.get('error') if isinstance(reply, dict) else 'no reply'})"
        raise WireError(f"process 0 {self.broken}; nothing was published")

    def _beat(self):
        pause = min(1.0, self.heartbeat_s / 3)
        while not self._done.wait(pause):
            try:
                self.request({"op": "beat"})
            except WireError:
                return

    def close(self):
        if self._done.is_set():
            return
        self._done.set()
        try:
            if not self.broken:
                self.request({"op": "bye"})
        except WireError:
            pass
        self.sock.close()
