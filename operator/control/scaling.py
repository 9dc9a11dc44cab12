"""The planner's I/O: scrape a deployment's routers (and its engines, for an engine-metric target), keep the
samples, ask the planner (`scaling.planner`, pure), write each planned role's target and the `Scaling`
condition to the status, and reconcile so the children follow (`reconcile.reconcile`, the one apply path).

The routers are scraped pod by pod, at their ready pods' IPs on the router's port (what the operator reaches
in a cluster and on the local rig alike, whose loopback pod IPs no Endpoints object may hold; the Service's
one address would answer from one router at a time, and two routers' counters cannot be subtracted from
each other). An engine is scraped at its pod IP on the engine's `http` port.

A pod's page is not trusted with the operator's time or memory. The pages are read off the clock's
threads, on the `Scraper`'s one thread, every page of every deployment at once on non-blocking sockets,
each whole within one wall-clock deadline however slowly it trickles: a tick reads the pages its last tick
asked for and asks for the next, so it never waits on a pod and a slow pod delays no other deployment's
tick. What is kept of the pages is bounded (`signals`, `Memory.record`).
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import io
import logging
import re
import selectors
import socket
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, TypeVar, cast

from disagg.operator import conditions as cond
from disagg.operator.api import ROLES, DisaggDeploymentSpec, Role
from disagg.operator.builders.router import ROUTER_PORT_NAME
from disagg.operator.control.k8s_apply import Kube
from disagg.operator.control.reconcile import Observed, Outcome, judge, reconcile
from disagg.operator.naming import Installation, router_selector
from disagg.operator.scaling import planner, targets
from disagg.operator.scaling.retire import UNKNOWN, Busy
from disagg.operator.scaling.signals import (
    EngineSample,
    Histogram,
    RouterSample,
    Sample,
    parse_engine,
    parse_router,
)
from disagg.worker.contracts.engine_pods import engine_pod
from disagg.worker.contracts.pod_contract import DRAINING_ANNOTATION, ENGINE_HTTP_PORT_NAME

T = TypeVar("T")
log = logging.getLogger(__name__)

# The deadline of one tick's pages, from the first connect to the last byte of each.
SCRAPE_TIMEOUT_S: Final = 2.0
# A router's or engine's page is tens of KiB; one far larger is not a metrics page.
MAX_SCRAPE_BYTES: Final = 4 << 20
# Room for the status line, headers and chunk sizes around a page's body.
_FRAMING_BYTES: Final = 64 << 10
# Samples a deployment keeps: a 3600 s window at the default 5 s interval is 720 of them; a shorter
# interval reads a long window as its newest samples.
MAX_SAMPLES: Final = 1024


@dataclass
class Memory:
    """What the planner keeps of one deployment between ticks (lost on a restart: it starts over)."""

    samples: deque[Sample] = field(default_factory=deque)
    history: dict[Role, planner.Recommendations] = field(default_factory=dict)
    pending: Scrape | None = None
    """The scrape the last tick asked for, read by the next."""
    busy: Busy = UNKNOWN
    """The engines the routers had legs on at the newest scrape that answered, and when it was asked."""

    def collect(self, spec: DisaggDeploymentSpec) -> None:
        """Record the pending scrape if it is over (a slow one is read at a later tick)."""
        if self.pending is None or not self.pending.pages.done():
            return
        sample = self.pending.sample()
        self.record(sample, spec)
        if sample.routers:
            self.busy = Busy(sample.busy(), self.pending.wall)
        self.pending = None

    def record(self, sample: Sample, spec: DisaggDeploymentSpec) -> None:
        """Keep what the spec's targets read of `sample` for as long as its windows read it (at most
        `MAX_SAMPLES`): memory bounded by the deployment's pods and windows, whatever its pages hold."""
        self.samples.append(sample.kept(_histograms(spec)))
        keep = keep_s(spec)
        while self.samples and (sample.at - self.samples[0].at > keep or len(self.samples) > MAX_SAMPLES):
            self.samples.popleft()


@dataclass
class Planners:
    """Every autoscaled deployment's `Memory`, by (namespace, name)."""

    _memory: dict[tuple[str, str], Memory] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    scraper: Scraper = field(default_factory=lambda: Scraper())

    def of(self, key: tuple[str, str]) -> Memory:
        with self._lock:
            return self._memory.setdefault(key, Memory())

    def forget(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._memory.pop(key, None)


class Pages:
    """One tick's pages under way on the `Scraper`'s thread: `pages` (None where a page could not be had)
    once `done`."""

    def __init__(self, urls: Sequence[str], deadline: float) -> None:
        self.urls = list(urls)
        self.deadline = deadline
        self.pages: list[str | None] = [None] * len(self.urls)
        self.open: dict[int, _Exchange] = {}
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)


