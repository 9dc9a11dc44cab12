"""The reconcile steps behind the kopf handlers: judge the spec, apply or refuse, then recompute status.

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
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from disagg.operator import conditions as cond
from disagg.operator.api import ROLES, ConditionStatus, DisaggDeploymentSpec
from disagg.operator.builders.children import build, revision_of
from disagg.operator.builders.engine import engine_kind
from disagg.operator.builders.router import endpoint_of
from disagg.operator.control.k8s_apply import Kube
from disagg.operator.kv_status import peers_reported, pod_kv
from disagg.operator.naming import COMPONENT_LABEL, SINCE_ANNOTATION, Installation, Owner
from disagg.operator.policies.chain import REFUSAL_CHAIN
from disagg.operator.policies.compat import CompatReport, evaluate
from disagg.operator.rollout import Rollout, assess, since_of, slot_children
from disagg.operator.scaling import targets as scaling_targets
from disagg.operator.scaling.retire import UNKNOWN, Busy
from disagg.operator.scaling.steps import ScaleSteps, scale_steps
from disagg.operator.status import Workload, compute, incompatibility_message, to_json, workload
from disagg.worker.contracts.pairing import Routing, routing_from_pods
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


def reconcile(
    kube: Kube,
    body: Mapping[str, Any],
    installation: Installation,
    observed: Observed,
    busy: Busy = UNKNOWN,
    *,
    created: bool = False,
) -> Outcome:
    """Converge the children on the spec (or refuse it), then write the status. `busy`: what the routers
    last said of the engines' legs in flight (the planner's scrape), which ends a scale-down's drain.
    `created`: this is the first attempt of kopf's create handler (kopf saw no handled state on the object).

    The children are listed before the apply: their resourceVersions tell which applies wrote something (a
    server-side apply that changes nothing leaves the object, and its resourceVersion, as it was), and the
    apply responses are the freshest view of the workloads for the status. A deployment that cannot own a
    child yet is not listed (see `_unborn`)."""
    owner = _owner(body)
    uid: str = body["metadata"]["uid"]
    verdict = judge(body.get("spec") or {}, installation)
    if verdict.violations:
        # A refused spec changes no child, so what the watch shows is the whole answer: one write, no list.
        written = refresh_status(kube, owner.namespace, owner.name, installation, observed, body)
        return Outcome((), (), verdict.message, refused_now=written)
    latest = kube.latest_status(body)
    unborn = created and _unborn(latest, owner.generation)
    news = _verdict_is_news(latest, owner.generation)
    if news and not unborn:
        # The verdict is known before any request: say it first (what `kubectl apply` waits to see), from
        # what the watch shows, rather than after a list and three apply waves. It costs a second status
        # write only when the verdict is news (a spec change); the one after the applies follows.
        refresh_status(kube, owner.namespace, owner.name, installation, observed, body)
    # judge() reports a violation whenever the spec cannot be parsed or planned.
    assert verdict.spec is not None and verdict.report is not None and verdict.report.plan is not None
    children = [] if unborn else kube.children(owner.namespace, owner.name, uid)
    before = [workload(child) for child in children if _is_workload(child)]
    pods = list(observed.pods(owner.namespace, owner.name))
    now = datetime.now(UTC)
    # The planner's counts live in the status: read the newest (a handler's event can trail the planner's
    # own write, and applying an older, lower count would let the ReplicaSet cut a decoder undrained).
    status = kube.latest_status(body)
    rollout = _assess(verdict, owner, before, pods, routing_from_pods(pods), now, status)
    steps = scale_steps(
        _effective(verdict, status),
        owner,
        before,
        pods,
        rollout.slot,
        rollout.old_slot is not None,
        busy,
        now,
    )
    desired = build(
        sized(steps.spec, rollout),
        owner,
        verdict.report.plan,
        verdict.report.hashes,
        installation,
        verdict.report.factors,
        rollout.slot,
    )
    since = cond.rfc3339(since_of(before, rollout.slot, rollout.revision, now))
    for obj in desired:
        if _is_workload(obj) and obj["metadata"]["labels"].get(COMPONENT_LABEL) in ("prefill", "decode"):
            obj["metadata"]["annotations"][SINCE_ANNOTATION] = since
    if news and unborn:
        # A new deployment's verdict goes first too, with what the apply waves are about to create: nothing
        # exists, and nothing but this call creates its children, so the status after the applies is known
        # now. That write is then the only one this call makes (the one after the applies finds nothing
        # changed), where saying "no workloads" first cost a second write per create.
        created_now = [replace(workload(obj), settled=False) for obj in desired if _is_workload(obj)]
        _write_status(kube, body, verdict, created_now, observed, endpoint_of(desired))
    existing = {
        (child["kind"], child["metadata"]["name"]): child["metadata"].get("resourceVersion")
        for child in children
    }
    kept = set(slot_children(children, rollout.old_slot)) if rollout.keep_old and rollout.old_slot else set()
    kept -= set(rollout.remove)
    for pod in rollout.drain + steps.drain:
        kube.annotate_pod(owner.namespace, pod, {DRAINING_ANNOTATION: cond.rfc3339(now)})
    for pod in rollout.undrain:
        kube.annotate_pod(owner.namespace, pod, {DRAINING_ANNOTATION: None})
    _retire(kube, owner.namespace, steps)
    removed = _remove_decoders(kube, owner.namespace, rollout) if rollout.keep_old else []
    # Three waves, each applied at once: what the pods mount or run as (the ConfigMap, ServiceAccounts, Roles,
    # Services), the RoleBindings, then the workloads. A binding after its Role: the API server resolves the
    # Role to check that a binder without `escalate` holds its permissions, and answers 404 while it is not
    # there (an admin skips that check, so only a least-privilege operator failed, and waited a retry). No
    # pod before its ServiceAccount: the API server would refuse it and its controller back off.
    waves = [
        [obj for obj in desired if not _is_workload(obj) and obj["kind"] != "RoleBinding"],
        [obj for obj in desired if obj["kind"] == "RoleBinding"],
        [obj for obj in desired if _is_workload(obj)],
    ]
    changed, applied = [], []
    for wave in waves:
        for obj, stored in zip(wave, kube.apply_all(wave), strict=True):
            key = (obj["kind"], obj["metadata"]["name"])
            applied.append({**stored, "kind": key[0]})
            if existing.get(key) != stored["metadata"].get("resourceVersion"):
                changed.append(f"{key[0]} {key[1]}")
    wanted = {(obj["kind"], obj["metadata"]["name"]) for obj in desired} | kept
    deleted = removed
    for key in sorted(existing.keys() - wanted):
        kube.delete(key[0], owner.namespace, key[1])
        deleted.append(f"{key[0]} {key[1]}")
    workloads = [workload(child) for child in applied if _is_workload(child)]
    scaled = dict([rollout.scale]) if rollout.scale is not None else {}
    workloads += [
        replace(w, desired=scaled.get(w.name, w.desired)) for w in before if (w.kind, w.name) in kept
    ]
    _write_status(kube, body, verdict, workloads, observed, endpoint_of(applied))
    return Outcome(
        tuple(sorted(changed)),
        tuple(deleted),
        None,
        drained=rollout.drain + steps.drain,
        retired=steps.delete,
    )


def _retire(kube: Kube, namespace: str, steps: ScaleSteps) -> None:
    """A scale-down's pod writes, before the apply that lowers the count: a mark taken back, then the
    drained pods deleted (the ReplicaSet's replacement of each is what the lower count removes)."""
    for pod in steps.undrain:
        kube.annotate_pod(namespace, pod, {DRAINING_ANNOTATION: None})
    for pod in steps.delete:
        kube.delete_pod(namespace, pod)


def _effective(verdict: Verdict, status: Mapping[str, Any]) -> DisaggDeploymentSpec:
    """The spec with each role's replicas at its target (`scaling.targets`: the planner's count where it
    sets one, kept in the status)."""
    assert verdict.spec is not None
    counts = scaling_targets.targets(verdict.spec, status)
    return scaling_targets.with_replicas(
        verdict.spec, {role: n for role, n in counts.items() if n is not None}
    )


def sized(spec: DisaggDeploymentSpec, rollout: Rollout) -> DisaggDeploymentSpec:
    """The spec with the replicas to build: while another revision runs, what the rollout's step runs the
    spec's revision's slot at; otherwise `spec`'s own, the scale steps' counts. (The rollout's sizes then
    are only the planner's targets: applied, they would lower a decode count while its scale-down still
    drains the pod that is to go, and the ReplicaSet would cut the other.)"""
    sizes = rollout.replicas.get(rollout.revision) if rollout.old_slot is not None else None
    if sizes is None or sizes == (spec.prefill.replicas, spec.decode.replicas):
        return spec
    return spec.model_copy(
        update={
            "prefill": spec.prefill.model_copy(update={"replicas": sizes[0]}),
            "decode": spec.decode.model_copy(update={"replicas": sizes[1]}),
        }
    )


def _remove_decoders(kube: Kube, namespace: str, rollout: Rollout) -> list[str]:
    """A step's old decode pods go: delete exactly them, then lower their Deployment's replicas. In this
    order: a replacement the ReplicaSet starts for a deleted pod is pending, and a scale-down removes a
    pending pod before a serving one (the reverse order would let the ReplicaSet choose which pods go)."""
    for pod in rollout.delete_pods:
        kube.delete_pod(namespace, pod)
    if rollout.scale is not None:
        kube.scale_deployment(namespace, *rollout.scale)
    return [f"Pod {pod}" for pod in rollout.delete_pods]


def _assess(
    verdict: Verdict,
    owner: Owner,
    workloads: list[Workload],
    pods: list[Mapping[str, Any]],
    routing: Routing,
    now: datetime,
    status: Mapping[str, Any],
) -> Rollout:
    """`rollout.assess` for a compatible verdict: its revision against what the cluster runs."""
    assert verdict.spec is not None and verdict.report is not None and verdict.report.plan is not None
    spec, report = _effective(verdict, status), verdict.report
    assert report.plan is not None
    return assess(
        revision=revision_of(spec, owner, report.plan, report.hashes, report.factors),
        workloads=workloads,
        pods=pods,
        routing=routing,
        now=now,
        settings=spec.rollout,
        sizes=(spec.prefill.replicas, spec.decode.replicas),
    )


def _unborn(status: Mapping[str, Any], generation: int) -> bool:
    """Whether a just-created deployment can own no child yet: its uid is new, every reconcile that applies
    ends with a status write (so no status means none has), and its spec is the first (an operator that
    applied generation 1 and died before its status write left children that generation 1 builds alike).
    Listing such a deployment's children costs one LIST per kind at the API server, each reading every
    object of the kind in the namespace to match the label (a thousand deployments, a thousand of each),
    for an empty answer."""
    return generation == 1 and not status.get("conditions")


def _verdict_is_news(status: Mapping[str, Any], generation: int) -> bool:
    """Whether the stored status lacks a compatible verdict on this generation of the spec."""
    for item in status.get("conditions") or ():
        if isinstance(item, Mapping) and item.get("type") == cond.COMPATIBLE:
            judged = item.get("status"), item.get("observedGeneration")
            return judged != (ConditionStatus.TRUE.value, generation)
    return True


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
    current = kube.latest_status(body)
    pods = list(observed.pods(metadata["namespace"], metadata["name"]))
    routing = routing_from_pods(pods)
    now = datetime.now(UTC)
    rollout = (
        None if verdict.violations else _assess(verdict, _owner(body), workloads, pods, routing, now, body)
    )
    spec = verdict.spec
    status = compute(
        generation=int(metadata.get("generation") or 1),
        previous=cond.parse(current.get("conditions")),
        violations=verdict.violations,
        report=verdict.report,
        workloads=sorted(workloads, key=_listing_order),
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
