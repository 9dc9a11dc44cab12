"""A real `disagg worker sidecar --mode watch` process facing vLLM's real side-channel listener, reporting
through the real API server.

The engines are vLLM's own `_nixl_handshake_listener` threads (run by the vLLM peer process of
tests/interop) serving payloads built by vLLM's classes and hashed by vLLM from the argv: a PP2 x TP2 prefill
engine on its head pod's address, and a TP2 decode engine. The decode pod's condition is True; when its
engine turns into vLLM 0.32 (same pod, same port), it is False with `CompatibilityHashMismatch` naming the
releases, and a Warning Event says so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from local_cluster import ControlPlane
from operator_harness import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "interop"))

from _vllm_peer import INSTALLED_RELEASE, VENV_PYTHON, VllmPeer, extracted_release
from test_topology_interop import (
    DECODE_POD,
    DECODE_RANKS,
    HEAD_POD,
    HOST,
    PREFILL_ENGINE,
    PREFILL_RANKS,
    STAGE1_POD,
    topology,
    vllm_hash,
    vllm_listener,
    vllm_payloads,
)
from test_watch_sidecar import DEPLOYMENT, create_pod, kv_condition

from disagg.rig.local import free_port
from disagg.worker.contracts.peer_report import PeerReport, decode_peer_report
from disagg.worker.contracts.pod_contract import PEER_REPORT_ANNOTATION

pytestmark = pytest.mark.vllm


def peer_report(core: client.CoreV1Api, namespace: str, pod: str) -> PeerReport:
    """The `disagg.io/kv-peers` annotation the watch sidecar wrote on its Pod."""
    found = json.loads(core.read_namespaced_pod(pod, namespace, _preload_content=False).data)
    return decode_peer_report(found["metadata"]["annotations"][PEER_REPORT_ANNOTATION])


@pytest.fixture(scope="module")
def peers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmPeer]]:
    if not VENV_PYTHON.exists():
        pytest.fail(f"{VENV_PYTHON} is missing: run `bash hack/vllm/venv.sh` (make test does)", pytrace=False)
    if not (extracted_release("0.32.0") / "vllm").is_dir():
        pytest.fail("vLLM 0.32.0 is not extracted: run `bash hack/vllm/wheels.sh`", pytrace=False)
    base = tmp_path_factory.mktemp("vllm-watch")
    started = {v: VllmPeer(v, base / f"peer-{v}.log", base / "hf") for v in (INSTALLED_RELEASE, "0.32.0")}
    yield started
    for peer in started.values():
        peer.close()


def test_a_watch_sidecar_facing_vllm_reports_true_then_the_release_mismatch(
    control_plane: ControlPlane, namespace: str, tmp_path: Path, peers: dict[str, VllmPeer]
) -> None:
    new, old = peers[INSTALLED_RELEASE], peers["0.32.0"]
    prediction = vllm_hash(new, "producer")
    old_hash = vllm_hash(old, "consumer")
    core = client.CoreV1Api(control_plane.api_client)
    topology_file = tmp_path / "topology.json"
    topology_file.write_text(json.dumps(topology(2, 2, prediction)))
    prefill_port, decode_port = free_port(), free_port()
    create_pod(core, namespace, DECODE_POD, "decode", decode_port)
    create_pod(core, namespace, HEAD_POD, "prefill", prefill_port)
    # Stage 1's pod serves no side channel (a headless vLLM node): only its head answers for it.
    create_pod(core, namespace, STAGE1_POD, "prefill", free_port())
    env: dict[str, Any] = {
        **os.environ,
        "DISAGG_ROLE": "decode",
        "DISAGG_TOPOLOGY_FILE": str(topology_file),
        "POD_NAME": DECODE_POD,
        "POD_IP": HOST,
        "DISAGG_SIDE_CHANNEL_PORT": str(decode_port),
        "PYTHONSAFEPATH": "1",
        "POD_NAMESPACE": namespace,
        "DISAGG_DEPLOYMENT": DEPLOYMENT,
        "KUBECONFIG": str(control_plane.kubeconfig),
    }
    # Live engine ids, as the operator's launcher draws them: the stable prefix and a per-start suffix.
    prefill_id, decode_id, restarted_id = (
        f"{PREFILL_ENGINE}-0a1b2c3d",
        f"{DECODE_POD}-4e5f6a7b",
        f"{DECODE_POD}-8c9d0e1f",
    )
    prefill = vllm_payloads(new, prefill_id, PREFILL_RANKS, prediction.digest)
    log_path = tmp_path / "watch.log"
    command = [sys.executable, "-m", "disagg.operator.cli.main", "worker", "sidecar", "--mode", "watch"]
    with vllm_listener(new, prefill, prefill_port) as prefill_listener, open(log_path, "wb") as log:
        watcher = subprocess.Popen(
            [*command, "--interval", "1"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            decode = vllm_payloads(new, decode_id, DECODE_RANKS, prediction.digest)
            with vllm_listener(new, decode, decode_port):
                ready = wait_for(
                    "the watch sidecar's True condition",
                    lambda: (c := kv_condition(core, namespace, DECODE_POD)).get("status") == "True" and c,
                )
            assert ready["reason"] == "HandshakesSucceeded", log_path.read_text()
            assert f"prefill stage 1 (pod {STAGE1_POD})" in ready["message"]
            report = peer_report(core, namespace, DECODE_POD)
            assert (report.engine_id, report.kv_hash) == (decode_id, prediction.digest)
            assert [(v.pod, v.engine_id, v.ok, v.kv_hash) for v in report.peers] == [
                (HEAD_POD, prefill_id, True, prediction.digest),
                (STAGE1_POD, prefill_id, True, prediction.digest),
            ]

            decode = vllm_payloads(old, restarted_id, DECODE_RANKS, old_hash.digest)
            with vllm_listener(old, decode, decode_port):
                refused = wait_for(
                    "the watch sidecar's False condition",
                    lambda: (c := kv_condition(core, namespace, DECODE_POD)).get("status") == "False" and c,
                )
            assert refused["reason"] == "CompatibilityHashMismatch", log_path.read_text()
            assert "this engine runs vLLM 0.32.0, the peer vLLM 0.33.0" in refused["message"]
            report = peer_report(core, namespace, DECODE_POD)
            assert (report.engine_id, report.kv_hash) == (restarted_id, old_hash.digest)
            assert [(v.pod, v.ok, v.reason, v.kv_hash) for v in report.peers] == [
                (HEAD_POD, False, "CompatibilityHashMismatch", prediction.digest),
                (STAGE1_POD, False, "CompatibilityHashMismatch", prediction.digest),
            ]
            events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={DECODE_POD}")
            assert any(
                e.reason == "CompatibilityHashMismatch" and "vLLM 0.32.0" in (e.message or "")
                for e in events.items
            ), [(e.reason, e.message) for e in events.items]
            assert new.call("listener_alive", handle=prefill_listener)
        finally:
            watcher.send_signal(signal.SIGTERM)
            code = watcher.wait(timeout=30)
    assert code == 0, log_path.read_text()