class Scraper:
    """Every deployment's pages, read on one thread of its own, multiplexed on non-blocking sockets: a tick
    hands its URLs over (`submit`) and reads what came back at its next tick, so no clock thread ever waits
    on a pod. Each page is had whole, with a 200, within `MAX_SCRAPE_BYTES` and its batch's deadline
    (`SCRAPE_TIMEOUT_S` after `submit`), which bounds the whole exchange: a socket timeout bounds each
    read, not a peer that trickles a byte a second. URLs are http, at an IP address."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._new: list[Pages] = []
        self._wake, self._waker = socket.socketpair()
        self._waker.setblocking(False)
        self._thread: threading.Thread | None = None

    def submit(self, urls: Sequence[str]) -> Pages:
        batch = Pages(urls, time.monotonic() + SCRAPE_TIMEOUT_S)
        if not batch.urls:
            batch._done.set()
            return batch
        with self._lock:
            self._new.append(batch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="disagg-scraper", daemon=True)
                self._thread.start()
        with contextlib.suppress(BlockingIOError):
            self._waker.send(b"\0")
        return batch

    def _loop(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake, selectors.EVENT_READ, None)
        active: list[Pages] = []
        while True:
            try:
                active = self._turn(selector, active)
            except Exception:
                # A pass that broke must not end the thread every planner tick waits on.
                log.exception("the scraper's pass failed; its batches count as not answering")
                for batch in active:
                    self._end(selector, batch)
                active = []

    def _turn(self, selector: selectors.BaseSelector, active: list[Pages]) -> list[Pages]:
        now = time.monotonic()
        timeout = max(0.0, min(b.deadline for b in active) - now) if active else None
        for key, _ in selector.select(timeout):
            if key.data is None:
                self._wake.recv(4096)
                continue
            batch, index, exchange = key.data
            try:
                finished = exchange.step(selector)
            except (OSError, ValueError, http.client.HTTPException):
                finished, exchange.page = True, None
            if finished:
                selector.unregister(exchange.sock)
                exchange.sock.close()
                batch.pages[index] = exchange.page
                del batch.open[index]
        with self._lock:
            new, self._new = self._new, []
        for batch in new:
            for index, url in enumerate(batch.urls):
                exchange = _Exchange.start(url)
                if exchange is not None:
                    batch.open[index] = exchange
                    selector.register(exchange.sock, selectors.EVENT_WRITE, (batch, index, exchange))
        now = time.monotonic()
        kept = []
        for batch in [*active, *new]:
            if batch.open and now < batch.deadline:
                kept.append(batch)
            else:
                self._end(selector, batch)
        return kept

    @staticmethod
    def _end(selector: selectors.BaseSelector, batch: Pages) -> None:
        """The batch is over: what has not answered by now did not answer."""
        for exchange in batch.open.values():
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(exchange.sock)
            exchange.sock.close()
        batch.open.clear()
        batch._done.set()


@dataclass
class _Exchange:
    """One GET on a non-blocking socket: connect, send the request, read until the peer closes."""

    sock: socket.socket
    request: bytes
    sent: int = 0
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    page: str | None = None
    head_size: int | None = None
    length: int | None = None
    chunked: bool = False

    @classmethod
    def start(cls, url: str) -> _Exchange | None:
        try:
            parts = urllib.parse.urlsplit(url)
            host, port = parts.hostname, parts.port or 80
            if parts.scheme != "http" or not host:
                return None
            # A pod's address is an IP: a name would need a lookup, which blocks past any deadline.
            family, kind, proto, _, address = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST
            )[0]
        except (OSError, ValueError):
            return None
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        request = (
            f"GET {target} HTTP/1.1\r\nHost: {parts.netloc}\r\nAccept: text/plain\r\n"
            "Accept-Encoding: identity\r\nUser-Agent: disagg-operator\r\nConnection: close\r\n\r\n"
        )
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            if sock.connect_ex(address) not in (0, errno.EINPROGRESS):
                sock.close()
                return None
        except OSError:
            sock.close()
            return None
        return cls(sock, request.encode("ascii"))

    def step(self, selector: selectors.BaseSelector) -> bool:
        """Go on as far as the socket allows; True once the exchange is over (`page` is its answer)."""
        if self.sent < len(self.request):
            if self.sent == 0 and self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                return True  # the connection was refused
            self.sent += self.sock.send(self.request[self.sent :])
            if self.sent == len(self.request):
                selector.modify(self.sock, selectors.EVENT_READ, selector.get_key(self.sock).data)
            return False
        try:
            chunk = self.sock.recv(64 << 10)
        except BlockingIOError:
            return False
        self.size += len(chunk)
        if self.size > MAX_SCRAPE_BYTES + _FRAMING_BYTES:
            return True
        self.chunks.append(chunk)
        if chunk and not self._whole():
            return False
        self.page = _body(b"".join(self.chunks))
        return True

    def _whole(self) -> bool:
        """Whether the response is complete before the peer closes (one that keeps the connection open
        despite `Connection: close` would otherwise be read until the deadline): its Content-Length of body
        after the headers, or a chunked body's last chunk."""
        if self.head_size is None:
            raw = b"".join(self.chunks)
            self.chunks = [raw]
            end = raw.find(b"\r\n\r\n")
            if end < 0 and len(raw) > _FRAMING_BYTES:
                raise ValueError("no end of the headers in the framing's room")
            if end < 0:
                return False
            head = raw[:end]
            self.head_size = end + 4
            length = re.search(rb"(?im)^content-length:[ \t]*([0-9]{1,12})[ \t]*\r?$", head)
            self.length = None if length is None else int(length.group(1))
            self.chunked = re.search(rb"(?im)^transfer-encoding:[^\r\n]*chunked", head) is not None
        if self.length is not None:
            return self.size - self.head_size >= self.length
        tail = b"".join(self.chunks[-2:])[-7:]
        return self.chunked and tail == b"\r\n0\r\n\r\n"


