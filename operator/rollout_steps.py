"""The steps of a rollout: how many engines each slot runs next, which old ones drain, which go. Pure.

Counted per role in engines: a prefill engine is one StatefulSet (its pipeline stages' pods together, useless
without every stage), a decode engine is one pod. `spec.rollout.maxSurge` and `maxUnavailable` bound each
role: never more than `desired + surge` engines of a role exist (the old revision's, draining or
terminating ones included), and an old engine leaves service (is marked draining) only while at least
`desired - unavailable` engines of the role, and one routable pair, still serve without it.

Each call is one level-based step from what the cluster shows (`RoleState`): the new revision grows only
once every engine of its previous step is in a routable pair; old engines are drained before they are
removed (once idle, or `drainSeconds` after the mark; one that serves nothing is removed at once); a
rollout that is stuck grows and drains nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from disagg.operator.api import RolloutSpec

ROLES: Final = ("prefill", "decode")
NOUNS: Final = {"prefill": "prefill engines", "decode": "decoders"}


@dataclass(frozen=True)
class OldEngine:
    """An engine of the revision being replaced. `name`: a prefill engine's StatefulSet, a decode pod
    ("" for a pod its Deployment counts but has not made yet); `pods`: what a drain marks."""

    name: str
    pods: tuple[str, ...] = ()
    serving: bool = False
    """In a routable pair now (a draining engine never is)."""
    draining_since: datetime | None = None
    idle: bool = False
    """Draining, and its engine reported nothing in flight since (a grace after) the mark."""
    gone: bool = False
    """Deleted, its pods still terminating: it counts toward the surge and is removed already."""


@dataclass(frozen=True)
class RoleState:
    """One role as the cluster shows it: `new` engines of the spec's revision (its workloads' replicas),
    `routable` of them in a routable pair, the old revision's engines in removal order (`removal_order`)."""

    desired: int
    new: int
    routable: int
    old: tuple[OldEngine, ...] = ()


@dataclass(frozen=True)
class RoleStep:
    """What to do now: run `new` engines of the spec's revision, mark the pods `drain` draining, remove the
    engines `remove`; `old` engines of the old revision are left once they are gone."""

    new: int
    drain: tuple[str, ...] = ()
    remove: tuple[OldEngine, ...] = ()
    old: int = 0


@dataclass(frozen=True)
class Bounds:
    surge: int
    unavailable: int


def _scaled(value: int | str, desired: int, *, up: bool) -> int:
    if isinstance(value, int):
        return value
    share = desired * int(value.rstrip("%")) / 100
    return math.ceil(share) if up else math.floor(share)


def bounds(settings: RolloutSpec, desired: int) -> Bounds:
    """maxSurge and maxUnavailable in engines of a role of `desired` replicas, as a Deployment's: a
    percentage of surge rounds up, of unavailability down. Two that come to 0 (the spec refuses two that
    say 0) allow a surge of one, so a rollout always moves without taking an engine out of service first."""
    surge = _scaled(settings.max_surge, desired, up=True)
    unavailable = _scaled(settings.max_unavailable, desired, up=False)
    if surge == 0 and unavailable == 0:
        surge = 1
    return Bounds(surge, unavailable)


def removal_order(role: str, engines: Sequence[tuple[int, OldEngine]]) -> tuple[OldEngine, ...]:
    """Which old engines go first, given each with its rank (a prefill engine's replica index, a decode
    pod's position by name). Prefill: the highest index first, as a StatefulSet scales down, so the engines
    left are always 0..n-1 (what the builders would make of that slot again, after a rollback). Decode: the
    pods that serve nothing first (not made yet, not ready, not paired: nothing to drain), then the highest
    rank; the Deployment's own choice on a scale-down is never relied on (see `plan_step`'s caller)."""
    if role == "prefill":
        return tuple(engine for _, engine in sorted(engines, key=lambda item: -item[0]))
    return tuple(engine for _, engine in sorted(engines, key=lambda item: (item[1].serving, -item[0])))


def plan_step(
    states: Mapping[str, RoleState], settings: RolloutSpec, now: datetime, *, frozen: bool = False
) -> dict[str, RoleStep]:
    """The next step for every role in `ROLES`. `frozen`: the rollout is stuck; the new revision does not
    grow and no old engine is taken out of service (drains already done still end in removal)."""
    needs = {role: _needed(states[role], settings) for role in ROLES}
    # Old engines serve only in old pairs: while the new revision has no pair, or any role still needs old
    # engines, every role keeps one old engine serving (the last old prefill engine drained would leave
    # the old decoders with nothing to pair with).
    keep_pair = not all(states[role].routable >= 1 for role in ROLES) or any(needs.values())
    return {
        role: _role_step(states[role], settings, now, frozen, max(needs[role], int(keep_pair)))
        for role in ROLES
    }


def _needed(state: RoleState, settings: RolloutSpec) -> int:
    """Old engines of a role that must keep serving: the floor maxUnavailable sets, less the new ones."""
    return max(0, state.desired - bounds(settings, state.desired).unavailable - state.routable)


def _role_step(state: RoleState, settings: RolloutSpec, now: datetime, frozen: bool, need: int) -> RoleStep:
    bound = bounds(settings, state.desired)
    drain_for = timedelta(seconds=settings.drain_seconds)
    live = [engine for engine in state.old if not engine.gone]
    done = [
        e for e in live if e.draining_since is not None and (e.idle or now >= e.draining_since + drain_for)
    ]
    active = [engine for engine in live if engine.draining_since is None]
    # Grow only once the previous step's engines pair; count every old engine that still has pods.
    new = min(state.new, state.desired)
    if not frozen and state.routable >= state.new:
        room = state.desired + bound.surge - len(state.old)
        new = max(new, min(state.desired, room))
    drained: list[OldEngine] = []
    if not frozen:
        left, serving = len(active), sum(engine.serving for engine in active)
        for engine in active:
            if left <= need or (engine.serving and serving - 1 < need):
                break
            drained.append(engine)
            left -= 1
            serving -= engine.serving
    marks = tuple(pod for engine in drained if engine.serving for pod in engine.pods)
    remove = tuple(done) + tuple(engine for engine in drained if not engine.serving)
    return RoleStep(new=new, drain=marks, remove=remove, old=len(live) - len(remove))


def steps_of(states: Mapping[str, RoleState], settings: RolloutSpec) -> tuple[int, int]:
    """(this step, all steps): a step adds up to surge + unavailable engines of each role."""

    def count(engines: int, role: str) -> int:
        state = states[role]
        bound = bounds(settings, state.desired)
        return math.ceil(engines / max(1, bound.surge + bound.unavailable))

    total = max(count(states[role].desired, role) for role in ROLES)
    current = max(count(states[role].new, role) for role in ROLES)
    return max(1, min(current, total)), max(1, total)


def progress(states: Mapping[str, RoleState], settings: RolloutSpec, revision: str) -> str:
    """ "step 2 of 4: 1/4 prefill engines and 2/6 decoders of revision R routable" """
    step, total = steps_of(states, settings)
    roles = " and ".join(f"{states[role].routable}/{states[role].desired} {NOUNS[role]}" for role in ROLES)
    return f"step {step} of {total}: {roles} of revision {revision} routable"
