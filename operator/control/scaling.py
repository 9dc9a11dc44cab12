"""The planner's I/O: scrape a deployment's routers (and its engines, for an engine-metric target), keep the
samples, ask the planner (`scaling.planner`, pure), write each planned role's target and the `Scaling`
condition to the status, and reconcile so the children follow (`reconcile.reconcile`, the one apply path).

The routers are scraped pod by pod, at their ready pods' IPs on the router's port (what the operator reaches
in a cluster and on the local rig alike, whose loopback pod IPs no Endpoints object may hold; the Service's
one address would answer from one router at a time, and two routers' counters cannot be subtracted from
each other). An engine is scraped at its pod IP on the engine's `http` port.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

from disagg.operator import conditions as cond
from disagg.operator.api import ROLES, DisaggDeploymentSpec, Role
from disagg.operator.builders.router import ROUTER_PORT_NAME
from disagg.operator.control.k8s_apply import Kube
from disagg.operator.control.reconcile import Observed, Outcome, judge, reconcile
from disagg.operator.naming import Installation, router_selector
from disagg.operator.scaling import planner, targets
from disagg.operator.scaling.retire import Busy
from disagg.operator.scaling.signals import EngineSample, RouterSample, Sample, parse_engine, parse_router
from disagg.worker.contracts.engine_pods import engine_pod
from disagg.worker.contracts.pod_contract import DRAINING_ANNOTATION, ENGINE_HTTP_PORT_NAME

T = TypeVar("T")
log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S: Final = 2.0
# A router's or engine's page is tens of KiB; one far larger is not a metrics page.
MAX_SCRAPE_BYTES: Final = 4 << 20
# Samples older than the longest window any spec may name are never read.
KEEP_S: Final = 3600.0


@dataclass
class Memory:
    """What the planner keeps of one deployment between ticks (lost on a restart: it starts over)."""

    samples: deque[Sample] = field(default_factory=deque)
    history: dict[Role, planner.Recommendations] = field(default_factory=dict)


@dataclass
class Planners:
    """Every autoscaled deployment's `Memory`, by (namespace, name)."""

    _memory: dict[tuple[str, str], Memory] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def of(self, key: tuple[str, str]) -> Memory:
        with self._lock:
            return self._memory.setdefault(key, Memory())

    def forget(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._memory.pop(key, None)


def fetch_page(url: str) -> str | None:
    """The page at `url`, or None when it cannot be had whole within `SCRAPE_TIMEOUT_S` and
    `MAX_SCRAPE_BYTES`: a pod's answer is not trusted with the operator's memory or its executor's time
    (a socket timeout bounds each read, not a peer that trickles)."""
    deadline = time.monotonic() + SCRAPE_TIMEOUT_S
    chunks: list[bytes] = []
    size = 0
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
            while chunk := response.read(64 << 10):
                size += len(chunk)
                if size > MAX_SCRAPE_BYTES or time.monotonic() > deadline:
                    return None
                chunks.append(chunk)
    except (OSError, ValueError):
        return None
    return b"".join(chunks).decode("utf-8", errors="replace")


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


def scrape(
    kube: Kube,
    namespace: str,
    name: str,
    spec: DisaggDeploymentSpec,
    pods: Sequence[Mapping[str, Any]],
    at: float,
) -> Sample:
    routers: dict[str, RouterSample] = {}
    selector = ",".join(f"{key}={value}" for key, value in router_selector(name).items())
    for address in router_addresses(kube.list_pods(namespace, selector)):
        text = fetch_page(f"http://{address}/metrics")
        router = _parsed(parse_router, text, address)
        if router is not None:
            routers[address] = router
    engines: dict[tuple[str, str], EngineSample] = {}
    wanted = _engine_roles(spec)
    for pod in pods:
        engine = engine_pod(pod)
        if engine is None or engine.role not in wanted or engine.stage != 0 or engine.host is None:
            continue
        port = _http_port(pod)
        text = None if port is None else fetch_page(f"http://{engine.host}:{port}/metrics")
        sample = _parsed(parse_engine, text, engine.engine_id)
        if sample is not None:
            engines[(engine.role, engine.engine_id)] = sample
    return Sample(at, routers, engines)


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
    now: float | None = None,
) -> Outcome | None:
    """One tick for one deployment: scrape, plan, write the targets, reconcile when something moved."""
    metadata = body["metadata"]
    namespace, name = metadata["namespace"], metadata["name"]
    verdict = judge(body.get("spec") or {}, installation)
    if verdict.violations or verdict.spec is None:
        return None
    spec = verdict.spec
    at = time.monotonic() if now is None else now
    pods = list(observed.pods(namespace, name))
    sample = scrape(kube, namespace, name, spec, pods, at)
    memory.samples.append(sample)
    while memory.samples and at - memory.samples[0].at > KEEP_S:
        memory.samples.popleft()
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
    wall = datetime.now(UTC)
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
    busy = Busy(sample.busy() if sample.routers else None, wall)
    return reconcile(kube, {**body, "status": status}, installation, observed, busy)
