"""`converge.decide`: what a reconcile does, decided from what it read, with no cluster."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from built import OWNER
from dd_specs import spec

from disagg.operator import converge
from disagg.operator.naming import Installation
from disagg.operator.policies.compat import evaluate
from disagg.operator.scaling.retire import UNKNOWN

NOW = datetime(2026, 12, 7, 9, 0, tzinfo=UTC)
INSTALLED = Installation(worker_image="w:1")


def decide(children: list[dict[str, Any]], *, unborn: bool, news: bool) -> converge.Decision:
    model = spec()
    seen = converge.Seen(unborn, news, children, [], {}, NOW)
    return converge.decide(model, evaluate(model), OWNER, INSTALLED, seen, UNKNOWN)


def test_a_new_deployment_is_announced_with_what_the_waves_create_and_prunes_nothing() -> None:
    decision = decide([], unborn=True, news=True)
    assert decision.announce is not None
    announced = {(w.kind, w.name) for w in decision.announce}
    workloads = {(o["kind"], o["metadata"]["name"]) for o in decision.waves[2]}
    assert announced == workloads and not any(w.settled for w in decision.announce)
    assert decision.prune == [] and decision.drain == () and decision.undrain == ()


def test_the_waves_put_bindings_after_what_they_bind_and_workloads_last() -> None:
    first, bindings, workloads = decide([], unborn=True, news=True).waves
    assert {o["kind"] for o in bindings} == {"RoleBinding"}
    assert {o["kind"] for o in workloads} == {"StatefulSet", "Deployment"}
    assert not {o["kind"] for o in first} & {"RoleBinding", "StatefulSet", "Deployment"}


def test_a_child_the_spec_no_longer_wants_is_pruned_and_a_known_verdict_not_announced() -> None:
    stale = {"kind": "Service", "metadata": {"name": "gemma-pp2-prefill-1", "resourceVersion": "7"}}
    decision = decide([stale], unborn=False, news=False)
    assert decision.announce is None
    assert decision.prune == [("Service", "gemma-pp2-prefill-1")]
    assert decision.existing == {("Service", "gemma-pp2-prefill-1"): "7"}


def test_a_generation_1_deployment_without_conditions_can_own_no_child_yet() -> None:
    assert converge.unborn({}, 1)
    assert not converge.unborn({}, 2)
    assert not converge.unborn({"conditions": [{"type": "Compatible"}]}, 1)
    compatible = {"conditions": [{"type": "Compatible", "status": "True", "observedGeneration": 3}]}
    assert not converge.verdict_is_news(compatible, 3)
    assert converge.verdict_is_news(compatible, 4)
