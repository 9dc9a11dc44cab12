"""`disagg bench rollout`: an engine version change rolled out under steady load, on the real API server.

The operator (a real `disagg operator run`) builds a reference-engine deployment (a PP2 prefill engine, two
decoders, the router) on engine release 0.32.0; `LocalKubelet` runs every container as a process and
`ServiceProxy` stands in for kube-proxy. A load of completions runs through the router's Service at
concurrency 8 while `spec.engine.version` changes to 0.33.0 (a KV-incompatible change: another compatibility
hash), in steps of `maxSurge: 1` per role. Measured: failed requests (must be 0), outputs against the
monolithic run (all equal), routable pairs in every state the pods pass through (`Samples`: a list, then a
watch replaying every change in the API server's order, so a loaded machine delays states but never skips
one; never 0 pairs, and no state lost), engine pods in every state against the surge bound (desired +
maxSurge engines per role, a PP2 prefill engine being two pods), the steps Progressing named, and the
rollout's duration and phases.
`drainSeconds` is its default, an hour: an old engine goes once its sidecar reports it idle, and the bench
prints how long the drains took.

Then the two ways a new revision can disagree with itself: roles the policies can tell apart (a decode
override of the engine release) are refused before any pod; a decoder only its live hash tells apart (the
rig starts the new revision's decoders with another engine's hash, what a wrong image would do) stops the
rollout (`RolloutStuck`) with the old revision serving, and applying the old spec again rolls back.

`RolloutRun` is the scenario; the cluster test (`tests/cluster/test_rollout_cluster.py`) runs it too.
"""

from __future__ import annotations

import itertools
import json
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from disagg.operator.rollout import parse_time
from disagg.rig.local import REPO
from disagg.rig.local_serving import (
    live_pods,
    local_serving,
    read_deployment,
    service_url,
    wait_until_served,
)
from disagg.rig.pod_states import PodStates
from disagg.rig.serving_load import Case, Load, monolithic
from disagg.worker.contracts.pairing import routing_from_pods
from disagg.worker.contracts.pod_contract import POD_NAME_ENV, ROLE_ENV

EXAMPLE = REPO / "examples" / "reference-pp2-hma.yaml"
NAME = "roll"
OLD_VERSION, NEW_VERSION = "0.32.0", "0.33.0"
CONCURRENCY = 8
MIN_REQUESTS = 300
MAX_TOKENS = 6
DECODERS = 2
MAX_SURGE = 1
TIMEOUT_S = 300.0
PROMPTS = tuple(f"Rollout request {k}: the KV moves from prefill to decode." for k in range(16))
CASES = tuple(Case("completions", False, prompt, MAX_TOKENS) for prompt in PROMPTS)


def document(namespace: str, version: str, side_channel_port: int) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"] = {"name": NAME, "namespace": namespace}
    spec = doc["spec"]
    spec["engine"]["version"] = version
    spec["decode"]["replicas"] = DECODERS
    spec["kvTransfer"]["sideChannelPort"] = side_channel_port
    # drainSeconds stays its default (3600): an old engine goes once its sidecar reports nothing in flight.
    spec["rollout"] = {"progressDeadlineSeconds": 240, "maxSurge": MAX_SURGE}
    return doc


def surge_bound(doc: dict[str, Any]) -> tuple[int, int]:
    """Engine pods at most during the rollout (desired + maxSurge engines per role), and what the whole new
    revision beside the old would be."""
    prefill, decode = doc["spec"]["prefill"], doc["spec"]["decode"]
    stages = int(prefill.get("pipelineParallelSize", 1))
    desired = prefill["replicas"] * stages + decode["replicas"]
    bound = (prefill["replicas"] + MAX_SURGE) * stages + decode["replicas"] + MAX_SURGE
    return bound, 2 * desired


