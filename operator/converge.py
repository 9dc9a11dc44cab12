"""What one reconcile of a compatible spec does, decided from what it read. Pure.

`control.reconcile` runs a reconcile as named steps, as LWS's DisaggregatedSet controller runs a planner
(`planner.go`) beside an executor (`executor.go`): it reads (`Seen`: the stored status, the children, the
pods), asks `decide` here what to do (`Decision`: the rollout's and the scale-down's pod writes, the children
to apply in their waves, those to prune, what to say first on a create), applies that, and reports the status.
Deciding does no I/O and reads no clock: `Seen.now` is when the reconcile read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from disagg.operator import conditions as cond
from disagg.operator.api import ConditionStatus, DisaggDeploymentSpec
from disagg.operator.builders.children import build, revision_of
from disagg.operator.naming import COMPONENT_LABEL, SINCE_ANNOTATION, Installation, Owner
from disagg.operator.policies.compat import CompatReport
from disagg.operator.rollout import Rollout, assess, since_of, slot_children
from disagg.operator.scaling import targets as scaling_targets
from disagg.operator.scaling.retire import Busy
from disagg.operator.scaling.steps import ScaleSteps, scale_steps
from disagg.operator.status import Workload, workload
from disagg.worker.contracts.pairing import routing_from_pods

ChildKey = tuple[str, str]
"""A child as (kind, name)."""


@dataclass(frozen=True)
class Seen:
    """What a reconcile read before deciding. `unborn`: a just-created deployment that can own no child yet
    (`unborn`), whose children were therefore not listed; `news`: the stored status lacks a compatible
    verdict on this generation (`verdict_is_news`); `status`: the stored status after any first word."""

    unborn: bool
    news: bool
    children: Sequence[Mapping[str, Any]]
    pods: Sequence[Mapping[str, Any]]
    status: Mapping[str, Any]
    now: datetime

    @property
    def before(self) -> list[Workload]:
        """The workloads among the listed children, as they were before this reconcile."""
        return [workload(child) for child in self.children if is_workload(child)]


@dataclass(frozen=True)
class Decision:
    """What a reconcile does, in order: mark `drain` pods draining and take the mark off `undrain`, the scale
    steps' pod writes (`steps`), the rollout's decoder removal (`rollout`), apply `waves` one after another,
    prune `prune`. `announce`: on a create whose verdict is news, the workloads the waves are about to create,
    for a status written before them."""

    rollout: Rollout
    steps: ScaleSteps
    desired: tuple[dict[str, Any], ...]
    announce: tuple[Workload, ...] | None
    existing: Mapping[ChildKey, str | None]
    kept: frozenset[ChildKey]
    drain: tuple[str, ...]
    undrain: tuple[str, ...]
    waves: tuple[tuple[dict[str, Any], ...], ...]
    before: tuple[Workload, ...]

    @property
    def prune(self) -> list[ChildKey]:
        """The children that exist and that neither the spec nor a rollout's kept old slot wants, in order."""
        wanted = {(obj["kind"], obj["metadata"]["name"]) for obj in self.desired} | self.kept
        return sorted(self.existing.keys() - wanted)

    def workloads_after(self, applied: Sequence[Mapping[str, Any]]) -> list[Workload]:
        """The workloads once applied: the apply responses', and the old slot's kept ones at the size a
        rollout's step scaled them to."""
        workloads = [workload(child) for child in applied if is_workload(child)]
        scaled = dict([self.rollout.scale]) if self.rollout.scale is not None else {}
        workloads += [
            replace(w, desired=scaled.get(w.name, w.desired))
            for w in self.before
            if (w.kind, w.name) in self.kept
        ]
        return workloads


