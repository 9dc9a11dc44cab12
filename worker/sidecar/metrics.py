"""The sidecar's Prometheus metrics and its HTTP endpoints: `/healthz`, `/readyz` and `/metrics`.

`/healthz` answers 200 while the sidecar's main loop (the thread that owns the NIXL agent) has turned within
`stall_after_s`; a wedged loop turns it 503, so the kubelet restarts the container. `/readyz` answers 200 once
the engine has registered its KV pool and the side channel serves it; until then, 503 with the reason.
The port is bounded in connections and idle time (`HttpServer`), so idle clients cannot fail the probes.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Final

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

HANDSHAKE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class SidecarMetrics:
    """Every metric of one sidecar, in its own registry (several sidecars may share a test process)."""

    def __init__(self, role: str, engine_id: str, pp_rank: int, tp_rank: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.bytes_pushed = Counter(
            "disagg_kv_bytes_pushed",
            "Bytes of KV this worker wrote to decoders (completed WRITEs).",
            registry=r,
        )
        self.transfers = Counter(
            "disagg_kv_transfers",
            "Requests whose KV this worker finished moving: sent (prefill) or received (decode).",
            ["direction"],
            registry=r,
        )
        self.failures = Counter(
            "disagg_kv_transfer_failures",
            "Requests whose KV transfer failed, by reason.",
            ["reason"],
            registry=r,
        )
        self.handshake_latency = Histogram(
            "disagg_handshake_latency_seconds",
            "From starting a handshake with a peer engine to its NIXL agents being loaded (side channel, "
            "checks, add agent).",
            ["peer_role"],
            buckets=HANDSHAKE_BUCKETS,
            registry=r,
        )
        self.lease_expiries = Counter(
            "disagg_kv_lease_expiries", "Finished requests whose blocks were released unpushed.", registry=r
        )
        self.engine_messages = Counter(
            "disagg_engine_messages", "Messages from the engine on the local socket.", ["type"], registry=r
        )
        self.engine_errors = Counter(
            "disagg_engine_message_errors",
            "Local-socket messages answered with an error.",
            ["reason"],
            registry=r,
        )
        self.peer_engines = Gauge(
            "disagg_peer_engines", "Peer engines whose NIXL agents this worker holds.", registry=r
        )
        self.peer_evictions = Counter(
            "disagg_peer_engine_evictions",
            "Peer engines whose agents and descriptors were released (Idle, PeerUnreachable, PeerRestarted, "
            "PeerFailed).",
            ["reason"],
            registry=r,
        )
        self.ready = Gauge("disagg_sidecar_ready", "1 once the KV pool is registered and served.", registry=r)
        self.info = Gauge(
            "disagg_sidecar_info",
            "The worker this sidecar serves.",
            ["role", "engine_id", "pp_rank", "tp_rank"],
            registry=r,
        )
        self.info.labels(role, engine_id, str(pp_rank), str(tp_rank)).set(1)
        # Per pair, from the prefill worker that writes the KV, labelled with the engines' live ids.
        self.transport_info = Gauge(
            "disagg_kv_transport_info",
            "1 for the transport UCX chose for this prefill worker's WRITEs to a decode engine (its lanes "
            "as UCX printed them, e.g. cma/memory, rc_mlx5/mlx5_0:1).",
            ["prefill", "decode", "transport", "lanes"],
            registry=r,
        )
        self.pair_bytes = Counter(
            "disagg_kv_pair_bytes",
            "Bytes of KV this prefill worker wrote to a decode engine (completed WRITEs).",
            ["prefill", "decode"],
            registry=r,
        )
        self.pair_seconds = Counter(
            "disagg_kv_pair_transfer_seconds",
            "Seconds from posting to completing this prefill worker's WRITEs to a decode engine; "
            "rate(bytes) / rate(seconds) is the pair's bandwidth.",
            ["prefill", "decode"],
            registry=r,
        )
        self.pair_bandwidth = Gauge(
            "disagg_kv_pair_bandwidth_gbps",
            "GB/s of the latest push from this prefill worker to a decode engine.",
            ["prefill", "decode"],
            registry=r,
        )

    def render(self) -> bytes:
        out: bytes = generate_latest(self.registry)
        return out


@dataclass
class Health:
    """Liveness and readiness as the main loop reports them."""

    stall_after_s: float = 10.0
    _beat: float = field(default_factory=time.monotonic)
    _not_ready: str = "the engine has not registered its KV layout"
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def beat(self) -> None:
        self._beat = time.monotonic()

    def set_ready(self, reason_not_ready: str | None) -> None:
        with self._lock:
            self._not_ready = reason_not_ready or ""

    def alive(self) -> tuple[bool, str]:
        stalled = time.monotonic() - self._beat
        if stalled > self.stall_after_s:
            return False, f"main loop stalled for {stalled:.1f} s"
        return True, "ok"

    def readiness(self) -> tuple[bool, str]:
        with self._lock:
            reason = self._not_ready
        return (not reason, reason or "ready")


Route = Callable[[], tuple[int, str, bytes]]

# The port serves the kubelet's probes and a Prometheus scraper, a handful of connections at a time. The old
# one-thread-per-connection server with no timeout let 400 idle connections fail /healthz (and the kubelet
# would restart a healthy sidecar); 1,994 of them held 2,003 threads. Here one event-loop thread serves every
# connection, each gets one request and `REQUEST_TIMEOUT_S` to send its head, and past `MAX_CONNECTIONS` the
# oldest connection still sending its head is dropped for the new one, so idle connections can never lock
# a probe out, however many there are.
MAX_CONNECTIONS: Final = 256
REQUEST_TIMEOUT_S: Final = 10.0
# A probe's request head is a few hundred bytes; a longer one is refused unread.
MAX_HEAD_BYTES: Final = 8192
LISTEN_BACKLOG: Final = 512


def _routes(metrics: SidecarMetrics, health: Health) -> dict[str, Route]:
    return {
        "/metrics": lambda: (200, CONTENT_TYPE_LATEST, metrics.render()),
        "/healthz": lambda: _status(health.alive()),
        "/readyz": lambda: _status(health.readiness()),
    }


def _status(state: tuple[bool, str]) -> tuple[int, str, bytes]:
    ok, text = state
    return (200 if ok else 503), "text/plain; charset=utf-8", (text + "\n").encode()


def respond(routes: Mapping[str, Route], head: bytes) -> tuple[int, str, bytes]:
    """The answer to one request head (request line and headers). Pure but for the routes it calls."""
    request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = request_line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return 400, "text/plain", b"malformed request line\n"
    method, target, _ = parts
    if method != "GET":
        return 405, "text/plain", b"only GET is served\n"
    route = routes.get(target.split("?", 1)[0])
    return route() if route else (404, "text/plain", b"try /healthz, /readyz or /metrics\n")


def _response_bytes(code: int, content_type: str, body: bytes) -> bytes:
    reason = HTTPStatus(code).phrase
    head = (
        f"HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


class HttpServer:
    """The endpoints on one daemon thread running an asyncio loop; `port` is the bound one (0 asks the OS
    for a free port). At most `max_connections` are open at once and each is closed after one answer or
    `request_timeout_s` without a full request head."""

    def __init__(
        self,
        host: str,
        port: int,
        metrics: SidecarMetrics,
        health: Health,
        *,
        max_connections: int = MAX_CONNECTIONS,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self._routes = _routes(metrics, health)
        self._max_connections = max_connections
        self._request_timeout_s = request_timeout_s
        self._socket = socket.create_server((host, port), backlog=LISTEN_BACKLOG)
        self.port: int = self._socket.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._stopping: asyncio.Event | None = None
        self._started = threading.Event()
        # Connections still sending their request head, oldest first: the ones dropped past the cap.
        self._waiting: OrderedDict[asyncio.StreamWriter, None] = OrderedDict()
        self._handlers: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._run, name="metrics-http", daemon=True)

    @property
    def open_connections(self) -> int:
        """Connections still sending their request head (read on the server's thread; a snapshot here)."""
        return len(self._waiting)

    def start(self) -> HttpServer:
        self._thread.start()
        self._started.wait()
        return self

    def stop(self) -> None:
        stopping = self._stopping
        if stopping is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(stopping.set)
        self._thread.join(timeout=5)
        self._socket.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        # The backlog again: asyncio listens anew on the socket it is given, with 100 unless told.
        server = await asyncio.start_server(
            self._connection, sock=self._socket, backlog=LISTEN_BACKLOG, limit=MAX_HEAD_BYTES
        )
        self._started.set()
        try:
            await self._stopping.wait()
        finally:
            server.close()
            for task in self._handlers:
                task.cancel()
            # Every handler ends before the loop closes (a pending one would be destroyed with it).
            await asyncio.gather(*self._handlers, return_exceptions=True)
            await server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # a stream handler runs as a task
        self._handlers.add(task)
        try:
            await self._answer(reader, writer)
        finally:
            self._handlers.discard(task)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._waiting[writer] = None
        while len(self._waiting) > self._max_connections:
            oldest, _ = self._waiting.popitem(last=False)
            oldest.transport.abort()  # its handler sees the reset and returns
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._request_timeout_s)
            except asyncio.LimitOverrunError:
                answer = (431, "text/plain", b"request head too large\n")
            else:
                answer = respond(self._routes, head)
            self._waiting.pop(writer, None)
            writer.write(_response_bytes(*answer))
            await asyncio.wait_for(writer.drain(), self._request_timeout_s)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass  # an idle, half-sent or vanished client: closing it is the whole answer
        finally:
            self._waiting.pop(writer, None)
            writer.close()
