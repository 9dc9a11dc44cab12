"""The rollout of a new engine revision beside the old one, decided from what the cluster shows. Pure.

A deployment's engine children (its topology ConfigMap, prefill StatefulSets, decode Deployment and their
Services) live in one of two slots (`naming.SLOTS`): `a` keeps the names a deployment that never rolled
out has, `b` is the other set. Every engine workload and pod carries its revision (`naming.REVISION_LABEL`,
`builders.topology.revision`: what its pairs depend on) and its slot. The cluster is the truth: each call
derives the old and the new revision from the workloads' labels, so a restarted operator resumes a rollout
where the cluster is.

- The spec's revision is applied in the slot that already holds it; a change that keeps the revision
  (replicas, resources, images of the same release) is applied there in place, as before slots existed.
- A new revision goes in the other slot, beside the old one, in steps (`rollout_steps.plan_step`, bounded
  per role by `maxSurge` and `maxUnavailable`): each step adds new engines once the previous step's pair
  (the router's own pairing: verified handshakes, equal hashes), and takes as many old ones out of service
  as the new ones replace. An old engine that served is first marked draining
  (`pod_contract.DRAINING_ANNOTATION`: the router sends it nothing new) and removed once its sidecar
  reports its engine idle (0 requests in flight, measured `IDLE_GRACE_S` after the mark: `_idle`), or at
  the latest `drainSeconds` after the mark: a prefill engine by deleting its StatefulSet (the highest
  replica first), a decode pod by deleting it and lowering the old Deployment's replicas in the same
  reconcile. Once no old engine is left, the old
  slot's children are pruned. `maxSurge: 100%` brings the whole new revision up at once, as before steps.
- A new revision whose own pairs the sidecars refuse (a hash mismatch within it) is stuck at once; one
  without a routable pair after `progressDeadlineSeconds` is stuck too. Stuck, the old revision keeps
  serving with what it has (no step grows the new one or drains the old) and the new one stays, never
  routed, for inspection. Applying the old spec makes the
  old slot the spec's again: the failed slot's children go (its pods never served: nothing to drain).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Protocol

from disagg.operator.api import RolloutSpec
from disagg.operator.naming import COMPONENT_LABEL, REVISION_LABEL, SLOT_LABEL, SLOTS
from disagg.operator.rollout_steps import (
    NOUNS,
    ROLES,
    OldEngine,
    RoleState,
    plan_step,
    progress,
    removal_order,
)
from disagg.worker.contracts.engine_pods import engine_pod
from disagg.worker.contracts.pairing import HASH_DIFFERS, Routing
from disagg.worker.contracts.peer_report import InFlight, PeerReportError, decode_peer_report
from disagg.worker.contracts.pod_contract import DRAINING_ANNOTATION, PEER_REPORT_ANNOTATION, ROLE_LABEL
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
    def name(self) -> str: ...

    @property
    def role(self) -> str: ...

    @property
    def desired(self) -> int: ...

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
    `pairs`: routable pairs within each revision; `replicas`: (prefill engines, decode pods) each revision
    runs after this step, the spec's revision's being what its slot is built with. This step's actions:
    `drain` old pods to mark draining, `undrain` pods of the spec's slot to unmark (a rollback midway),
    `remove` old prefill children to delete (the engines' StatefulSets and Services), `delete_pods` old
    decode pods to delete and then `scale` (the old decode Deployment, its new replicas)."""

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
    replicas: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    undrain: tuple[str, ...] = ()
    remove: tuple[tuple[str, str], ...] = ()
    delete_pods: tuple[str, ...] = ()
    scale: tuple[str, int] | None = None


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
        return Rollout(revision, slot, pairs=pairs, replicas={revision: sizes})
    old_revision = old[0]
    mine = [pod for pod in pods if slot_of(pod) == slot and labels_of(pod).get(REVISION_LABEL) == revision]
    theirs = [pod for pod in pods if slot_of(pod) == old_slot]
    routable = _routable_engines(routing, {_name(pod) for pod in mine})
    serving = _serving_pods(routing)
    states = {
        "prefill": RoleState(
            desired=sizes[0],
            new=len([w for w in _in_slot(workloads, slot) if w.role == "prefill"]),
            routable=routable[0],
            old=_old_prefills(_in_slot(workloads, old_slot), theirs, serving),
        ),
        "decode": RoleState(
            desired=sizes[1],
            new=sum(w.desired for w in _in_slot(workloads, slot) if w.role == "decode"),
            routable=routable[1],
            old=_old_decoders(_in_slot(workloads, old_slot), theirs, serving),
        ),
    }
    kept = f"revision {old_revision} keeps serving ({pairs.get(old_revision, 0)} pairs)"
    stuck = _stuck(routing, mine, serving, routable, states, workloads, slot, revision, now, settings)
    steps = plan_step(states, settings, now, frozen=bool(stuck))
    step = progress(states, settings, revision)
    left = {role: steps[role].old for role in ROLES}
    base = Rollout(
        revision,
        slot,
        old_revision,
        old_slot,
        keep_old=any(left.values()),
        pairs=pairs,
        replicas={
            revision: (steps["prefill"].new, steps["decode"].new),
            old_revision: (left["prefill"], left["decode"]),
        },
        drain=tuple(sorted(pod for role in ROLES for pod in steps[role].drain)),
        undrain=tuple(sorted(_name(pod) for pod in mine if _marked(pod))),
        draining=any(_marked(pod) for pod in theirs) or any(steps[role].drain for role in ROLES),
        remove=tuple(
            (kind, engine.name) for engine in steps["prefill"].remove for kind in ("StatefulSet", "Service")
        ),
        delete_pods=tuple(sorted(e.name for e in steps["decode"].remove if e.name and not e.gone)),
        scale=_scale(_in_slot(workloads, old_slot), left["decode"]),
    )
    if stuck:
        return replace(base, phase=STUCK, message=f"{step}; {stuck}; {kept}")
    if not base.keep_old:
        return replace(
            base,
            phase=DRAINING_OLD,
            message=f"{step}; revision {old_revision} is drained and its children are deleted",
        )
    if any(steps[role].new > states[role].routable for role in ROLES):
        return replace(base, phase=WAITING, message=f"{step}; {kept}")
    return replace(base, phase=DRAINING_OLD, message=f"{step}; {_drain_note(theirs, base, now, settings)}")


