"""`KVTransferReady` and `Routable`: the sidecars' handshake results, aggregated from their Pods. Pure.

Each sidecar writes the outcome of its handshakes to its own Pod as the condition
`disagg.io/kv-transfer-ready` (the readiness gate the builders declare), with a CamelCase reason such as
`CompatibilityHashMismatch` and a message naming the peer. The deployment's condition carries the first
failure's reason and a message naming every failing stage and pod, so `kubectl describe` says which stage
failed against which decode pod, and why. Engines whose live hashes agree but differ from the spec's
prediction are True with reason `CompatibilityHashPredictionDiffers`, naming the likely factor.

A prefill pod's peer report also says, per decode pod, the transport UCX chose for its KV and the bytes and
GB/s pushed (`worker.reporting.transport_report`): `pair_transports` lists them for the status,
`transport_summary` sums them up for `kubectl get` (`shm 2/2`), and `transport_verdict` turns
`KVTransferReady` False with `KVTransportMismatch` where a pair's KV took another transport than the spec's
`kvTransfer.transport`.

`Routable` counts the (prefill engine, decode pod) pairs the router may send requests to, by the same
`pairing.routing_from_pods` over the same pods (their `disagg.io/kv-peers` reports), and names each excluded
pair with its reason, so `kubectl get disagg` says which pair gets no traffic and why.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from disagg.operator.api import REASON_PATTERN, ConditionStatus
from disagg.worker.contracts.pairing import Exclusion, Routing
from disagg.worker.contracts.peer_report import PeerReportError, decode_peer_report
from disagg.worker.contracts.pod_contract import PEER_REPORT_ANNOTATION, POD_CONDITION, ROLE_LABEL
from disagg.worker.contracts.ucx_lanes import satisfies
from disagg.worker.kv.layout import natural_sort_key

_ROLE_ORDER: Final = {"prefill": 0, "decode": 1}
# A sidecar's True with this reason: its engine's peers accept it, the spec's predicted hash does not.
PREDICTION_DIFFERS: Final = "CompatibilityHashPredictionDiffers"
# The Routable message lists excluded pairs up to about this many characters (a condition holds 32768).
MAX_ROUTABLE_MESSAGE: Final = 8000


MAX_PAIR_TRANSPORTS: Final = 256
"""Pairs listed in the status (the summary counts them all)."""


@dataclass(frozen=True)
class PairTransport:
    """What one prefill pod's worker says of its KV to one decode pod."""

    prefill_pod: str
    decode_pod: str
    transport: str
    lanes: str
    kv_bytes: int
    gbps: float


@dataclass(frozen=True)
class PodKV:
    """One engine pod's sidecar report; `status` None means the sidecar has not written one yet."""

    name: str
    role: str
    stage: int | None
    status: ConditionStatus | None
    reason: str
    message: str
    transports: tuple[PairTransport, ...] = ()

    @property
    def where(self) -> str:
        if self.role == "prefill" and self.stage is not None:
            return f"prefill stage {self.stage} (pod {self.name})"
        return f"{self.role} pod {self.name}"


@dataclass(frozen=True)
class KVVerdict:
    status: ConditionStatus
    reason: str
    message: str


def pod_kv(pod: Mapping[str, Any]) -> PodKV:
    """Read a Pod (camelCase dict as the API serves it). A prefill pod's stage is its StatefulSet ordinal."""
    metadata = pod.get("metadata") or {}
    name = str(metadata.get("name", ""))
    role = str((metadata.get("labels") or {}).get(ROLE_LABEL, ""))
    stage = _ordinal(name) if role == "prefill" else None
    transports = _transports(name, metadata) if role == "prefill" else ()
    for condition in (pod.get("status") or {}).get("conditions") or ():
        if condition.get("type") == POD_CONDITION:
            return PodKV(
                name=name,
                role=role,
                stage=stage,
                status=ConditionStatus(condition.get("status", "Unknown")),
                reason=_reason(condition.get("reason")),
                message=str(condition.get("message") or ""),
                transports=transports,
            )
    return PodKV(name=name, role=role, stage=stage, status=None, reason="", message="", transports=transports)


