"""The rollout of a new engine revision beside the old one, decided from what the cluster shows. Pure.

A deployment's engine children (its topology ConfigMap, prefill StatefulSets, decode Deployment and their
Services) live in one of two slots (`naming.SLOTS`): `a` keeps the names a deployment that never rolled
out has, `b` is the other set. Every engine workload and pod carries its revision (`naming.REVISION_LABEL`,
`builders.topology.revision`: what its pairs depend on) and its slot. The cluster is the truth: each call
derives the old and the new revision from the workloads' labels, so a restarted operator resumes a rollout
where the cluster is.

- The spec's revision is applied in the slot that already holds it; a change that keeps the revision
  (replicas, resources, images of the same release) is applied there in place, as before slots existed.
- A new revision goes in the other slot, beside the old one (the whole new revision at once: a surge of
  100%). The old slot's children are kept, untouched, until the new revision serves.
- Once every new prefill engine and every new decode pod is in a routable pair (the router's own pairing:
  verified handshakes, equal hashes), the old revision's pods that served are marked draining
  (`pod_contract.DRAINING_ANNOTATION`): the router sends them nothing new. Once every marked pod's sidecar
  reports its engine idle (0 requests in flight, measured a grace after the mark: `drain_progress`), or at
  the latest `drainSeconds` after the mark, the old slot's children are no longer kept, and the reconcile
  prunes them.
- A new revision whose own pairs the sidecars refuse (a hash mismatch within it) is stuck at once; one
  without a routable pair after `progressDeadlineSeconds` is stuck too. Stuck, the old revision keeps
  serving at full size and the new one stays, never routed, for inspection. Applying the old spec makes the
  old slot the spec's again: the failed slot's children go (its pods never served: nothing to drain).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Protocol

from disagg.operator.api import RolloutSpec
from disagg.operator.naming import COMPONENT_LABEL, REVISION_LABEL, SLOT_LABEL, SLOTS
from disagg.worker.contracts.engine_pods import engine_pod
from disagg.worker.contracts.pairing import HASH_DIFFERS, Routing
from disagg.worker.contracts.peer_report import InFlight, PeerReportError, decode_peer_report
from disagg.worker.contracts.pod_contract import DRAINING_ANNOTATION, PEER_REPORT_ANNOTATION
from disagg.worker.kv.errors import CompatibilityHashMismatch

WAITING: Final = "RolloutWaitingForRoutablePairs"
DRAINING_OLD: Final = "RolloutDraining"
STUCK: Final = "RolloutStuck"
COMPLETE: Final = "RolloutComplete"
# What stops a rollout at once: the sidecars found the new revision's own pairs' hashes differ (a refusal for
# the hash, or ok verdicts on differing hashes). Any other refusal (a handshake that failed while a peer was
# still starting) may pass; the progress deadline bounds it.
_MISMATCH: Final = frozenset({CompatibilityHashMismatch.reason, HASH_DIFFERS})
# The components whose children live in a slot; the worker's access and the router are shared.
SLOTTED_COMPONENTS: Final = frozenset({"prefill", "decode", "topology"})
# How long after a drain mark a pod's "0 in flight" counts: the routers see the mark within a watch event's
# latency, and a request one of them chose just before has reached the engine by then.
IDLE_GRACE_S: Final = 5


class EngineWorkload(Protocol):
    """What the rollout reads of a StatefulSet or Deployment (`status.Workload` is one)."""

    @property
    def role(self) -> str: ...

    @property
    def slot(self) -> str: ...

    @property
    def revision(self) -> str: ...

    @property
    def since(self) -> datetime | None: ...


@dataclass(frozen=True)
class Rollout:
    """Where the spec's revision goes and what to do about the other slot.

    `phase` is None while no other revision has workloads (the spec's revision is all there is), else one
    of `WAITING`, `DRAINING_OLD`, `STUCK`. `keep_old`: the old slot's children stay (else they are pruned);
    `drain`: old pods to mark draining now; `pairs`: routable pairs within each revision."""

    revision: str
    slot: str
    old_revision: str | None = None
    old_slot: str | None = None
    phase: str | None = None
    message: str = ""
    keep_old: bool = False
    drain: tuple[str, ...] = ()
    draining: bool = False
    pairs: Mapping[str, int] = field(default_factory=dict)


def labels_of(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels if isinstance(labels, Mapping) else {}


def slot_of(obj: Mapping[str, Any]) -> str:
    """A child's or pod's slot; one from before slots existed is in slot `a`."""
    slot = labels_of(obj).get(SLOT_LABEL)
    return slot if slot in SLOTS else SLOTS[0]


def _other(slot: str) -> str:
    return SLOTS[1] if slot == SLOTS[0] else SLOTS[0]


def _engines(workloads: Iterable[EngineWorkload]) -> list[EngineWorkload]:
    return [w for w in workloads if w.role in ("prefill", "decode")]


def _revisions(workloads: Iterable[EngineWorkload], revision: str) -> dict[str, set[str]]:
    """The revisions each slot's engine workloads run; one without a revision label (from before revisions
    existed) is taken to run `revision`, so an operator upgrade changes it in place, as it always did."""
    found: dict[str, set[str]] = {}
    for workload in _engines(workloads):
        found.setdefault(workload.slot, set()).add(workload.revision or revision)
    return found


def revision_pairs(routing: Routing, pods: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Routable pairs whose prefill head and decode pod run the same revision, by revision."""
    revision_of = {
        (pod.get("metadata") or {}).get("name"): labels_of(pod).get(REVISION_LABEL) for pod in pods
    }
    counts: dict[str, int] = {}
    for pair in routing.pairs:
        revision = revision_of.get(pair.prefill.head_pod)
        if revision and revision == revision_of.get(pair.decode.pod):
            counts[revision] = counts.get(revision, 0) + 1
    return counts