class _Replay:
    """A socket whose stream is bytes already read: http.client parses the response from it (status,
    headers, a Content-Length or chunked body) as it would from the peer."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def makefile(self, *args: object, **kwargs: object) -> io.BytesIO:
        return io.BytesIO(self._data)


def _body(raw: bytes) -> str | None:
    response = http.client.HTTPResponse(cast(socket.socket, _Replay(raw)), method="GET")
    response.begin()
    if response.status != 200:
        return None
    body = response.read()
    if len(body) > MAX_SCRAPE_BYTES:
        return None
    return body.decode("utf-8", errors="replace")


def router_addresses(pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """`ip:port` of every ready router pod."""
    found = []
    for pod in pods:
        status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ()
        )
        ports = [
            p["containerPort"]
            for c in (pod.get("spec") or {}).get("containers") or ()
            for p in c.get("ports") or ()
            if p.get("name") == ROUTER_PORT_NAME and isinstance(p.get("containerPort"), int)
        ]
        if (
            ready
            and ports
            and status.get("podIP")
            and not (pod.get("metadata") or {}).get("deletionTimestamp")
        ):
            found.append(f"{status['podIP']}:{ports[0]}")
    return sorted(found)


def _engine_roles(spec: DisaggDeploymentSpec) -> set[Role]:
    """The roles whose target is an engine metric (the others need only the routers)."""
    roles: set[Role] = set()
    prefill, decode = spec.prefill.autoscaling, spec.decode.autoscaling
    if prefill is not None and prefill.target is not None and prefill.target.prompt_tokens_per_second:
        roles.add("prefill")
    if decode is not None and decode.target is not None and decode.target.kv_cache_usage:
        roles.add("decode")
    return roles


def _histograms(spec: DisaggDeploymentSpec) -> set[Histogram]:
    """The router histograms a role's target reads (the window keeps no other)."""
    found: set[Histogram] = set()
    prefill, decode = spec.prefill.autoscaling, spec.decode.autoscaling
    if prefill is not None and prefill.target is not None and prefill.target.ttft_p90_seconds:
        found.add("ttft")
    if decode is not None and decode.target is not None and decode.target.inter_token_latency_p90_seconds:
        found.add("itl")
    return found


def keep_s(spec: DisaggDeploymentSpec) -> float:
    """How long a sample is read: the longest metric window of the planned roles."""
    windows = [s.metric_window_seconds for role in ROLES if (s := spec.autoscaling(role)) is not None]
    return float(max(windows, default=0))


@dataclass
class Scrape:
    """One tick's scrape: the pages it asked the `Scraper` for, and what makes a `Sample` of them."""

    at: float
    """When it was asked for, on the operator's clock: the sample's time."""
    wall: datetime
    """The same, on the wall: what a drain reads the routers' busy engines against."""
    pages: Pages
    routers: list[str]
    engines: dict[tuple[str, str], int | None]
    """Per (role, engine id), its page's index in `pages` (None: no port to ask)."""
    ours: frozenset[str]
    """The deployment's engine ids and pod names: the only legs kept of a router's page."""

    def sample(self) -> Sample:
        """What answered (`pages.done()` first)."""
        routers: dict[str, RouterSample] = {}
        for index, address in enumerate(self.routers):
            router = _parsed(lambda text: parse_router(text, self.ours), self.pages.pages[index], address)
            if router is not None:
                routers[address] = router
        engines: dict[tuple[str, str], EngineSample] = {}
        for key, at_index in self.engines.items():
            text = None if at_index is None else self.pages.pages[at_index]
            sample = _parsed(parse_engine, text, key[1])
            if sample is not None:
                engines[key] = sample
        return Sample(self.at, routers, engines)