def _transports(name: str, metadata: Mapping[str, Any]) -> tuple[PairTransport, ...]:
    text = (metadata.get("annotations") or {}).get(PEER_REPORT_ANNOTATION)
    if not text:
        return ()
    try:
        report = decode_peer_report(text)
    except PeerReportError:
        return ()  # Routable names an unreadable report; the transport is then unknown, not an error.
    return tuple(
        PairTransport(name, v.pod, v.transport, v.lanes, v.kv_bytes, v.gbps)
        for v in report.peers
        if v.transport
    )


def pair_transports(pods: Iterable[PodKV]) -> list[PairTransport]:
    """Every reported pair's transport, prefill pods in stage order, at most `MAX_PAIR_TRANSPORTS`."""
    ordered = sorted(pods, key=lambda pod: natural_sort_key(pod.name))
    pairs = [
        pair
        for pod in ordered
        for pair in sorted(pod.transports, key=lambda p: natural_sort_key(p.decode_pod))
    ]
    return pairs[:MAX_PAIR_TRANSPORTS]


def transport_summary(pods: Iterable[PodKV]) -> str | None:
    """`shm 2/2`: how many of the pairs the prefill pods reported took each transport (None before any)."""
    counts: dict[str, int] = {}
    for pod in pods:
        for pair in pod.transports:
            counts[pair.transport] = counts.get(pair.transport, 0) + 1
    total = sum(counts.values())
    if not total:
        return None
    return ", ".join(f"{transport} {n}/{total}" for transport, n in sorted(counts.items()))[:64]


def transport_verdict(verdict: KVVerdict, pods: Iterable[PodKV], demanded: str) -> KVVerdict:
    """`verdict`, unless it is True and a pair's KV took another transport than `demanded`: then False with
    `KVTransportMismatch`, naming each such pair. A failed or pending handshake keeps its own reason."""
    if verdict.status is not ConditionStatus.TRUE:
        return verdict
    wrong = [
        pair
        for pair in pair_transports(pods)
        if not satisfies(demanded, pair.lanes.split(",") if pair.lanes else [pair.transport])
    ]
    if not wrong:
        return verdict
    details = "; ".join(
        f"prefill pod {p.prefill_pod} to decode pod {p.decode_pod}: {p.transport}"
        + (f" ({p.lanes})" if p.lanes else "")
        for p in wrong
    )
    return KVVerdict(
        ConditionStatus.FALSE,
        "KVTransportMismatch",
        f"spec.kvTransfer.transport is {demanded} but {len(wrong)} pair(s) moved KV over another "
        f"transport, as UCX chose it: {details}",
    )


def aggregate(pods: Iterable[PodKV]) -> KVVerdict:
    """False if any sidecar reports a failure, Unknown while any has not reported, True when all succeeded."""
    ordered = sorted(pods, key=lambda pod: (_ROLE_ORDER.get(pod.role, 2), natural_sort_key(pod.name)))
    if not ordered:
        return KVVerdict(ConditionStatus.UNKNOWN, "NoPods", "no engine pods exist yet")
    failing = [pod for pod in ordered if pod.status is ConditionStatus.FALSE]
    if failing:
        details = "; ".join(
            f"{pod.where}: {pod.reason}" + (f": {pod.message}" if pod.message else "") for pod in failing
        )
        return KVVerdict(
            ConditionStatus.FALSE,
            failing[0].reason,
            f"{len(failing)} of {len(ordered)} sidecars report a failed KV handshake: {details}",
        )
    waiting = [pod for pod in ordered if pod.status is not ConditionStatus.TRUE]
    if waiting:
        return KVVerdict(
            ConditionStatus.UNKNOWN,
            "AwaitingHandshake",
            f"{len(waiting)} of {len(ordered)} sidecars have not reported a KV handshake yet: "
            + ", ".join(pod.where for pod in waiting),
        )
    mispredicted = [pod for pod in ordered if pod.reason == PREDICTION_DIFFERS]
    if mispredicted:
        # The engines accept one another (vLLM checks their live hashes, not the operator's prediction): a
        # warning to fix the spec, not a failed gate.
        return KVVerdict(
            ConditionStatus.TRUE,
            "CompatibilityHashPredictionDiffers",
            f"all {len(ordered)} sidecars completed their KV handshakes, but the engines' live compatibility "
            f"hash is not the one the spec predicts: "
            + "; ".join(f"{pod.where}: {pod.message}" for pod in mispredicted),
        )
    return KVVerdict(
        ConditionStatus.TRUE,
        "HandshakesSucceeded",
        f"all {len(ordered)} sidecars completed their KV handshakes with their peers",
    )