def target_slot(workloads: Sequence[EngineWorkload], revision: str, pairs: Mapping[str, int]) -> str:
    """The slot the spec's revision is applied in: the one that holds it, else the free one, else (both
    hold other revisions: a third revision while a rollout is under way) the one serving fewer pairs."""
    found = _revisions(workloads, revision)
    for slot in SLOTS:
        if revision in found.get(slot, set()):
            return slot
    used = [slot for slot in SLOTS if slot in found]
    if not used:
        return SLOTS[0]
    if len(used) == 1:
        return _other(used[0])

    def serving(slot: str) -> tuple[int, float]:
        since = [w.since.timestamp() for w in _engines(workloads) if w.slot == slot and w.since is not None]
        return sum(pairs.get(r, 0) for r in found[slot]), -max(since, default=0.0)

    return min(SLOTS, key=serving)


def since_of(workloads: Sequence[EngineWorkload], slot: str, revision: str, now: datetime) -> datetime:
    """When `slot` began to run `revision`: what its workloads already say, else now."""
    times = [
        w.since
        for w in _engines(workloads)
        if w.slot == slot and (w.revision or revision) == revision and w.since is not None
    ]
    return min(times, default=now)


def parse_time(text: object) -> datetime | None:
    if not isinstance(text, str):
        return None
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def assess(
    *,
    revision: str,
    workloads: Sequence[EngineWorkload],
    pods: Sequence[Mapping[str, Any]],
    routing: Routing,
    now: datetime,
    settings: RolloutSpec,
    sizes: tuple[int, int],
) -> Rollout:
    """The rollout as the cluster shows it now. `sizes`: the spec's prefill engines and decode pods."""
    pairs = revision_pairs(routing, pods)
    slot = target_slot(workloads, revision, pairs)
    old_slot = _other(slot)
    found = _revisions(workloads, revision)
    old = sorted(found.get(old_slot, set()) - {revision})
    if not old:
        return Rollout(revision, slot, pairs=pairs)
    old_revision = old[0]
    base = Rollout(revision, slot, old_revision, old_slot, keep_old=True, pairs=pairs)
    mine = [pod for pod in pods if slot_of(pod) == slot and labels_of(pod).get(REVISION_LABEL) == revision]
    theirs = [pod for pod in pods if slot_of(pod) == old_slot]
    routable = _routable_engines(routing, {_name(pod) for pod in mine})
    prefills, decodes = sizes
    if routable[0] < prefills or routable[1] < decodes:
        return _not_yet(base, routing, mine, routable, sizes, workloads, now, settings)
    # Every new engine serves: drain the old pods that served (the rest have nothing to finish).
    serving = {pair.prefill.head_pod for pair in routing.pairs} | {pair.decode.pod for pair in routing.pairs}
    serving |= {stage for pair in routing.pairs for stage in pair.prefill.stage_pods}
    marks = tuple(sorted(_name(pod) for pod in theirs if _name(pod) in serving and not _marked(pod)))
    drained = drain_progress(theirs, marks, now, settings)
    if drained.done:
        return Rollout(
            revision,
            slot,
            old_revision,
            old_slot,
            DRAINING_OLD,
            f"revision {revision} serves ({pairs.get(revision, 0)} routable pairs); revision "
            f"{old_revision} is drained ({drained.summary}) and its children are deleted",
            keep_old=False,
            draining=True,
            pairs=pairs,
        )
    return Rollout(
        revision,
        slot,
        old_revision,
        old_slot,
        DRAINING_OLD,
        f"revision {revision} serves ({pairs.get(revision, 0)} routable pairs); revision {old_revision} "
        f"takes no new request, {drained.idle} of {drained.marked} old pods idle; deleted once all are, or "
        f"in {drained.left_s}s (drainSeconds {settings.drain_seconds})",
        keep_old=True,
        drain=marks,
        draining=True,
        pairs=pairs,
    )


