"""One reconcile's scaling steps for the roles the planner sets: from each role's target, what the cluster
runs and what the routers last said, the spec to build and the pod writes that go with it
(`retire`). Pure.

A role the planner does not set is built at its target as it always was. While a rollout is under way (two
slots hold engines) the planner's roles are built at their targets too, and nothing is drained for a
scale-down: the rollout drains and prunes the old slot as a whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from disagg.operator.api import DisaggDeploymentSpec, Role
from disagg.operator.naming import SLOT_LABEL, SLOTS, Owner, prefill_name
from disagg.operator.scaling import retire
from disagg.operator.scaling.retire import Busy, Member, Retirement
from disagg.operator.scaling.targets import with_replicas
from disagg.worker.contracts.engine_pods import engine_pod
from disagg.worker.contracts.pod_contract import DRAINING_ANNOTATION


class RoleWorkload(Protocol):
    """What the steps read of a StatefulSet or Deployment (`status.Workload` is one)."""

    @property
    def role(self) -> str: ...

    @property
    def slot(self) -> str: ...

    @property
    def desired(self) -> int: ...


@dataclass(frozen=True)
class ScaleSteps:
    spec: DisaggDeploymentSpec
    """The spec to build: each planned role at the count `retire` says to build now."""
    drain: tuple[str, ...] = ()
    undrain: tuple[str, ...] = ()
    delete: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()


def _slot(obj: Mapping[str, Any]) -> str:
    slot = ((obj.get("metadata") or {}).get("labels") or {}).get(SLOT_LABEL)
    return slot if slot in SLOTS else SLOTS[0]


def _since(text: object) -> datetime | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def members(
    pods: Sequence[Mapping[str, Any]], role: Role, owner: Owner, slot: str, applied: int
) -> list[Member]:
    """The role's live replicas in `slot`: decode pods, or prefill engines by replica number."""
    names = {prefill_name(owner.name, i, slot): i for i in range(applied)}
    grouped: dict[str, list[tuple[str, datetime | None]]] = {}
    for pod in pods:
        metadata = pod.get("metadata") or {}
        engine = engine_pod(pod)
        if engine is None or engine.role != role or _slot(pod) != slot or metadata.get("deletionTimestamp"):
            continue
        mark = _since((metadata.get("annotations") or {}).get(DRAINING_ANNOTATION))
        grouped.setdefault(engine.engine_id, []).append((engine.name, mark))
    found = []
    for name, pods_of in sorted(grouped.items()):
        if role == "prefill" and name not in names:
            continue
        marks = [t for _, t in pods_of if t is not None]
        found.append(
            Member(
                name=name,
                index=names.get(name, 0),
                pods=tuple(sorted(p for p, _ in pods_of)),
                marked=tuple(sorted(p for p, t in pods_of if t is not None)),
                since=min(marks, default=None),
            )
        )
    return found


def scale_steps(
    spec: DisaggDeploymentSpec,
    owner: Owner,
    workloads: Sequence[RoleWorkload],
    pods: Sequence[Mapping[str, Any]],
    slot: str,
    rolling: bool,
    busy: Busy,
    now: datetime,
) -> ScaleSteps:
    """`spec` has each role at its target (`targets.with_replicas`); `slot` is the spec's revision's, and
    `rolling` whether another revision has workloads."""
    if rolling:
        return ScaleSteps(spec)
    counts: dict[Role, int] = {}
    drain: list[str] = []
    undrain: list[str] = []
    delete: list[str] = []
    waiting: list[str] = []
    for role in ("prefill", "decode"):
        if not spec.planned(role):
            continue
        target = spec.role(role).replicas
        mine = [w for w in workloads if w.role == role and w.slot == slot]
        if not mine:
            continue
        applied = len(mine) if role == "prefill" else mine[0].desired
        found = members(pods, role, owner, slot, max(applied, target))
        step: Retirement = (retire.prefill if role == "prefill" else retire.decode)(
            target, applied, found, busy, now, spec.rollout.drain_seconds
        )
        counts[role] = step.replicas
        drain += step.drain
        undrain += step.undrain
        delete += step.delete
        waiting += step.waiting
    return ScaleSteps(
        with_replicas(spec, counts), tuple(drain), tuple(undrain), tuple(delete), tuple(waiting)
    )
