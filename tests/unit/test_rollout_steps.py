"""`rollout_steps`: whole rollouts walked step by step, the bounds checked at every moment; no cluster.

A walk is the operator's timer loop in miniature: each tick `plan_step` reads the engines as they are, its
step is carried out (new engines made, which pair one tick later; old pods marked draining; drained engines
deleted, their pods terminating for a tick), and the bounds are checked right after, the moment with the
most pods and the fewest serving."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

import pytest

from disagg.operator.api import RolloutSpec
from disagg.operator.rollout_steps import (
    ROLES,
    OldEngine,
    RoleState,
    bounds,
    plan_step,
    progress,
    removal_order,
)

START = datetime(2026, 12, 2, 9, 0, 0, tzinfo=UTC)
TICK = timedelta(seconds=2)
DRAIN_S = 5
SIZES = {"prefill": 4, "decode": 6}


@dataclass
class Role:
    """One role in the walk: the new revision's engines (made, paired) and the old revision's."""

    role: str
    desired: int
    new: int = 0
    routable: int = 0
    old: list[OldEngine] = field(default_factory=list)
    removed: list[OldEngine] = field(default_factory=list)

    def state(self) -> RoleState:
        ranked = removal_order(self.role, list(enumerate(self.old)))
        return RoleState(self.desired, self.new, self.routable, ranked)

    def serving(self) -> int:
        return self.routable + sum(engine.serving for engine in self.old)


def serving_old(role: str, count: int) -> Role:
    stem = "p" if role == "prefill" else "d"
    pods = 2 if role == "prefill" else 1  # a PP2 prefill engine: two stage pods
    engines = [
        OldEngine(f"{stem}{k}", tuple(f"{stem}{k}-{s}" for s in range(pods)), serving=True)
        for k in range(count)
    ]
    return Role(role, count, old=engines)


def tick(roles: dict[str, Role], settings: RolloutSpec, now: datetime, *, frozen: bool = False) -> None:
    """Observe, plan, act: pods made last tick pair now; terminating pods are gone; the step is done."""
    for role in roles.values():
        role.routable = role.new
        role.old = [engine for engine in role.old if not engine.gone]
    steps = plan_step({name: role.state() for name, role in roles.items()}, settings, now, frozen=frozen)
    for name, role in roles.items():
        step = steps[name]
        marks = set(step.drain)
        gone = {engine.name for engine in step.remove}
        for engine in step.remove:
            assert engine.draining_since is None or now >= engine.draining_since + timedelta(
                seconds=settings.drain_seconds
            ), f"{engine.name} removed before its drain ended"
            assert engine.draining_since is not None or not engine.serving, f"{engine.name} served, undrained"
            role.removed.append(engine)
        role.old = [
            replace(engine, gone=True, serving=False)
            if engine.name in gone
            else replace(engine, draining_since=now, serving=False)
            if marks & set(engine.pods)
            else engine
            for engine in role.old
        ]
        assert step.new >= role.new
        role.new = step.new
        assert step.old == len([e for e in role.old if not e.gone])


def couple(roles: dict[str, Role]) -> None:
    """Old engines serve only in old pairs: with no old engine of the other role serving, none does."""
    if not all(any(e.serving for e in roles[name].old) for name in ROLES):
        for role in roles.values():
            role.old = [replace(e, serving=False) for e in role.old]


def check(roles: dict[str, Role], settings: RolloutSpec) -> None:
    for name, role in roles.items():
        bound = bounds(settings, role.desired)
        assert role.new + len(role.old) <= role.desired + bound.surge, f"{name}: surge bound broken"
        assert role.serving() >= role.desired - bound.unavailable, f"{name}: too few engines serve"
    new_pair = all(roles[name].routable >= 1 for name in ROLES)
    old_pair = all(any(e.serving for e in roles[name].old) for name in ROLES)
    assert new_pair or old_pair, "a moment without a routable pair"


def walk(
    roles: dict[str, Role], settings: RolloutSpec, *, ticks: int = 200, stop: int | None = None
) -> tuple[int, datetime]:
    now = START
    for count in range(ticks):
        if stop is not None and count == stop:
            return count, now
        tick(roles, settings, now)
        couple(roles)
        check(roles, settings)
        if all(
            role.new == role.desired and role.routable == role.new and not role.old for role in roles.values()
        ):
            return count, now
        now += TICK
    raise AssertionError(f"the rollout did not finish in {ticks} ticks: {roles}")


def fresh() -> dict[str, Role]:
    return {role: serving_old(role, count) for role, count in SIZES.items()}


@pytest.mark.parametrize(
    ("surge", "unavailable"),
    [(1, 0), (2, 0), ("25%", 0), (1, 1), ("25%", 1), (0, 1), ("100%", 0)],
)
def test_a_whole_rollout_holds_the_surge_and_availability_bounds_at_every_step(
    surge: int | str, unavailable: int | str
) -> None:
    settings = RolloutSpec(drain_seconds=DRAIN_S, max_surge=surge, max_unavailable=unavailable)
    roles = fresh()
    walk(roles, settings)
    for name, role in roles.items():
        # Every old engine went, each drained first (checked in `tick`), and only once.
        assert sorted(engine.name for engine in role.removed) == sorted(
            engine.name for engine in serving_old(name, SIZES[name]).old
        )


def test_a_smaller_surge_takes_more_steps_and_fewer_pods_at_the_peak() -> None:
    def peak(surge: int | str) -> tuple[int, int]:
        settings = RolloutSpec(drain_seconds=DRAIN_S, max_surge=surge)
        roles, most, now = fresh(), 0, START
        for count in range(200):
            tick(roles, settings, now)
            most = max(most, sum(r.new + len(r.old) for r in roles.values()))
            if all(r.new == r.desired and r.routable == r.new and not r.old for r in roles.values()):
                return count, most
            now += TICK
        raise AssertionError("unfinished")

    one, half, whole = peak(1), peak("50%"), peak("100%")
    assert one[1] == 10 + 2 and whole[1] == 20 and one[1] < half[1] < whole[1]
    assert one[0] > half[0] > whole[0]


def test_the_new_revision_grows_only_once_its_previous_step_pairs() -> None:
    settings = RolloutSpec(drain_seconds=DRAIN_S, max_surge=2)
    states = {role: RoleState(SIZES[role], 2, 1, tuple(serving_old(role, SIZES[role]).old)) for role in ROLES}
    steps = plan_step(states, settings, START)
    assert steps["decode"].new == 2 and steps["prefill"].new == 2
    # One new engine of each role serves: one old one of each may drain, none may go yet.
    assert len(steps["prefill"].drain) == 2 and len(steps["decode"].drain) == 1
    assert not steps["prefill"].remove and not steps["decode"].remove


def test_a_stuck_rollout_freezes_with_the_old_revision_serving() -> None:
    settings = RolloutSpec(drain_seconds=DRAIN_S, max_surge=1)
    roles = fresh()
    _, now = walk(roles, settings, stop=12)
    assert 0 < roles["decode"].new < SIZES["decode"]
    before = {
        name: (role.new, [e.name for e in role.old if e.draining_since is None])
        for name, role in roles.items()
    }
    # The sidecars report a hash mismatch within the new revision: its engines leave the pairs.
    for role in roles.values():
        role.routable = 0
    for _ in range(20):
        now += TICK
        steps = plan_step({n: r.state() for n, r in roles.items()}, settings, now, frozen=True)
        for name, role in roles.items():
            assert steps[name].new == role.new and not steps[name].drain
            assert {e.name for e in steps[name].remove} <= {
                e.name for e in role.old if e.draining_since is not None
            }
    # The old revision's undrained engines all still serve.
    for name, role in roles.items():
        assert [e.name for e in role.old if e.draining_since is None] == before[name][1]
        assert all(e.serving for e in role.old if e.draining_since is None)
    assert all(any(e.serving for e in roles[name].old) for name in ROLES)


def test_rolling_back_midway_walks_back_within_the_same_bounds() -> None:
    settings = RolloutSpec(drain_seconds=DRAIN_S, max_surge=1)
    roles = fresh()
    walk(roles, settings, stop=14)
    # The old spec again: the old revision's engines left (undrained, as the reconcile unmarks them) are
    # the spec's; the new revision's engines are the ones to replace.
    back: dict[str, Role] = {}
    for name, role in roles.items():
        kept = [e for e in role.old if not e.gone]
        stem = "p" if name == "prefill" else "d"
        pods = 2 if name == "prefill" else 1
        grown = [
            OldEngine(
                f"{stem}-new{k}", tuple(f"{stem}-new{k}-{s}" for s in range(pods)), serving=k < role.routable
            )
            for k in range(role.new)
        ]
        back[name] = Role(name, role.desired, new=len(kept), routable=len(kept), old=grown)
    check(back, settings)
    walk(back, settings)
    assert all(role.new == role.desired for role in back.values())


def test_bounds_round_a_surge_up_and_unavailability_down_and_never_both_to_zero() -> None:
    assert bounds(RolloutSpec(), 6) == bounds(RolloutSpec(max_surge="25%"), 6)
    assert (bounds(RolloutSpec(), 6).surge, bounds(RolloutSpec(), 6).unavailable) == (2, 0)
    assert bounds(RolloutSpec(max_surge=0, max_unavailable="25%"), 6).unavailable == 1
    assert bounds(RolloutSpec(max_surge="0%", max_unavailable="10%"), 4).surge == 1
    assert bounds(RolloutSpec(max_surge="100%"), 4).surge == 4


def test_both_bounds_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="maxSurge and maxUnavailable are both 0"):
        RolloutSpec.model_validate({"maxSurge": 0, "maxUnavailable": "0%"})
    with pytest.raises(ValueError, match="percentage"):
        RolloutSpec.model_validate({"maxSurge": "120%"})


def test_removal_order_takes_the_highest_prefill_replica_and_idle_decoders_first() -> None:
    prefills = [(k, OldEngine(f"d-prefill-{k}", serving=True)) for k in (0, 2, 1)]
    assert [e.name for e in removal_order("prefill", prefills)] == [
        "d-prefill-2",
        "d-prefill-1",
        "d-prefill-0",
    ]
    decoders = [
        (0, OldEngine("d-decode-a", serving=True)),
        (1, OldEngine("d-decode-b", serving=False)),
        (2, OldEngine("d-decode-c", serving=True)),
        (3, OldEngine("")),
    ]
    assert [e.name for e in removal_order("decode", decoders)] == [
        "",
        "d-decode-b",
        "d-decode-c",
        "d-decode-a",
    ]


def test_progress_says_the_step() -> None:
    settings = RolloutSpec(max_surge=2)
    states = {"prefill": RoleState(4, 4, 4), "decode": RoleState(6, 4, 2)}
    assert progress(states, settings, "r2") == (
        "step 2 of 3: 4/4 prefill engines and 2/6 decoders of revision r2 routable"
    )