@dataclass(frozen=True)
class DrainProgress:
    """How far the old revision's drain is: `marked` pods drain, `idle` of them have nothing in flight;
    `done` once there is nothing to drain, every marked pod is idle, or `drainSeconds` have passed
    (`bound`); `left_s`: seconds until the bound."""

    marked: int
    idle: int
    done: bool
    bound: bool
    left_s: int

    @property
    def summary(self) -> str:
        if self.marked == 0:
            return "none of its pods had served"
        if self.bound and self.idle < self.marked:
            return f"{self.idle} of {self.marked} old pods idle when drainSeconds passed"
        return f"{self.idle} of {self.marked} old pods idle"


def drain_progress(
    theirs: Sequence[Mapping[str, Any]], marks: Sequence[str], now: datetime, settings: RolloutSpec
) -> DrainProgress:
    """The drain of the old slot's pods `theirs`, of which `marks` are being marked now.

    A marked pod is idle once its sidecar's peer report (`peer_report.InFlight`) says its engine has 0
    requests in flight, measured at least `IDLE_GRACE_S` after the pod's drain mark: a request the router
    chose just before it saw the mark has reached the engine by then, and is counted. A pod being marked
    now has no such report yet. A PP prefill engine's stages past the head hold no request of their own (the
    head schedules them all), so the head's report speaks for them. The drain ends when every marked pod is
    idle, or at the latest
    `drainSeconds` after the last mark, whatever the pods report."""
    started: list[datetime] = []
    idle = 0
    speaker = _speakers(theirs)
    for pod in theirs:
        mark = parse_time(_annotations(pod).get(DRAINING_ANNOTATION))
        if mark is None:
            continue
        started.append(mark)
        head = speaker.get(_name(pod))
        idle += head is not None and _idle_since(head, mark + timedelta(seconds=IDLE_GRACE_S))
    marked = len(started) + len(marks)
    if marks:
        started.append(now)
    ends = max(started, default=now) + timedelta(seconds=settings.drain_seconds)
    bound = bool(started) and now >= ends
    done = not started or bound or (not marks and idle == marked)
    left = max(0, int((ends - now).total_seconds() + 0.999))
    return DrainProgress(marked, idle, done, bound, left)