def _drain_note(
    theirs: Sequence[Mapping[str, Any]], rollout: Rollout, now: datetime, settings: RolloutSpec
) -> str:
    marked = [pod for pod in theirs if _marked(pod)]
    marks = [t for t in (parse_time(_annotations(pod).get(DRAINING_ANNOTATION)) for pod in marked) if t]
    count = len(marked) + len(rollout.drain)
    serves = rollout.pairs.get(rollout.old_revision or "", 0)
    if not count:
        return f"revision {rollout.old_revision} serves ({serves} pairs)"
    heads = {
        _engine_of(pod): pod for pod in theirs if (engine := engine_pod(pod)) is None or engine.stage == 0
    }
    idle = sum(_idle([pod, heads[_engine_of(pod)]] if _engine_of(pod) in heads else [pod]) for pod in marked)
    ends = max(marks, default=now) + timedelta(seconds=settings.drain_seconds)
    wait = max(0, int((ends - now).total_seconds() + 0.999))
    return (
        f"{count} pods of revision {rollout.old_revision} take no new request, {idle} of {count} old pods "
        f"idle; each engine is deleted once idle, at the latest in {wait}s (drainSeconds "
        f"{settings.drain_seconds}); it serves {serves} pairs meanwhile"
    )


def _engine_of(pod: Mapping[str, Any]) -> str:
    """The engine a pod belongs to: a prefill stage's StatefulSet (its name less the ordinal), else itself."""
    name = _name(pod)
    return name.rsplit("-", 1)[0] if _role(pod) == "prefill" else name


def _in_slot(workloads: Sequence[EngineWorkload], slot: str) -> list[EngineWorkload]:
    return [w for w in _engines(workloads) if w.slot == slot]


def _serving_pods(routing: Routing) -> set[str]:
    """Every pod in a routable pair: prefill heads and their stages, decoders."""
    serving = {pair.prefill.head_pod for pair in routing.pairs} | {pair.decode.pod for pair in routing.pairs}
    return serving | {stage for pair in routing.pairs for stage in pair.prefill.stage_pods}


def _drained_at(pods: Sequence[Mapping[str, Any]]) -> datetime | None:
    marks = [t for t in (parse_time(_annotations(pod).get(DRAINING_ANNOTATION)) for pod in pods) if t]
    return min(marks, default=None)


def _idle(pods: Sequence[Mapping[str, Any]]) -> bool:
    """A draining engine's sidecar reports 0 requests in flight, measured at least `IDLE_GRACE_S` after the
    latest drain mark of its pods (`peer_report.InFlight`): a request a router chose just before it saw the
    mark has reached the engine by then, and is counted. The engine's head speaks for it: a PP prefill's
    stages past 0 hold no request of their own (the head schedules them all)."""
    marks = [t for t in (parse_time(_annotations(pod).get(DRAINING_ANNOTATION)) for pod in pods) if t]
    if not marks:
        return False
    heads = [pod for pod in pods if (engine := engine_pod(pod)) is None or engine.stage == 0]
    after = max(marks) + timedelta(seconds=IDLE_GRACE_S)
    return bool(heads) and all(_reports_idle(pod, after) for pod in heads)


