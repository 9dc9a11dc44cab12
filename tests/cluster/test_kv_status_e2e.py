"""KVTransferReady end to end on the real API server: the operator, the pods, and one sidecar per pod.

The operator (a real `disagg operator run`) creates the StatefulSet and Deployment; the controller manager
creates their pods. There is no kubelet, so `LocalKubelet` binds each pod, gives it a loopback IP, marks it
running and starts its sidecar as a local process with the pod's downward-API identity: each one registers
a real NIXL agent, serves its handshake payload on its side channel, handshakes the other role's pods and
writes its Pod's `disagg.io/kv-transfer-ready` condition, which the operator aggregates.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from local_cluster import ControlPlane
from operator_harness import Cluster, example, wait_for

from disagg.operator.api import DisaggDeploymentSpec
from disagg.operator.policies.compat import role_factors
from disagg.rig.local_kubelet import LocalKubelet, with_engine_hash, with_layer_names
from disagg.worker.contracts.pairing import Routing, routing_from_pods
from disagg.worker.contracts.peer_report import decode_peer_report
from disagg.worker.contracts.pod_contract import PEER_REPORT_ANNOTATION, POD_CONDITION
from disagg.worker.kv import wire
from disagg.worker.kv.errors import MissingLayers, PeerUnreachable
from disagg.worker.reporting.peer_check import Outcome, Peer, PeerResult, peer_report
from disagg.worker.reporting.pod_report import PodReporter

NAME = "kv"
# A small hybrid model (sliding-window layers with a full-attention layer every 6th) keeps the pools tiny.
SPEC_PATCH: dict[str, Any] = {
    "model": {"numLayers": 12, "numKvHeads": 4, "headSize": 16},
    "prefill": {"pipelineParallelSize": 2},
    "decode": {"replicas": 2},
    # What these tests judge is the sidecars' KV status; the router's own tests run it against these pods.
    "router": {"enabled": False},
}
TIMEOUT_S = 120.0
T0 = datetime(2026, 11, 30, 9, 0, 0, tzinfo=UTC)


@pytest.fixture
def kubelet(cluster: Cluster, ns: str, tmp_path: Path) -> Iterator[LocalKubelet]:
    kubelet = LocalKubelet(cluster.cp.api_client, cluster.cp.kubeconfig, ns, NAME, tmp_path / "pods")
    try:
        yield kubelet
    finally:
        kubelet.stop_all()


def deploy(cluster: Cluster, ns: str, extra: dict[str, Any] | None = None) -> DisaggDeploymentSpec:
    # Each run its own side-channel port: another run's pods may share a loopback subnet by chance.
    patch = {
        **SPEC_PATCH,
        "kvTransfer": {"sideChannelPort": 20000 + secrets.randbelow(20000)},
        **(extra or {}),
    }
    document = example("pp2-hma.yaml", ns, NAME, patch)
    result = cluster.kubectl_apply(document)
    assert result.returncode == 0, result.stderr
    return DisaggDeploymentSpec.model_validate(document["spec"])


def kv_condition(
    cluster: Cluster, kubelet: LocalKubelet, ns: str, status: str, reason: str
) -> dict[str, Any]:
    """Play kubelet until the deployment's KVTransferReady has this status and reason."""

    def probe() -> dict[str, Any] | None:
        kubelet.sync()
        found = cluster.condition(ns, NAME, "KVTransferReady")
        return found if found and (found["status"], found["reason"]) == (status, reason) else None

    try:
        return wait_for(f"KVTransferReady={status} ({reason})", probe, timeout=TIMEOUT_S, interval=0.3)
    except AssertionError as error:
        logs = "\n".join(f"--- {name}\n{kubelet.log_tail(name, 8)}" for name in sorted(kubelet.pods))
        found = cluster.condition(ns, NAME, "KVTransferReady")
        raise AssertionError(f"{error}\nlast KVTransferReady: {found}\n{logs}") from None


def pods(cluster: Cluster, ns: str) -> dict[str, dict[str, Any]]:
    return {pod["metadata"]["name"]: pod for pod in cluster.children(ns, NAME)["Pod"]}


def pod_conditions(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in pod["status"].get("conditions") or ()}


