"""The reconcile behind the kopf handlers, in named steps: judge the spec (refusing it changes no child),
say the verdict first when it is news, read, decide (`converge.decide`, pure), apply, report the status.

Level-based and idempotent: every call builds the full desired set from the spec and applies it with
server-side apply, deletes children the spec no longer wants, and recomputes the whole status from what the
cluster shows. It never branches on the event that caused it. An incompatible spec changes no child: on
create nothing exists, and on update the running topology stays as it was.

A spec whose engine revision differs from the running one rolls out beside it (`rollout.assess` decides from
the children's labels and the pods' pairing): the spec's children go in the other slot, beside the old's,
in steps bounded by `spec.rollout.maxSurge`/`maxUnavailable` (`rollout_steps`): the spec's slot is built
at the step's replicas, old pods are marked draining and, once idle (at the latest `drainSeconds` later),
removed (a prefill engine's StatefulSet pruned, a decode pod deleted and its Deployment scaled down), the
old slot pruned once empty. The operator's clock (`ticks.advance_rollout`) calls `reconcile` while
`status.oldRevision` says a rollout is under way.

At scale (a thousand deployments, seven thousand children) three things keep the API server's load
proportional to what changed: the verdict on a spec is computed once per distinct spec (`judge` is pure, so
its cache is exact); a status refresh reads the deployment, its workloads and its pods from the operator's
watch stores (`Observed`), not by getting or listing them; and a write (a status patch, an Event) happens
only when it changes something, so a resume or a pod event that changes nothing issues no write.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from disagg.operator import conditions as cond
from disagg.operator import converge
from disagg.operator.api import ROLES, ConditionStatus, DisaggDeploymentSpec
from disagg.operator.builders.router import endpoint_of
from disagg.operator.control.k8s_apply import Kube
from disagg.operator.engine_kind import engine_kind
from disagg.operator.kv_status import peers_reported, pod_kv
from disagg.operator.naming import Installation, Owner
from disagg.operator.policies.chain import REFUSAL_CHAIN
from disagg.operator.policies.compat import CompatReport, evaluate
from disagg.operator.rollout import Rollout
from disagg.operator.scaling import targets as scaling_targets
from disagg.operator.scaling.retire import UNKNOWN, Busy
from disagg.operator.scaling.steps import ScaleSteps
from disagg.operator.settings import installation_from_environ
from disagg.operator.status import Workload, compute, incompatibility_message, to_json
from disagg.worker.contracts.pairing import routing_from_pods
from disagg.worker.contracts.pod_contract import DRAINING_ANNOTATION
from disagg.worker.kv.errors import Violation


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
    drained: tuple[str, ...] = ()
    """Pods this call marked draining."""
    retired: tuple[str, ...] = ()
    """Pods this call deleted to lower a count the planner set (after their drain)."""

    def news(self) -> list[tuple[str, str, str]]:
        """The Events worth posting, as (type, reason, message): only what this call changed."""
        posted = []
        if self.refused is not None and self.refused_now:
            posted.append(("Warning", "SpecRefused", self.refused))
        for reason, verb, pods in (
            ("Draining", "Draining", self.drained),
            ("ScaledDown", "Deleted", self.retired),
            ("Pruned", "Deleted", self.deleted),
            ("Applied", "Applied", self.changed),
        ):
            if pods:
                posted.append(("Normal", reason, f"{verb} " + ", ".join(pods)))
        return posted


@dataclass(frozen=True)
class Observed:
    """What the operator's watch stores show of one deployment: the deployment itself (None once it is
    gone), its StatefulSets and Deployments, its pods.

    All are callables so a caller reads the stores when the status is computed, not when it was queued."""

    workloads: Callable[[str, str], Iterable[Workload]]
    pods: Callable[[str, str], Iterable[Mapping[str, Any]]]
    deployment: Callable[[str, str], Mapping[str, Any] | None]


# A verdict is about 17 KiB and costs ~10-20 ms; deployments stamped from one template share one entry.
VERDICT_CACHE_SIZE = 1024


def judge(raw_spec: Mapping[str, Any], installation: Installation | None = None) -> Verdict:
    """Every reason to refuse a spec: schema errors, then `policies.REFUSAL_CHAIN`. `installation` defaults
    to this process's environment, which is the operator's (the admission webhook runs inside it).

    Pure in the spec and the installation, so it is cached on them: every pod event of a deployment used to
    re-run the whole evaluation. The verdict is shared between callers and never mutated."""
    installed = installation if installation is not None else installation_from_environ(os.environ)
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
        # The wire names alone, as the API server and `disagg check` read a spec.
        spec = DisaggDeploymentSpec.model_validate(raw_spec, by_alias=True, by_name=False)
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


def reconcile(
    kube: Kube,
    body: Mapping[str, Any],
    installation: Installation,
    observed: Observed,
    busy: Busy = UNKNOWN,
    *,
    created: bool = False,
) -> Outcome:
    """Converge the children on the spec (or refuse it), then write the status, in named steps: judge, say the
    verdict first when it is news, read, decide (`converge.decide`, pure), apply, report. `busy`: what the
    routers last said of the engines' legs in flight (the planner's scrape), which ends a scale-down's drain.
    `created`: this is the first attempt of kopf's create handler (kopf saw no handled state on the object).

    The children are listed before the apply: their resourceVersions tell which applies wrote something (a
    server-side apply that changes nothing leaves the object, and its resourceVersion, as it was), and the
    apply responses are the freshest view of the workloads for the status. A deployment that cannot own a
    child yet is not listed (`converge.unborn`)."""
    owner = _owner(body)
    verdict = judge(body.get("spec") or {}, installation)
    if verdict.violations:
        # A refused spec changes no child, so what the watch shows is the whole answer: one write, no list.
        written = refresh_status(kube, owner.namespace, owner.name, installation, observed, body)
        return Outcome((), (), verdict.message, refused_now=written)
    # judge() reports a violation whenever the spec cannot be parsed or planned.
    assert verdict.spec is not None and verdict.report is not None and verdict.report.plan is not None
    latest = kube.latest_status(body)
    unborn = created and converge.unborn(latest, owner.generation)
    news = converge.verdict_is_news(latest, owner.generation)
    if news and not unborn:
        # The verdict is known before any request: say it first (what `kubectl apply` waits to see), from
        # what the watch shows, rather than after a list and three apply waves. It costs a second status
        # write only when the verdict is news (a spec change); the one after the applies follows.
        refresh_status(kube, owner.namespace, owner.name, installation, observed, body)
    seen = _read(kube, body, owner, observed, unborn=unborn, news=news)
    decision = converge.decide(verdict.spec, verdict.report, owner, installation, seen, busy)
    if decision.announce is not None:
        _write_status(kube, body, verdict, list(decision.announce), observed, endpoint_of(decision.desired))
    changed, applied, deleted = _apply(kube, owner.namespace, decision, seen.now)
    _write_status(kube, body, verdict, decision.workloads_after(applied), observed, endpoint_of(applied))
    return Outcome(
        tuple(sorted(changed)),
        tuple(deleted),
        None,
        drained=decision.drain,
        retired=decision.steps.delete,
    )


def _read(
    kube: Kube, body: Mapping[str, Any], owner: Owner, observed: Observed, *, unborn: bool, news: bool
) -> converge.Seen:
    """What a reconcile decides from: the children (listed, unless the deployment can own none yet), the
    pods (from the watch) and the stored status. The planner's counts live in the status: the newest is
    read (a handler's event can trail the planner's own write, and applying an older, lower count would let
    the ReplicaSet cut a decoder undrained)."""
    children = [] if unborn else kube.children(owner.namespace, owner.name, body["metadata"]["uid"])
    pods = list(observed.pods(owner.namespace, owner.name))
    now = datetime.now(UTC)
    return converge.Seen(unborn, news, children, pods, kube.latest_status(body), now)


def _apply(
    kube: Kube, namespace: str, decision: converge.Decision, now: datetime
) -> tuple[list[str], list[Any], list[str]]:
    """Do what `decision` says, in its order: the drain marks (dated `now`, when the reconcile read), the
    scale-down's pod writes, a rollout step's decoder removal, the three apply waves, the prune. Returns the
    children whose apply wrote something, the apply responses, and what was deleted."""
    for pod in decision.drain:
        kube.annotate_pod(namespace, pod, {DRAINING_ANNOTATION: cond.rfc3339(now)})
    for pod in decision.undrain:
        kube.annotate_pod(namespace, pod, {DRAINING_ANNOTATION: None})
    _retire(kube, namespace, decision.steps)
    deleted = _remove_decoders(kube, namespace, decision.rollout) if decision.rollout.keep_old else []
    changed, applied = [], []
    for wave in decision.waves:
        for obj, stored in zip(wave, kube.apply_all(list(wave)), strict=True):
            key = (obj["kind"], obj["metadata"]["name"])
            applied.append({**stored, "kind": key[0]})
            if decision.existing.get(key) != stored["metadata"].get("resourceVersion"):
                changed.append(f"{key[0]} {key[1]}")
    for kind, name in decision.prune:
        kube.delete(kind, namespace, name)
        deleted.append(f"{kind} {name}")
    return changed, applied, deleted


def _retire(kube: Kube, namespace: str, steps: ScaleSteps) -> None:
    """A scale-down's pod writes, before the apply that lowers the count: a mark taken back, then the
    drained pods deleted (the ReplicaSet's replacement of each is what the lower count removes)."""
    for pod in steps.undrain:
        kube.annotate_pod(namespace, pod, {DRAINING_ANNOTATION: None})
    for pod in steps.delete:
        kube.delete_pod(namespace, pod)


def _remove_decoders(kube: Kube, namespace: str, rollout: Rollout) -> list[str]:
    """A step's old decode pods go: delete exactly them, then lower their Deployment's replicas. In this
    order: a replacement the ReplicaSet starts for a deleted pod is pending, and a scale-down removes a
    pending pod before a serving one (the reverse order would let the ReplicaSet choose which pods go)."""
    for pod in rollout.delete_pods:
        kube.delete_pod(namespace, pod)
    if rollout.scale is not None:
        kube.scale_deployment(namespace, *rollout.scale)
    return [f"Pod {pod}" for pod in rollout.delete_pods]


def refresh_status(
    kube: Kube,
    namespace: str,
    name: str,
    installation: Installation,
    observed: Observed,
    body: Mapping[str, Any] | None = None,
) -> bool:
    """Recompute the status from the spec and the stored deployment (or `body`, a handler's newer one),
    workloads and pods; write it only if it changed.

    No request but the write: the deployment comes from the watch, and the stored conditions it is judged
    against from `Kube.latest_status` (the watch's, or this process's own newer write), or a flip would be
    judged against a stale one and move a lastTransitionTime that should stay."""
    if body is None:
        body = observed.deployment(namespace, name)
    if body is None:
        kube.forget_status(namespace, name)
        return False
    if body["metadata"].get("deletionTimestamp"):
        return False
    verdict = judge(body.get("spec") or {}, installation)
    workloads = list(observed.workloads(namespace, name)) if verdict.report is not None else []
    # Only a reconcile applies or deletes the router's Service, and it writes the endpoint it saw.
    endpoint = kube.latest_status(body).get("endpoint")
    return _write_status(
        kube, body, verdict, workloads, observed, endpoint if isinstance(endpoint, str) else None
    )


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
    current = kube.latest_status(body)
    pods = list(observed.pods(metadata["namespace"], metadata["name"]))
    routing = routing_from_pods(pods)
    now = datetime.now(UTC)
    rollout = (
        None
        if verdict.violations or verdict.spec is None
        else converge.assess_rollout(verdict.spec, verdict.report, _owner(body), workloads, pods, now, body)
    )
    spec = verdict.spec
    status = compute(
        generation=int(metadata.get("generation") or 1),
        previous=cond.parse(current.get("conditions")),
        violations=verdict.violations,
        report=verdict.report,
        workloads=sorted(workloads, key=converge.listing_order),
        pods=[pod_kv(pod) for pod in pods],
        routing=routing,
        reported=peers_reported(pods),
        now=now,
        endpoint=endpoint,
        rollout=rollout,
        desired=None if spec is None else scaling_targets.targets(spec, current),
        selectors={role: scaling_targets.selector(metadata["name"], role) for role in ROLES},
        scaling=spec is not None and any(spec.autoscaling(role) for role in ROLES),
        engine_kinds=None if spec is None else {role: engine_kind(spec, role) for role in ROLES},
        transport="any" if spec is None else spec.kv_transfer.transport.value,
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
    current = kube.latest_status(body)
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
