"""`disagg bench autoscale`: a load step (concurrency 1 -> 16 -> 1) on an autoscaled deployment, on the real
API server.

The operator (a real `disagg operator run`) builds a reference-engine deployment (a PP2 prefill engine, one
decoder, the router); `LocalKubelet` runs every container as a process and `ServiceProxy` stands in for
kube-proxy. Both roles are autoscaled by the operator's planner, with windows of seconds set in the spec:
decode on running requests per decoder (the load step's signal), prefill on a TTFT p90 the step does not
break. Streamed completions run through the router's Service at concurrency 1, then 16 until the decoders
have scaled up and served a while, then 1 until they are back down. Measured: the time from each step to
the planner's decision and to the pods (ready, or gone), the SLO attainment of the requests before and after
the scale-up, and failed requests (must be 0: a scale-down drains its decoders first).

`AutoscaleRun` is the scenario; the cluster test (`tests/cluster/test_autoscale_cluster.py`) runs it too.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from kubernetes import client

from disagg.rig.bench_rollout import EXAMPLE
from disagg.rig.local_serving import (
    live_pods,
    local_serving,
    read_deployment,
    service_url,
    wait_until_served,
)
from disagg.rig.serving_load import LoadThread
from disagg.worker.contracts.pod_contract import DRAINING_ANNOTATION

NAME = "scale"
ROLES = ("prefill", "decode")
LOW, HIGH = 1, 16
MAX_DECODERS = 2
TARGET_RUNNING = 6
UP_WINDOW_S, DOWN_WINDOW_S, METRIC_WINDOW_S = 0, 20, 10
DRAIN_S = 120
MAX_TOKENS = 12
# Prefill's target: far above what the step does to TTFT even on a machine whose cores every engine process
# shares (a loaded CI runner saw a TTFT p90 of 76 s at concurrency 16), so only decode's target breaks.
PREFILL_TTFT_S = 600
# The SLO a request meets: its first token within TTFT_SLO_S and its tokens on average ITL_SLO_S apart.
TTFT_SLO_S, ITL_SLO_S = 2.0, 0.25
BASELINE_S = 15.0
SERVE_AFTER_UP_S = 20.0
TIMEOUT_S = 420.0
PROMPTS = tuple(f"Autoscale request {k}: decode scales with its running requests." for k in range(16))


def document(namespace: str, side_channel_port: int) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"] = {"name": NAME, "namespace": namespace}
    spec = doc["spec"]
    spec["decode"]["replicas"] = 1
    windows = {
        "scaleUpStabilizationWindowSeconds": UP_WINDOW_S,
        "scaleDownStabilizationWindowSeconds": DOWN_WINDOW_S,
        "metricWindowSeconds": METRIC_WINDOW_S,
    }
    spec["decode"]["autoscaling"] = {
        "minReplicas": 1,
        "maxReplicas": MAX_DECODERS,
        "target": {"runningRequests": TARGET_RUNNING},
        **windows,
    }
    spec["prefill"]["autoscaling"] = {
        "maxReplicas": 2,
        "target": {"ttftP90Seconds": PREFILL_TTFT_S},
        **windows,
    }
    spec["kvTransfer"]["sideChannelPort"] = side_channel_port
    spec["rollout"] = {"drainSeconds": DRAIN_S}
    return doc


@dataclass
class Outcome:
    at: float
    ok: bool
    ttft: float | None = None
    itl: float | None = None
    error: str = ""

    @property
    def met(self) -> bool:
        return (
            self.ok
            and self.ttft is not None
            and self.ttft <= TTFT_SLO_S
            and (self.itl is None or self.itl <= ITL_SLO_S)
        )


@dataclass
class StepLoad:
    """Streamed completions through `url` at a concurrency that can be changed while it runs."""

    url: str
    model: str
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._load = LoadThread(self._one, HIGH)
        self._load.concurrency = LOW

    @property
    def concurrency(self) -> int:
        return self._load.concurrency

    @concurrency.setter
    def concurrency(self, value: int) -> None:
        self._load.concurrency = value

    def start(self) -> StepLoad:
        self._load.start()
        return self

    async def _one(self, session: aiohttp.ClientSession, index: int) -> None:
        body = {
            "model": self.model,
            "prompt": PROMPTS[index % len(PROMPTS)],
            "max_tokens": MAX_TOKENS,
            "stream": True,
        }
        start = time.monotonic()
        tokens: list[float] = []
        try:
            async with session.post(f"{self.url}/v1/completions", json=body) as response:
                if response.status != 200:
                    raw = await response.read()
                    self.outcomes.append(Outcome(start, False, error=f"{response.status} {raw[:200]!r}"))
                    return
                async for line in response.content:
                    text = line.decode().strip()
                    if text.startswith("data: ") and text != "data: [DONE]":
                        event = json.loads(text[6:])
                        if event.get("choices"):
                            tokens.append(time.monotonic())
        except Exception as exc:  # every failure is counted and reported
            self.outcomes.append(Outcome(start, False, error=f"{type(exc).__name__}: {exc}"))
            return
        if not tokens:
            self.outcomes.append(Outcome(start, False, error="no token"))
            return
        itl = (tokens[-1] - tokens[0]) / (len(tokens) - 1) if len(tokens) > 1 else None
        self.outcomes.append(Outcome(start, True, tokens[0] - start, itl))

    def stop(self) -> None:
        self._load.stop()

    def between(self, start: float, end: float) -> list[Outcome]:
        return [o for o in self.outcomes if start <= o.at < end]


def attainment(outcomes: Sequence[Outcome]) -> float:
    return sum(o.met for o in outcomes) / len(outcomes) if outcomes else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@dataclass
class AutoscaleRun:
    """The scenario on a namespace an operator watches; `apply` is `kubectl apply` of a document."""

    api: client.ApiClient
    kubeconfig: Path
    namespace: str
    apply: Callable[[dict[str, Any]], None]
    workdir: Path
    say: Callable[[str], None] = print
    port: int = field(default_factory=lambda: 20000 + secrets.randbelow(20000))
    counts: list[tuple[float, int, int, int]] = field(default_factory=list)
    """(when, desired decoders, decode pods, prefill engines) at every wait step."""
    during_scale_down: Callable[[], None] | None = None
    """Called once while a decoder the planner scaled away drains (a test kills and restarts the operator
    there: the new one must finish the drain from what the cluster shows, removing that decoder alone)."""

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def status(self) -> dict[str, Any]:
        found: dict[str, Any] = read_deployment(self.custom, self.namespace, NAME).get("status") or {}
        return found

    def pods(self, role: str) -> list[dict[str, Any]]:
        items = live_pods(self.core, self.namespace, NAME)
        return [p for p in items if (p["metadata"].get("labels") or {}).get("disagg.io/role") == role]

    def ready(self, role: str) -> int:
        return sum(
            1
            for p in self.pods(role)
            if not p["metadata"].get("deletionTimestamp")
            and any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in (p.get("status") or {}).get("conditions") or ()
            )
        )

    def wait(self, what: str, probe: Callable[[], bool], check: Callable[[], None]) -> float:
        start = time.monotonic()
        while not probe():
            check()
            status = self.status()
            self.counts.append(
                (
                    time.monotonic(),
                    int((status.get("decode") or {}).get("desiredReplicas") or 0),
                    len(self.pods("decode")),
                    int((status.get("prefill") or {}).get("desiredReplicas") or 0),
                )
            )
            if time.monotonic() - start > TIMEOUT_S:
                raise AssertionError(f"timed out waiting for {what}; status: {json.dumps(status)[:3000]}")
            time.sleep(0.5)
        return time.monotonic() - start

    def desired(self, role: str) -> int:
        return int((self.status().get(role) or {}).get("desiredReplicas") or 0)

    def events(self) -> list[str]:
        """The namespace's Events in order (the operator's drains and deletions, the ReplicaSets' and the
        Deployments' scaling): what a failure's message shows of who removed which pod when."""
        listed: Any = self.core.list_namespaced_event(self.namespace, _preload_content=False)
        items = json.loads(listed.data)["items"]

        def when(event: dict[str, Any]) -> str:
            return str(event.get("lastTimestamp") or event.get("eventTime") or "")

        return [
            f"{when(e)} {e['involvedObject'].get('kind')}/{e['involvedObject'].get('name')} "
            f"{e.get('reason')}: {e.get('message')}"
            for e in sorted(items, key=when)
        ]

    def pod_names(self) -> dict[str, list[str]]:
        """The live pods' names by role."""
        return {
            role: sorted(p["metadata"]["name"] for p in self.pods(role)) for role in ("prefill", "decode")
        }

    def draining(self) -> bool:
        """Some decode pod is marked to drain."""
        return any(
            DRAINING_ANNOTATION in (p["metadata"].get("annotations") or {}) for p in self.pods("decode")
        )

    def scaling(self) -> dict[str, Any]:
        return next((c for c in self.status().get("conditions") or () if c["type"] == "Scaling"), {})

    def run(self) -> dict[str, Any]:
        say = self.say
        doc = document(self.namespace, self.port)
        self.apply(doc)
        pods = self.workdir / "pods"
        with local_serving(self.api, self.kubeconfig, self.namespace, NAME, pods) as (_, loop):
            up = self.wait(
                "the deployment to serve",
                lambda: self.status().get("routablePairs") == "1/1" and self.ready("decode") == 1,
                loop.check,
            )
            url = service_url(self.core, self.namespace, NAME)
            up += wait_until_served(url, loop.check)
            say(f"  serving after {up:.1f} s: 1 prefill engine (PP2), 1 decoder, 1/1 pairs")
            load = StepLoad(url, doc["spec"]["model"]["name"]).start()
            began = time.monotonic()
            try:
                time.sleep(BASELINE_S)
                loop.check()
                step_up = time.monotonic()
                load.concurrency = HIGH
                decided_up = self.wait(
                    "the planner to scale decode up", lambda: self.desired("decode") > 1, loop.check
                )
                reason_up = self.scaling().get("reason")
                scaled_up = self.wait(
                    "the new decoders to serve",
                    lambda: (
                        self.ready("decode") >= self.desired("decode") > 1
                        and self.status().get("routablePairs")
                        == f"{self.desired('decode')}/{self.desired('decode')}"
                    ),
                    loop.check,
                )
                served_up = time.monotonic()
                peak = self.desired("decode")
                time.sleep(SERVE_AFTER_UP_S)
                loop.check()
                step_down = time.monotonic()
                load.concurrency = LOW
                decided_down = self.wait(
                    "the planner to scale decode down", lambda: self.desired("decode") == 1, loop.check
                )
                reason_down = self.scaling().get("reason")
                before_down = self.pod_names()
                hook = [self.during_scale_down] if self.during_scale_down is not None else []
                added: set[str] = set()

                def gone() -> bool:
                    if hook and self.draining():
                        hook.pop()()
                    names = self.pod_names()["decode"]
                    added.update(set(names) - set(before_down["decode"]))
                    return len(names) == 1

                scaled_down = self.wait("the drained decoders to go", gone, loop.check)
                time.sleep(3)
                loop.check()
                after_down = self.pod_names()
            finally:
                load.stop()
            end = time.monotonic()
        before = load.between(step_up, served_up)
        after = load.between(served_up, step_down)
        # When each failed in the load's life: a failure's cause is found by what happened then.
        failures = [f"{o.at - began:.1f} s into the load: {o.error}" for o in load.outcomes if not o.ok]
        result = {
            "requests": len(load.outcomes),
            "failed": len(failures),
            "failures": failures[:5],
            "peak_decoders": peak,
            "max_decoders_seen": max((c[1] for c in self.counts), default=0),
            "pods_before_down": before_down,
            "pods_after_down": after_down,
            "decode_pods_added_down": sorted(added),
            "max_prefill_seen": max((c[3] for c in self.counts), default=0),
            "decide_up_s": decided_up,
            "scale_up_s": decided_up + scaled_up,
            "decide_down_s": decided_down,
            "scale_down_s": decided_down + scaled_down,
            "reasons": (reason_up, reason_down),
            "attainment_low": attainment(load.between(0.0, step_up)),
            "attainment_before": attainment(before),
            "attainment_after": attainment(after),
            "requests_before": len(before),
            "requests_after": len(after),
            "ttft_p90_before": percentile([o.ttft for o in before if o.ttft is not None], 0.9),
            "ttft_p90_after": percentile([o.ttft for o in after if o.ttft is not None], 0.9),
            "duration_s": end - step_up,
            "events": self.events(),
        }
        say(
            f"  load 1 -> {HIGH}: decode scaled 1 -> {peak} (decided after {decided_up:.1f} s, {reason_up}; "
            f"serving after {result['scale_up_s']:.1f} s); prefill stayed at {result['max_prefill_seen']}"
        )
        say(
            f"  load {HIGH} -> 1: decode 1 decided after {decided_down:.1f} s ({reason_down}; scale-down "
            f"window {DOWN_WINDOW_S} s), drained decoders gone after {result['scale_down_s']:.1f} s"
        )
        say(
            f"  SLO (TTFT <= {TTFT_SLO_S} s, mean ITL <= {ITL_SLO_S} s): {result['attainment_low']:.0%} at "
            f"concurrency 1; at {HIGH} before the new decoders served {result['attainment_before']:.0%} of "
            f"{len(before)} (TTFT p90 {result['ttft_p90_before']:.2f} s), after "
            f"{result['attainment_after']:.0%} of {len(after)} (TTFT p90 {result['ttft_p90_after']:.2f} s)"
        )
        say(f"  requests: {len(load.outcomes)}, failed {len(failures)}")
        return result


def main(argv: Sequence[str] | None = None) -> int:
    from disagg.rig.bench_cluster import bench_cluster

    with bench_cluster("autoscale") as cluster:
        print("autoscale bench: kube-apiserver v1.20.2, the operator, every container a local process")
        run = AutoscaleRun(cluster.api, cluster.kubeconfig, cluster.namespace, cluster.apply, cluster.workdir)
        result = run.run()
    good = result["failed"] == 0 and result["peak_decoders"] > 1 and result["max_prefill_seen"] == 1
    for line in result["failures"]:
        print(f"    {line}")
    print("  verdict: " + ("scaled up and back down, no request failed" if good else "A BOUND WAS BROKEN"))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