def decide(
    spec: DisaggDeploymentSpec,
    report: CompatReport,
    owner: Owner,
    installation: Installation,
    seen: Seen,
    busy: Busy,
) -> Decision:
    """Everything a reconcile of a compatible `spec` writes, from what it saw. `busy`: what the routers last
    said of the engines' legs in flight (the planner's scrape), which ends a scale-down's drain."""
    assert report.plan is not None  # a compatible verdict always has a plan
    before = seen.before
    rollout = assess_rollout(spec, report, owner, before, seen.pods, seen.now, seen.status)
    steps = scale_steps(
        effective(spec, seen.status),
        owner,
        before,
        list(seen.pods),
        rollout.slot,
        rollout.old_slot is not None,
        busy,
        seen.now,
    )
    desired = build(
        sized(steps.spec, rollout),
        owner,
        report.plan,
        report.hashes,
        installation,
        report.factors,
        rollout.slot,
    )
    since = cond.rfc3339(since_of(before, rollout.slot, rollout.revision, seen.now))
    for obj in desired:
        if is_workload(obj) and obj["metadata"]["labels"].get(COMPONENT_LABEL) in ("prefill", "decode"):
            obj["metadata"]["annotations"][SINCE_ANNOTATION] = since
    # A new deployment's verdict goes first too, with what the apply waves are about to create: nothing
    # exists, and nothing but this reconcile creates its children, so the status after the applies is known
    # now. That write is then the only one the reconcile makes (the one after the applies finds nothing
    # changed), where saying "no workloads" first cost a second write per create.
    announce = (
        tuple(replace(workload(obj), settled=False) for obj in desired if is_workload(obj))
        if seen.news and seen.unborn
        else None
    )
    existing = {
        (child["kind"], child["metadata"]["name"]): child["metadata"].get("resourceVersion")
        for child in seen.children
    }
    kept = (
        set(slot_children(seen.children, rollout.old_slot))
        if rollout.keep_old and rollout.old_slot
        else set()
    )
    kept -= set(rollout.remove)
    # Three waves, each applied at once: what the pods mount or run as (the ConfigMap, ServiceAccounts, Roles,
    # Services), the RoleBindings, then the workloads. A binding after its Role: the API server resolves the
    # Role to check that a binder without `escalate` holds its permissions, and answers 404 while it is not
    # there (an admin skips that check, so only a least-privilege operator failed, and waited a retry). No
    # pod before its ServiceAccount: the API server would refuse it and its controller back off.
    waves = (
        tuple(obj for obj in desired if not is_workload(obj) and obj["kind"] != "RoleBinding"),
        tuple(obj for obj in desired if obj["kind"] == "RoleBinding"),
        tuple(obj for obj in desired if is_workload(obj)),
    )
    return Decision(
        rollout=rollout,
        steps=steps,
        desired=tuple(desired),
        announce=announce,
        existing=existing,
        kept=frozenset(kept),
        drain=rollout.drain + steps.drain,
        undrain=tuple(rollout.undrain),
        waves=waves,
        before=tuple(before),
    )


def effective(spec: DisaggDeploymentSpec, status: Mapping[str, Any]) -> DisaggDeploymentSpec:
    """The spec with each role's replicas at its target (`scaling.targets`: the planner's count where it
    sets one, kept in the status)."""
    counts = scaling_targets.targets(spec, status)
    return scaling_targets.with_replicas(spec, {role: n for role, n in counts.items() if n is not None})


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


def assess_rollout(
    spec: DisaggDeploymentSpec,
    report: CompatReport,
    owner: Owner,
    workloads: Sequence[Workload],
    pods: Sequence[Mapping[str, Any]],
    now: datetime,
    status: Mapping[str, Any],
) -> Rollout:
    """`rollout.assess` for a compatible verdict: its revision against what the cluster runs."""
    assert report.plan is not None
    targeted = effective(spec, status)
    return assess(
        revision=revision_of(targeted, owner, report.plan, report.hashes, report.factors),
        workloads=list(workloads),
        pods=list(pods),
        routing=routing_from_pods(pods),
        now=now,
        settings=targeted.rollout,
        sizes=(targeted.prefill.replicas, targeted.decode.replicas),
    )


def unborn(status: Mapping[str, Any], generation: int) -> bool:
    """Whether a just-created deployment can own no child yet: its uid is new, every reconcile that applies
    ends with a status write (so no status means none has), and its spec is the first (an operator that
    applied generation 1 and died before its status write left children that generation 1 builds alike).
    Listing such a deployment's children costs one LIST per kind at the API server, each reading every
    object of the kind in the namespace to match the label (a thousand deployments, a thousand of each),
    for an empty answer."""
    return generation == 1 and not status.get("conditions")


def verdict_is_news(status: Mapping[str, Any], generation: int) -> bool:
    """Whether the stored status lacks a compatible verdict on this generation of the spec."""
    for item in status.get("conditions") or ():
        if isinstance(item, Mapping) and item.get("type") == cond.COMPATIBLE:
            judged = item.get("status"), item.get("observedGeneration")
            return judged != (ConditionStatus.TRUE.value, generation)
    return True


def is_workload(obj: Mapping[str, Any]) -> bool:
    return obj.get("kind") in ("StatefulSet", "Deployment")


def listing_order(item: Workload) -> tuple[bool, str]:
    # The order the API lists them in (StatefulSets, then Deployments, each by name): the status's messages
    # name workloads in this order, and a reshuffle would be a write that changes nothing.
    return item.kind != "StatefulSet", item.name
