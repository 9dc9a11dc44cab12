"""`spec.kvTransfer.transport`: what it refuses before any pod exists, the UCX settings it builds, and each
pair's transport in the status (from the prefill pods' peer reports), with a reason when one is not the one
demanded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from built import container, env, objects
from dd_specs import DELETE, load, spec, spec_dict

from disagg.operator.api import ConditionStatus, DisaggDeployment
from disagg.operator.builders.pod_template import ENGINE_CONTAINER
from disagg.operator.control.reconcile import judge
from disagg.operator.crd import PRINTER_COLUMNS
from disagg.operator.kv_status import KVVerdict, pair_transports, pod_kv, transport_summary, transport_verdict
from disagg.operator.naming import Installation
from disagg.worker.contracts.peer_report import (
    PEER_REPORT_VERSION,
    PeerReport,
    PeerVerdict,
    encode_peer_report,
)
from disagg.worker.contracts.pod_contract import PEER_REPORT_ANNOTATION, SIDECAR_CONTAINER

REFERENCE = Path(__file__).parents[2] / "examples" / "reference-pp2-hma.yaml"
PREFILL, DECODE = ("StatefulSet", "gemma-pp2-prefill-0"), ("Deployment", "gemma-pp2-decode")


def test_rdma_without_an_rdma_device_is_refused_before_any_pod_exists() -> None:
    verdict = judge(spec_dict(spec({"kvTransfer": {"transport": "rdma", "rdma": DELETE}})), Installation())
    assert [v.reason for v in verdict.violations] == ["KVTransportNeedsRdma"]
    assert "spec.kvTransfer.rdma" in verdict.violations[0].message
    with_devices = spec(
        {"kvTransfer": {"transport": "rdma", "rdma": {"resourceName": "rdma/ib", "count": 1}}}
    )
    assert not judge(spec_dict(with_devices), Installation()).violations
    assert spec().kv_transfer.transport.value == "any"


def test_a_vllm_engine_gets_the_transports_ucx_settings_and_logs_its_lanes_for_its_sidecar() -> None:
    built = objects(spec({"kvTransfer": {"transport": "tcp"}}))
    for key in (PREFILL, DECODE):
        engine, sidecar = (
            env(container(built[key], ENGINE_CONTAINER)),
            env(container(built[key], SIDECAR_CONTAINER)),
        )
        assert engine["UCX_TLS"] == "tcp,self,cuda_copy"
        assert engine["UCX_PROTO_INFO"] == "y"
        assert engine["UCX_LOG_FILE"] == "/dev/shm/ucx.%h.%p.log"
        assert sidecar["DISAGG_KV_TRANSPORT"] == "tcp"
        assert "UCX_TLS" not in sidecar  # the watching sidecar owns no agent
    default = env(container(objects(spec())[PREFILL], ENGINE_CONTAINER))
    assert "UCX_TLS" not in default and default["UCX_PROTO_INFO"] == "y"


def test_the_reference_engines_transfer_sidecar_gets_them_instead() -> None:
    document = load(REFERENCE)
    document["spec"]["kvTransfer"]["transport"] = "shm"
    model = DisaggDeployment.model_validate(document).spec
    for obj in objects(model).values():
        if obj["kind"] not in ("StatefulSet", "Deployment") or SIDECAR_CONTAINER not in str(obj):
            continue
        if obj["metadata"]["name"].endswith("router"):
            continue
        sidecar = env(container(obj, SIDECAR_CONTAINER))
        assert sidecar["UCX_TLS"] == "sm,tcp,self,cuda_copy"
        assert sidecar["DISAGG_KV_TRANSPORT"] == "shm"
        assert "UCX_TLS" not in env(container(obj, ENGINE_CONTAINER))


def prefill_pod(name: str, pairs: dict[str, tuple[str, str]]) -> dict[str, Any]:
    report = PeerReport(
        version=PEER_REPORT_VERSION,
        engine_id=f"{name}-engine",
        kv_hash="h",
        peers=tuple(
            PeerVerdict(
                pod=decode,
                engine_id=f"{decode}-engine",
                ok=True,
                reason="HandshakesSucceeded",
                kv_hash="h",
                transport=transport,
                lanes=lanes,
                kv_bytes=4096,
                gbps=1.5,
            )
            for decode, (transport, lanes) in pairs.items()
        ),
    )
    return {
        "metadata": {
            "name": name,
            "labels": {"disagg.io/role": "prefill"},
            "annotations": {PEER_REPORT_ANNOTATION: encode_peer_report(report)},
        },
        "status": {"conditions": []},
    }


OK = KVVerdict(ConditionStatus.TRUE, "HandshakesSucceeded", "all good")


def test_each_pairs_transport_is_listed_and_summed_up_for_the_printer_column() -> None:
    pods = [
        pod_kv(prefill_pod("p-1", {"d-0": ("shm", "cma/memory")})),
        pod_kv(prefill_pod("p-0", {"d-1": ("tcp", "tcp/lo"), "d-0": ("shm", "cma/memory")})),
    ]
    assert transport_summary(pods) == "shm 2/3, tcp 1/3"
    assert [(p.prefill_pod, p.decode_pod, p.transport) for p in pair_transports(pods)] == [
        ("p-0", "d-0", "shm"),
        ("p-0", "d-1", "tcp"),
        ("p-1", "d-0", "shm"),
    ]
    assert pair_transports(pods)[0].kv_bytes == 4096 and pair_transports(pods)[0].gbps == 1.5
    assert transport_verdict(OK, pods, "any") == OK
    assert {"name": "Transport", "jsonPath": ".status.kvTransport"}.items() <= next(
        c for c in PRINTER_COLUMNS if c["name"] == "Transport"
    ).items()


def test_a_pair_that_took_another_transport_than_demanded_turns_kv_transfer_ready_false() -> None:
    pods = [pod_kv(prefill_pod("p-0", {"d-0": ("tcp", "tcp/lo"), "d-1": ("rdma", "rc_mlx5/mlx5_0:1")}))]
    verdict = transport_verdict(OK, pods, "rdma")
    assert verdict.status is ConditionStatus.FALSE and verdict.reason == "KVTransportMismatch"
    assert "p-0 to decode pod d-0: tcp (tcp/lo)" in verdict.message and "d-1" not in verdict.message
    failing = KVVerdict(ConditionStatus.FALSE, "PeerUnreachable", "down")
    assert transport_verdict(failing, pods, "rdma") == failing
    assert transport_summary([pod_kv(prefill_pod("p-0", {}))]) is None
