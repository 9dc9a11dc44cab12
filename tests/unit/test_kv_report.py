"""The sidecar's report, pure parts: peers from Pods, a round's verdict, the condition patch, Event names."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from disagg.operator.api import DisaggDeploymentSpec
from disagg.operator.builders.children import build
from disagg.operator.naming import Owner
from disagg.operator.policies.compat import evaluate
from disagg.rig.local_kubelet import pod_ready, resolve_env
from disagg.worker.contracts.peer_report import (
    MAX_DIFFERS_CHARS,
    MAX_PEERS,
    decode_peer_report,
    encode_peer_report,
)
from disagg.worker.contracts.pod_contract import PEER_REPORT_ANNOTATION, POD_CONDITION, SIDECAR_CONTAINER
from disagg.worker.kv.errors import CompatibilityHashMismatch, DisaggError, MissingLayers, PeerUnreachable
from disagg.worker.reporting.peer_check import (
    Outcome,
    Peer,
    PeerResult,
    peer_report,
    peers_from_pods,
    summarize,
)
from disagg.worker.reporting.pod_report import annotation_patch, condition_patch, event_body, event_name
from disagg.worker.sidecar.config import SidecarConfig, from_env

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pp2-hma.yaml"
T0 = datetime(2026, 11, 30, 9, 0, 0, tzinfo=UTC)


def built_pods() -> dict[str, dict[str, Any]]:
    """The operator's pod templates for the pp2-hma example, as pods named as their controllers name them."""
    spec = DisaggDeploymentSpec.model_validate(yaml.safe_load(EXAMPLE.read_text())["spec"])
    report = evaluate(spec)
    assert report.plan is not None
    objects = build(spec, Owner("gemma", "ns", "uid-1", 1), report.plan, report.hashes)
    templates = {
        obj["kind"]: obj["spec"]["template"]
        for obj in objects
        if obj["kind"] in ("StatefulSet", "Deployment") and obj["metadata"]["name"] != "gemma-router"
    }

    def pod(name: str, kind: str, ip: str | None) -> dict[str, Any]:
        template = templates[kind]
        return {
            "metadata": {**template["metadata"], "name": name, "namespace": "ns"},
            "spec": template["spec"],
            "status": {"podIP": ip} if ip else {},
        }

    return {
        "gemma-prefill-0-0": pod("gemma-prefill-0-0", "StatefulSet", "10.0.0.1"),
        "gemma-prefill-0-1": pod("gemma-prefill-0-1", "StatefulSet", "10.0.0.2"),
        "gemma-decode-7c9-abcde": pod("gemma-decode-7c9-abcde", "Deployment", "10.0.0.3"),
        "gemma-decode-7c9-fghij": pod("gemma-decode-7c9-fghij", "Deployment", None),
    }


def sidecar_config(tmp_path: Path, role: str, pod: str) -> SidecarConfig:
    doc = {
        "transferMode": "push",
        "blockSize": 32,
        "stages": [{"startLayer": 0, "endLayer": 31}, {"startLayer": 31, "endLayer": 62}],
        "model": {"layerKinds": ["full"] * 62, "numKVHeads": 16, "headSize": 128, "dtypeBytes": 2},
    }
    path = tmp_path / "topology.json"
    path.write_text(json.dumps(doc))
    return from_env({"DISAGG_ROLE": role, "DISAGG_TOPOLOGY_FILE": str(path), "POD_NAME": pod})


def test_peers_come_from_the_operators_pods_with_stage_engine_and_side_channel_port(tmp_path: Path) -> None:
    pods = built_pods()
    decode = sidecar_config(tmp_path, "decode", "gemma-decode-7c9-abcde")
    peers = peers_from_pods(pods.values(), decode)
    assert peers == [
        Peer("gemma-prefill-0-0", "prefill", 0, "gemma-prefill-0", "10.0.0.1", 5600),
        Peer("gemma-prefill-0-1", "prefill", 1, "gemma-prefill-0", "10.0.0.2", 5600),
    ]
    prefill = sidecar_config(tmp_path, "prefill", "gemma-prefill-0-1")
    decoders = peers_from_pods(pods.values(), prefill)
    assert [(p.pod, p.engine_id, p.host) for p in decoders] == [
        ("gemma-decode-7c9-abcde", "gemma-decode-7c9-abcde", "10.0.0.3"),
        ("gemma-decode-7c9-fghij", "gemma-decode-7c9-fghij", None),
    ]
    deleting = {**pods["gemma-decode-7c9-abcde"]}
    deleting["metadata"] = {**deleting["metadata"], "deletionTimestamp": "2026-11-30T09:00:00Z"}
    assert [p.pod for p in peers_from_pods([deleting], prefill)] == []


def decoder(name: str) -> Peer:
    return Peer(name, "decode", 0, name, "10.0.0.9", 5600)