@dataclass
class Samples:
    """Routable pairs (the router's own pairing) and engine pods in every state the deployment's pods pass
    through (`PodStates`: a list, then a watch that replays every change in the API server's order), from
    `start` to `stop`. A slow machine delays the states, never thins them: a pairless moment cannot fall
    between two of them. States lost to a watch the server ends as too old are in `unseen_s`."""

    core: client.CoreV1Api
    namespace: str
    old_revision: str = ""
    """The revision being replaced: it never grows, so a pod of it made after the watch began (or still
    Pending) is a ReplicaSet's replacement for a decoder a step deleted, which the step's scale-down removes
    (counted apart from the engine pods). On a loaded machine the replacement can start before the scale-down
    reaches the ReplicaSet: a Deployment gives no way to say which pod a lower count removes on Kubernetes
    1.20 (pod-deletion-cost is 1.22's), so the step deletes the pod it drained and the ReplicaSet replaces it
    for a moment."""
    pairs: list[int] = field(default_factory=list)
    """Per state, in order: routable pairs, replacements (above) and the other engine pods, and when the
    state arrived (`time.monotonic()`)."""
    replacements: list[int] = field(default_factory=list)
    pods: list[int] = field(default_factory=list)
    at: list[float] = field(default_factory=list)
    peak: list[str] = field(default_factory=list)
    """The engine pods of the state with the most: name, phase, and whether it is being deleted."""
    _states: PodStates | None = None
    _began: datetime = field(default_factory=lambda: datetime.now(UTC).replace(microsecond=0))

    def start(self) -> Samples:
        self._began = datetime.now(UTC).replace(microsecond=0)
        self._states = PodStates(self.core, self.namespace, NAME, self._on_state).start()
        return self

    def _on_state(self, at: float, items: list[dict[str, Any]]) -> None:
        engines = [p for p in items if "disagg.io/role" in (p["metadata"].get("labels") or {})]
        self.pairs.append(len(routing_from_pods(items).pairs))
        replacing = [
            p
            for p in engines
            if self.old_revision
            and p["metadata"]["labels"].get("disagg.io/revision") == self.old_revision
            and (
                (p.get("status") or {}).get("phase") == "Pending"
                or (parse_time(p["metadata"].get("creationTimestamp")) or self._began) > self._began
            )
        ]
        self.replacements.append(len(replacing))
        engines = [p for p in engines if p not in replacing]
        if len(engines) > max(self.pods, default=0):
            self.peak = [
                f"{p['metadata']['name']} {(p.get('status') or {}).get('phase')}"
                + (" deleting" if p["metadata"].get("deletionTimestamp") else "")
                for p in engines
            ]
        self.pods.append(len(engines))
        self.at.append(at)

    def stop(self) -> None:
        """Ends the watch; raises if it failed (a state it could not hand on is not a state seen)."""
        assert self._states is not None
        self._states.stop()

    @property
    def states(self) -> int:
        return len(self.pairs)

    @property
    def unseen_s(self) -> list[float]:
        """Each stretch whose states were lost (a watch the server ended as too old, then a list)."""
        return list(self._states.unseen_s) if self._states is not None else []

    def longest_still_s(self) -> float:
        """The longest time between two states as they arrived: the pods changed nothing in between (no
        state between them exists), so this is no gap in what was seen; printed, never a bound."""
        return max((b - a for a, b in itertools.pairwise(self.at)), default=0.0)

    def seen(self) -> str:
        """What the states cover, for the printed line."""
        lost = self.unseen_s
        if not lost:
            return f"every one of {self.states} pod states (a watch: none lost)"
        return (
            f"{self.states} pod states (a watch; {len(lost)} stretches lost to a watch the server ended as "
            f"too old, {sum(lost):.2f} s in all, the longest {max(lost):.2f} s)"
        )


