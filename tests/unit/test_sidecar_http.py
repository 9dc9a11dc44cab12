"""The sidecar's health and metrics port under idle connections (issue 22, finding 1): the real `HttpServer`
in this process, 2,000 idle sockets opened against it, and the probes must still answer right, from a
bounded number of threads and connections."""

from __future__ import annotations

import contextlib
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from disagg.worker.sidecar.metrics import (
    MAX_CONNECTIONS,
    REQUEST_TIMEOUT_S,
    Health,
    HttpServer,
    SidecarMetrics,
)

IDLE_CONNECTIONS = 2_000
HOST = "127.0.0.1"


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=30) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode()


@pytest.fixture
def enough_descriptors() -> Iterator[None]:
    """The idle clients and the server's side of them share this process's descriptor limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = IDLE_CONNECTIONS + MAX_CONNECTIONS + 512
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"RLIMIT_NOFILE's hard limit {hard} is below the {wanted} descriptors this test opens")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def server(request_timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[HttpServer, Health]:
    # No main loop beats here: liveness is the loop's business, what is tested is that the port answers.
    health = Health(stall_after_s=3600)
    metrics = SidecarMetrics("prefill", "engine-a", 0, 0)
    return HttpServer(HOST, 0, metrics, health, request_timeout_s=request_timeout_s).start(), health


# The idle clients run in a process of their own: in this one, every connect would wait for the GIL the
# server's loop holds. It opens them, half send half a request head, and then it answers "open?" with how
# many the server has not closed, and whether the newest is among them.
CLIENTS = """
import socket, sys, time
port, count = int(sys.argv[1]), int(sys.argv[2])
started = time.monotonic()
idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(count)]
for sock in idle[::2]:
    sock.sendall(b"GET /healthz HTTP/1.1\\r\\nHost: x\\r\\n")
for sock in idle:
    sock.settimeout(0)
def still_open(sock):
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except ConnectionError:
        return False
print("opened", flush=True)
print(f"opened {count} in {time.monotonic() - started:.1f} s", file=sys.stderr)
for line in sys.stdin:
    print(sum(still_open(sock) for sock in idle), int(still_open(idle[-1])), flush=True)
"""


def test_probes_answer_under_2000_idle_connections_from_bounded_threads(enough_descriptors: None) -> None:
    # Only the cap drops connections here, not the request timeout (this machine may be slow to open them).
    http, health = server(request_timeout_s=3600)
    threads = threading.active_count()
    clients = subprocess.Popen(
        [sys.executable, "-c", CLIENTS, str(http.port), str(IDLE_CONNECTIONS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert clients.stdin is not None and clients.stdout is not None

    def held_by_server() -> tuple[int, bool]:
        assert clients.stdin is not None and clients.stdout is not None
        clients.stdin.write("open?\n")
        clients.stdin.flush()
        count, newest = clients.stdout.readline().split()
        return int(count), newest == "1"

    try:
        assert clients.stdout.readline() == "opened\n"
        assert get(http.port, "/healthz") == (200, "ok\n")
        assert get(http.port, "/readyz") == (503, "the engine has not registered its KV layout\n")
        health.set_ready(None)
        assert get(http.port, "/readyz") == (200, "ready\n")
        code, text = get(http.port, "/metrics")
        assert code == 200 and "disagg_sidecar_ready" in text
        assert threading.active_count() == threads, "the server started threads for connections"
        # The server holds at most its cap of the idle ones: the oldest were dropped for the newer.
        assert http.open_connections <= MAX_CONNECTIONS
        deadline = time.monotonic() + 30
        while (held := held_by_server())[0] > MAX_CONNECTIONS:
            assert time.monotonic() < deadline, f"the server holds {held[0]} idle connections"
            time.sleep(0.1)
        assert held[1], "the newest idle connection was dropped before older ones"
    finally:
        clients.stdin.close()
        clients.wait(timeout=60)
        http.stop()


def test_an_idle_connection_is_closed_after_the_request_timeout() -> None:
    http, _ = server(request_timeout_s=0.2)
    try:
        with socket.create_connection((HOST, http.port), timeout=30) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")  # and never the blank line that ends the head
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1024) == b""  # closed by the server, unanswered
        assert get(http.port, "/healthz") == (200, "ok\n")
    finally:
        http.stop()


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1 200 OK"),
        (b"GET /healthz?verbose=1 HTTP/1.0\r\n\r\n", b"HTTP/1.1 200 OK"),
        (b"GET /nowhere HTTP/1.1\r\n\r\n", b"HTTP/1.1 404 Not Found"),
        (b"POST /healthz HTTP/1.1\r\nContent-Length: 0\r\n\r\n", b"HTTP/1.1 405 Method Not Allowed"),
        (b"nonsense\r\n\r\n", b"HTTP/1.1 400 Bad Request"),
        (b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 20_000 + b"\r\n\r\n", b"HTTP/1.1 431"),
    ],
)
def test_each_request_gets_one_answer_and_the_connection_closes(request_bytes: bytes, status: bytes) -> None:
    http, _ = server()
    try:
        with socket.create_connection((HOST, http.port), timeout=30) as sock:
            sock.sendall(request_bytes)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(status), answer[:200]
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b"Connection: close" in head
        assert f"Content-Length: {len(body)}".encode() in head
    finally:
        http.stop()