def stage(index: int) -> Peer:
    return Peer(f"gemma-prefill-0-{index}", "prefill", index, "gemma-prefill-0", f"10.0.0.{index + 1}", 5600)


def test_one_refusing_decoder_does_not_make_the_stage_unready_but_is_reported(tmp_path: Path) -> None:
    prefill = sidecar_config(tmp_path, "prefill", "gemma-prefill-0-1")
    refusal = CompatibilityHashMismatch("NIXL compatibility hash mismatch: local aa, remote bb")
    outcome = summarize(prefill, [PeerResult(decoder("d-1"), None), PeerResult(decoder("d-2"), refusal)], [])
    assert (outcome.status, outcome.reason) == ("True", "SomePeersRefused")
    assert [r.peer.pod for r in outcome.refusals] == ["d-2"]
    assert (
        "decode pod d-2 at 10.0.0.9:5600 with CompatibilityHashMismatch: NIXL compatibility hash mismatch"
        in outcome.message
    )

    alone = summarize(prefill, [PeerResult(decoder("d-2"), refusal)], [decoder("d-3")])
    assert (alone.status, alone.reason) == ("False", "CompatibilityHashMismatch")
    assert "waiting for decode pod d-3 to get an IP" in alone.message


def test_a_decoder_needs_every_stage_of_a_prefill_engine(tmp_path: Path) -> None:
    decode = sidecar_config(tmp_path, "decode", "gemma-decode-7c9-abcde")
    missing = MissingLayers("layer model.layers.40.self_attn.attn is not advertised")
    refused = summarize(decode, [PeerResult(stage(0), None), PeerResult(stage(1), missing)], [])
    assert (refused.status, refused.reason) == ("False", "MissingLayers")
    assert "prefill stage 1 (pod gemma-prefill-0-1)" in refused.message
    waiting = summarize(decode, [PeerResult(stage(0), None)], [stage(1)])
    assert (waiting.status, waiting.reason) == ("Unknown", "AwaitingPeers")
    ready = summarize(decode, [PeerResult(stage(0), None), PeerResult(stage(1), None)], [])
    assert (ready.status, ready.reason) == ("True", "HandshakesSucceeded")


def test_the_condition_moves_its_transition_time_only_when_the_status_flips() -> None:
    failed = Outcome("False", "MissingLayers", "stage 1 lacks layer 40")
    first = condition_patch(None, failed, T0)
    assert first is not None
    (written,) = first["status"]["conditions"]
    assert written == {
        "type": POD_CONDITION,
        "status": "False",
        "reason": "MissingLayers",
        "message": "stage 1 lacks layer 40",
        "lastTransitionTime": "2026-11-30T09:00:00Z",
    }
    assert condition_patch([written], failed, T0 + timedelta(seconds=5)) is None
    other = Outcome("False", "PeerUnreachable", "decode pod d-1 did not answer")
    again = condition_patch([{"type": "Ready", "status": "True"}, written], other, T0 + timedelta(seconds=9))
    assert again is not None
    assert again["status"]["conditions"][0]["lastTransitionTime"] == "2026-11-30T09:00:00Z"
    flipped = condition_patch(
        [written], Outcome("True", "HandshakesSucceeded", "ok"), T0 + timedelta(minutes=1)
    )
    assert flipped is not None
    assert flipped["status"]["conditions"][0]["lastTransitionTime"] == "2026-11-30T09:01:00Z"


def test_equal_refusals_share_one_event_and_different_ones_do_not() -> None:
    pod = {"metadata": {"name": "gemma-prefill-0-1", "namespace": "ns", "uid": "u-1"}}
    body = event_body(pod, "Warning", "MissingLayers", "stage 1 lacks layer 40", T0)
    assert body["metadata"]["name"] == event_name(
        "gemma-prefill-0-1", "MissingLayers", "stage 1 lacks layer 40"
    )
    assert body["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "gemma-prefill-0-1",
        "namespace": "ns",
        "uid": "u-1",
    }
    assert (body["type"], body["reason"], body["count"]) == ("Warning", "MissingLayers", 1)
    assert event_name("p", "MissingLayers", "a") == event_name("p", "MissingLayers", "a")
    assert event_name("p", "MissingLayers", "a") != event_name("p", "MissingLayers", "b")
    assert event_name("p", "MissingLayers", "a") != event_name("p", "BlockSizeMismatch", "a")