def role_pods(cluster: Cluster, ns: str, role: str) -> list[str]:
    return sorted(
        n for n, p in pods(cluster, ns).items() if p["metadata"]["labels"]["disagg.io/role"] == role
    )


def events(cluster: Cluster, ns: str, pod: str, reason: str) -> list[dict[str, Any]]:
    response = cluster.core.list_namespaced_event(
        ns, field_selector=f"involvedObject.name={pod},reason={reason}", _preload_content=False
    )
    items: list[dict[str, Any]] = json.loads(response.data)["items"]
    return items


def test_healthy_topology_turns_kv_transfer_ready_and_the_pods_ready(
    cluster: Cluster, ns: str, kubelet: LocalKubelet
) -> None:
    deploy(cluster, ns)
    ready = kv_condition(cluster, kubelet, ns, "True", "HandshakesSucceeded")
    assert "all 4 sidecars" in ready["message"]

    def all_ready() -> dict[str, dict[str, Any]] | None:
        # The kubelet writes Ready from the pod's gate on its next sync after the sidecar's condition.
        kubelet.sync()
        found = pods(cluster, ns)
        flags = [pod_conditions(pod).get("Ready", {}).get("status") for pod in found.values()]
        return found if flags and all(flag == "True" for flag in flags) else None

    found = wait_for("every pod Ready", all_ready, timeout=TIMEOUT_S, interval=0.3)
    assert len(found) == 4
    for name, pod in found.items():
        # What the local kubelet wrote, as a kubelet would: bound, running, its own IP.
        assert pod["spec"]["nodeName"] and pod["status"]["phase"] == "Running"
        assert pod["status"]["podIP"] == kubelet.ips[name]
        assert pod["spec"]["readinessGates"] == [{"conditionType": POD_CONDITION}]
        conditions = pod_conditions(pod)
        assert conditions[POD_CONDITION]["status"] == "True", (name, conditions)
        assert conditions["Ready"]["status"] == "True", (name, conditions)
    # Each sidecar names the peers it handshook: a decode pod both prefill stages, a stage both decode pods.
    decoders = role_pods(cluster, ns, "decode")
    stage1 = pod_conditions(found[f"{NAME}-prefill-0-1"])[POD_CONDITION]["message"]
    assert all(f"decode pod {d}" in stage1 for d in decoders), stage1
    decode = pod_conditions(found[decoders[0]])[POD_CONDITION]["message"]
    assert f"prefill stage 0 (pod {NAME}-prefill-0-0)" in decode
    assert f"prefill stage 1 (pod {NAME}-prefill-0-1)" in decode

    def available() -> dict[str, Any] | None:
        kubelet.sync()
        found = cluster.condition(ns, NAME, "Available")
        return found if found and found["status"] == "True" else None

    wait_for("Available=True", available, timeout=TIMEOUT_S, interval=0.3)


def test_a_decoder_on_another_engine_version_turns_it_false_until_it_is_fixed(
    cluster: Cluster, ns: str, kubelet: LocalKubelet
) -> None:
    spec = deploy(cluster, ns)
    kv_condition(cluster, kubelet, ns, "True", "HandshakesSucceeded")
    bad = role_pods(cluster, ns, "decode")[0]
    other_version = wire.compat_hash({**role_factors(spec, "decode"), "vllm_version": "0.32.0"})
    before = pod_conditions(pods(cluster, ns)[bad])[POD_CONDITION]

    kubelet.restart(bad, with_engine_hash("decode", other_version))
    refused = kv_condition(cluster, kubelet, ns, "False", "CompatibilityHashMismatch")
    message = refused["message"]
    assert f"decode pod {bad}: CompatibilityHashMismatch" in message, message
    assert f"prefill stage 0 (pod {NAME}-prefill-0-0)" in message, message
    assert f"prefill stage 1 (pod {NAME}-prefill-0-1)" in message, message
    assert other_version in message
    pod = pods(cluster, ns)[bad]
    condition = pod_conditions(pod)[POD_CONDITION]
    assert condition["status"] == "False"
    assert condition["lastTransitionTime"] >= before["lastTransitionTime"]
    assert pod_conditions(pod)["Ready"]["status"] == "False", "the readiness gate must hold the pod back"

    # The stages keep serving the healthy decoder: their own conditions stay True and name the refusal.
    def stage0_degraded() -> dict[str, Any] | None:
        kubelet.sync()
        found = pod_conditions(pods(cluster, ns)[f"{NAME}-prefill-0-0"])[POD_CONDITION]
        return found if (found["status"], found["reason"]) == ("True", "SomePeersRefused") else None

    stage0 = wait_for("stage 0 to report the refusing decoder", stage0_degraded, timeout=TIMEOUT_S)
    assert f"decode pod {bad} at " in stage0["message"] and "CompatibilityHashMismatch" in stage0["message"]

    def repeated() -> list[dict[str, Any]] | None:
        kubelet.sync()
        found = events(cluster, ns, bad, "CompatibilityHashMismatch")
        return found if found and max(e.get("count") or 1 for e in found) >= 2 else None

    posted = wait_for("a repeated refusal to bump its Event's count", repeated, timeout=TIMEOUT_S)
    assert all(e["type"] == "Warning" and e["source"]["component"] == "disagg-kv-worker" for e in posted)
    # One Event per distinct refusal (one per prefill stage), counted, not one Event per round.
    assert len(posted) == 2, [e["message"] for e in posted]

    kubelet.restart(bad)
    kv_condition(cluster, kubelet, ns, "True", "HandshakesSucceeded")
    recovered = pod_conditions(pods(cluster, ns)[bad])
    assert recovered[POD_CONDITION]["status"] == "True"
    assert recovered["Ready"]["status"] == "True"


