"""Who is paired with whom: the routable (prefill engine, decode pod) pairs of the deployments' pods. Pure.

The router sends a request only over a pair this module finds routable, and the operator's `Routable`
condition counts the same pairs, so what `kubectl get disagg` says is excluded is what gets no traffic.

A prefill engine is the stage pods of one StatefulSet (stage `s` is the pod with ordinal `s`); its head
(stage 0) takes the prefill leg on its `http` port and its side channel answers for every stage. A pair is
routable only when

1. every stage pod and the decode pod exist, are not being deleted, have an IP and are Ready;
   and none is draining (`disagg.io/draining`, the operator's mark on a revision being replaced);
2. the decode pod's peer report (`peer_report`) has an ok verdict for every stage pod, and every stage
   pod's report has an ok verdict for the decode pod;
3. those verdicts are about the engines running now: each names the other side's current live engine id
   (a restarted vLLM engine has a new id, and a verdict on the old one vouches for nothing);
4. the hashes agree: each side's own advertised hash is what the other side saw, and all are equal.

Otherwise the pair is one `Exclusion`, with the first failing rule's reason: a refusal the reports show
(`CompatibilityHashMismatch`, ...) comes before `PodNotReady`, because a refused pod is unready by its
readiness gate and the refusal is why; then `PodNotReady`, `InvalidPeerReport`, `NotYetChecked`,
`HashDiffers`. A pod that is gone, being deleted or without an IP is `PodNotReady` whatever its report says;
a pod that is there but draining is `Draining` whatever its report says (it served until now: nothing
else is wrong with it, it is just leaving).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from disagg.worker.contracts.engine_pods import ORDINAL, EnginePod, engine_pod
from disagg.worker.contracts.peer_report import PeerReport, PeerReportError, PeerVerdict, decode_peer_report
from disagg.worker.contracts.pod_contract import PEER_REPORT_ANNOTATION
from disagg.worker.kv.layout import natural_sort_key

POD_NOT_READY: Final = "PodNotReady"
NOT_YET_CHECKED: Final = "NotYetChecked"
INVALID_PEER_REPORT: Final = PeerReportError.reason
HASH_DIFFERS: Final = "HashDiffers"
DRAINING: Final = "Draining"
_SHORT_HASH: Final = 12


@dataclass(frozen=True)
class PrefillTarget:
    """A prefill engine: where the prefill leg goes and what the decode leg's `kv_transfer_params` name.

    `engine_id` is the head's reported live id (the stable id until it reports); `host` is "" until the
    head pod has an IP; `kv_hash` "" until the head reports."""

    engine_id: str
    head_pod: str
    host: str
    http_port: int
    side_channel_port: int
    tp_size: int
    pp_size: int
    stage_pods: tuple[str, ...]
    kv_hash: str
    restarts: int = 0
    """Container restarts of the stage pods, summed (`EnginePod.restarts`)."""


@dataclass(frozen=True)
class DecodeTarget:
    """A decode pod; `engine_id`, `host` and `kv_hash` as for `PrefillTarget`."""

    pod: str
    engine_id: str
    host: str
    http_port: int
    tp_size: int
    kv_hash: str
    restarts: int = 0


@dataclass(frozen=True)
class Pair:
    prefill: PrefillTarget
    decode: DecodeTarget


@dataclass(frozen=True)
class Exclusion:
    """A (prefill engine, decode pod) pair that gets no traffic: the head pod's and the decode pod's names,
    a CamelCase reason and a message naming both pods."""

    prefill: str
    decode: str
    reason: str
    message: str


@dataclass(frozen=True)
class Routing:
    """Every prefill engine and decode pod found (routable or not: route only by `pairs`), and every
    (engine, decode pod) pair of one deployment as either a `Pair` or an `Exclusion`."""

    prefills: tuple[PrefillTarget, ...]
    decodes: tuple[DecodeTarget, ...]
    pairs: tuple[Pair, ...]
    exclusions: tuple[Exclusion, ...]


@dataclass(frozen=True)
class _Reported:
    """A pod and what its annotation holds: a report, or why there is none usable."""

    pod: EnginePod
    report: PeerReport | None
    problem: str | None
    """`InvalidPeerReport`'s message, or None (no report at all when `report` is None too)."""
    verdicts: Mapping[str, PeerVerdict]
    """The report's verdicts by peer pod: a deployment's pairs look them up pods × pods times."""

    def verdict(self, pod: str) -> PeerVerdict | None:
        return self.verdicts.get(pod)


