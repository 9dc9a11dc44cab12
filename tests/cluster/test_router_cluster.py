"""`disagg router run` as a real process on the real API server: it watches the deployment's engine pods and
routes only over pairs whose sidecars reported a successful handshake with each other, following every change
of the pods (a report flipping, a pod deleted) as the watch delivers it.

The engines behind the pods are `tests/router/engine_fakes` servers on loopback (the pods' IP is 127.0.0.1 and
their `http` ports are the fakes'): the router is the thing under test.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes import client
from local_cluster import ControlPlane

from disagg.rig.local import free_port
from disagg.worker.contracts.peer_report import (
    PEER_REPORT_VERSION,
    PeerReport,
    PeerVerdict,
    encode_peer_report,
)
from disagg.worker.contracts.pod_contract import (
    DEPLOYMENT_LABEL,
    ENGINE_CONTAINER,
    ENGINE_HTTP_PORT_NAME,
    PEER_REPORT_ANNOTATION,
    PIPELINE_PARALLEL_SIZE_ENV,
    ROLE_LABEL,
    SIDE_CHANNEL_PORT_NAME,
    SIDECAR_CONTAINER,
    TENSOR_PARALLEL_SIZE_ENV,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))
from engine_fakes import Exchange, FakeEngine

pytestmark = pytest.mark.cluster

DEPLOYMENT = "dd"
HOST = "127.0.0.1"
HASH, OTHER_HASH = "a" * 64, "b" * 64
SUFFIX = "-1a2b3c4d"
STAGES = ("dd-prefill-0-0", "dd-prefill-0-1")
D1, D2 = "dd-decode-5f6-aaaaa", "dd-decode-5f6-bbbbb"
ENGINE_ID = "dd-prefill-0" + SUFFIX
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 4}


def live(pod: str) -> str:
    return ENGINE_ID if pod in STAGES else pod + SUFFIX


def report(pod: str, peers: dict[str, bool], kv_hash: str = HASH) -> str:
    verdicts = tuple(
        PeerVerdict(
            pod=peer,
            engine_id=live(peer),
            ok=ok,
            reason="HandshakesSucceeded" if ok else "CompatibilityHashMismatch",
            kv_hash=HASH if ok else OTHER_HASH,
        )
        for peer, ok in peers.items()
    )
    return encode_peer_report(
        PeerReport(version=PEER_REPORT_VERSION, engine_id=live(pod), kv_hash=kv_hash, peers=verdicts)
    )


def create_pod(
    core: client.CoreV1Api, namespace: str, name: str, role: str, http_port: int, annotation: str
) -> None:
    pp = "2" if role == "prefill" else "1"
    body: dict[str, Any] = {
        "metadata": {
            "name": name,
            "labels": {DEPLOYMENT_LABEL: DEPLOYMENT, ROLE_LABEL: role},
            "annotations": {PEER_REPORT_ANNOTATION: annotation},
        },
        "spec": {
            "containers": [
                {
                    "name": ENGINE_CONTAINER,
                    "image": "disagg-transfer:test",
                    "ports": [
                        {"name": ENGINE_HTTP_PORT_NAME, "containerPort": http_port},
                        {"name": SIDE_CHANNEL_PORT_NAME, "containerPort": 5600},
                    ],
                },
                {
                    "name": SIDECAR_CONTAINER,
                    "image": "disagg-transfer:test",
                    "env": [
                        {"name": PIPELINE_PARALLEL_SIZE_ENV, "value": pp},
                        {"name": TENSOR_PARALLEL_SIZE_ENV, "value": "1"},
                    ],
                },
            ]
        },
    }
    core.create_namespaced_pod(namespace, body)
    core.patch_namespaced_pod_status(
        name,
        namespace,
        {
            "status": {
                "phase": "Running",
                "podIP": HOST,
                "podIPs": [{"ip": HOST}],
                "conditions": [{"type": "Ready", "status": "True"}],
            }
        },
    )


def annotate(core: client.CoreV1Api, namespace: str, name: str, annotation: str) -> None:
    core.patch_namespaced_pod(
        name, namespace, {"metadata": {"annotations": {PEER_REPORT_ANNOTATION: annotation}}}
    )


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "the router did not follow the pods"
        await asyncio.sleep(0.1)


def test_the_router_routes_only_over_pairs_that_handshook_and_follows_the_watch(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    core = client.CoreV1Api(control_plane.api_client)
    port = free_port()
    log = (tmp_path / "router.log").open("wb")
    router = subprocess.Popen(
        [
            sys.executable,
            "-P",
            "-m",
            "disagg.operator.cli.main",
            "router",
            "run",
            "--deployment",
            DEPLOYMENT,
            "--namespace",
            namespace,
            "--host",
            HOST,
            "--port",
            str(port),
            "--kubeconfig",
            str(control_plane.kubeconfig),
            # The pod watch and the pairing are under test; the fakes count each request (the canary is
            # tests/router/test_router_canary.py's).
            "--no-kv-canary",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://{HOST}:{port}"

    async def go() -> None:
        exchange = Exchange()
        prefill = FakeEngine("prefill", exchange, engine_id=ENGINE_ID, pp_size=2)
        d1, d2 = FakeEngine("decode", exchange, engine_id=D1), FakeEngine("decode", exchange, engine_id=D2)
        for engine in (prefill, d1, d2):
            await engine.start()
        try:
            async with aiohttp.ClientSession() as session:

                async def status(path: str) -> int:
                    try:
                        async with session.get(url + path) as response:
                            return response.status
                    except aiohttp.ClientError:
                        return 0

                async def complete() -> int:
                    async with session.post(url + "/v1/completions", json=COMPLETION) as response:
                        await response.read()
                        return response.status

                await eventually(lambda: _is(status("/healthz"), 200))
                assert await status("/readyz") == 503  # no pods yet
                # D2's handshake with the prefill failed (both sides say so): only D1 pairs.
                for stage in STAGES:
                    create_pod(
                        core, namespace, stage, "prefill", prefill.port, report(stage, {D1: True, D2: False})
                    )
                create_pod(core, namespace, D1, "decode", d1.port, report(D1, dict.fromkeys(STAGES, True)))
                create_pod(core, namespace, D2, "decode", d2.port, report(D2, dict.fromkeys(STAGES, False)))
                await eventually(lambda: _is(status("/readyz"), 200))
                for _ in range(12):
                    assert await complete() == 200
                assert len(d1.received) == 12 and d2.received == []
                assert {r.body["kv_transfer_params"]["remote_engine_id"] for r in d1.received} == {ENGINE_ID}
                assert {r.body["kv_transfer_params"]["pp_size"] for r in d1.received} == {2}

                # The handshake succeeds after all: D2 joins as soon as both sides' reports say so.
                annotate(core, namespace, D2, report(D2, dict.fromkeys(STAGES, True)))
                for stage in STAGES:
                    annotate(core, namespace, stage, report(stage, {D1: True, D2: True}))

                async def d2_serves() -> bool:
                    assert await complete() == 200
                    return bool(d2.received)

                await eventually(d2_serves)

                # D1 goes away: everything goes to D2, nothing fails.
                core.delete_namespaced_pod(D1, namespace, grace_period_seconds=0)

                async def d1_gone() -> bool:
                    before = len(d1.received)
                    for _ in range(4):
                        assert await complete() == 200
                    return len(d1.received) == before

                await eventually(d1_gone)
                # Stage 1 unready: the engine has no pair left, and the router says so.
                core.patch_namespaced_pod_status(
                    STAGES[1], namespace, {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
                )
                await eventually(lambda: _is(status("/readyz"), 503))
                assert await complete() == 503
                async with session.get(url + "/metrics") as response:
                    metrics = await response.text()
                assert "disagg_router_routable_pairs 0.0" in metrics
                assert 'disagg_router_excluded_pairs{reason="PodNotReady"} 1.0' in metrics
        finally:
            for engine in (prefill, d1, d2):
                await engine.stop()

    try:
        asyncio.run(go())
    finally:
        router.terminate()
        code = router.wait(timeout=15)
        log.close()
    assert code == 0, (tmp_path / "router.log").read_text()[-4000:]


async def _is(value: Awaitable[int], wanted: int) -> bool:
    return await value == wanted