def scrape(
    kube: Kube,
    scraper: Scraper,
    namespace: str,
    name: str,
    spec: DisaggDeploymentSpec,
    pods: Sequence[Mapping[str, Any]],
    at: float,
    wall: datetime,
) -> Scrape:
    """Ask `scraper` for every ready router's page and the engine pages a target reads."""
    selector = ",".join(f"{key}={value}" for key, value in router_selector(name).items())
    addresses = router_addresses(kube.list_pods(namespace, selector))
    urls = [f"http://{address}/metrics" for address in addresses]
    wanted = _engine_roles(spec)
    ours: set[str] = set()
    engines: dict[tuple[str, str], int | None] = {}
    for pod in pods:
        engine = engine_pod(pod)
        if engine is None:
            continue
        ours.update((engine.engine_id, engine.name))
        if engine.role not in wanted or engine.stage != 0 or engine.host is None:
            continue
        port = _http_port(pod)
        engines[(engine.role, engine.engine_id)] = None if port is None else len(urls)
        if port is not None:
            urls.append(f"http://{engine.host}:{port}/metrics")
    return Scrape(at, wall, scraper.submit(urls), addresses, engines, frozenset(ours))


def _parsed(parse: Callable[[str], T], text: str | None, source: str) -> T | None:
    """`parse(text)`, or None (the pod did not answer) when the page is missing or not Prometheus text."""
    if text is None:
        return None
    try:
        return parse(text)
    except ValueError as error:
        log.warning("the metrics of %s are not Prometheus text (%s): counted as not answering", source, error)
        return None


def _http_port(pod: Mapping[str, Any]) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == ENGINE_HTTP_PORT_NAME and isinstance(port.get("containerPort"), int):
                return int(port["containerPort"])
    return None


def _behind(
    spec: DisaggDeploymentSpec, status: Mapping[str, Any], observed: Observed, namespace: str, name: str
) -> bool:
    """Whether a planned role's children or pods have not caught up with its target: a count applied
    that differs, pods not yet ready, or a drain mark outside a rollout."""
    workloads = list(observed.workloads(namespace, name))
    for role in ROLES:
        want = targets.target(spec, role, status)
        if not spec.planned(role) or want is None:
            continue
        mine = [w for w in workloads if w.role == role]
        built = len(mine) if role == "prefill" else sum(w.desired for w in mine)
        if built != want or sum(w.ready for w in mine) < sum(w.desired for w in mine):
            return True
    if status.get("oldRevision"):
        return False
    return any(
        DRAINING_ANNOTATION in ((pod.get("metadata") or {}).get("annotations") or {})
        for pod in observed.pods(namespace, name)
    )


def plan_tick(
    kube: Kube,
    body: Mapping[str, Any],
    installation: Installation,
    observed: Observed,
    memory: Memory,
    scraper: Scraper,
    now: float | None = None,
) -> Outcome | None:
    """One tick for one deployment: read the scrape the last tick asked for and ask for the next, plan,
    write the targets, reconcile when something moved. The plan reads samples up to an interval old, so
    the tick never waits on a pod."""
    metadata = body["metadata"]
    namespace, name = metadata["namespace"], metadata["name"]
    verdict = judge(body.get("spec") or {}, installation)
    if verdict.violations or verdict.spec is None:
        return None
    spec = verdict.spec
    at = time.monotonic() if now is None else now
    wall = datetime.now(UTC)
    memory.collect(spec)
    if memory.pending is None:
        pods = list(observed.pods(namespace, name))
        memory.pending = scrape(kube, scraper, namespace, name, spec, pods, at, wall)
    status = kube.latest_status(body)
    decisions = []
    for role in ROLES:
        scaling = spec.autoscaling(role)
        current = targets.target(spec, role, status)
        if scaling is None or not spec.planned(role) or current is None:
            continue
        decision, memory.history[role] = planner.plan(
            role, scaling, list(memory.samples), current, memory.history.get(role, ()), at
        )
        decisions.append(decision)
    previous = cond.parse(status.get("conditions"))
    settling = _behind(spec, status, observed, namespace, name)
    update = targets.condition(decisions, previous, settling, wall)
    patch: dict[str, Any] = {d.role: {"desiredReplicas": d.desired} for d in decisions}
    generation = int(metadata.get("generation") or 1)
    conditions = cond.merge(previous, [update] if update else [], generation=generation, now=wall)
    if conditions != previous:
        patch["conditions"] = cond.to_json(conditions)
    moved = any(d.changed for d in decisions)
    if moved or "conditions" in patch:
        kube.patch_status(namespace, name, patch)
        for d in decisions:
            status[d.role] = {**(status.get(d.role) or {}), "desiredReplicas": d.desired}
        status["conditions"] = cond.to_json(conditions)
    if not moved and not settling:
        return None
    return reconcile(kube, {**body, "status": status}, installation, observed, memory.busy)