def stale_decoders(slot_prefix: str, compat_hash: str) -> Callable[[dict[str, Any], dict[str, str]], None]:
    """The rig's knob for a difference only the live hashes show: the decoders whose pod name starts with
    `slot_prefix` start with `compat_hash` (what a decode image of another engine build would advertise);
    every other pod as built."""
    from disagg.rig.local_kubelet import with_engine_hash

    skew = with_engine_hash("decode", compat_hash)

    def fault(document: dict[str, Any], env: dict[str, str]) -> None:
        if env.get(ROLE_ENV) == "decode" and env.get(POD_NAME_ENV, "").startswith(slot_prefix):
            skew(document, env)

    return fault


@dataclass
class RolloutRun:
    """The scenario on a namespace an operator watches; `apply` is `kubectl apply` of a document."""

    api: client.ApiClient
    kubeconfig: Path
    namespace: str
    apply: Callable[[dict[str, Any]], None]
    workdir: Path
    say: Callable[[str], None] = print
    during_rollout: Callable[[], None] | None = None
    """Called once while the version change waits for the new revision's pairs, and once more while the old
    revision drains (a test kills and restarts the operator there: the rollout must resume from what the
    cluster shows)."""
    port: int = field(default_factory=lambda: 20000 + secrets.randbelow(20000))

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def get(self) -> dict[str, Any]:
        return read_deployment(self.custom, self.namespace, NAME)

    def condition(self, type_: str) -> dict[str, Any]:
        conditions = (self.get().get("status") or {}).get("conditions") or ()
        return next((c for c in conditions if c["type"] == type_), {})

    def wait(self, what: str, probe: Callable[[], bool], check: Callable[[], None]) -> float:
        start = time.monotonic()
        while not probe():
            check()
            if time.monotonic() - start > TIMEOUT_S:
                status = self.get().get("status") or {}
                raise AssertionError(f"timed out waiting for {what}; status: {json.dumps(status)[:3000]}")
            time.sleep(0.5)
        return time.monotonic() - start

    def settled(self, revisions: int = 1) -> bool:
        status = self.get().get("status") or {}
        progressing = self.condition("Progressing")
        return (
            status.get("routablePairs") == f"{DECODERS}/{DECODERS}"
            and progressing.get("reason") == "RolloutComplete"
            and not status.get("oldRevision")
            and len({p["metadata"]["labels"].get("disagg.io/revision") for p in self.engines()}) == revisions
        )

    def engines(self) -> list[dict[str, Any]]:
        return [
            p
            for p in live_pods(self.core, self.namespace, NAME)
            if "disagg.io/role" in p["metadata"]["labels"]
        ]

    def run(self) -> dict[str, Any]:
        say = self.say
        old = document(self.namespace, OLD_VERSION, self.port)
        model = old["spec"]["model"]["name"]
        self.apply(old)
        result: dict[str, Any] = {}
        pods = self.workdir / "pods"
        with local_serving(self.api, self.kubeconfig, self.namespace, NAME, pods) as (kubelet, loop):
            up = self.wait("the first revision to serve", self.settled, loop.check)
            url = service_url(self.core, self.namespace, NAME)
            up += wait_until_served(url, loop.check)
            base = len(self.engines())
            first = (self.get().get("status") or {}).get("revision")
            say(
                f"  revision {first} (engine {OLD_VERSION}) serving after {up:.1f} s: {base} engine pods, "
                f"{DECODERS}/{DECODERS} pairs"
            )
            expected = {case: monolithic(case) for case in CASES}
            load = Load(url, model, CASES, expected, CONCURRENCY).start()
            samples = Samples(self.core, self.namespace, old_revision=first or "").start()
            phases: dict[str, float] = {}
            steps: list[str] = []
            try:
                self.wait("requests before the change", lambda: load.ok >= 40, loop.check)
                new = document(self.namespace, NEW_VERSION, self.port)
                start = time.monotonic()
                self.apply(new)

                hooks = (
                    {"RolloutWaitingForRoutablePairs", "RolloutDraining"} if self.during_rollout else set()
                )

                def done() -> bool:
                    progressing = self.condition("Progressing")
                    reason = progressing.get("reason") or ""
                    phases.setdefault(reason, time.monotonic() - start)
                    step = (progressing.get("message") or "").split(";")[0]
                    if step.startswith("step ") and (not steps or steps[-1] != step):
                        steps.append(step)
                    if reason in hooks and self.during_rollout is not None:
                        hooks.discard(reason)
                        self.during_rollout()
                    return (self.get().get("status") or {}).get("revision") != first and self.settled()

                duration = self.wait("the rollout to complete", done, loop.check)
                self.wait(f"{MIN_REQUESTS} requests", lambda: load.sent >= MIN_REQUESTS, loop.check)
            finally:
                try:
                    samples.stop()
                finally:
                    load.stop()
            second = (self.get().get("status") or {}).get("revision")
            drain_s = duration - phases.get("RolloutDraining", duration)
            result["version_change"] = {
                "requests": load.sent,
                "ok": load.ok,
                "failed": len(load.failures),
                "mismatched": len(load.mismatches),
                "min_pairs": min(samples.pairs),
                "states": samples.states,
                "unseen_s": samples.unseen_s,
                "longest_still_s": samples.longest_still_s(),
                "max_engine_pods": max(samples.pods),
                "replacement_states": sum(1 for n in samples.replacements if n),
                "max_replacements": max(samples.replacements, default=0),
                "surge_bound": surge_bound(new)[0],
                "steps": steps,
                "duration_s": duration,
                "drain_s": drain_s,
                "phases": phases,
                "revisions": (first, second),
                "failures": load.failures[:5] + load.mismatches[:5],
            }
            say(
                f"  {OLD_VERSION} -> {NEW_VERSION}: revision {first} -> {second} in {duration:.1f} s "
                f"(phases first seen at: "
                + ", ".join(f"{reason} {t:.1f} s" for reason, t in phases.items())
                + f"); {drain_s:.1f} s from the first drain to the end, with drainSeconds 3600: each old "
                "engine went when its sidecar reported it idle"
            )
            say(
                f"  load at concurrency {CONCURRENCY}: {load.sent} requests, {len(load.failures)} failed, "
                f"{load.ok - len(load.mismatches)}/{load.ok} equal to the monolithic run"
            )
            say(
                f"  routable pairs over {samples.seen()}: min {min(samples.pairs)}, max {max(samples.pairs)} "
                f"(the pods stayed unchanged {samples.longest_still_s():.2f} s at the longest); engine pods "
                f"max {max(samples.pods)} (bound {surge_bound(new)[0]}: desired {base} + maxSurge "
                f"{MAX_SURGE} per role; the whole new revision beside the old would be {surge_bound(new)[1]})"
            )
            say("  steps Progressing named: " + " | ".join(steps))
            say("  engine pods at the peak: " + ", ".join(samples.peak))
            say(
                f"  pod states with a replacement of the old revision (a ReplicaSet's, for a decoder a "
                f"step deleted; its scale-down removes it; not counted above): "
                f"{sum(1 for n in samples.replacements if n)}, at most {max(samples.replacements)} at once"
            )
            result["refused"] = self.refused_before_any_pod(new, loop.check)
            result["stuck"] = self.stuck_then_rolled_back(kubelet, new, url, model, expected, loop.check)
        return result

    def refused_before_any_pod(self, serving: dict[str, Any], check: Callable[[], None]) -> dict[str, Any]:
        """A decode override of the engine release: pre-flight tells the roles apart, nothing is built."""
        before = sorted(p["metadata"]["name"] for p in self.engines())
        bad = json.loads(json.dumps(serving))
        bad["spec"]["decode"]["overrides"] = {"version": OLD_VERSION}
        self.apply(bad)
        self.wait("the refusal", lambda: self.condition("Compatible").get("status") == "False", check)
        compatible = self.condition("Compatible")
        time.sleep(3)
        after = sorted(p["metadata"]["name"] for p in self.engines())
        self.say(
            f"  decode override {OLD_VERSION} beside prefill {NEW_VERSION}: Compatible=False "
            f"{compatible.get('reason')}; engine pods unchanged: {after == before}"
        )
        self.apply(serving)
        self.wait(
            "the serving spec again", lambda: self.condition("Compatible").get("status") == "True", check
        )
        return {
            "reason": compatible.get("reason"),
            "message": compatible.get("message"),
            "unchanged": after == before,
        }

    def stuck_then_rolled_back(
        self,
        kubelet: Any,
        serving: dict[str, Any],
        url: str,
        model: str,
        expected: dict[Case, str],
        check: Callable[[], None],
    ) -> dict[str, Any]:
        """The new revision's decoders start with another hash: the rollout stops, the old one serves."""
        status = self.get().get("status") or {}
        serving_slot = next(
            r["slot"] for r in status.get("revisions") or () if r["revision"] == status["revision"]
        )
        prefix = f"{NAME}-decode" if serving_slot == "b" else f"{NAME}-b-decode"
        kubelet.new_pod_fault = stale_decoders(prefix, "0" * 64)
        changed = json.loads(json.dumps(serving))
        changed["spec"]["engine"]["version"] = OLD_VERSION
        load = Load(url, model, CASES, expected, CONCURRENCY).start()
        samples = Samples(self.core, self.namespace).start()
        try:
            start = time.monotonic()
            self.apply(changed)
            self.wait(
                "RolloutStuck",
                lambda: self.condition("Progressing").get("reason") == "RolloutStuck",
                check,
            )
            stuck_after = time.monotonic() - start
            stuck = self.condition("Progressing")
            time.sleep(4)
            still = self.get().get("status") or {}
            self.apply(serving)
            back = self.wait("the rollback", self.settled, check)
        finally:
            try:
                samples.stop()
            finally:
                load.stop()
                kubelet.new_pod_fault = None
        self.say(
            f"  new decoders with another live hash: Progressing={stuck.get('status')} {stuck.get('reason')} "
            f"after {stuck_after:.1f} s; old revision {still.get('oldRevision')} kept serving "
            f"(pairs {still.get('routablePairs')})"
        )
        self.say(f"    {stuck.get('message', '')[:400]}")
        self.say(
            f"  rollback (kubectl apply of the serving spec): complete after {back:.1f} s; load meanwhile "
            f"{load.sent} requests, {len(load.failures)} failed, {len(load.mismatches)} mismatched, "
            f"routable pairs over {samples.seen()}: min {min(samples.pairs)}"
        )
        return {
            "reason": stuck.get("reason"),
            "status": stuck.get("status"),
            "message": stuck.get("message"),
            "requests": load.sent,
            "failed": len(load.failures),
            "mismatched": len(load.mismatches),
            "min_pairs": min(samples.pairs),
            "states": samples.states,
            "unseen_s": samples.unseen_s,
            "rollback_s": back,
            "failures": load.failures[:5] + load.mismatches[:5],
        }


def main(argv: Sequence[str] | None = None) -> int:
    from disagg.rig.bench_cluster import bench_cluster

    with bench_cluster("rollout") as cluster:
        print("rollout bench: kube-apiserver v1.20.2, the operator, every container a local process")
        result = RolloutRun(
            cluster.api, cluster.kubeconfig, cluster.namespace, cluster.apply, cluster.workdir
        ).run()
    change = result["version_change"]
    stuck = result["stuck"]
    good = (
        change["failed"] == 0
        and change["mismatched"] == 0
        and change["requests"] >= MIN_REQUESTS
        and change["min_pairs"] >= 1
        and not change["unseen_s"]
        and change["max_engine_pods"] <= change["surge_bound"]
        and stuck["reason"] == "RolloutStuck"
        and stuck["failed"] == 0
        and stuck["min_pairs"] >= 1
        and not stuck["unseen_s"]
        and result["refused"]["unchanged"]
    )
    for line in change["failures"] + stuck["failures"]:
        print(f"    {line}")
    print("  verdict: " + ("every bound held" if good else "A BOUND WAS BROKEN"))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
