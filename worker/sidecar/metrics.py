"""The sidecar's Prometheus metrics and its HTTP endpoints: `/healthz`, `/readyz` and `/metrics`.

`/healthz` answers 200 while the sidecar's main loop (the thread that owns the NIXL agent) has turned within
`stall_after_s`; a wedged loop turns it 503, so the kubelet restarts the container. `/readyz` answers 200 once
the engine has registered its KV pool and the side channel serves it; until then, 503 with the reason.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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
        self.ready = Gauge("disagg_sidecar_ready", "1 once the KV pool is registered and served.", registry=r)
        self.info = Gauge(
            "disagg_sidecar_info",
            "The worker this sidecar serves.",
            ["role", "engine_id", "pp_rank", "tp_rank"],
            registry=r,
        )
        self.info.labels(role, engine_id, str(pp_rank), str(tp_rank)).set(1)

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


def _handler(metrics: SidecarMetrics, health: Health) -> type[BaseHTTPRequestHandler]:
    routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {
        "/metrics": lambda: (200, CONTENT_TYPE_LATEST, metrics.render()),
        "/healthz": lambda: _status(health.alive()),
        "/readyz": lambda: _status(health.readiness()),
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            route = routes.get(self.path.split("?", 1)[0])
            code, content_type, body = (
                route() if route else (404, "text/plain", b"try /healthz, /readyz or /metrics\n")
            )
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            # Probes every few seconds would drown the structured log.
            return

    return Handler


def _status(state: tuple[bool, str]) -> tuple[int, str, bytes]:
    ok, text = state
    return (200 if ok else 503), "text/plain; charset=utf-8", (text + "\n").encode()


class HttpServer:
    """The endpoints on a daemon thread; `port` is the bound one (0 asks the OS for a free port)."""

    def __init__(self, host: str, port: int, metrics: SidecarMetrics, health: Health) -> None:
        self._server = ThreadingHTTPServer((host, port), _handler(metrics, health))
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)

    def start(self) -> HttpServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
