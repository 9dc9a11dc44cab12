"""Each role's replica target as the status keeps it, the spec the builders get for a count, the role's pod
selector (the scale subresource's), and the `Scaling` condition from the planner's decisions. Pure.

The planner's count lives in `status.<role>.desiredReplicas` (the timer in `control/` writes it), never in
the spec: the spec stays what its author applied, and a reconcile reads the count from the status, so
the children are applied by the one reconcile path with the one field manager."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from disagg.operator import conditions as cond
from disagg.operator.api import ROLES, Condition, ConditionStatus, DisaggDeploymentSpec, Role
from disagg.operator.naming import INSTANCE_LABEL, label_value
from disagg.operator.scaling.planner import AT_MAX, METRICS_MISSING, SCALED_DOWN, SCALED_UP, STABLE, Decision
from disagg.worker.contracts.pod_contract import ROLE_LABEL

# Which decision names the condition when the roles differ: a change first, then what needs a look.
_RANK = {SCALED_UP: 0, SCALED_DOWN: 1, AT_MAX: 2, METRICS_MISSING: 3, STABLE: 4}


def target(spec: DisaggDeploymentSpec, role: Role, status: Mapping[str, Any] | None) -> int | None:
    """The count the role is to have: the planner's (within the bounds; the spec's replicas before its
    first decision), the spec's replicas, or None when an external autoscaler owns it."""
    if spec.external(role):
        return None
    replicas = spec.role(role).replicas
    scaling = spec.autoscaling(role)
    if scaling is None:
        return replicas
    stored = ((status or {}).get(role) or {}).get("desiredReplicas")
    low, high = scaling.bounds
    return min(max(stored if isinstance(stored, int) else replicas, low), high)


def targets(spec: DisaggDeploymentSpec, status: Mapping[str, Any] | None) -> dict[Role, int | None]:
    return {role: target(spec, role, status) for role in ROLES}


def with_replicas(spec: DisaggDeploymentSpec, counts: Mapping[Role, int]) -> DisaggDeploymentSpec:
    """The spec with the given roles' replicas replaced: what the builders build for those counts."""
    update: dict[str, Any] = {
        role: spec.role(role).model_copy(update={"replicas": n}) for role, n in counts.items()
    }
    return spec.model_copy(update=update) if update else spec


def selector(owner: str, role: Role) -> str:
    """The label selector of every pod of the role, in either slot."""
    return f"{INSTANCE_LABEL}={label_value(owner)},{ROLE_LABEL}={role}"


def condition(
    decisions: Sequence[Decision], previous: Sequence[Condition], settling: bool, now: datetime
) -> Condition | None:
    """`Scaling` from this tick's decisions: True while a role's count is changing (a decision changed it,
    or its pods have not caught up: `settling`), naming why it last changed; False once settled, naming
    what holds it (Stable, AtMaxReplicas, MetricsMissing)."""
    if not decisions:
        return None
    message = "; ".join(d.message for d in decisions)
    changed = [d for d in decisions if d.changed]
    if changed:
        first = min(changed, key=lambda d: _RANK[d.reason])
        return cond.desired(cond.SCALING, ConditionStatus.TRUE, first.reason, message, now)
    last = next((c for c in previous if c.type == cond.SCALING), None)
    if settling and last is not None and last.status == ConditionStatus.TRUE:
        return cond.desired(cond.SCALING, ConditionStatus.TRUE, last.reason, last.message, now)
    first = min(decisions, key=lambda d: _RANK[d.reason])
    return cond.desired(cond.SCALING, ConditionStatus.FALSE, first.reason, message, now)