def _speakers(pods: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Each pod's name to the pod whose report tells its engine's requests in flight: its own, or for a
    prefill stage past 0 its engine's head (absent while the head is gone)."""
    found = {pod_name: (engine_pod(pod), pod) for pod in pods if (pod_name := _name(pod))}
    heads = {
        (engine.deployment, engine.engine_id): pod
        for engine, pod in found.values()
        if engine is not None and engine.role == "prefill" and engine.stage == 0
    }
    out: dict[str, Mapping[str, Any]] = {}
    for pod_name, (engine, pod) in found.items():
        if engine is not None and engine.role == "prefill" and engine.stage > 0:
            head = heads.get((engine.deployment, engine.engine_id))
            if head is not None:
                out[pod_name] = head
        else:
            out[pod_name] = pod
    return out


def _idle_since(pod: Mapping[str, Any], after: datetime) -> bool:
    """The pod's report says 0 requests in flight, measured at or after `after`."""
    text = _annotations(pod).get(PEER_REPORT_ANNOTATION)
    if not isinstance(text, str):
        return False
    try:
        in_flight = decode_peer_report(text).in_flight
    except PeerReportError:
        return False
    return isinstance(in_flight, InFlight) and in_flight.requests == 0 and in_flight.at >= after


def _not_yet(
    base: Rollout,
    routing: Routing,
    mine: Sequence[Mapping[str, Any]],
    routable: tuple[int, int],
    sizes: tuple[int, int],
    workloads: Sequence[EngineWorkload],
    now: datetime,
    settings: RolloutSpec,
) -> Rollout:
    old = f"revision {base.old_revision} keeps serving ({base.pairs.get(base.old_revision or '', 0)} pairs)"
    mismatch = _mismatch(routing, mine)
    if mismatch:
        return _with(
            base,
            STUCK,
            f"revision {base.revision} cannot pair with itself: {mismatch}; {old}. Apply a spec whose "
            "roles agree, or the previous spec to roll back",
        )
    since = since_of(workloads, base.slot, base.revision, now)
    waited = (now - since).total_seconds()
    progress = (
        f"{routable[0]}/{sizes[0]} prefill engines and {routable[1]}/{sizes[1]} decode pods of revision "
        f"{base.revision} routable"
    )
    if waited > settings.progress_deadline_seconds:
        return _with(
            base,
            STUCK,
            f"{progress} after {int(waited)}s (progressDeadlineSeconds "
            f"{settings.progress_deadline_seconds}); {old}",
        )
    return _with(base, WAITING, f"{progress}; {old}")


def _mismatch(routing: Routing, mine: Sequence[Mapping[str, Any]]) -> str:
    """What shows that the pods `mine` (one revision's) disagree on their hashes, or "": a pod's peer report
    refusing another of them for its hash, or an exclusion of a pair of them for differing hashes."""
    names = {_name(pod) for pod in mine}
    for pod in mine:
        text = _annotations(pod).get(PEER_REPORT_ANNOTATION)
        if not isinstance(text, str):
            continue
        try:
            report = decode_peer_report(text)
        except PeerReportError:
            continue
        for verdict in report.peers:
            if verdict.pod in names and not verdict.ok and verdict.reason in _MISMATCH:
                return (
                    f"pod {_name(pod)} (hash {report.kv_hash[:12]}) reports {verdict.reason} from pod "
                    f"{verdict.pod} (hash {verdict.kv_hash[:12]})"
                )
    for exclusion in routing.exclusions:
        if exclusion.prefill in names and exclusion.decode in names and exclusion.reason in _MISMATCH:
            return f"{exclusion.reason}: {exclusion.message}"
    return ""


def _with(base: Rollout, phase: str, message: str) -> Rollout:
    return Rollout(
        base.revision,
        base.slot,
        base.old_revision,
        base.old_slot,
        phase,
        message,
        keep_old=True,
        pairs=base.pairs,
    )


def _routable_engines(routing: Routing, names: set[str]) -> tuple[int, int]:
    """Prefill engines and decode pods among `names` that are in a routable pair within `names`."""
    within = [pair for pair in routing.pairs if pair.prefill.head_pod in names and pair.decode.pod in names]
    return len({p.prefill.head_pod for p in within}), len({p.decode.pod for p in within})


def _name(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("name") or "")


def _annotations(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return annotations if isinstance(annotations, Mapping) else {}


def _marked(pod: Mapping[str, Any]) -> bool:
    return DRAINING_ANNOTATION in _annotations(pod)


def slot_children(children: Iterable[Mapping[str, Any]], slot: str) -> list[tuple[str, str]]:
    """(kind, name) of the engine children in `slot`: what a rollout keeps of the old revision."""
    return [
        (str(child.get("kind")), str((child.get("metadata") or {}).get("name")))
        for child in children
        if labels_of(child).get(COMPONENT_LABEL) in SLOTTED_COMPONENTS and slot_of(child) == slot
    ]
