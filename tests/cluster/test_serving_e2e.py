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
import ipaddress
import json
import secrets
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes import client
from operator_harness import Cluster, example, wait_for

from disagg.operator.api import DisaggDeploymentSpec
from disagg.operator.policies.compat import role_factors
from disagg.rig.local_kubelet import KubeletLoop, LocalKubelet, with_engine_hash
from disagg.rig.service_proxy import ServiceProxy
from disagg.worker.contracts.pairing import routing_from_pods
from disagg.worker.contracts.pod_contract import DEPLOYMENT_LABEL, ROLE_ENV
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


@dataclass(frozen=True)
class Case:
    endpoint: str
    stream: bool
    prompt: str

    def body(self, model: str) -> dict[str, Any]:
        common = {"model": model, "max_tokens": MAX_TOKENS, "stream": self.stream}
        if self.endpoint == "completions":
            return {**common, "prompt": self.prompt}
        return {**common, "messages": [{"role": "user", "content": self.prompt}]}


def monolithic(case: Case) -> str:
    """What the reference model run whole writes for `case` (the engine's chat template for chat)."""
    import torch

    from disagg.worker.engine.config import TinyConfig, decode, encode
    from disagg.worker.engine.model import TinyModel
    from disagg.worker.engine.openai_api import chat_prompt

    prompt = (
        case.prompt
        if case.endpoint == "completions"
        else chat_prompt([{"role": "user", "content": case.prompt}])
    )
    torch.set_num_threads(1)
    text: str = decode(TinyModel(TinyConfig()).generate(encode(prompt), MAX_TOKENS))
    return text


async def ask(session: aiohttp.ClientSession, url: str, case: Case, model: str) -> str:
    """The text of one answer through `url`, streamed (SSE events in order) or not."""
    async with session.post(f"{url}/v1/{case.endpoint.replace('_', '/')}", json=case.body(model)) as response:
        raw = await response.read()
        if response.status != 200:
            raise AssertionError(f"{case}: {response.status} {raw[:500]!r}")
    chat = case.endpoint != "completions"
    if not case.stream:
        choice = json.loads(raw)["choices"][0]
        return str(choice["message"]["content"] if chat else choice["text"])
    parts = []
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line.removeprefix("data: "))
        assert "error" not in event, f"{case}: {event}"
        for choice in event.get("choices") or ():
            parts.append((choice.get("delta") or {}).get("content") or "" if chat else choice.get("text", ""))
    return "".join(parts)


@dataclass
class Load:
    """Requests through the Service at a fixed concurrency in a thread until stopped; every answer checked."""

    url: str
    model: str
    cases: list[Case]
    expected: dict[Case, str]
    concurrency: int = 4
    sent: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Load:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        return self

    async def _run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

            async def worker(offset: int) -> None:
                index = offset
                while not self._stop.is_set():
                    case = self.cases[index % len(self.cases)]
                    index += self.concurrency
                    self.sent += 1
                    try:
                        got = await ask(session, self.url, case, self.model)
                    except Exception as exc:  # every failure is recorded and fails the test
                        self.failures.append(f"{case}: {type(exc).__name__}: {exc}")
                        continue
                    if got != self.expected[case]:
                        self.failures.append(f"{case}: {got!r} != {self.expected[case]!r}")

            await asyncio.gather(*(worker(k) for k in range(self.concurrency)))

    def stop(self) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=180)


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
    api = cluster.cp.api_client
    kubelet = LocalKubelet(api, cluster.cp.kubeconfig, ns, NAME, tmp_path / "pods")
    proxy = ServiceProxy(api, ns)
    loop = KubeletLoop([kubelet.sync, proxy.sync]).start()
    try:
        yield kubelet, loop, document["spec"]["model"]["name"]
    finally:
        try:
            loop.stop()
        finally:
            proxy.close()
            kubelet.stop_all()


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


def service_url(core: client.CoreV1Api, ns: str) -> str:
    service = core.read_namespaced_service(f"{NAME}-router", ns)
    address = service.spec.cluster_ip
    assert ipaddress.ip_address(address).is_loopback, (
        f"ClusterIP {address} is not a loopback address: restart the control plane "
        "(hack/control-plane.sh allocates ClusterIPs from a loopback range for the kube-proxy stand-in)"
    )
    return f"http://{address}:{service.spec.ports[0].port}"


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
    url = service_url(core, ns)

    cases = [
        Case(e, s, p) for e in ("completions", "chat_completions") for s in (False, True) for p in PROMPTS
    ]
    expected = {case: monolithic(case) for case in cases}

    async def each() -> dict[Case, str]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            return {case: await ask(session, url, case, model) for case in cases}

    assert asyncio.run(each()) == expected

    spec = DisaggDeploymentSpec.model_validate((cluster.get(ns, NAME) or {})["spec"])
    kubelet.new_pod_fault = new_version(spec)
    e0, e1 = f"{NAME}-prefill-0-0", f"{NAME}-prefill-1-0"
    load = Load(url, model, cases, expected).start()
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
                routing = routing_from_pods(live_pods(core, ns))
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

        first, second = sorted(d.pod for d in routing_from_pods(live_pods(core, ns)).decodes)
        delete(second)
        step("a new decoder beside old engines", lambda d: {(e0, first), (e1, first)}, refused=2)
        delete(f"{NAME}-prefill-1-0", f"{NAME}-prefill-1-1")
        new = next(
            pod
            for pod in sorted(d.pod for d in routing_from_pods(live_pods(core, ns)).decodes)
            if pod != first
        )
        step("old with old, new with new", lambda d: {(e0, first), (e1, new)}, refused=2)
        delete(first)
        step("two new decoders, one new engine", lambda d: {(e1, d[0]), (e1, d[1])}, refused=2)
        delete(f"{NAME}-prefill-0-0", f"{NAME}-prefill-0-1")
        step("everything new", lambda d: {(e, x) for e in (e0, e1) for x in d}, refused=0)
    finally:
        load.stop()
    assert load.failures == [], f"{len(load.failures)} of {load.sent} requests failed: {load.failures[:5]}"
    routable(cluster, ns, loop, "4/4")


def live_pods(core: client.CoreV1Api, ns: str) -> list[dict[str, Any]]:
    response = core.list_namespaced_pod(
        ns, label_selector=f"{DEPLOYMENT_LABEL}={NAME}", _preload_content=False
    )
    items: list[dict[str, Any]] = json.loads(response.data)["items"]
    return items