def routing_when(
    cluster: Cluster, kubelet: LocalKubelet, ns: str, what: str, wanted: Callable[[Routing], bool]
) -> Routing:
    """Play kubelet until `routing_from_pods` over the deployment's live pods satisfies `wanted`."""
    last: list[Routing] = []

    def probe() -> Routing | None:
        kubelet.sync()
        routing = routing_from_pods(pods(cluster, ns).values())
        last[:] = [routing]
        return routing if wanted(routing) else None

    try:
        return wait_for(what, probe, timeout=TIMEOUT_S, interval=0.3)
    except AssertionError as error:
        raise AssertionError(f"{error}\nlast routing: {last}") from None


def routable_condition(
    cluster: Cluster, kubelet: LocalKubelet, ns: str, status: str, message_start: str
) -> dict[str, Any]:
    """Play kubelet until the deployment's Routable condition has this status and its message starts so."""

    def probe() -> dict[str, Any] | None:
        kubelet.sync()
        found = cluster.condition(ns, NAME, "Routable")
        wanted = found and found["status"] == status and found["message"].startswith(message_start)
        return found if wanted else None

    try:
        return wait_for(f"Routable={status} ({message_start})", probe, timeout=TIMEOUT_S, interval=0.3)
    except AssertionError as error:
        raise AssertionError(f"{error}\nlast Routable: {cluster.condition(ns, NAME, 'Routable')}") from None