@dataclass(frozen=True)
class _Engine:
    engine_id: str
    """The stable id the stage pods share."""
    head_pod: str
    stages: Mapping[int, _Reported]
    lead: EnginePod
    """The head pod, or while it does not exist another stage's: its ports and sizes are the engine's."""

    @property
    def pp_size(self) -> int:
        return self.lead.pp_size


def _reported(pod: EnginePod) -> _Reported:
    text = pod.annotations.get(PEER_REPORT_ANNOTATION)
    if text is None:
        return _Reported(pod, None, None, {})
    try:
        report = decode_peer_report(text)
    except PeerReportError as exc:
        return _Reported(pod, None, exc.message, {})
    return _Reported(pod, report, None, {verdict.pod: verdict for verdict in report.peers})


def _short(kv_hash: str) -> str:
    return kv_hash[:_SHORT_HASH] if kv_hash else '""'


def _where(stage: int, pod: str) -> str:
    return f"prefill stage {stage} (pod {pod})"


def _head_name(engine_id: str, pods: Sequence[EnginePod]) -> str:
    """The stage-0 pod's name: its own, or a stage pod's with ordinal 0 while the head does not exist."""
    for pod in pods:
        if pod.stage == 0:
            return pod.name
    for pod in pods:
        match = ORDINAL.match(pod.name)
        if match is not None:
            return f"{match.group('base')}-0"
    return f"{engine_id}-0"


def _engines(prefill_pods: Sequence[EnginePod]) -> list[_Engine]:
    by_engine: dict[str, list[EnginePod]] = defaultdict(list)
    for pod in prefill_pods:
        by_engine[pod.engine_id].append(pod)
    engines = []
    for engine_id, pods in by_engine.items():
        pods.sort(key=lambda pod: (pod.deleting, natural_sort_key(pod.name)))
        lead = next((pod for pod in pods if pod.stage == 0), pods[0])
        stages: dict[int, _Reported] = {}
        for pod in pods:
            # A pod past the head's pipeline (a shrinking engine's) is not one of its stages. Two pods
            # claiming one stage (only by an explicit DISAGG_PP_RANK): the live one, else the first by name.
            if pod.stage < lead.pp_size:
                stages.setdefault(pod.stage, _reported(pod))
        engines.append(_Engine(engine_id, _head_name(engine_id, pods), stages, lead))
    return sorted(engines, key=lambda engine: natural_sort_key(engine.head_pod))


def _prefill_target(engine: _Engine) -> PrefillTarget:
    head = engine.stages.get(0)
    report = head.report if head is not None else None
    return PrefillTarget(
        engine_id=report.engine_id if report is not None else engine.engine_id,
        head_pod=engine.head_pod,
        host=(head.pod.host or "") if head is not None else "",
        http_port=engine.lead.http_port,
        side_channel_port=engine.lead.side_channel_port,
        tp_size=engine.lead.tp_size,
        pp_size=engine.pp_size,
        stage_pods=tuple(engine.stages[stage].pod.name for stage in sorted(engine.stages)),
        kv_hash=report.kv_hash if report is not None else "",
        restarts=sum(reported.pod.restarts for reported in engine.stages.values()),
    )


def _decode_target(decode: _Reported) -> DecodeTarget:
    report = decode.report
    return DecodeTarget(
        pod=decode.pod.name,
        engine_id=report.engine_id if report is not None else decode.pod.engine_id,
        host=decode.pod.host or "",
        http_port=decode.pod.http_port,
        tp_size=decode.pod.tp_size,
        kv_hash=report.kv_hash if report is not None else "",
        restarts=decode.pod.restarts,
    )


def _gone(engine: _Engine, decode: _Reported) -> list[str]:
    """Pods of the pair that are missing, being deleted or without an IP: no report makes them routable."""
    problems = []
    for stage in range(engine.pp_size):
        found = engine.stages.get(stage)
        if found is None:
            problems.append(f"prefill stage {stage} of engine {engine.engine_id} has no pod")
            continue
        problems.extend(_absent(found.pod, _where(stage, found.pod.name)))
    problems.extend(_absent(decode.pod, f"decode pod {decode.pod.name}"))
    return problems


def _absent(pod: EnginePod, where: str) -> list[str]:
    if pod.deleting:
        return [f"{where} is being deleted"]
    if pod.host is None:
        return [f"{where} has no IP yet"]
    return []


