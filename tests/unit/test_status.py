"""The DisaggDeployment status computed from the spec's verdict, the observed workloads and the sidecars."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from dd_specs import DELETE, spec
from test_pairing import D1, D2, STAGES, annotate, healthy, report, verdict

from disagg.operator import conditions as cond
from disagg.operator.api import ConditionStatus, DisaggDeploymentStatus, EngineKind
from disagg.operator.kv_status import PodKV, peers_reported
from disagg.operator.policies.compat import evaluate
from disagg.operator.status import Workload, compute, incompatibility_message, to_json, workload
from disagg.worker.contracts.pairing import routing_from_pods
from disagg.worker.kv.errors import Violation

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)


def sts(ready: int, generation: int = 1, settled: bool = True) -> Workload:
    return Workload("StatefulSet", "g-prefill-0", "prefill", 2, 2, ready, 2, settled, generation)


def deploy(ready: int, generation: int = 1) -> Workload:
    return Workload("Deployment", "g-decode", "decode", 2, 2, ready, 2, True, generation)


def status_of(
    workloads: list[Workload],
    violations: tuple[Violation, ...] = (),
    pods: tuple[PodKV, ...] = (),
    generation: int = 1,
    previous: DisaggDeploymentStatus | None = None,
    now: datetime = T0,
    engine_pods: Sequence[dict[str, Any]] = (),
) -> DisaggDeploymentStatus:
    return compute(
        generation=generation,
        previous=(previous.conditions or []) if previous else [],
        violations=violations,
        report=evaluate(spec()),
        workloads=workloads,
        pods=list(pods),
        routing=routing_from_pods(engine_pods),
        reported=peers_reported(engine_pods),
        now=now,
    )


def by_type(status: DisaggDeploymentStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status.value, c.reason) for c in status.conditions or []}


def test_fresh_compatible_deployment_is_being_created() -> None:
    status = status_of([sts(0), deploy(0)])
    assert by_type(status) == {
        "Compatible": ("True", "Compatible"),
        "Available": ("False", "AwaitingPods"),
        "Progressing": ("True", "Creating"),
        "KVTransferReady": ("Unknown", "NoPods"),
        "Routable": ("Unknown", "NoPairs"),
    }
    assert status.routable_pairs == "0/0"
    assert status.observed_generation == 1
    assert status.prefill is not None and status.prefill.replicas == 2
    assert status.topology is not None and len(status.topology.stages) == 2


def test_a_compatible_spec_without_engine_resources_says_what_the_operator_generated() -> None:
    bare = spec({"prefill": {"resources": DELETE}, "decode": {"resources": DELETE}})
    status = compute(
        generation=1,
        previous=[],
        violations=(),
        report=evaluate(bare),
        workloads=[],
        pods=[],
        routing=routing_from_pods([]),
        reported=False,
        now=T0,
    )
    (compatible,) = [c for c in status.conditions or [] if c.type == "Compatible"]
    assert compatible.reason == "Compatible"
    assert "Note: spec.prefill.resources and spec.decode.resources request no cpu and memory" in (
        compatible.message or ""
    )
    # The example's roles limit their GPUs: nothing to say of their resources.
    assert "request no cpu" not in by_type_message(status_of([sts(0), deploy(0)]), "Compatible")


def by_type_message(status: DisaggDeploymentStatus, kind: str) -> str:
    return next(c.message or "" for c in status.conditions or [] if c.type == kind)


def test_everything_ready_is_available_and_done() -> None:
    ok = PodKV("g-prefill-0-0", "prefill", 0, ConditionStatus.TRUE, "HandshakesSucceeded", "")
    status = status_of([sts(2), deploy(2)], pods=(ok,))
    assert by_type(status)["Available"] == ("True", "AllReplicasReady")
    assert by_type(status)["Progressing"] == ("False", "RolloutComplete")
    assert by_type(status)["KVTransferReady"] == ("True", "HandshakesSucceeded")


def test_workloads_of_an_older_generation_are_still_progressing() -> None:
    status = status_of([sts(2, generation=1), deploy(2, generation=1)], generation=2)
    assert by_type(status)["Progressing"] == ("True", "RollingOut")
    # Unsettled workloads of this generation: still the creation until it first completes, a rollout after.
    unsettled = status_of([sts(2, settled=False), deploy(2)])
    assert by_type(unsettled)["Progressing"] == ("True", "Creating")
    creating = status_of([sts(2, settled=False), deploy(2)], previous=unsettled)
    assert by_type(creating)["Progressing"] == ("True", "Creating")
    complete = status_of([sts(2), deploy(2)])
    assert by_type(complete)["Progressing"] == ("False", "RolloutComplete")
    after = status_of([sts(2, settled=False), deploy(2)], previous=complete)
    assert by_type(after)["Progressing"] == ("True", "RollingOut")


def test_incompatible_create_names_every_rule() -> None:
    violations = (
        Violation("DecodePipelineParallel", "decode PP is 2"),
        Violation("BlockSizeMismatch", "32 vs 16"),
    )
    status = status_of([], violations)
    compatible = cond.find(status.conditions or [], "Compatible")
    assert compatible is not None
    assert (compatible.status, compatible.reason) == (ConditionStatus.FALSE, "DecodePipelineParallel")
    assert compatible.message == "DecodePipelineParallel: decode PP is 2; BlockSizeMismatch: 32 vs 16"
    assert compatible.message == incompatibility_message(violations)
    assert by_type(status)["Available"] == ("False", "Incompatible")
    assert by_type(status)["Progressing"] == ("False", "SpecRefused")


def test_incompatible_update_says_the_running_objects_stay() -> None:
    running = status_of([sts(2), deploy(2)])
    refused = status_of(
        [sts(2), deploy(2)],
        (Violation("BlockSizeMismatch", "32 vs 16"),),
        generation=2,
        previous=running,
        now=T0 + timedelta(minutes=1),
    )
    compatible = cond.find(refused.conditions or [], "Compatible")
    assert compatible is not None and compatible.message.endswith(
        "The running objects from generation 1 were left unchanged."
    )
    assert compatible.last_transition_time == T0 + timedelta(minutes=1)
    # Available did not flip, so its transition time is the first one.
    available = cond.find(refused.conditions or [], "Available")
    assert available is not None and available.last_transition_time == T0


def test_json_is_what_the_api_server_stores() -> None:
    rendered = to_json(status_of([sts(0), deploy(0)]))
    assert rendered["observedGeneration"] == 1
    assert {c["type"] for c in rendered["conditions"]} == {
        "Compatible",
        "Available",
        "Progressing",
        "KVTransferReady",
        "Routable",
    }
    assert all(c["lastTransitionTime"] == "2026-11-30T09:00:00Z" for c in rendered["conditions"])
    assert "phase" not in rendered


def test_workload_reads_apps_v1_status() -> None:
    observed = workload(
        {
            "kind": "StatefulSet",
            "metadata": {
                "name": "g-prefill-0",
                "generation": 3,
                "labels": {"app.kubernetes.io/component": "prefill"},
                "annotations": {"disagg.io/generation": "2"},
            },
            "spec": {"replicas": 2},
            "status": {"observedGeneration": 3, "replicas": 2, "readyReplicas": 1, "updatedReplicas": 2},
        }
    )
    assert observed == Workload("StatefulSet", "g-prefill-0", "prefill", 2, 2, 1, 2, True, 2)
    assert not observed.done


def test_routable_counts_the_pairs_and_flips_only_when_no_pair_is_left() -> None:
    # The same pods and reports the router pairs by (`test_pairing`): PP2 prefill, two decoders.
    pods = healthy()
    before = status_of([sts(2), deploy(2)], engine_pods=list(pods.values()))
    routable = cond.find(before.conditions or [], "Routable")
    assert routable is not None
    assert (routable.status, routable.reason) == (ConditionStatus.TRUE, "PairsRoutable")
    assert routable.message == "2 of 2 prefill/decode pairs routable"
    assert (before.routable_pairs, routable.observed_generation) == ("2/2", 1)

    mismatch = "CompatibilityHashMismatch"
    annotate(pods, D2, report(D2, *(verdict(s, ok=False, reason=mismatch) for s in STAGES)))
    later = T0 + timedelta(minutes=1)
    degraded = status_of([sts(2), deploy(2)], engine_pods=list(pods.values()), previous=before, now=later)
    routable = cond.find(degraded.conditions or [], "Routable")
    assert routable is not None
    assert (routable.status, routable.reason) == (ConditionStatus.TRUE, "PairsRoutable")
    assert routable.message.startswith(
        f"1 of 2 prefill/decode pairs routable; excluded: {STAGES[0]} \u2194 {D2}: {mismatch}: prefill engine"
    )
    assert degraded.routable_pairs == "1/2"
    assert routable.last_transition_time == T0, "still True: the transition time stays"

    annotate(pods, D1, report(D1, verdict(STAGES[0]), verdict(STAGES[1], ok=False, reason="MissingLayers")))
    latest = T0 + timedelta(minutes=2)
    broken = status_of([sts(2), deploy(2)], engine_pods=list(pods.values()), previous=degraded, now=latest)
    routable = cond.find(broken.conditions or [], "Routable")
    assert routable is not None
    assert (routable.status, routable.reason) == (ConditionStatus.FALSE, "NoRoutablePair")
    assert routable.message.startswith("0 of 2 prefill/decode pairs routable; excluded: ")
    assert f"{D1}: MissingLayers" in routable.message and f"{D2}: {mismatch}" in routable.message
    assert routable.last_transition_time == latest
    assert broken.routable_pairs == "0/2"


def test_routable_is_unknown_until_a_pod_reports_and_false_after() -> None:
    pods = healthy()
    for name in pods:
        annotate(pods, name, None)
    waiting = status_of([sts(2), deploy(2)], engine_pods=list(pods.values()))
    assert by_type(waiting)["Routable"] == ("Unknown", "AwaitingPeerReports")
    assert waiting.routable_pairs == "0/2"
    annotate(pods, D1, report(D1, *(verdict(s) for s in STAGES)))
    assert by_type(status_of([sts(2), deploy(2)], engine_pods=list(pods.values())))["Routable"] == (
        "False",
        "NoRoutablePair",
    )


def test_a_rollout_says_where_it_is_and_readiness_follows_the_revision_that_serves() -> None:
    from disagg.operator.rollout import DRAINING_OLD, STUCK, WAITING, Rollout

    old = [Workload("StatefulSet", "g-prefill-0", "prefill", 2, 2, 2, 2, True, 1, "a", "r1")]
    old.append(Workload("Deployment", "g-decode", "decode", 2, 2, 2, 2, True, 1, "a", "r1"))
    new = [Workload("StatefulSet", "g-b-prefill-0", "prefill", 2, 2, 0, 2, True, 2, "b", "r2")]
    new.append(Workload("Deployment", "g-b-decode", "decode", 2, 2, 0, 2, True, 2, "b", "r2"))

    def at(phase: str) -> DisaggDeploymentStatus:
        rollout = Rollout(
            "r2",
            "b",
            "r1",
            "a",
            phase,
            f"{phase} message",
            True,
            pairs={"r1": 2},
            replicas={"r2": (1, 2), "r1": (1, 1)},
        )
        return compute(
            generation=2,
            previous=[],
            violations=(),
            report=evaluate(spec()),
            workloads=old + new,
            pods=[],
            routing=routing_from_pods(()),
            reported=False,
            now=T0,
            rollout=rollout,
        )

    waiting = at(WAITING)
    assert by_type(waiting)["Progressing"] == ("True", WAITING)
    # The old revision serves, so the deployment is available while the new one comes up.
    assert by_type(waiting)["Available"] == ("True", "AllReplicasReady")
    assert (waiting.revision, waiting.old_revision) == ("r2", "r1")
    assert [
        (r.revision, r.slot, r.routable_pairs, r.prefill_replicas, r.decode_replicas)
        for r in waiting.revisions or ()
    ] == [("r2", "b", 0, 1, 2), ("r1", "a", 2, 1, 1)]
    assert by_type(at(STUCK))["Progressing"] == ("False", STUCK)
    draining = at(DRAINING_OLD)
    assert by_type(draining)["Progressing"] == ("True", DRAINING_OLD)
    # Steps drain the old revision a few engines at a time: its workloads, at the size the steps left
    # them, and the new revision's that are up are what serves; a new one still starting is its step's.
    assert by_type(draining)["Available"] == ("True", "AllReplicasReady")
    assert to_json(draining)["oldRevision"] == "r1"


def test_each_role_shows_its_target_and_selector_and_scaling_goes_with_autoscaling() -> None:
    scaling = cond.desired(cond.SCALING, ConditionStatus.TRUE, "ScaledUp", "decode: 1 -> 2", T0)
    previous = DisaggDeploymentStatus(conditions=[scaling])

    def with_scaling(autoscaled: bool) -> DisaggDeploymentStatus:
        return compute(
            generation=1,
            previous=previous.conditions or [],
            violations=(),
            report=evaluate(spec()),
            workloads=[sts(2), deploy(2)],
            pods=[],
            routing=routing_from_pods(()),
            reported=False,
            now=T0,
            desired={"prefill": 1, "decode": 2},
            selectors={"prefill": "p", "decode": "d"},
            scaling=autoscaled,
        )

    kept = with_scaling(True)
    assert kept.decode is not None and (kept.decode.desired_replicas, kept.decode.selector) == (2, "d")
    assert by_type(kept)["Scaling"] == ("True", "ScaledUp")
    assert "Scaling" not in by_type(with_scaling(False))


def test_each_role_says_which_engine_kind_it_was_built_as() -> None:
    status = compute(
        generation=1,
        previous=[],
        violations=(),
        report=evaluate(spec()),
        workloads=[sts(0), deploy(0)],
        pods=[],
        routing=routing_from_pods([]),
        reported=False,
        now=T0,
        engine_kinds={"prefill": EngineKind.VLLM, "decode": EngineKind.VLLM},
    )
    assert status.prefill is not None and status.decode is not None
    assert status.prefill.engine_kind is status.decode.engine_kind is EngineKind.VLLM
    assert to_json(status)["prefill"]["engineKind"] == "VLLM"
