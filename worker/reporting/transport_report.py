"""Each pair's transport and bandwidth in a prefill pod's peer report, and a warning where the spec demanded
another transport. Pure.

The prefill worker's ledger (`sidecar.pairs`, from UCX's own lane selection and the completed pushes) is keyed
by the decode engine's live id, which the round's verdicts carry; a verdict whose engine the worker has not
connected to yet stays without a transport.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Final

import msgspec

from disagg.worker.contracts.peer_report import MAX_LANES_CHARS, MAX_PEER_REPORT_BYTES, PeerReport
from disagg.worker.contracts.pod_contract import KV_TRANSPORT_ENV
from disagg.worker.contracts.ucx_lanes import satisfies
from disagg.worker.reporting.peer_check import Outcome
from disagg.worker.sidecar.pairs import PairStats

TRANSPORT_ENV: Final = KV_TRANSPORT_ENV
MISMATCH_REASON: Final = "KVTransportMismatch"


def with_transports(outcome: Outcome, pairs: Mapping[str, PairStats], demanded: str) -> Outcome:
    """`outcome` with each verdict's pair transport, and a Warning per pair whose KV took another transport
    than `demanded` (`any` accepts every transport)."""
    if outcome.report is None or not pairs:
        return outcome
    verdicts, warnings = [], list(outcome.warnings)
    for verdict in outcome.report.peers:
        stats = pairs.get(verdict.engine_id) if verdict.engine_id else None
        if stats is None or not stats.lanes:
            verdicts.append(verdict)
            continue
        lanes = ",".join(stats.lanes)
        verdicts.append(
            msgspec.structs.replace(
                verdict,
                transport=stats.transport,
                lanes=lanes if len(lanes) <= MAX_LANES_CHARS else "",
                kv_bytes=stats.nbytes,
                gbps=round(min(stats.gbps, 1e6), 3),
            )
        )
        if not satisfies(demanded, stats.lanes):
            warnings.append(
                (
                    MISMATCH_REASON,
                    f"decode pod {verdict.pod}: KV moves over {stats.transport} ({lanes}), the spec demands "
                    f"{demanded}",
                )
            )
    report = msgspec.structs.replace(outcome.report, peers=tuple(verdicts))
    if len(msgspec.json.encode(report)) > MAX_PEER_REPORT_BYTES:
        report = _without_lanes(report)
    return replace(outcome, report=report, warnings=tuple(warnings))


def _without_lanes(report: PeerReport) -> PeerReport:
    # The lanes are detail: a report with every pair's must still fit, with the transport alone.
    return msgspec.structs.replace(
        report, peers=tuple(msgspec.structs.replace(v, lanes="") for v in report.peers)
    )