def _draining(engine: _Engine, decode: _Reported) -> list[str]:
    stages = [(_where(stage, found.pod.name), found) for stage, found in sorted(engine.stages.items())]
    return [
        f"{where} is draining"
        for where, found in [*stages, (f"decode pod {decode.pod.name}", decode)]
        if found.pod.draining
    ]


def _unready(engine: _Engine, decode: _Reported) -> list[str]:
    stages = [(_where(stage, found.pod.name), found) for stage, found in sorted(engine.stages.items())]
    return [
        f"{where} is not Ready"
        for where, found in [*stages, (f"decode pod {decode.pod.name}", decode)]
        if not found.pod.ready
    ]


def _refusals(engine: _Engine, decode: _Reported) -> list[tuple[str, str]]:
    """(reason, sentence) for each refusal either side reports about the other."""
    out = []
    for stage, found in sorted(engine.stages.items()):
        where = _where(stage, found.pod.name)
        seen = decode.verdict(found.pod.name)
        if seen is not None and not seen.ok:
            sentence = f"decode pod {decode.pod.name} reports {seen.reason} from {where}"
            out.append((seen.reason, sentence + _hashes(decode.report, seen)))
        saw = found.verdict(decode.pod.name)
        if saw is not None and not saw.ok:
            sentence = f"{where} reports {saw.reason} from decode pod {decode.pod.name}"
            out.append((saw.reason, sentence + _hashes(found.report, saw)))
    return out


def _hashes(judge: PeerReport | None, verdict: PeerVerdict) -> str:
    """` (its hash x, the peer's y; they differ in z)` when the refusal's two hashes are known and differ
    (and what differs, where the sidecar could tell)."""
    if judge is None or not judge.kv_hash or not verdict.kv_hash or judge.kv_hash == verdict.kv_hash:
        return ""
    differs = f"; they differ in {verdict.differs}" if verdict.differs else ""
    return f" (its hash {_short(judge.kv_hash)}, the peer's {_short(verdict.kv_hash)}{differs})"


def _reports(engine: _Engine, decode: _Reported) -> tuple[list[str], list[str]]:
    """(invalid reports, missing reports or verdicts) of the pair's pods."""
    invalid, missing = [], []
    sides = [(_where(stage, found.pod.name), found) for stage, found in sorted(engine.stages.items())]
    for where, found in [*sides, (f"decode pod {decode.pod.name}", decode)]:
        if found.problem is not None:
            invalid.append(f"{where} has an invalid {PEER_REPORT_ANNOTATION} annotation: {found.problem}")
        elif found.report is None:
            missing.append(f"{where} has not reported its peer checks yet")
    if invalid or missing:
        return invalid, missing
    assert decode.report is not None
    for stage, found in sorted(engine.stages.items()):
        assert found.report is not None
        where = _where(stage, found.pod.name)
        if decode.verdict(found.pod.name) is None:
            missing.append(f"decode pod {decode.pod.name} has not checked {where} yet")
        if found.verdict(decode.pod.name) is None:
            missing.append(f"{where} has not checked decode pod {decode.pod.name} yet")
    return invalid, missing


@dataclass(frozen=True)
class _Check:
    """One side's verdict on the other: `judge` (a pod, as a phrase) on `subject`, whose own report is
    `judged`; `judge_report` is the judge's own."""

    judge: str
    subject: str
    judged: PeerReport
    verdict: PeerVerdict
    judge_report: PeerReport


def _checks(engine: _Engine, decode: _Reported) -> list[_Check]:
    """Both directions for every stage; only once every report and verdict exists (`_reports`)."""
    assert decode.report is not None
    decoder = f"decode pod {decode.pod.name}"
    out = []
    for stage, found in sorted(engine.stages.items()):
        where = _where(stage, found.pod.name)
        on_stage = decode.verdict(found.pod.name)
        on_decode = found.verdict(decode.pod.name)
        assert found.report is not None and on_stage is not None and on_decode is not None
        out.append(_Check(decoder, where, found.report, on_stage, decode.report))
        out.append(_Check(where, decoder, decode.report, on_decode, found.report))
    return out


