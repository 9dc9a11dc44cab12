"""A scale-down through the drain: which replicas are marked, when each is done (idle after the grace, or the
drain bound), which pods are deleted and which count is built; and the reconcile's steps from the pods."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from dd_specs import VALID_EXAMPLE, load

from disagg.operator.api import DisaggDeploymentSpec
from disagg.operator.converge import sized
from disagg.operator.naming import Owner
from disagg.operator.rollout import Rollout
from disagg.operator.scaling import retire, targets
from disagg.operator.scaling.retire import GRACE_S, Busy, Member
from disagg.operator.scaling.steps import members, scale_steps
from disagg.operator.status import Workload

T0 = datetime(2026, 1, 1, tzinfo=UTC)
DRAIN_S = 600.0


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def pod(name: str, since: float | None = None) -> Member:
    marked = (name,) if since is not None else ()
    return Member(name, 0, (name,), marked, None if since is None else at(since))


def test_decode_marks_first_and_deletes_only_when_idle() -> None:
    pods = [pod("d-a"), pod("d-b"), pod("d-c")]
    first = retire.decode(2, 3, pods, Busy(), T0, DRAIN_S)
    # One pod to go: marked, nothing deleted, the count stays until it is done.
    assert (first.replicas, first.drain, first.delete) == (3, ("d-c",), ())
    marked = [pod("d-a"), pod("d-b"), pod("d-c", 0)]
    busy = retire.decode(2, 3, marked, Busy(frozenset({"d-c"}), at(10)), at(10), DRAIN_S)
    assert (busy.replicas, busy.delete, busy.waiting) == (3, (), ("d-c",))
    # Idle, but the routers' word predates the grace after the mark: not yet.
    early = retire.decode(2, 3, marked, Busy(frozenset(), at(GRACE_S - 1)), at(GRACE_S - 1), DRAIN_S)
    assert early.delete == ()
    idle = retire.decode(2, 3, marked, Busy(frozenset(), at(10)), at(10), DRAIN_S)
    # Deleted exactly, with the count lowered by as many in the same step.
    assert (idle.replicas, idle.delete, idle.drain) == (2, ("d-c",), ())


def test_decode_without_the_routers_word_waits_for_the_drain_bound() -> None:
    marked = [pod("d-a"), pod("d-b", 0)]
    assert retire.decode(1, 2, marked, Busy(), at(DRAIN_S - 1), DRAIN_S).delete == ()
    assert retire.decode(1, 2, marked, Busy(), at(DRAIN_S), DRAIN_S).delete == ("d-b",)


def test_decode_pods_not_created_yet_go_first_and_a_count_back_up_unmarks() -> None:
    # Four in the count, three pods: the missing one goes without touching a serving pod.
    step = retire.decode(3, 4, [pod("d-a"), pod("d-b"), pod("d-c")], Busy(), T0, DRAIN_S)
    assert (step.replicas, step.drain, step.delete) == (3, (), ())
    back = retire.decode(3, 3, [pod("d-a"), pod("d-b"), pod("d-c", 0)], Busy(), at(1), DRAIN_S)
    assert (back.replicas, back.undrain) == (3, ("d-c",))
    # Down by one while two are marked: the earlier mark is kept, the other taken back.
    two = retire.decode(2, 3, [pod("d-a"), pod("d-b", 5), pod("d-c", 0)], Busy(), at(6), DRAIN_S)
    assert (two.drain, two.undrain, two.waiting) == ((), ("d-b",), ("d-c",))


def engine(index: int, since: float | None = None) -> Member:
    pods = (f"x-prefill-{index}-0", f"x-prefill-{index}-1")
    return Member(
        f"x-prefill-{index}",
        index,
        pods,
        pods if since is not None else (),
        None if since is None else at(since),
    )


def test_prefill_drains_the_highest_engines_and_prunes_them_from_the_top() -> None:
    engines = [engine(0), engine(1), engine(2)]
    first = retire.prefill(1, 3, engines, Busy(), T0, DRAIN_S)
    assert first.replicas == 3
    assert first.drain == ("x-prefill-1-0", "x-prefill-1-1", "x-prefill-2-0", "x-prefill-2-1")
    marked = [engine(0), engine(1, 0), engine(2, 0)]
    # Engine 1 idle, engine 2 busy: nothing can go yet (2 is above 1).
    step = retire.prefill(1, 3, marked, Busy(frozenset({"x-prefill-2"}), at(10)), at(10), DRAIN_S)
    assert (step.replicas, step.waiting) == (3, ("x-prefill-2",))
    # Engine 2 idle, engine 1 busy: 2 goes, 1 stays.
    step = retire.prefill(1, 3, marked, Busy(frozenset({"x-prefill-1"}), at(10)), at(10), DRAIN_S)
    assert (step.replicas, step.waiting) == (2, ("x-prefill-1",))
    done = retire.prefill(1, 3, marked, Busy(frozenset(), at(10)), at(10), DRAIN_S)
    assert (done.replicas, done.drain) == (1, ())


def spec(**decode: Any) -> DisaggDeploymentSpec:
    document = load(VALID_EXAMPLE)
    document["spec"]["decode"].update(decode)
    return DisaggDeploymentSpec.model_validate(document["spec"])


AUTOSCALED = {"replicas": 1, "autoscaling": {"maxReplicas": 3, "target": {"runningRequests": 2}}}


def test_targets_come_from_the_status_within_the_bounds() -> None:
    autoscaled = spec(**AUTOSCALED)
    assert targets.target(autoscaled, "decode", None) == 1
    assert targets.target(autoscaled, "decode", {"decode": {"desiredReplicas": 3}}) == 3
    assert targets.target(autoscaled, "decode", {"decode": {"desiredReplicas": 9}}) == 3
    fixed = spec(replicas=2)
    assert targets.target(fixed, "decode", {"decode": {"desiredReplicas": 3}}) == 2
    external = spec(autoscaling={"mode": "external"})
    assert targets.target(external, "decode", None) is None
    assert targets.with_replicas(autoscaled, {"decode": 3}).decode.replicas == 3
    assert targets.selector("x", "decode") == "app.kubernetes.io/instance=x,disagg.io/role=decode"


def decode_pod(name: str, **annotations: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {"disagg.io/role": "decode", "disagg.io/deployment": "x"},
            "annotations": annotations,
        },
        "spec": {"containers": []},
        "status": {"podIP": "10.0.0.9"},
    }


def deployment(desired: int, slot: str = "a") -> Workload:
    return Workload("Deployment", "x-decode", "decode", desired, desired, desired, desired, True, 1, slot)


def test_the_steps_read_the_pods_and_skip_a_rollout() -> None:
    owner = Owner("x", "ns", "uid", 1)
    three = targets.with_replicas(spec(**AUTOSCALED), {"decode": 2})
    pods = [
        decode_pod("x-decode-1"),
        decode_pod("x-decode-2", **{"disagg.io/draining": "2026-01-01T00:00:00Z"}),
        {
            **decode_pod("x-decode-3"),
            "metadata": {**decode_pod("x-decode-3")["metadata"], "deletionTimestamp": "t"},
        },
    ]
    found = members(pods, "decode", owner, "a", 3)
    assert [(m.name, m.marked) for m in found] == [("x-decode-1", ()), ("x-decode-2", ("x-decode-2",))]
    steps = scale_steps(three, owner, [deployment(3)], pods, "a", False, Busy(frozenset(), at(30)), at(30))
    # Three in the count, two live pods (one terminating): the count drops to 2 with no pod touched.
    assert (steps.spec.decode.replicas, steps.delete) == (2, ())
    one = targets.with_replicas(spec(**AUTOSCALED), {"decode": 1})
    steps = scale_steps(one, owner, [deployment(2)], pods, "a", False, Busy(frozenset(), at(30)), at(30))
    assert (steps.spec.decode.replicas, steps.delete) == (1, ("x-decode-2",))
    rolling = scale_steps(one, owner, [deployment(2)], pods, "a", True, Busy(frozenset(), at(30)), at(30))
    assert (rolling.spec.decode.replicas, rolling.delete) == (1, ())


def test_a_scale_down_builds_its_held_count_and_a_rollout_step_its_own() -> None:
    owner = Owner("x", "ns", "uid", 1)
    one = targets.with_replicas(spec(**AUTOSCALED), {"decode": 1})
    pods = [decode_pod("x-decode-1"), decode_pod("x-decode-2")]
    busy = Busy(frozenset({"x-decode-1", "x-decode-2"}), at(0))
    steps = scale_steps(one, owner, [deployment(2)], pods, "a", False, busy, at(0))
    # The target is 1: one pod is marked, and the count stays at 2 until it is done.
    assert (steps.spec.decode.replicas, steps.drain) == (2, ("x-decode-2",))
    # What `rollout.assess` says when the revision is all there is: its sizes are the targets, (1, 1).
    alone = Rollout("r1", "a", replicas={"r1": (1, 1)})
    assert sized(steps.spec, alone).decode.replicas == 2
    stepping = Rollout("r2", "b", old_revision="r1", old_slot="a", replicas={"r2": (1, 1), "r1": (1, 2)})
    assert sized(steps.spec, stepping).decode.replicas == 1