def test_the_peer_reports_pair_the_pods_and_a_skewed_decoder_is_excluded_in_the_status(
    cluster: Cluster, ns: str, kubelet: LocalKubelet
) -> None:
    spec = deploy(cluster, ns)
    head, stage1 = f"{NAME}-prefill-0-0", f"{NAME}-prefill-0-1"
    routing = routing_when(cluster, kubelet, ns, "both pairs routable", lambda r: len(r.pairs) == 2)
    decoders = role_pods(cluster, ns, "decode")
    prefill_hash = wire.compat_hash(role_factors(spec, "prefill"))
    assert [(p.prefill.head_pod, p.decode.pod) for p in routing.pairs] == [(head, d) for d in decoders]
    (prefill,) = routing.prefills
    assert (prefill.engine_id, prefill.host, prefill.pp_size, prefill.stage_pods) == (
        f"{NAME}-prefill-0",
        kubelet.ips[head],
        2,
        (head, stage1),
    )
    assert prefill.kv_hash == prefill_hash
    assert [(d.pod, d.engine_id, d.host) for d in routing.decodes] == [
        (d, d, kubelet.ips[d]) for d in decoders
    ]
    healthy = routable_condition(cluster, kubelet, ns, "True", "2 of 2 prefill/decode pairs routable")
    assert healthy["reason"] == "PairsRoutable"
    since = healthy["lastTransitionTime"]
    # What the sidecars wrote, as the router and the operator read it.
    written = pods(cluster, ns)[decoders[0]]["metadata"]["annotations"][PEER_REPORT_ANNOTATION]
    report = decode_peer_report(written)
    assert [(v.pod, v.engine_id, v.ok, v.kv_hash) for v in report.peers] == [
        (head, f"{NAME}-prefill-0", True, prefill_hash),
        (stage1, f"{NAME}-prefill-0", True, prefill_hash),
    ]

    bad, good = decoders
    other_version = wire.compat_hash({**role_factors(spec, "decode"), "vllm_version": "0.32.0"})
    kubelet.restart(bad, with_engine_hash("decode", other_version))

    def bad_excluded_for_its_hash(routing: Routing) -> bool:
        # Until the restarted decoder's first round, only the stages' refusals are on record.
        return [(e.decode, e.reason) for e in routing.exclusions] == [
            (bad, "CompatibilityHashMismatch")
        ] and (f"decode pod {bad} reports" in routing.exclusions[0].message)

    routing = routing_when(cluster, kubelet, ns, f"{bad} excluded for its hash", bad_excluded_for_its_hash)
    assert [(p.prefill.head_pod, p.decode.pod) for p in routing.pairs] == [(head, good)]
    routable = routable_condition(
        cluster, kubelet, ns, "True", f"1 of 2 prefill/decode pairs routable; excluded: {head} \u2194 {bad}: "
    )
    assert "CompatibilityHashMismatch" in routable["message"], routable
    assert (cluster.get(ns, NAME) or {})["status"]["routablePairs"] == "1/2"
    (exclusion,) = routing.exclusions
    assert exclusion.prefill == head
    assert (
        f"decode pod {bad} reports CompatibilityHashMismatch from prefill stage 0 (pod {head})"
        in exclusion.message
    )
    assert (
        f"prefill stage 1 (pod {stage1}) reports CompatibilityHashMismatch from decode pod {bad}"
        in exclusion.message
    )
    assert other_version[:12] in exclusion.message
    assert routable["lastTransitionTime"] == since, "still True: the transition time stays"


def test_the_reporter_writes_the_peer_report_annotation_only_when_it_changed(
    control_plane: ControlPlane, namespace: str
) -> None:
    core = client.CoreV1Api(control_plane.api_client)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "decode-a", "annotations": {"someone.else/note": "kept"}},
        "spec": {"containers": [{"name": "kv-worker", "image": "disagg"}]},
    }
    core.create_namespaced_pod(namespace, pod)
    reporter = PodReporter(control_plane.api_client, namespace, "decode-a", clock=lambda: T0)
    stage = Peer("stage-0", "prefill", 0, "p", "10.0.0.9", 5600)
    report = peer_report("decode-a-1a2b3c4d", "aa", [PeerResult(stage, None, "p-5e6f7a8b", "aa")])
    outcome = Outcome("True", "HandshakesSucceeded", "handshakes succeeded with stage-0", report=report)

    def stored() -> tuple[str, dict[str, str]]:
        found = json.loads(core.read_namespaced_pod("decode-a", namespace, _preload_content=False).data)
        return found["metadata"]["resourceVersion"], found["metadata"]["annotations"]

    assert reporter.report(outcome)
    version, annotations = stored()
    assert decode_peer_report(annotations[PEER_REPORT_ANNOTATION]) == report, "kept through pods/status"
    assert annotations["someone.else/note"] == "kept"
    assert not reporter.report(outcome), "an unchanged report is not written again"
    assert stored()[0] == version
    refused = PeerResult(stage, PeerUnreachable("gone"))
    changed = replace(outcome, report=peer_report("decode-a-1a2b3c4d", "aa", [refused]))
    assert reporter.report(changed), "a changed verdict alone is a write"
    version_after, annotations = stored()
    assert version_after != version
    assert decode_peer_report(annotations[PEER_REPORT_ANNOTATION]).peers[0].reason == "PeerUnreachable"