def routable_pairs(routing: Routing) -> str:
    """`routable/all` (prefill engine, decode pod) pairs: `status.routablePairs`, the Pairs column."""
    return f"{len(routing.pairs)}/{len(routing.pairs) + len(routing.exclusions)}"


def peers_reported(pods: Iterable[Mapping[str, Any]]) -> bool:
    """Whether any engine pod carries a peer report (`disagg.io/kv-peers`) yet."""
    return any(
        PEER_REPORT_ANNOTATION in ((pod.get("metadata") or {}).get("annotations") or {}) for pod in pods
    )


def routable(routing: Routing, reported: bool) -> KVVerdict:
    """`Routable`: the pairs the router may use (`pairing.routing_from_pods`, the router's own function), and
    every excluded pair with its reason. True while at least one pair is routable; Unknown while there is
    no pair to judge or no pod has reported its peer checks; False otherwise."""
    total = len(routing.pairs) + len(routing.exclusions)
    if total == 0:
        return KVVerdict(
            ConditionStatus.UNKNOWN, "NoPairs", "no prefill engine and decode pod exist together yet"
        )
    if not routing.pairs and not reported:
        return KVVerdict(
            ConditionStatus.UNKNOWN,
            "AwaitingPeerReports",
            f"none of the {total} prefill/decode pairs' sidecars has reported its peer checks yet",
        )
    head = f"{len(routing.pairs)} of {total} prefill/decode pairs routable"
    excluded = _exclusions(routing.exclusions)
    message = f"{head}; excluded: {excluded}" if excluded else head
    if routing.pairs:
        return KVVerdict(ConditionStatus.TRUE, "PairsRoutable", message)
    return KVVerdict(ConditionStatus.FALSE, "NoRoutablePair", message)


def _exclusions(exclusions: Sequence[Exclusion]) -> str:
    """`prefill ↔ decode: Reason: message; ...`, cut to `MAX_ROUTABLE_MESSAGE` with a count of the rest."""
    parts: list[str] = []
    size = 0
    for index, exclusion in enumerate(exclusions):
        part = f"{exclusion.prefill} \u2194 {exclusion.decode}: {exclusion.reason}: {exclusion.message}"
        if parts and size + len(part) > MAX_ROUTABLE_MESSAGE:
            parts.append(f"and {len(exclusions) - index} more")
            break
        parts.append(part if len(part) <= MAX_ROUTABLE_MESSAGE else part[: MAX_ROUTABLE_MESSAGE - 3] + "...")
        size += len(part) + 2
    return "; ".join(parts)


def _reason(raw: object) -> str:
    # A sidecar's reason is copied into our own condition, whose schema requires the CamelCase pattern.
    text = str(raw or "")
    return text if re.match(REASON_PATTERN, text) else "TransferFailed"


def _ordinal(name: str) -> int | None:
    suffix = name.rsplit("-", 1)[-1]
    return int(suffix) if suffix.isdigit() else None
