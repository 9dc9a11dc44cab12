"""What the planner's tick reads before it scrapes: the ready router pods' addresses; and what a scrape takes
from a pod's answer (real HTTP servers on loopback): a page whole within its size bound and one deadline
however slowly it trickles, without holding the clock's threads, and only what the window reads of it. Its
interval is a setting (`test_settings.py`)."""

from __future__ import annotations

import pickle
import socket
import threading
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from dd_specs import valid_document

from disagg.operator.api import DisaggDeploymentSpec
from disagg.operator.control import scaling
from disagg.operator.control.scaling import MAX_SCRAPE_BYTES, Scraper, router_addresses, scrape
from disagg.operator.runtime.ticker import Tick, Ticker
from disagg.operator.scaling.signals import Sample

SCRAPER = Scraper()
WALL = datetime(2026, 1, 1, tzinfo=UTC)


def fetch_page(url: str) -> str | None:
    """One page through the operator's scraper, waited for here (a tick reads it at its next)."""
    pages = SCRAPER.submit([url])
    assert pages.wait(15.0), "the scraper did not end the batch within its bound"
    return pages.pages[0]


def sampled(kube: Any, spec: DisaggDeploymentSpec, at: float = 0.0) -> Sample:
    """A tick's scrape of `kube`'s routers, waited for."""
    asked = scrape(kube, SCRAPER, "ns", "x", spec, [], at, WALL)
    assert asked.pages.wait(15.0), "the scraper did not end the batch within its bound"
    return asked.sample()


def router_pod(ip: str, ready: bool, deleting: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": f"x-router-{ip}"}
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": metadata,
        "spec": {"containers": [{"name": "router", "ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": str(ready)}]},
    }


def test_only_ready_live_router_pods_are_scraped() -> None:
    pods = [
        router_pod("10.0.0.2", True),
        router_pod("10.0.0.1", True),
        router_pod("10.0.0.3", False),
        router_pod("10.0.0.4", True, deleting=True),
        {"metadata": {"name": "pending"}, "spec": {}, "status": {}},
    ]
    assert router_addresses(pods) == ["10.0.0.1:8000", "10.0.0.2:8000"]


def test_a_scrape_reads_a_page_whole_and_refuses_one_past_its_size_bound(
    pages: tuple[str, dict[str, bytes]],
) -> None:
    url, served = pages
    served["/metrics"] = b"vllm:num_requests_running 1\n"
    served["/huge"] = b"#" * (MAX_SCRAPE_BYTES + 1)
    assert fetch_page(url + "/metrics") == "vllm:num_requests_running 1\n"
    assert fetch_page(url + "/huge") is None
    assert fetch_page(url.rsplit(":", 1)[0] + ":1/metrics") is None  # nothing listens: missing, not an error


class Trickle:
    """Real HTTP peers on loopback that answer a byte at a time (after the headers, or within them) until
    the test ends: the slow pod of the issue, which no per-read socket timeout ever fires on."""

    def __init__(self, count: int, in_headers: bool = False) -> None:
        self.stopping = threading.Event()
        self.servers: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.in_headers = in_headers
        for _ in range(count):
            server = socket.create_server(("127.0.0.1", 0))
            self.servers.append(server)
            self._start(self._accept, server)

    @property
    def ports(self) -> list[int]:
        return [server.getsockname()[1] for server in self.servers]

    def _start(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self.threads.append(thread)
        thread.start()

    def _accept(self, server: socket.socket) -> None:
        server.settimeout(0.1)
        while not self.stopping.is_set():
            try:
                peer, _ = server.accept()
            except OSError:
                continue
            self._start(self._serve, peer)

    def _serve(self, peer: socket.socket) -> None:
        with peer:
            try:
                peer.recv(4096)
                head = b"HTTP/1.1 200 OK\r\n"
                if not self.in_headers:
                    peer.sendall(head + b"Content-Length: 1000000\r\n\r\n")
                while not self.stopping.wait(0.05):
                    peer.sendall(b"X-Slow: a\r\n" if self.in_headers else b"#")
            except OSError:
                return

    def close(self) -> None:
        self.stopping.set()
        for server in self.servers:
            server.close()
        for thread in self.threads:
            thread.join(5)


@pytest.fixture
def short_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scaling, "SCRAPE_TIMEOUT_S", 0.5)


@pytest.mark.parametrize("in_headers", [False, True])
def test_a_page_that_trickles_is_given_up_at_the_deadline(short_deadline: None, in_headers: bool) -> None:
    trickle = Trickle(1, in_headers=in_headers)
    try:
        assert fetch_page(f"http://127.0.0.1:{trickle.ports[0]}/metrics") is None
    finally:
        trickle.close()


def autoscaled_spec() -> DisaggDeploymentSpec:
    patch = {"decode": {"autoscaling": {"maxReplicas": 4, "target": {"runningRequests": 4}}}}
    return DisaggDeploymentSpec.model_validate(valid_document(patch)["spec"])


