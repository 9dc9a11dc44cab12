"""`disagg worker sidecar --mode watch` on the real API server: it writes its Pod's KV condition and Events.

The decode pod's engine (vLLM with `NixlPushConnector` in production) and a prefill stage are stood in for
by real workers in this process: a `LocalKV` registered with a real NIXL agent, its handshake payload served
on a real side channel. The watching sidecar is a real `disagg` process with the pod's downward-API
identity; it binds nothing, handshakes the engine and the stage, and reports. When the engine goes away,
the condition turns False with `PeerUnreachable`, naming the engine, and a Warning Event says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubernetes import client
from local_cluster import ControlPlane
from operator_harness import wait_for

from disagg.rig.local import LOOPBACK_UCX_ENV as UCX_ENV
from disagg.rig.local import free_port
from disagg.rig.status_sidecar import registered_kv
from disagg.worker.connector.side_channel import SideChannelServer
from disagg.worker.contracts.pod_contract import (
    DEPLOYMENT_LABEL,
    ROLE_LABEL,
    SIDE_CHANNEL_PORT_NAME,
    SIDECAR_CONTAINER,
)
from disagg.worker.reporting.pod_report import find_condition
from disagg.worker.sidecar.config import SidecarConfig, from_env

HOST = "127.0.0.1"
DEPLOYMENT = "wd"
DECODE_POD = "wd-decode-5d8f-x2k"
PREFILL_POD = "wd-prefill-0"
TOPOLOGY = {
    "transferMode": "push",
    "blockSize": 16,
    "stages": [{"stage": 0, "startLayer": 0, "endLayer": 6}],
    "model": {
        "layerKinds": ["sliding_window", "sliding_window", "full"] * 2,
        "numKVHeads": 2,
        "headSize": 16,
        "dtypeBytes": 2,
        "name": "tiny",
        "dtype": "float16",
    },
}


def pod_env(topology_file: Path, role: str, pod: str, port: int) -> dict[str, str]:
    return {
        "DISAGG_ROLE": role,
        "DISAGG_TOPOLOGY_FILE": str(topology_file),
        "POD_NAME": pod,
        "POD_IP": HOST,
        "DISAGG_SIDE_CHANNEL_PORT": str(port),
    }


@contextlib.contextmanager
def engine(config: SidecarConfig) -> Iterator[SideChannelServer]:
    """A worker serving its real handshake payload where the pod's engine serves its side channel."""
    pool = Path("/dev/shm") / f"disagg-test-watch-{config.engine_id}-{secrets.token_hex(4)}"
    with registered_kv(config, 2, pool) as local:
        server = SideChannelServer(config.side_channel_host, config.side_channel_port)
        server.set_payload(config.pp_rank, config.tp_rank, local.handshake_payload())
        with server:
            yield server


def create_pod(core: client.CoreV1Api, namespace: str, name: str, role: str, port: int) -> None:
    body: dict[str, Any] = {
        "metadata": {"name": name, "labels": {DEPLOYMENT_LABEL: DEPLOYMENT, ROLE_LABEL: role}},
        "spec": {
            "containers": [
                {"name": "engine", "image": "vllm/vllm-openai:v0.11.0"},
                {
                    "name": SIDECAR_CONTAINER,
                    "image": "disagg-worker:test",
                    "ports": [{"name": SIDE_CHANNEL_PORT_NAME, "containerPort": port}],
                },
            ]
        },
    }
    core.create_namespaced_pod(namespace, client.V1Pod.model_validate(body))
    core.patch_namespaced_pod_status(
        name, namespace, {"status": {"phase": "Running", "podIP": HOST, "podIPs": [{"ip": HOST}]}}
    )


def kv_condition(core: client.CoreV1Api, namespace: str, pod: str) -> dict[str, Any]:
    response: Any = core.read_namespaced_pod_status(pod, namespace, _preload_content=False)
    found = find_condition(json.loads(response.data).get("status", {}).get("conditions"))
    return dict(found or {})


def test_a_watch_sidecar_reports_its_engine_on_its_pod(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    for key, value in UCX_ENV.items():
        os.environ.setdefault(key, value)
    core = client.CoreV1Api(control_plane.api_client)
    topology_file = tmp_path / "topology.json"
    topology_file.write_text(json.dumps(TOPOLOGY))
    decode_port, prefill_port = free_port(), free_port()
    decode_env = pod_env(topology_file, "decode", DECODE_POD, decode_port)
    prefill = from_env(pod_env(topology_file, "prefill", PREFILL_POD, prefill_port))
    create_pod(core, namespace, DECODE_POD, "decode", decode_port)
    create_pod(core, namespace, PREFILL_POD, "prefill", prefill_port)
    log_path = tmp_path / "watch.log"
    with engine(from_env(decode_env)) as decode_engine, engine(prefill), open(log_path, "wb") as log:
        watcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "disagg.operator.cli.main",
                "worker",
                "sidecar",
                "--mode",
                "watch",
                "--interval",
                "1",
            ],
            env={
                **os.environ,
                **decode_env,
                "PYTHONSAFEPATH": "1",
                "POD_NAMESPACE": namespace,
                "DISAGG_DEPLOYMENT": DEPLOYMENT,
                "KUBECONFIG": str(control_plane.kubeconfig),
            },
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            ready = wait_for(
                "the watch sidecar's True condition",
                lambda: (c := kv_condition(core, namespace, DECODE_POD)).get("status") == "True" and c,
            )
            assert ready["reason"] == "HandshakesSucceeded", log_path.read_text()
            assert f"prefill stage 0 (pod {PREFILL_POD})" in ready["message"]
            assert decode_engine.served >= 1, "the sidecar handshakes its own engine"

            decode_engine.stop()
            refused = wait_for(
                "the watch sidecar's False condition",
                lambda: (c := kv_condition(core, namespace, DECODE_POD)).get("status") == "False" and c,
            )
            assert refused["reason"] == "PeerUnreachable", log_path.read_text()
            assert f"this pod's own engine {DECODE_POD}" in refused["message"]
            assert f"{HOST}:{decode_port}" in refused["message"]

            def warned() -> bool:
                # The Event is posted after the condition: on a loaded machine it can trail the read.
                events = core.list_namespaced_event(
                    namespace, field_selector=f"involvedObject.name={DECODE_POD}"
                )
                return any(
                    e.reason == "PeerUnreachable" and e.type == "Warning" and DECODE_POD in (e.message or "")
                    for e in events.items
                )

            wait_for("the PeerUnreachable Warning Event", warned)
        finally:
            watcher.send_signal(signal.SIGTERM)
            code = watcher.wait(timeout=30)
    assert code == 0, log_path.read_text()
