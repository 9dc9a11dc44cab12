"""The DisaggDeployment's status, computed afresh from the spec's verdict and what the cluster shows. Pure.

Level-based: whoever recomputes it (the spec handler, a child's or a pod's event) reads everything afresh and
gets the same answer, so concurrent writers converge. Conditions keep their lastTransitionTime unless their
status flips (`conditions.merge`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from disagg.operator import conditions as cond
from disagg.operator.api import (
    Condition,
    ConditionStatus,
    DisaggDeploymentStatus,
    EngineKind,
    PairTransportStatus,
    RevisionStatus,
    Role,
    RoleHashes,
    RoleStatus,
)
from disagg.operator.kv_status import (
    PodKV,
    aggregate,
    pair_transports,
    routable,
    routable_pairs,
    transport_summary,
    transport_verdict,
)
from disagg.operator.naming import (
    COMPONENT_LABEL,
    GENERATION_ANNOTATION,
    REVISION_LABEL,
    SINCE_ANNOTATION,
)
from disagg.operator.policies.compat import CompatReport
from disagg.operator.rollout import STUCK, Rollout, parse_time, slot_of
from disagg.worker.contracts.pairing import Routing
from disagg.worker.kv.errors import Violation

# Progressing's reasons while workloads are not yet ready: a new deployment's first ones, or any later change.
CREATING: Final = "Creating"
ROLLING_OUT: Final = "RollingOut"


@dataclass(frozen=True, slots=True)
class Workload:
    """A StatefulSet or Deployment as observed: desired pods, pods that exist, ready and up to date."""

    kind: str
    name: str
    role: str
    desired: int
    replicas: int
    ready: int
    updated: int
    settled: bool
    generation: int | None
    slot: str = "a"
    revision: str = ""
    """The revision it runs (its `disagg.io/revision` label; "" on one from before revisions existed)."""
    since: datetime | None = None
    """When its slot began to run its revision (`disagg.io/revision-since`)."""

    @property
    def done(self) -> bool:
        return self.settled and self.ready >= self.desired and self.updated >= self.desired

    def describe(self) -> str:
        return f"{self.kind} {self.name} {self.ready}/{self.desired} ready"


def workload(obj: Mapping[str, Any]) -> Workload:
    """Read an apps/v1 StatefulSet or Deployment (camelCase dict)."""
    metadata, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    annotations = metadata.get("annotations") or {}
    annotation = annotations.get(GENERATION_ANNOTATION)
    return Workload(
        kind=str(obj.get("kind", "")),
        name=str(metadata.get("name", "")),
        role=str((metadata.get("labels") or {}).get(COMPONENT_LABEL, "")),
        desired=int(spec.get("replicas", 1)),
        replicas=int(status.get("replicas") or 0),
        ready=int(status.get("readyReplicas") or 0),
        updated=int(status.get("updatedReplicas") or 0),
        settled=int(status.get("observedGeneration") or 0) >= int(metadata.get("generation") or 0),
        generation=int(annotation) if annotation is not None and annotation.isdigit() else None,
        slot=slot_of(obj),
        revision=str((metadata.get("labels") or {}).get(REVISION_LABEL) or ""),
        since=parse_time(annotations.get(SINCE_ANNOTATION)),
    )


def incompatibility_message(violations: Sequence[Violation]) -> str:
    """One sentence per broken rule; the same text the admission webhook refuses with."""
    return "; ".join(f"{violation.reason}: {violation.message}" for violation in violations)


def compute(
    *,
    generation: int,
    previous: Sequence[Condition],
    violations: Sequence[Violation],
    report: CompatReport,
    workloads: Sequence[Workload],
    pods: Sequence[PodKV],
    routing: Routing,
    reported: bool,
    now: datetime,
    endpoint: str | None = None,
    rollout: Rollout | None = None,
    desired: Mapping[Role, int | None] | None = None,
    selectors: Mapping[Role, str] | None = None,
    scaling: bool = False,
    engine_kinds: Mapping[Role, EngineKind] | None = None,
    transport: str = "any",
) -> DisaggDeploymentStatus:
    """The whole status; `violations` are every refusal (pre-flight rules and engine-argument conflicts);
    `routing` is `pairing.routing_from_pods` of the pods, `reported` whether any pod has a peer report;
    `endpoint` is the router Service's URL, when one exists; `rollout` what `rollout.assess` makes of the
    workloads and pods (None for a refused spec); `desired` each role's replica target and `selectors` its
    pods' label selector (`scaling.targets`); `scaling` whether a role is autoscaled (else a `Scaling`
    condition left from when one was goes); `engine_kinds` the kind each role's engine was built as
    (`builders.engine.engine_kind`); `transport` the spec's `kvTransfer.transport`, which every pair's KV
    must have taken."""
    updates: list[Condition] = []
    applied = sorted({w.generation for w in workloads if w.generation is not None})
    if violations:
        message = incompatibility_message(violations)
        if workloads:
            kept = f"generation {applied[0]}" if applied else "an earlier generation"
            message += f". The running objects from {kept} were left unchanged."
        updates.append(
            cond.desired(cond.COMPATIBLE, ConditionStatus.FALSE, violations[0].reason, message, now)
        )
        updates.append(
            cond.desired(
                cond.PROGRESSING,
                ConditionStatus.FALSE,
                "SpecRefused",
                f"generation {generation} is not applied until the spec is compatible",
                now,
            )
        )
    else:
        assert report.plan is not None  # a compatible spec always has a plan
        updates.append(
            cond.desired(
                cond.COMPATIBLE,
                ConditionStatus.TRUE,
                "Compatible",
                f"{report.plan.pp_size} prefill stage(s) send KV to decode with "
                f"{report.plan.routing_mode.value} routing; compatibility hash "
                f"{report.hashes['prefill'][:12]}",
                now,
            )
        )
        pending = [w for w in workloads if not w.done]
        stale = [w for w in workloads if w.generation != generation]
        if rollout is not None and rollout.phase is not None:
            status = ConditionStatus.FALSE if rollout.phase == STUCK else ConditionStatus.TRUE
            updates.append(cond.desired(cond.PROGRESSING, status, rollout.phase, rollout.message, now))
        elif pending or stale:
            updates.append(
                cond.desired(
                    cond.PROGRESSING,
                    ConditionStatus.TRUE,
                    CREATING if _creating(previous, stale) else ROLLING_OUT,
                    "waiting for " + ", ".join(w.describe() for w in (pending or stale)),
                    now,
                )
            )
        else:
            updates.append(
                cond.desired(
                    cond.PROGRESSING,
                    ConditionStatus.FALSE,
                    "RolloutComplete",
                    f"every workload of generation {generation} is ready",
                    now,
                )
            )
    updates.append(_available(_serving(workloads, rollout), violations, now))
    verdict = transport_verdict(aggregate(pods), pods, transport)
    updates.append(cond.desired(cond.KV_TRANSFER_READY, verdict.status, verdict.reason, verdict.message, now))
    pairs = routable(routing, reported)
    updates.append(cond.desired(cond.ROUTABLE, pairs.status, pairs.reason, pairs.message, now))
    carried = previous if scaling else [c for c in previous if c.type != cond.SCALING]
    return DisaggDeploymentStatus(
        observed_generation=generation,
        conditions=cond.merge(carried, updates, generation=generation, now=now),
        prefill=_role_status(workloads, "prefill", desired, selectors, engine_kinds),
        decode=_role_status(workloads, "decode", desired, selectors, engine_kinds),
        topology=report.plan.to_status() if report.plan is not None else None,
        compatibility_hashes=RoleHashes(prefill=report.hashes["prefill"], decode=report.hashes["decode"]),
        routable_pairs=routable_pairs(routing),
        kv_transport=transport_summary(pods),
        kv_transports=[
            PairTransportStatus(
                prefill_pod=p.prefill_pod,
                decode_pod=p.decode_pod,
                transport=p.transport,
                lanes=p.lanes or None,
                kv_bytes=p.kv_bytes,
                gbps=p.gbps,
            )
            for p in pair_transports(pods)
        ]
        or None,
        endpoint=endpoint,
        **_revisions(rollout),
    )


def _creating(previous: Sequence[Condition], stale: Sequence[Workload]) -> bool:
    """Whether the deployment's first workloads are still coming up: every workload is of this generation
    and Progressing has never said anything but `Creating` (nothing to roll out from yet). Once it has
    completed, or a spec change finds older workloads, the deployment rolls out."""
    progressing = cond.find(previous, cond.PROGRESSING)
    return not stale and (progressing is None or progressing.reason == CREATING)


def _serving(workloads: Sequence[Workload], rollout: Rollout | None) -> list[Workload]:
    """The workloads whose readiness is the deployment's: during a rollout, the old revision's and the
    new revision's that are ready; the router's, always."""
    if rollout is None or rollout.old_slot is None:
        return list(workloads)
    # The old revision's (at the size its steps left it) and the new revision's that are up; one the new
    # revision is still growing waits for its step, as a Deployment's surge pods do.
    return [
        w for w in workloads if w.role not in ("prefill", "decode") or w.slot == rollout.old_slot or w.done
    ]


def _revisions(rollout: Rollout | None) -> dict[str, Any]:
    if rollout is None:
        return {}
    revisions = [
        RevisionStatus(
            revision=rollout.revision,
            slot=rollout.slot,
            routable_pairs=rollout.pairs.get(rollout.revision, 0),
            prefill_replicas=rollout.replicas.get(rollout.revision, (0, 0))[0],
            decode_replicas=rollout.replicas.get(rollout.revision, (0, 0))[1],
        )
    ]
    if rollout.old_revision is not None and rollout.old_slot is not None:
        revisions.append(
            RevisionStatus(
                revision=rollout.old_revision,
                slot=rollout.old_slot,
                routable_pairs=rollout.pairs.get(rollout.old_revision, 0),
                draining=rollout.draining,
                prefill_replicas=rollout.replicas.get(rollout.old_revision, (0, 0))[0],
                decode_replicas=rollout.replicas.get(rollout.old_revision, (0, 0))[1],
            )
        )
    return {"revision": rollout.revision, "old_revision": rollout.old_revision, "revisions": revisions}


def _available(every: Sequence[Workload], violations: Sequence[Violation], now: datetime) -> Condition:
    # The engines serve; the router's rollout is Progressing's business, not whether the engines are up.
    workloads = [w for w in every if w.role in ("prefill", "decode")]
    if not workloads:
        reason = "Incompatible" if violations else "NoWorkloads"
        return cond.desired(cond.AVAILABLE, ConditionStatus.FALSE, reason, "no engine workloads exist", now)
    roles = {w.role for w in workloads if w.desired > 0}
    short = [w for w in workloads if w.ready < w.desired]
    if short or roles != {"prefill", "decode"}:
        missing = sorted({"prefill", "decode"} - roles)
        parts = [w.describe() for w in short] + [f"{role} has no replicas" for role in missing]
        return cond.desired(cond.AVAILABLE, ConditionStatus.FALSE, "AwaitingPods", "; ".join(parts), now)
    return cond.desired(
        cond.AVAILABLE,
        ConditionStatus.TRUE,
        "AllReplicasReady",
        f"every prefill stage and decode pod is ready ({sum(w.ready for w in workloads)} pods)",
        now,
    )


def _role_status(
    workloads: Sequence[Workload],
    role: Role,
    desired: Mapping[Role, int | None] | None,
    selectors: Mapping[Role, str] | None,
    engine_kinds: Mapping[Role, EngineKind] | None,
) -> RoleStatus:
    mine = [w for w in workloads if w.role == role]
    return RoleStatus(
        replicas=sum(w.replicas for w in mine),
        ready_replicas=sum(w.ready for w in mine),
        desired_replicas=(desired or {}).get(role),
        selector=(selectors or {}).get(role),
        engine_kind=(engine_kinds or {}).get(role),
    )


def to_json(status: DisaggDeploymentStatus) -> dict[str, Any]:
    body: dict[str, Any] = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    body["conditions"] = cond.to_json(status.conditions or ())
    return body
