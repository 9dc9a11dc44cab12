"""KVTransferReady aggregation from the sidecars' Pod conditions, and the Routable verdict's message."""

from __future__ import annotations

from typing import Any

import pytest

from disagg.operator.api import ConditionStatus
from disagg.operator.kv_status import MAX_ROUTABLE_MESSAGE, aggregate, pod_kv, routable, routable_pairs
from disagg.worker.contracts.pairing import Exclusion, Routing
from disagg.worker.contracts.pod_contract import POD_CONDITION
from disagg.worker.kv import errors

HANDSHAKE_REASONS = [
    cls.reason
    for cls in (
        errors.PeerUnreachable,
        errors.CompatibilityHashMismatch,
        errors.WireFormatError,
        errors.MissingLayers,
        errors.BlockSizeMismatch,
        errors.RegionGeometryMismatch,
        errors.EngineIdMismatch,
        errors.TransferFailed,
    )
]


def pod(name: str, role: str, condition: dict[str, Any] | None = None) -> dict[str, Any]:
    conditions = [{"type": "PodScheduled", "status": "False"}]
    if condition is not None:
        conditions.append({"type": POD_CONDITION, **condition})
    return {
        "metadata": {"name": name, "labels": {"disagg.io/role": role}},
        "status": {"phase": "Pending", "conditions": conditions},
    }


def ok(name: str, role: str) -> dict[str, Any]:
    return pod(name, role, {"status": "True", "reason": "HandshakesSucceeded", "message": "ok"})


def test_reasons_cover_the_issue_list() -> None:
    assert set(HANDSHAKE_REASONS) == {
        "PeerUnreachable",
        "CompatibilityHashMismatch",
        "ConnectorVersionMismatch",
        "MissingLayers",
        "BlockSizeMismatch",
        "RegionGeometryMismatch",
        "EngineIdMismatch",
        "TransferFailed",
    }


def test_no_pods_is_unknown() -> None:
    verdict = aggregate([])
    assert (verdict.status, verdict.reason) == (ConditionStatus.UNKNOWN, "NoPods")


def test_unreported_pods_are_named() -> None:
    verdict = aggregate([pod_kv(ok("d-prefill-0-0", "prefill")), pod_kv(pod("d-prefill-0-1", "prefill"))])
    assert (verdict.status, verdict.reason) == (ConditionStatus.UNKNOWN, "AwaitingHandshake")
    assert "prefill stage 1 (pod d-prefill-0-1)" in verdict.message
    assert "d-prefill-0-0" not in verdict.message


def test_all_true_is_true() -> None:
    pods = [ok("d-prefill-0-0", "prefill"), ok("d-prefill-0-1", "prefill"), ok("d-decode-abc", "decode")]
    verdict = aggregate(pod_kv(p) for p in pods)
    assert (verdict.status, verdict.reason) == (ConditionStatus.TRUE, "HandshakesSucceeded")
    assert "all 3 sidecars" in verdict.message


@pytest.mark.parametrize("reason", HANDSHAKE_REASONS)
def test_failure_reason_stage_and_peer_reach_the_message(reason: str) -> None:
    failing = pod(
        "d-prefill-0-1",
        "prefill",
        {"status": "False", "reason": reason, "message": "against decode pod d-decode-7f9c-x2"},
    )
    verdict = aggregate(
        [pod_kv(ok("d-prefill-0-0", "prefill")), pod_kv(failing), pod_kv(ok("d-decode-a", "decode"))]
    )
    assert (verdict.status, verdict.reason) == (ConditionStatus.FALSE, reason)
    assert verdict.message == (
        f"1 of 3 sidecars report a failed KV handshake: prefill stage 1 (pod d-prefill-0-1): {reason}: "
        "against decode pod d-decode-7f9c-x2"
    )


def test_first_failure_in_stage_order_gives_the_reason_and_all_are_listed() -> None:
    pods = [
        pod("d-decode-a", "decode", {"status": "False", "reason": "PeerUnreachable", "message": "p"}),
        pod("d-prefill-1-10", "prefill", {"status": "False", "reason": "MissingLayers", "message": "m"}),
        pod("d-prefill-1-2", "prefill", {"status": "False", "reason": "BlockSizeMismatch", "message": "b"}),
    ]
    verdict = aggregate(pod_kv(p) for p in pods)
    assert verdict.reason == "BlockSizeMismatch"
    assert verdict.message.index("prefill stage 2") < verdict.message.index("prefill stage 10")
    assert verdict.message.index("prefill stage 10") < verdict.message.index("decode pod d-decode-a")


def test_failure_wins_over_unreported() -> None:
    pods = [pod("d-prefill-0-0", "prefill"), pod("d-decode-a", "decode", {"status": "False", "reason": "X"})]
    assert aggregate(pod_kv(p) for p in pods).status is ConditionStatus.FALSE


def test_reason_that_is_not_camel_case_becomes_transfer_failed() -> None:
    kv = pod_kv(pod("d-decode-a", "decode", {"status": "False", "reason": "not a reason!", "message": "x"}))
    assert kv.reason == "TransferFailed"


def test_engines_that_agree_against_the_prediction_are_ready_with_a_warning_reason() -> None:
    note = "the prediction differs in nixl_connector_version (the engine speaks 14 or 15)"
    pods = [
        ok("p-0", "prefill"),
        pod(
            "d-1",
            "decode",
            {"status": "True", "reason": "CompatibilityHashPredictionDiffers", "message": note},
        ),
    ]
    verdict = aggregate(pod_kv(p) for p in pods)
    assert (verdict.status, verdict.reason) == (ConditionStatus.TRUE, "CompatibilityHashPredictionDiffers")
    assert f"decode pod d-1: {note}" in verdict.message


def test_the_routable_message_names_excluded_pairs_within_a_bound() -> None:
    exclusions = tuple(
        Exclusion(
            "g-prefill-0-0", f"g-decode-{i}", "PodNotReady", f"decode pod g-decode-{i} is not Ready " * 5
        )
        for i in range(2000)
    )
    verdict = routable(Routing((), (), (), exclusions), reported=True)
    assert (verdict.status, verdict.reason) == (ConditionStatus.FALSE, "NoRoutablePair")
    assert verdict.message.startswith(
        "0 of 2000 prefill/decode pairs routable; excluded: g-prefill-0-0 \u2194 g-decode-0: PodNotReady: "
    )
    assert len(verdict.message) < MAX_ROUTABLE_MESSAGE + 300
    shown = verdict.message.count("\u2194")
    assert verdict.message.endswith(f"; and {2000 - shown} more")
    assert routable_pairs(Routing((), (), (), exclusions)) == "0/2000"