def _reports_idle(pod: Mapping[str, Any], after: datetime) -> bool:
    """The pod's report says 0 requests in flight, measured at or after `after`."""
    text = _annotations(pod).get(PEER_REPORT_ANNOTATION)
    if not isinstance(text, str):
        return False
    try:
        in_flight = decode_peer_report(text).in_flight
    except PeerReportError:
        return False
    return isinstance(in_flight, InFlight) and in_flight.requests == 0 and in_flight.at >= after


def _old_prefills(
    workloads: Sequence[EngineWorkload], pods: Sequence[Mapping[str, Any]], serving: set[str]
) -> tuple[OldEngine, ...]:
    """The old slot's prefill engines: its StatefulSets, and any whose pods outlive a deleted one (a pod
    is its StatefulSet's name and its ordinal)."""
    by_set: dict[str, list[Mapping[str, Any]]] = {}
    for pod in pods:
        if _role(pod) == "prefill":
            by_set.setdefault(_name(pod).rsplit("-", 1)[0], []).append(pod)
    sets = {w.name for w in workloads if w.role == "prefill"}
    engines = []
    for name in sorted(sets | by_set.keys()):
        members = by_set.get(name, [])
        engine = OldEngine(
            name=name,
            pods=tuple(sorted(_name(pod) for pod in members)),
            serving=any(_name(pod) in serving for pod in members),
            draining_since=_drained_at(members),
            idle=_idle(members),
            gone=name not in sets,
        )
        engines.append((_index(name), engine))
    return removal_order("prefill", engines)


def _old_decoders(
    workloads: Sequence[EngineWorkload], pods: Sequence[Mapping[str, Any]], serving: set[str]
) -> tuple[OldEngine, ...]:
    """The old slot's decode pods, and one unnamed engine per replica its Deployment has not made yet."""
    engines = [
        OldEngine(
            name=_name(pod),
            pods=(_name(pod),),
            serving=_name(pod) in serving,
            draining_since=_drained_at([pod]),
            idle=_idle([pod]),
            gone=bool((pod.get("metadata") or {}).get("deletionTimestamp")),
        )
        for pod in sorted((pod for pod in pods if _role(pod) == "decode"), key=_name)
    ]
    wanted = sum(w.desired for w in workloads if w.role == "decode")
    engines += [OldEngine(name="")] * max(0, wanted - len([e for e in engines if not e.gone]))
    return removal_order("decode", list(enumerate(engines)))


def _scale(workloads: Sequence[EngineWorkload], replicas: int) -> tuple[str, int] | None:
    """The old decode Deployment's name and new replicas, when a step lowers them."""
    for w in workloads:
        if w.role == "decode" and w.desired != replicas:
            return w.name, replicas
    return None


def _index(name: str) -> int:
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def _role(pod: Mapping[str, Any]) -> str:
    return str(labels_of(pod).get(ROLE_LABEL) or "")


def _stuck(
    routing: Routing,
    mine: Sequence[Mapping[str, Any]],
    serving: set[str],
    routable: tuple[int, int],
    states: Mapping[str, RoleState],
    workloads: Sequence[EngineWorkload],
    slot: str,
    revision: str,
    now: datetime,
    settings: RolloutSpec,
) -> str:
    """Why the new revision is stuck, or "": its own pairs' hashes differ (at once), or its engines have
    waited past progressDeadlineSeconds for a routable pair (counted from when the slot began while the
    revision has no pair at all, else from the making of its oldest pod that is not routable)."""
    mismatch = _mismatch(routing, mine)
    if mismatch:
        return (
            f"revision {revision} cannot pair with itself: {mismatch}. Apply a spec whose roles agree, or "
            "the previous spec to roll back"
        )
    if routable[0] == 0 or routable[1] == 0:
        waited = (now - since_of(workloads, slot, revision, now)).total_seconds()
    else:
        made = [
            parse_time((pod.get("metadata") or {}).get("creationTimestamp"))
            for pod in mine
            if _name(pod) not in serving and not _marked(pod)
        ]
        waited = (now - min((t for t in made if t is not None), default=now)).total_seconds()
    if waited <= settings.progress_deadline_seconds:
        return ""
    counts = " and ".join(f"{states[role].routable}/{states[role].new} {NOUNS[role]}" for role in ROLES)
    return (
        f"{counts} of revision {revision} routable after {int(waited)}s (progressDeadlineSeconds "
        f"{settings.progress_deadline_seconds})"
    )


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
