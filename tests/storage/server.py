"""moto's S3 API server on a free 127.0.0.1 port, for the storage tests (conftest.py) and the examples
of docs/storage.md (tests/fixtures/docs_inputs.py): started in about a second, ended with the process
that started it even if that one is killed."""
import socket
import subprocess
import sys
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent():
    """In the server's process before it starts (Linux): end it when the test process ends, even if
    that is killed and never runs the fixture's teardown."""
    try:
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_moto(log_path) -> tuple:
    """(the server's process, its endpoint URL), once it answers."""
    port = _free_port()
    log = open(log_path, "wb")
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    log.close()
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
            return server, url
        except OSError:
            if server.poll() is not None:
                raise AssertionError("moto's server did not start")
            time.sleep(0.1)
    stop_moto(server)
    raise AssertionError("moto's server did not answer within 30 s")


def stop_moto(server):
    server.terminate()
    server.wait(10)
