"""The request path end to end on the real API server: the operator, every container of every pod a process.

The operator (a real `disagg operator run`) builds the reference deployment: two PP2 prefill engines (HMA),
two decoders and the router. `LocalKubelet` runs each pod's own containers (`disagg engine serve`, the
transfer sidecar with a real NIXL agent, `disagg router run`) and `ServiceProxy` stands in for kube-proxy,
so requests go where a client's would: to the router's Service address. Every answer is compared with the
reference model run whole in this process.

The rolling change replaces the pods one by one with a new engine version (another compatibility hash) while
a load runs through the Service: old and new pods coexist, the sidecars refuse every old/new pair, the router
sends each request over an old/old or new/new pair only, and no request fails.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes import client
from operator_harness import Cluster, example, wait_for

from disagg.operator.api import DisaggDeploymentSpec
from disagg.operator.policies.compat import role_factors
from disagg.rig.local_kubelet import KubeletLoop, LocalKubelet, with_engine_hash
from disagg.rig.local_serving import live_pods, local_serving, service_url, wait_until_served
from disagg.rig.serving_load import Case, Load, ask, monolithic
from disagg.worker.contracts.pairing import routing_from_pods
from disagg.worker.contracts.pod_contract import ROLE_ENV
from disagg.worker.kv import wire

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NAME = "serve"
TIMEOUT_S = 240.0
MAX_TOKENS = 12
PROMPTS = (
    "Hello!",
    "Disaggregated serving moves the KV cache from prefill to decode.",
    "Pipeline-parallel prefill stages each hold a slice of the layers; the decoder holds them all. " * 2,
)


@pytest.fixture
def serving(cluster: Cluster, ns: str, tmp_path: Path) -> Iterator[tuple[LocalKubelet, KubeletLoop, str]]:
    patch = {
        "prefill": {"replicas": 2},
        # Each run its own side-channel port: another run's pods may share a loopback subnet by chance.
        "kvTransfer": {"sideChannelPort": 20000 + secrets.randbelow(20000)},
    }
    document = example("reference-pp2-hma.yaml", ns, NAME, patch)
    result = cluster.kubectl_apply(document)
    assert result.returncode == 0, result.stderr
    cp = cluster.cp
    with local_serving(cp.api_client, cp.kubeconfig, ns, NAME, tmp_path / "pods") as (kubelet, loop):
        yield kubelet, loop, document["spec"]["model"]["name"]


def routable(cluster: Cluster, ns: str, loop: KubeletLoop, pairs: str) -> None:
    def probe() -> bool | None:
        loop.check()
        found = cluster.get(ns, NAME) or {}
        status = found.get("status") or {}
        ready = next((c for c in status.get("conditions") or () if c["type"] == "Available"), {})
        return True if status.get("routablePairs") == pairs and ready.get("status") == "True" else None

    try:
        wait_for(f"{pairs} pairs routable", probe, timeout=TIMEOUT_S, interval=0.5)
    except AssertionError as error:
        routable_condition = cluster.condition(ns, NAME, "Routable")
        raise AssertionError(f"{error}; Routable: {routable_condition}") from None


def new_version(spec: DisaggDeploymentSpec) -> Callable[[dict[str, Any], dict[str, str]], None]:
    """A pod started on another engine release: its role's compatibility hash with another vllm_version."""
    hashes = {
        role: wire.compat_hash({**role_factors(spec, role), "vllm_version": "0.34.0"})
        for role in ("prefill", "decode")
    }

    def fault(document: dict[str, Any], env: dict[str, str]) -> None:
        role = env[ROLE_ENV]
        with_engine_hash(role, hashes[role])(document, env)

    return fault


def test_every_endpoint_through_the_service_and_a_rolling_version_change_with_no_failed_request(
    cluster: Cluster, ns: str, serving: tuple[LocalKubelet, KubeletLoop, str]
) -> None:
    kubelet, loop, model = serving
    core = client.CoreV1Api(cluster.cp.api_client)
    routable(cluster, ns, loop, "4/4")
    url = service_url(core, ns, NAME)
    wait_until_served(url, loop.check)

    cases = [
        Case(e, s, p, MAX_TOKENS)
        for e in ("completions", "chat_completions")
        for s in (False, True)
        for p in PROMPTS
    ]
    expected = {case: monolithic(case) for case in cases}

    async def each() -> dict[Case, str]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            return {case: await ask(session, url, case, model) for case in cases}

    assert asyncio.run(each()) == expected

    spec = DisaggDeploymentSpec.model_validate((cluster.get(ns, NAME) or {})["spec"])
    kubelet.new_pod_fault = new_version(spec)
    e0, e1 = f"{NAME}-prefill-0-0", f"{NAME}-prefill-1-0"
    load = Load(url, model, cases, expected, concurrency=4).start()
    try:

        def delete(*pods: str) -> None:
            for pod in pods:
                core.delete_namespaced_pod(pod, ns)

        def step(what: str, pairs: Callable[[list[str]], set[tuple[str, str]]], refused: int) -> None:
            """Until exactly `pairs` (of the decoders now) are routable and `refused` pairs are excluded
            because the sidecars refused them; then until the load has sent requests over that state."""
            sent = load.sent

            def probe() -> bool | None:
                loop.check()
                routing = routing_from_pods(live_pods(core, ns, NAME))
                decoders = sorted(d.pod for d in routing.decodes)
                got = {(p.prefill.head_pod, p.decode.pod) for p in routing.pairs}
                mismatched = [x for x in routing.exclusions if x.reason == "CompatibilityHashMismatch"]
                return (
                    True
                    if len(decoders) == 2 and got == pairs(decoders) and len(mismatched) == refused
                    else None
                )

            wait_for(what, probe, timeout=TIMEOUT_S, interval=0.5)
            wait_for(f"requests over {what}", lambda: load.sent >= sent + 8 or None, timeout=TIMEOUT_S)

        first, second = sorted(d.pod for d in routing_from_pods(live_pods(core, ns, NAME)).decodes)
        delete(second)
        step("a new decoder beside old engines", lambda d: {(e0, first), (e1, first)}, refused=2)
        delete(f"{NAME}-prefill-1-0", f"{NAME}-prefill-1-1")
        new = next(
            pod
            for pod in sorted(d.pod for d in routing_from_pods(live_pods(core, ns, NAME)).decodes)
            if pod != first
        )
        step("old with old, new with new", lambda d: {(e0, first), (e1, new)}, refused=2)
        delete(first)
        step("two new decoders, one new engine", lambda d: {(e1, d[0]), (e1, d[1])}, refused=2)
        delete(f"{NAME}-prefill-0-0", f"{NAME}-prefill-0-1")
        step("everything new", lambda d: {(e, x) for e in (e0, e1) for x in d}, refused=0)
    finally:
        load.stop()
    failed = load.failures + load.mismatches
    assert failed == [], f"{len(failed)} of {load.sent} requests failed: {failed[:5]}"
    routable(cluster, ns, loop, "4/4")