def test_a_prefill_stage_whose_layers_do_not_match_turns_it_false_until_it_is_fixed(
    cluster: Cluster, ns: str, kubelet: LocalKubelet
) -> None:
    # Layers are paired, and checked, by name: on vLLM 0.34 (connector version 16) every pair is, with the
    # example's sliding-window model run without HMA as the operator chooses (issue 42).
    deploy(cluster, ns, {"engine": {"image": "vllm/vllm-openai:v0.34.0", "version": "0.34.0"}})
    kv_condition(cluster, kubelet, ns, "True", "HandshakesSucceeded")
    stage1 = f"{NAME}-prefill-0-1"

    kubelet.restart(stage1, with_layer_names("model.language_model.layers.{i}.self_attn.attn"))
    refused = kv_condition(cluster, kubelet, ns, "False", "MissingLayers")
    message = refused["message"]
    assert f"prefill stage 1 (pod {stage1}): MissingLayers" in message, message
    for decoder in role_pods(cluster, ns, "decode"):
        assert f"decode pod {decoder}" in message, message
    assert "model.language_model.layers.6.self_attn.attn" in message, message
    assert events(cluster, ns, stage1, "MissingLayers"), "the refusal is posted as an Event on the pod"

    kubelet.restart(stage1)
    kv_condition(cluster, kubelet, ns, "True", "HandshakesSucceeded")
    recovered = events(cluster, ns, stage1, "HandshakesSucceeded")
    assert [e["type"] for e in recovered] == ["Normal"], "the recovery is posted as a Normal Event"


def test_the_reporter_keeps_the_kubelets_conditions_and_counts_repeated_refusals(
    control_plane: ControlPlane, namespace: str
) -> None:
    core = client.CoreV1Api(control_plane.api_client)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "stage-1"},
        "spec": {
            "containers": [{"name": "kv-worker", "image": "disagg"}],
            "readinessGates": [{"conditionType": POD_CONDITION}],
        },
    }
    core.create_namespaced_pod(namespace, pod)
    core.patch_namespaced_pod_status(
        "stage-1", namespace, {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    )
    times = iter(T0 + timedelta(minutes=minute) for minute in range(10))
    reporter = PodReporter(control_plane.api_client, namespace, "stage-1", clock=lambda: next(times))
    peer = Peer("decode-a", "decode", 0, "decode-a", "10.0.0.9", 5600)
    missing = PeerResult(peer, MissingLayers("the decoder does not advertise model.layers.6"))
    refused = Outcome("False", "MissingLayers", "refused by decode pod decode-a", (missing,))

    def stored() -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
        conditions = {
            c.type: c for c in core.read_namespaced_pod_status("stage-1", namespace).status.conditions
        }
        listed = core.list_namespaced_event(namespace, _preload_content=False)
        found = {
            t: {"status": c.status, "reason": c.reason, "since": c.last_transition_time}
            for t, c in conditions.items()
        }
        return found, json.loads(listed.data)["items"]

    assert reporter.report(refused)
    assert not reporter.report(refused), "an unchanged outcome is not written again"
    conditions, posted = stored()
    assert conditions["Ready"]["status"] == "False", "the kubelet's condition is left alone"
    assert conditions[POD_CONDITION]["reason"] == "MissingLayers"
    assert [(e["reason"], e["count"]) for e in posted] == [("MissingLayers", 2)]
    assert (
        posted[0]["message"]
        == "decode pod decode-a at 10.0.0.9:5600: the decoder does not advertise model.layers.6"
    )

    # A restarted sidecar finds the Event it posted and keeps counting.
    restarted = PodReporter(control_plane.api_client, namespace, "stage-1", clock=lambda: next(times))
    unreachable = Outcome("False", "PeerUnreachable", "decode-a did not answer", (missing,))
    assert restarted.report(unreachable)
    conditions, posted = stored()
    assert [(e["reason"], e["count"]) for e in posted] == [("MissingLayers", 3)]
    assert conditions[POD_CONDITION]["reason"] == "PeerUnreachable"
    assert conditions[POD_CONDITION]["since"] == T0, "same status: the transition time stays"

    assert restarted.report(
        Outcome("True", "HandshakesSucceeded", "handshakes succeeded with decode pod decode-a")
    )
    conditions, posted = stored()
    assert conditions[POD_CONDITION]["status"] == "True"
    assert conditions[POD_CONDITION]["since"] == T0 + timedelta(minutes=3)
    assert sorted((e["type"], e["reason"]) for e in posted) == [
        ("Normal", "HandshakesSucceeded"),
        ("Warning", "MissingLayers"),
    ]
