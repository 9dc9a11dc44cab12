"""The operator's two scheduled steps (`ticker.Tick`): a rollout under way, and the planner.

Each holds its deployment's key in the refresh queue (`WorkQueue.holding`), as a spec reconcile does, so no
status refresh, spec reconcile or other step of the same deployment runs meanwhile, and posts the Events of
what it changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from disagg.operator.api import ScalingMode, scaling_mode
from disagg.operator.control.k8s_apply import Kube
from disagg.operator.control.reconcile import Observed, Outcome, reconcile
from disagg.operator.control.scaling import Planners, plan_tick
from disagg.operator.naming import Installation
from disagg.operator.runtime.ticker import Tick
from disagg.operator.runtime.work_queue import WorkQueue

# How often a rollout under way is reconciled again: how soon a new revision's first routable pairs start
# the old one's drain, and how close to `drainSeconds` its children are pruned.
ROLLOUT_TICK_S = 2.0


def rolling_out(body: Mapping[str, Any]) -> bool:
    return bool((body.get("status") or {}).get("oldRevision"))


def planned(body: Mapping[str, Any]) -> bool:
    """Some role is autoscaled by the planner (`spec.<role>.autoscaling`, mode `Planner`, the default; the
    stored spec may spell it `planner`)."""
    spec = body.get("spec") or {}
    roles = (spec.get("prefill") or {}, spec.get("decode") or {})
    return any(
        scaling_mode((role.get("autoscaling") or {}).get("mode", ScalingMode.PLANNER)) is ScalingMode.PLANNER
        for role in roles
        if role.get("autoscaling")
    )


def ticks(
    kube: Kube,
    installation: Installation,
    observed: Observed,
    refresh: WorkQueue,
    planners: Planners,
    planner_interval_s: float,
) -> list[Tick]:
    """The rollout's step (every `ROLLOUT_TICK_S`) and the planner's (every `planner_interval_s`,
    `Settings.planner_interval_s`)."""

    def post(body: Mapping[str, Any], outcome: Outcome | None) -> None:
        for type_, reason, message in outcome.news() if outcome is not None else ():
            kube.post_event(body, type_, reason, message)

    def fresh(key: tuple[str, str], uid: object) -> Mapping[str, Any] | None:
        """The deployment as the store has it once the step holds its key: the clock read it earlier, and a
        spec reconcile the step waited for may have applied a newer spec, which reconciling the older one
        would undo until the next tick. None once it is gone, being deleted, or another of its name."""
        current = observed.deployment(*key)
        if current is None or current["metadata"].get("deletionTimestamp"):
            return None
        return current if current["metadata"].get("uid") == uid else None

    def advance_rollout(body: Mapping[str, Any]) -> None:
        """Nothing in the spec changes when the new revision becomes routable or a drain ends, and no
        child's event runs a reconcile."""
        metadata = body["metadata"]
        key = (metadata["namespace"], metadata["name"])
        with refresh.holding(key):
            current = fresh(key, metadata.get("uid"))
            outcome = reconcile(kube, current, installation, observed) if current is not None else None
        post(body, outcome)

    def plan_replicas(body: Mapping[str, Any]) -> None:
        """Read the routers' (and engines') pages asked for at the last tick and ask for the next (on the
        scraper's thread: this one never waits on a pod), let the planner set each role's target in the
        status, and reconcile when a count moved or a scale-down's drain is under way."""
        metadata = body["metadata"]
        key = (metadata["namespace"], metadata["name"])
        with refresh.holding(key):
            current = fresh(key, metadata.get("uid"))
            memory, scraper = planners.of(key), planners.scraper
            outcome = plan_tick(kube, current, installation, observed, memory, scraper) if current else None
        post(body, outcome)

    return [
        Tick("rollout", ROLLOUT_TICK_S, rolling_out, advance_rollout),
        Tick("planner", planner_interval_s, planned, plan_replicas),
    ]
