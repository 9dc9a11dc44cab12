"""The reconcile steps behind the kopf handlers: judge the spec, apply or refuse, then recompute status.

Level-based and idempotent: every call builds the full desired set from the spec and applies it with
server-side apply, deletes children the spec no longer wants, and recomputes the whole status from what the
cluster shows. It never branches on the event that caused it. An incompatible spec changes no child: on
create nothing exists, and on update the running topology stays as it was.

At scale (a thousand deployments, seven thousand children) three things keep the API server's load
proportional to what changed: the verdict on a spec is computed once per distinct spec (`judge` is pure, so
its cache is exact); a status refresh reads the workloads and pods from the operator's watch indices
(`Observed`), not by listing them; and a write (a status patch, an Event) happens only when it changes
something, so a resume or a pod event that changes nothing issues no write.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from disagg.operator import conditions as cond
from disagg.operator.api import ConditionStatus, DisaggDeploymentSpec
from disagg.operator.builders import Installation, Owner, build
from disagg.operator.builders_router import endpoint_of
from disagg.operator.compat import CompatReport, evaluate
from disagg.operator.k8s_apply import Kube
from disagg.operator.kv_status import peers_reported, pod_kv
from disagg.operator.policies import REFUSAL_CHAIN
from disagg.operator.status import Workload, compute, incompatibility_message, to_json, workload
from disagg.worker.contracts.pairing import routing_from_pods
from disagg.worker.kv.errors import Violation

_LOG = logging.getLogger("disagg.operator.status")


@dataclass(frozen=True)
class Verdict:
    spec: DisaggDeploymentSpec | None
    report: CompatReport | None
    violations: tuple[Violation, ...]

    @property
    def message(self) -> str:
        return incompatibility_message(self.violations)


@dataclass(frozen=True)
class Outcome:
    """`changed`: the children whose apply wrote something (new, or a resourceVersion that moved);
    `refused_now`: the refusal changed the status (it is news, worth an Event)."""

    changed: tuple[str, ...]
    deleted: tuple[str, ...]
    refused: str | None
    refused_now: bool = False


@dataclass(frozen=True)
class Observed:
    """What the operator's watch indices show of one deployment: its StatefulSets and Deployments, its pods.

    Both are callables so a caller reads the index when the status is computed, not when it was queued."""

    workloads: Callable[[str, str], Iterable[Workload]]
    pods: Callable[[str, str], Iterable[Mapping[str, Any]]]


# A verdict is about 17 KiB and costs ~10-20 ms; deployments stamped from one template share one entry.
VERDICT_CACHE_SIZE = 1024


def judge(raw_spec: Mapping[str, Any], installation: Installation | None = None) -> Verdict:
    """Every reason to refuse a spec: schema errors, then `policies.REFUSAL_CHAIN`. `installation` defaults
    to this process's environment, which is the operator's (the admission webhook runs inside it).

    Pure in the spec and the installation, so it is cached on them: every pod event of a deployment used to
    re-run the whole evaluation. The verdict is shared between callers and never mutated."""
    installed = installation if installation is not None else Installation.from_environ(os.environ)
    try:
        # What the API serves is JSON, so this round trip is exact; a caller's odd mapping is judged as is.
        key = json.dumps(raw_spec, sort_keys=True, separators=(",", ":"), default=dict)
    except (TypeError, ValueError, RecursionError):
        return _evaluate(raw_spec, installed)
    return _judge(key, installed)


@functools.lru_cache(maxsize=VERDICT_CACHE_SIZE)
def _judge(raw_json: str, installed: Installation) -> Verdict:
    return _evaluate(json.loads(raw_json), installed)


def _evaluate(raw_spec: Any, installed: Installation) -> Verdict:
    try:
        spec = DisaggDeploymentSpec.model_validate(raw_spec)
    except ValidationError as error:
        problems = "; ".join(
            f"spec.{'.'.join(str(part) for part in item['loc'])}: {item['msg']}" for item in error.errors()
        )
        return Verdict(None, None, (Violation("InvalidSpec", problems),))
    report = evaluate(spec, REFUSAL_CHAIN, installed)
    return Verdict(spec, report, report.violations)


def _owner(body: Mapping[str, Any]) -> Owner:
    metadata = body["metadata"]
    return Owner(
        name=metadata["name"],
        namespace=metadata["namespace"],
        uid=metadata["uid"],
        generation=int(metadata.get("generation") or 1),
    )


def reconcile(kube: Kube, body: Mapping[str, Any], installation: Installation, observed: Observed) -> Outcome:
    """Converge the children on the spec (or refuse it), then write the status.

    The children are listed before the apply: their resourceVersions tell which applies wrote something (a
    server-side apply that changes nothing leaves the object, and its resourceVersion, as it was), and the
    apply responses are the freshest view of the workloads for the status."""
    owner = _owner(body)
    uid: str = body["metadata"]["uid"]
    verdict = judge(body.get("spec") or {}, installation)
    if verdict.violations:
        children = kube.children(owner.namespace, owner.name, uid)
        workloads = [workload(child) for child in children if _is_workload(child)]
        written = _write_status(kube, body, verdict, workloads, observed, endpoint_of(children))
        return Outcome((), (), verdict.message, refused_now=written)
    # judge() reports a violation whenever the spec cannot be parsed or planned.
    assert verdict.spec is not None and verdict.report is not None and verdict.report.plan is not None
    desired = build(
        verdict.spec, owner, verdict.report.plan, verdict.report.hashes, installation, verdict.report.factors
    )
    existing = {
        (child["kind"], child["metadata"]["name"]): child["metadata"].get("resourceVersion")
        for child in kube.children(owner.namespace, owner.name, uid)
    }
    changed, applied = [], []
    for obj in desired:
        key = (obj["kind"], obj["metadata"]["name"])
        applied.append({**kube.apply(obj), "kind": key[0]})
        if existing.get(key) != applied[-1]["metadata"].get("resourceVersion"):
            changed.append(f"{key[0]} {key[1]}")
    wanted = {(obj["kind"], obj["metadata"]["name"]) for obj in desired}
    deleted = []
    for key in sorted(existing.keys() - wanted):
        kube.delete(key[0], owner.namespace, key[1])
        deleted.append(f"{key[0]} {key[1]}")
    workloads = [workload(child) for child in applied if _is_workload(child)]
    _write_status(kube, body, verdict, workloads, observed, endpoint_of(applied))
    return Outcome(tuple(sorted(changed)), tuple(deleted), None)


def refresh_status(
    kube: Kube, namespace: str, name: str, installation: Installation, observed: Observed
) -> bool:
    """Recompute the status from the spec and the indexed workloads and pods; write it only if it changed.

    One GET: the stored conditions must be the latest (our own last write included), or a flip would be
    judged against a stale one and move a lastTransitionTime that should stay."""
    body = kube.read_deployment(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return False
    verdict = judge(body.get("spec") or {}, installation)
    workloads = list(observed.workloads(namespace, name)) if verdict.report is not None else []
    # Only a reconcile applies or deletes the router's Service, and it writes the endpoint it saw.
    endpoint = (body.get("status") or {}).get("endpoint")
    return _write_status(
        kube, body, verdict, workloads, observed, endpoint if isinstance(endpoint, str) else None
    )


def _listing_order(item: Workload) -> tuple[bool, str]:
    # The order the API lists them in (StatefulSets, then Deployments, each by name): the status's messages
    # name workloads in this order, and a reshuffle would be a write that changes nothing.
    return item.kind != "StatefulSet", item.name


def _is_workload(obj: Mapping[str, Any]) -> bool:
    return obj.get("kind") in ("StatefulSet", "Deployment")


def _write_status(
    kube: Kube,
    body: Mapping[str, Any],
    verdict: Verdict,
    workloads: list[Workload],
    observed: Observed,
    endpoint: str | None,
) -> bool:
    metadata = body["metadata"]
    if verdict.report is None:
        # The stored object breaks the schema (possible only without the CRD's validation): say so and stop.
        return _write_invalid(kube, body, verdict)
    current = dict(body.get("status") or {})
    pods = list(observed.pods(metadata["namespace"], metadata["name"]))
    status = compute(
        generation=int(metadata.get("generation") or 1),
        previous=cond.parse(current.get("conditions")),
        violations=verdict.violations,
        report=verdict.report,
        workloads=sorted(workloads, key=_listing_order),
        pods=[pod_kv(pod) for pod in pods],
        routing=routing_from_pods(pods),
        reported=peers_reported(pods),
        now=datetime.now(UTC),
        endpoint=endpoint,
    )
    rendered = to_json(status)
    if rendered == current:
        return False
    # A merge patch keeps what it does not name: a field the status no longer has (the router's endpoint once
    # it is disabled) is removed by naming it null.
    removed = {key: None for key in current if key not in rendered}
    kube.patch_status(metadata["namespace"], metadata["name"], {**removed, **rendered})
    return True


def _write_invalid(kube: Kube, body: Mapping[str, Any], verdict: Verdict) -> bool:
    metadata = body["metadata"]
    generation = int(metadata.get("generation") or 1)
    current = body.get("status") or {}
    conditions = cond.set_condition(
        cond.parse(current.get("conditions")),
        cond.COMPATIBLE,
        ConditionStatus.FALSE,
        verdict.violations[0].reason,
        verdict.message,
        generation=generation,
        now=datetime.now(UTC),
    )
    rendered = {**current, "observedGeneration": generation, "conditions": cond.to_json(conditions)}
    if rendered == current:
        return False
    kube.patch_status(metadata["namespace"], metadata["name"], rendered)
    return True


class RefreshQueue:
    """A deduplicating work queue for status refreshes, as controller-runtime's workqueue does it.

    A pod's or workload's event only says "look at this deployment again". `request` returns at once; a key
    waits in the queue at most once however many events name it, and one key is never refreshed by two
    workers at a time (a request during its refresh queues it again, to be read afresh). A reconcile holds
    its key (`holding`): it writes the status itself, so no refresh runs meanwhile and the events of the
    children it applies cost one refresh after it, not one each during it. A failed refresh is logged with
    its traceback and retried after `retry_delay`, so a transient API error cannot leave a stale status
    behind.
    """

    def __init__(
        self,
        refresh: Callable[[tuple[str, str]], object],
        *,
        workers: int = 4,
        retry_delay: float = 1.0,
    ) -> None:
        self._refresh = refresh
        self._retry_delay = retry_delay
        self._ready = threading.Condition()
        self._order: deque[tuple[str, str]] = deque()
        self._queued: set[tuple[str, str]] = set()
        self._busy: set[tuple[str, str]] = set()
        self._again: set[tuple[str, str]] = set()
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._work, name=f"disagg-status-{index}", daemon=True)
            for index in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def request(self, key: tuple[str, str]) -> None:
        with self._ready:
            if key in self._busy:
                self._again.add(key)
            elif key not in self._queued:
                self._queued.add(key)
                self._order.append(key)
                # All: a reconcile waiting in `holding` shares the condition, and a single wake-up that
                # reached it instead of an idle worker would leave this key queued until some refresh ends.
                self._ready.notify_all()

    @contextmanager
    def holding(self, key: tuple[str, str]) -> Iterator[None]:
        """Run the body with no refresh of `key` running (it waits for one that is); requests meanwhile
        are refreshed once afterwards."""
        with self._ready:
            while key in self._busy:
                self._ready.wait()
            self._busy.add(key)
            if key in self._queued:
                self._queued.discard(key)
                self._order.remove(key)
                self._again.add(key)
        try:
            yield
        finally:
            self._release(key)

    def _release(self, key: tuple[str, str]) -> None:
        with self._ready:
            self._busy.discard(key)
            again = key in self._again
            self._again.discard(key)
            self._ready.notify_all()
        if again:
            self.request(key)

    def stop(self) -> None:
        with self._ready:
            self._stopping = True
            self._ready.notify_all()

    def _take(self) -> tuple[str, str] | None:
        with self._ready:
            while not self._order and not self._stopping:
                self._ready.wait()
            if self._stopping:
                return None
            key = self._order.popleft()
            self._queued.discard(key)
            self._busy.add(key)
            return key

    def _work(self) -> None:
        while (key := self._take()) is not None:
            failed = False
            try:
                self._refresh(key)
            except Exception:
                failed = True
                _LOG.exception("Status refresh of %s/%s failed; retrying in %.1f s", *key, self._retry_delay)
            if failed:
                # The retry reads everything afresh: a request made meanwhile needs no refresh of its own.
                with self._ready:
                    self._again.discard(key)
            self._release(key)
            if failed:
                timer = threading.Timer(self._retry_delay, self.request, args=(key,))
                timer.daemon = True
                timer.start()