class Routers:
    """What `scrape` asks the API server: the router pods, here at loopback ports."""

    def __init__(self, ports: list[int]) -> None:
        self.pods = [
            {
                "metadata": {"name": f"x-router-{port}"},
                "spec": {
                    "containers": [{"name": "router", "ports": [{"name": "http", "containerPort": port}]}]
                },
                "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
            }
            for port in ports
        ]

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return self.pods


def test_slow_routers_hold_a_scrape_one_deadline_and_a_healthy_one_still_answers(
    short_deadline: None, pages: tuple[str, dict[str, bytes]]
) -> None:
    url, served = pages
    served["/metrics"] = b'disagg_router_in_flight_requests{role="decode"} 3\n'
    trickle = Trickle(12)
    try:
        kube = Routers([*trickle.ports, int(url.rsplit(":", 1)[1])])
        sample = sampled(kube, autoscaled_spec())
    finally:
        trickle.close()
    assert list(sample.routers) == [f"127.0.0.1:{url.rsplit(':', 1)[1]}"]
    assert next(iter(sample.routers.values())).in_flight == {"decode": 3.0}


def test_slow_pods_of_two_deployments_leave_the_clocks_threads_to_a_third(
    short_deadline: None, pages: tuple[str, dict[str, bytes]]
) -> None:
    # The case: two deployments with a trickling router each, on the clock's two threads. Each tick
    # asks for its pages and reads those its last tick asked for: the third's answers keep coming.
    url, served = pages
    served["/metrics"] = b'disagg_router_in_flight_requests{role="decode"} 1\n'
    trickle = Trickle(2)
    spec = autoscaled_spec()
    answered: dict[str, int] = {"a": 0, "b": 0, "c": 0}
    healthy = Routers([int(url.rsplit(":", 1)[1])])
    kubes = {"a": Routers(trickle.ports[:1]), "b": Routers(trickle.ports[1:]), "c": healthy}
    pending: dict[str, scaling.Scrape] = {}

    def tick(body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        asked = pending.get(name)
        if asked is not None and asked.pages.done():
            answered[name] += bool(asked.sample().routers)
            del pending[name]
        if name not in pending:
            pending[name] = scrape(kubes[name], SCRAPER, "ns", name, spec, [], time.monotonic(), WALL)

    bodies = [{"metadata": {"namespace": "ns", "name": name}} for name in answered]
    ticker = Ticker(lambda: bodies, [Tick("planner", 0.1, lambda body: True, tick)], resolution=0.05)
    ticker.start()
    try:
        for _ in range(300):
            if answered["c"] >= 3:
                break
            time.sleep(0.05)
    finally:
        ticker.stop(timeout=5)
        trickle.close()
    assert answered["c"] >= 3 and answered["a"] == answered["b"] == 0, answered


def test_a_hostile_router_page_is_kept_in_bounded_memory(pages: tuple[str, dict[str, bytes]]) -> None:
    # Legs on engines that are not the deployment's, roles that are none, and the histogram a decode
    # running-requests target does not read: the window keeps none of it.
    lines = [f'disagg_router_outstanding_legs{{engine="e{i}",role="decode"}} 1' for i in range(2000)]
    lines += [f'disagg_router_in_flight_requests{{role="r{i}"}} 1' for i in range(2000)]
    lines += [f'disagg_router_time_to_first_token_seconds_bucket{{le="{i}",x="{j}"}} 1' for i in range(60)
              for j in range(20)]  # fmt: skip
    lines.append('disagg_router_in_flight_requests{role="decode"} 2')
    url, served = pages
    served["/metrics"] = ("\n".join(lines) + "\n").encode()
    kube = Routers([int(url.rsplit(":", 1)[1])])
    spec = autoscaled_spec()
    memory = scaling.Memory()
    for k in range(8):
        memory.record(sampled(kube, spec, k * 5.0), spec)
    assert len(memory.samples) == 7  # the default 30 s metric window
    (router,) = memory.samples[-1].routers.values()
    assert router.in_flight == {"decode": 2.0} and router.legs == {} and router.ttft == ()
    # What the samples hold, whatever the page held (a page is about 200 KiB).
    assert len(pickle.dumps(memory.samples)) < 4 << 10


@pytest.mark.parametrize(
    "response",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\nqueued 1.0\n\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n7\r\nqueued \r\n5\r\n1.0\n\n\r\n0\r\n\r\n",
    ],
)
def test_a_whole_answer_is_read_though_the_peer_keeps_the_connection_open(
    short_deadline: None, response: bytes
) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def answer() -> None:
        peer, _ = server.accept()
        held.append(peer)
        peer.recv(4096)
        peer.sendall(response)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        page = fetch_page(f"http://127.0.0.1:{server.getsockname()[1]}/metrics")
    finally:
        thread.join(5)
        for sock in (*held, server):
            sock.close()
    assert page == "queued 1.0\n\n"
