"""How a role goes from n replicas to fewer without cutting a request in flight. Pure.

The replicas that will go are marked draining first (`pod_contract.DRAINING_ANNOTATION`: the router pairs
no draining pod, so it sends them nothing new). A replica is done when the routers report no leg in flight
on it (`signals.Sample.busy`, read at least `GRACE_S` after the mark, so every router has seen the mark
before its word counts), or when the drain bound (`spec.rollout.drainSeconds`) has passed. Then:

- prefill: each replica is a StatefulSet, `<name>-prefill-<i>`, and a lower count drops the highest `i`:
  those are the ones marked, and the count built drops past each one once it and every one above it are
  done (the reconcile prunes what is not built).
- decode: one Deployment. Its ReplicaSet picks for itself which pods a lower count removes, so the planner
  picks them: it deletes exactly the done pods and lowers the count by as many in the same step. The
  ReplicaSet replaces a deleted pod until it sees the lower count, and a pending or unready pod is the
  first it removes on a scale-down: the replacement goes, never a serving pod.

A count that goes back up before the drain ends keeps its replicas: their marks are removed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final

# How long after a mark the routers' word that a replica is idle counts: the router watches pods, and a
# request it routed just before it saw the mark may not be in flight yet when the mark is a moment old.
GRACE_S: Final = 5.0


@dataclass(frozen=True)
class Member:
    """One replica as the cluster shows it: a decode pod, or a prefill engine and its stage pods."""

    name: str
    """What the routers count legs by: the decode pod's name, the prefill engine's id (its StatefulSet)."""
    index: int
    """A prefill engine's replica number; 0 for a decode pod."""
    pods: tuple[str, ...]
    marked: tuple[str, ...] = ()
    """Its pods that carry the drain mark."""
    since: datetime | None = None
    """When its first pod was marked."""


@dataclass(frozen=True)
class Busy:
    """What the routers said: the replicas with a leg in flight, and when they said it (None: unknown)."""

    names: frozenset[str] | None = None
    at: datetime | None = None


UNKNOWN: Final = Busy()
"""No router was asked: only the drain bound ends a drain."""


@dataclass(frozen=True)
class Retirement:
    replicas: int
    """The count to build now."""
    drain: tuple[str, ...] = ()
    """Pods to mark draining now."""
    undrain: tuple[str, ...] = ()
    """Pods whose mark goes (the count went back up)."""
    delete: tuple[str, ...] = ()
    """Pods to delete in the same step as `replicas` (decode)."""
    waiting: tuple[str, ...] = ()
    """Replicas draining and not done yet."""


def _done(member: Member, busy: Busy, now: datetime, drain_s: float) -> bool:
    if member.since is None:
        return False
    if (now - member.since).total_seconds() >= drain_s:
        return True
    return (
        busy.names is not None
        and busy.at is not None
        and (busy.at - member.since).total_seconds() >= GRACE_S
        and member.name not in busy.names
    )


def _unmarked(members: Sequence[Member]) -> tuple[str, ...]:
    return tuple(sorted(pod for m in members for pod in m.marked))


def _marks(members: Sequence[Member]) -> tuple[str, ...]:
    return tuple(sorted(pod for m in members for pod in m.pods if pod not in m.marked))


def decode(
    target: int, applied: int, members: Sequence[Member], busy: Busy, now: datetime, drain_s: float
) -> Retirement:
    """The decode Deployment's step toward `target` from `applied` (its count now); `members` are its live
    pods (not terminating)."""
    if target >= applied:
        return Retirement(target, undrain=_unmarked(members))
    # Pods the count has and the cluster does not (not created yet) go first, and cut nothing.
    free = max(0, applied - len(members))
    applied -= min(free, applied - target)
    excess = applied - target
    if excess <= 0:
        return Retirement(applied, undrain=_unmarked(members))
    marked = sorted((m for m in members if m.since is not None), key=lambda m: (m.since, m.name))
    fresh = sorted((m for m in members if m.since is None), key=lambda m: m.name, reverse=True)
    victims = (marked + fresh)[:excess]
    kept = [m for m in members if m not in victims]
    done = [m for m in victims if _done(m, busy, now, drain_s)]
    return Retirement(
        applied - len(done),
        drain=_marks(victims),
        undrain=_unmarked(kept),
        delete=tuple(sorted(pod for m in done for pod in m.pods)),
        waiting=tuple(sorted(m.name for m in victims if m not in done)),
    )


def prefill(
    target: int, applied: int, members: Sequence[Member], busy: Busy, now: datetime, drain_s: float
) -> Retirement:
    """The prefill engines' step toward `target` from `applied` (the StatefulSets built now); `members`
    are the engines that exist, by replica number."""
    if target >= applied:
        return Retirement(target, undrain=_unmarked(members))
    victims = [m for m in members if target <= m.index < applied]
    kept = [m for m in members if m.index < target]
    waiting = [m for m in victims if not _done(m, busy, now, drain_s)]
    replicas = max([target, *(m.index + 1 for m in waiting)])
    return Retirement(
        replicas,
        drain=_marks([m for m in victims if m.index < replicas]),
        undrain=_unmarked(kept),
        waiting=tuple(sorted(m.name for m in waiting)),
    )