def _stale(engine: _Engine, decode: _Reported) -> list[str]:
    """Verdicts on an engine other than the one running now (it restarted since), and stages reporting
    different engines (a PP engine's stages all advertise its head's id)."""
    out = []
    head = engine.stages[0].report
    assert head is not None
    for stage, found in sorted(engine.stages.items()):
        assert found.report is not None
        if found.report.engine_id != head.engine_id:
            out.append(
                f"{_where(stage, found.pod.name)} runs engine {found.report.engine_id}, its head "
                f"{engine.head_pod} engine {head.engine_id}"
            )
    for check in _checks(engine, decode):
        if check.verdict.engine_id != check.judged.engine_id:
            out.append(
                f"{check.judge} checked engine {check.verdict.engine_id or '(unknown)'} of {check.subject}, "
                f"which now runs engine {check.judged.engine_id}"
            )
    return out


def _hash_differences(engine: _Engine, decode: _Reported) -> list[str]:
    """What each side saw against what the other advertises, then the sides' own hashes, each once."""
    seen: list[str] = []
    own: dict[frozenset[str], str] = {}
    for check in _checks(engine, decode):
        if check.verdict.kv_hash != check.judged.kv_hash:
            seen.append(
                f"{check.judge} saw compatibility hash {_short(check.verdict.kv_hash)} from {check.subject}, "
                f"which advertises {_short(check.judged.kv_hash)}"
            )
        if check.judge_report.kv_hash != check.judged.kv_hash:
            own.setdefault(
                frozenset((check.judge, check.subject)),
                f"{check.judge} advertises compatibility hash {_short(check.judge_report.kv_hash)}, "
                f"{check.subject} {_short(check.judged.kv_hash)}",
            )
    return seen + list(own.values())


def _judge(engine: _Engine, decode: _Reported) -> tuple[str, str] | None:
    """(reason, why) that the pair is not routable, or None when it is."""
    gone = _gone(engine, decode)
    if gone:
        return POD_NOT_READY, "; ".join(gone)
    draining = _draining(engine, decode)
    if draining:
        return DRAINING, "; ".join(draining)
    refusals = _refusals(engine, decode)
    if refusals:
        return refusals[0][0], "; ".join(sentence for _, sentence in refusals)
    unready = _unready(engine, decode)
    if unready:
        return POD_NOT_READY, "; ".join(unready)
    invalid, missing = _reports(engine, decode)
    if invalid:
        return INVALID_PEER_REPORT, "; ".join(invalid + missing)
    if missing:
        return NOT_YET_CHECKED, "; ".join(missing)
    stale = _stale(engine, decode)
    if stale:
        return NOT_YET_CHECKED, "; ".join(stale)
    differences = _hash_differences(engine, decode)
    if differences:
        return HASH_DIFFERS, "; ".join(differences)
    return None


def _deployment_routing(pods: Sequence[EnginePod]) -> Routing:
    engines = _engines([pod for pod in pods if pod.role == "prefill"])
    decodes = sorted(
        (_reported(pod) for pod in pods if pod.role == "decode"),
        key=lambda decode: natural_sort_key(decode.pod.name),
    )
    prefill_targets = {engine.head_pod: _prefill_target(engine) for engine in engines}
    decode_targets = {decode.pod.name: _decode_target(decode) for decode in decodes}
    pairs, exclusions = [], []
    for engine in engines:
        for decode in decodes:
            verdict = _judge(engine, decode)
            if verdict is None:
                pairs.append(Pair(prefill_targets[engine.head_pod], decode_targets[decode.pod.name]))
                continue
            reason, why = verdict
            message = f"prefill engine {engine.engine_id} (head pod {engine.head_pod}) and decode pod "
            message += f"{decode.pod.name}: {why}"
            exclusions.append(Exclusion(engine.head_pod, decode.pod.name, reason, message))
    return Routing(
        tuple(prefill_targets.values()), tuple(decode_targets.values()), tuple(pairs), tuple(exclusions)
    )


def routing_from_pods(pods: Iterable[Mapping[str, Any]]) -> Routing:
    """The pairs of `pods` (camelCase dicts as the API serves them; any others are ignored), engines
    paired only within their own deployment (label `disagg.io/deployment`). Never raises on what the pods'
    annotations hold: a report that cannot be read excludes its pod's pairs."""
    by_deployment: dict[str, list[EnginePod]] = defaultdict(list)
    for pod in pods:
        found = engine_pod(pod) if isinstance(pod, Mapping) else None
        if found is not None:
            by_deployment[found.deployment].append(found)
    parts = [_deployment_routing(by_deployment[name]) for name in sorted(by_deployment)]
    return Routing(
        tuple(target for part in parts for target in part.prefills),
        tuple(target for part in parts for target in part.decodes),
        tuple(pair for part in parts for pair in part.pairs),
        tuple(exclusion for part in parts for exclusion in part.exclusions),
    )