def test_the_local_kubelet_resolves_the_downward_api_and_enforces_readiness_gates() -> None:
    pod = built_pods()["gemma-prefill-0-1"]
    pod["metadata"]["uid"] = "u-7"
    pod["spec"] = {**pod["spec"], "nodeName": "disagg-local-node"}
    sidecar = next(c for c in pod["spec"]["containers"] if c["name"] == SIDECAR_CONTAINER)
    env = resolve_env(pod, sidecar)
    assert env["POD_NAME"] == "gemma-prefill-0-1"
    assert env["POD_NAMESPACE"] == "ns"
    assert env["POD_UID"] == "u-7"
    assert env["POD_IP"] == "10.0.0.2"
    assert env["NODE_NAME"] == "disagg-local-node"
    assert env["DISAGG_DEPLOYMENT"] == "gemma"
    assert not pod_ready(pod, containers_ready=True), "the KV gate has no condition yet"
    pod["status"]["conditions"] = [{"type": POD_CONDITION, "status": "True"}]
    assert pod_ready(pod, containers_ready=True)
    assert not pod_ready(pod, containers_ready=False)


def test_a_rounds_results_become_the_pods_peer_report() -> None:
    mismatch = CompatibilityHashMismatch("NIXL compatibility hash mismatch: local aa, remote bb")
    results = [
        PeerResult(decoder("d-1"), None, "d-1-1a2b3c4d", "aa"),
        PeerResult(decoder("d-2"), mismatch, "d-2-5e6f7a8b", "bb"),
        # A peer's answer is untrusted: what does not fit the report is unknown, not a broken report.
        PeerResult(decoder("d-3"), DisaggError("odd", reason="not camel case"), "x" * 1000, "h" * 1000),
        PeerResult(decoder("d-4"), PeerUnreachable("did not answer")),
    ]
    report = peer_report("gemma-prefill-0-0a0b0c0d", "aa", results)
    assert decode_peer_report(encode_peer_report(report)) == report
    assert (report.version, report.engine_id, report.kv_hash) == (1, "gemma-prefill-0-0a0b0c0d", "aa")
    assert [(v.pod, v.engine_id, v.ok, v.reason, v.kv_hash) for v in report.peers] == [
        ("d-1", "d-1-1a2b3c4d", True, "HandshakesSucceeded", "aa"),
        ("d-2", "d-2-5e6f7a8b", False, "CompatibilityHashMismatch", "bb"),
        ("d-3", "", False, "HandshakeFailed", ""),
        ("d-4", "", False, "PeerUnreachable", ""),
    ]
    many = [PeerResult(decoder(f"d-{i}"), None, f"d-{i}", "aa") for i in range(MAX_PEERS + 5)]
    assert len(peer_report("e", "aa", many).peers) == MAX_PEERS


def test_the_peer_report_annotation_is_written_only_when_it_changed() -> None:
    report = peer_report("e-1", "aa", [PeerResult(decoder("d-1"), None, "d-1", "aa")])
    patch = annotation_patch({"other": "kept"}, report)
    assert patch == {"metadata": {"annotations": {PEER_REPORT_ANNOTATION: encode_peer_report(report)}}}
    assert annotation_patch({PEER_REPORT_ANNOTATION: encode_peer_report(report)}, report) is None
    assert annotation_patch(None, None) is None, "a round without a report leaves the annotation alone"
    changed = peer_report("e-1", "aa", [PeerResult(decoder("d-1"), PeerUnreachable("gone"), "", "")])
    assert annotation_patch({PEER_REPORT_ANNOTATION: encode_peer_report(report)}, changed) is not None


def test_a_hash_refusal_reports_what_differs_within_its_bound_and_a_full_report_still_fits() -> None:
    dtype = (
        "the KV dtype (dtype, or cache_dtype where set), likely, by block_lens: 256 KV bytes per token here"
    )
    refusal = CompatibilityHashMismatch("hash mismatch", differences=(dtype + " " + "x" * 400, "the model"))
    [verdict] = peer_report("e-1", "aa", [PeerResult(decoder("d-2"), refusal, "d-2-1a2b3c4d", "bb")]).peers
    assert verdict.differs.startswith(dtype) and verdict.differs.endswith("…")
    assert len(verdict.differs) == MAX_DIFFERS_CHARS
    # Other refusals carry none, and the annotation round-trips it.
    [other] = peer_report("e-1", "aa", [PeerResult(decoder("d-3"), MissingLayers("no layer 40"))]).peers
    assert other.differs == ""
    text = encode_peer_report(peer_report("e-1", "aa", [PeerResult(decoder("d-2"), refusal)]))
    assert decode_peer_report(text).peers[0].differs == verdict.differs
    # Every peer refused with a long difference: the differences go, the report still fits its bound.
    many = [
        PeerResult(decoder(f"d-{i:04d}".ljust(60, "x")), refusal, "e" * 70, "b" * 64)
        for i in range(MAX_PEERS)
    ]
    full = peer_report("e-1", "aa", many)
    assert len(full.peers) == MAX_PEERS and {v.differs for v in full.peers} == {""}
    decode_peer_report(encode_peer_report(full))
