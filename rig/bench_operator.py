"""`make bench` for the operator, against the real local kube-apiserver (hack/control-plane.sh).

Two measurements, each beside the API server's own floor in the same run:
1. `kubectl apply` → `Compatible` condition, median over sequential applies. Floor: the same `kubectl apply`,
   then one status patch by a client that is already connected (what any operator must at least do). The
   floor's samples and the operator's alternate, in two namespaces, so a drifting load moves both alike.
2. N DisaggDeployments (`--deployments`, 100 by default; `disagg bench operator --deployments 1000` for the
   scale case, about 7,000 children and 4,000 pods) reconciled end to end (every child applied, `Compatible`
   written). Floor: one client doing the same work without kopf: create, build, server-side apply every child,
   patch the status; run before the operator's run and again after it, the ratio taken to their mean (the
   floor's client waits for each request, and at 1,000 its time varied from 95 s to 155 s between runs).
   Then every deployment must converge to its final conditions (no kubelet runs, so the pods stay Pending:
   Available False, Progressing True, KVTransferReady Unknown) with no error in the operator's log and no
   Warning Event from the operator (counted apart: the cluster's own controllers' warnings, as the
   StatefulSet controller warns and retries when the loaded API server refuses a Pod create, and kopf's
   attempts at a request it retries); it prints the operator's peak RSS and its RSS after every 100
   deployments, with the growth per 100, and for each run the CPU seconds each process of the machine's
   control plane, the operator and the bench spent.
Each run has a fresh namespace, deleted before the next run starts. The control plane is started if none
runs, and stopped again only if this run started it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, watch
from urllib3.exceptions import ProtocolError

from disagg.operator.api import GROUP, PLURAL, VERSION
from disagg.operator.builders.children import build
from disagg.operator.control.k8s_apply import Kube
from disagg.operator.control.reconcile import judge
from disagg.operator.naming import FIELD_MANAGER, Owner
from disagg.rig import control_plane
from disagg.rig.bench_cluster import (
    CpuMeter,
    Operator,
    api_client,
    apply_crd,
    fresh_namespace,
    kubectl_apply,
)
from disagg.rig.control_plane import Paths
from disagg.rig.local import REPO

EXAMPLE = REPO / "examples" / "pp2-hma.yaml"
# What a deployment of the example settles on when no kubelet runs its pods.
FINAL = {
    "Compatible": ("True", "Compatible"),
    "Available": ("False", "AwaitingPods"),
    "Progressing": ("True", "Creating"),
    "KVTransferReady": ("Unknown", "AwaitingHandshake"),
    "Routable": ("Unknown", "AwaitingPeerReports"),
}


class ConditionWatch:
    """Records when each DisaggDeployment of a namespace first shows a `Compatible` condition."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.seen: dict[str, float] = {}
        # Names whose latest event shows the FINAL conditions.
        self.final: set[str] = set()
        self.on_seen: Callable[[int], None] = lambda count: None
        self._changed = threading.Condition()
        self._watch = watch.Watch()  # type: ignore[no-untyped-call]
        self._custom = client.CustomObjectsApi(api)
        self._namespace = namespace
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        stream = self._watch.stream(  # type: ignore[no-untyped-call]
            self._custom.list_namespaced_custom_object, GROUP, VERSION, self._namespace, PLURAL
        )
        try:
            for event in stream:
                if self._stopping.is_set():
                    # stop() cut the connection: the client yields the cut line as None.
                    return
                self._record(event["object"])
        except ProtocolError:
            # stop() closes the connection under the stream; any other end of it is an error.
            if not self._stopping.is_set():
                raise

    def _record(self, obj: dict[str, Any]) -> None:
        conditions = (obj.get("status") or {}).get("conditions") or []
        name = obj["metadata"]["name"]
        shown = {item.get("type"): (item.get("status"), item.get("reason")) for item in conditions}
        with self._changed:
            if "Compatible" in shown and name not in self.seen:
                self.seen[name] = time.perf_counter()
                self.on_seen(len(self.seen))
            if shown == FINAL:
                self.final.add(name)
            else:
                self.final.discard(name)
            self._changed.notify_all()

    def wait_final(self, names: Sequence[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not self.final.issuperset(names):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [name for name in names if name not in self.final]
                    raise TimeoutError(
                        f"{len(missing)} deployments not at their final conditions: {missing[:5]}"
                    )
                self._changed.wait(left)

    def wait(self, names: Sequence[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not all(name in self.seen for name in names):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [name for name in names if name not in self.seen]
                    raise TimeoutError(f"no Compatible condition within {timeout} s on {missing[:5]}")
                self._changed.wait(left)

    def stop(self) -> None:
        self._stopping.set()
        self._watch.stop()  # type: ignore[no-untyped-call]


def _document(namespace: str, name: str) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    document["metadata"] = {"name": name, "namespace": namespace}
    return document


def _floor_status(kube: Kube, namespace: str, name: str) -> None:
    """The one status write any operator makes after reading the object."""
    body = kube.read_deployment(namespace, name)
    assert body is not None
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    condition = {
        "type": "Compatible",
        "status": "True",
        "reason": "Compatible",
        "message": "applied directly by a client",
        "lastTransitionTime": now,
    }
    kube.patch_status(namespace, name, {"observedGeneration": 1, "conditions": [condition]})


@dataclass
class Latency:
    floor: list[float] = field(default_factory=list)
    operator: list[float] = field(default_factory=list)


def _apply_latency(
    paths: Paths, api: client.ApiClient, floor_ns: str, operator_ns: str, count: int
) -> Latency:
    """`count` samples of each, alternating (floor, operator, floor, ...): a machine whose load drifts
    during the run moves both alike, where two runs one after the other would each see another load."""
    kube, latency = Kube(api), Latency()
    watches = {floor_ns: ConditionWatch(api, floor_ns), operator_ns: ConditionWatch(api, operator_ns)}
    try:
        for index in range(count):
            for namespace, samples in ((floor_ns, latency.floor), (operator_ns, latency.operator)):
                name = f"latency-{index}"
                start = time.perf_counter()
                kubectl_apply(paths, _document(namespace, name))
                if namespace == floor_ns:
                    _floor_status(kube, namespace, name)
                watches[namespace].wait([name], timeout=60)
                samples.append(watches[namespace].seen[name] - start)
    finally:
        for watch_ in watches.values():
            watch_.stop()
    return latency


def _floor_reconcile(kube: Kube, namespace: str, name: str) -> None:
    """What the operator does for one object, done directly: create, judge, build, apply, write status."""
    document = _document(namespace, name)
    kube.create_deployment(namespace, document)
    body = kube.read_deployment(namespace, name)
    assert body is not None
    verdict = judge(body["spec"])
    assert verdict.spec is not None and verdict.report is not None and verdict.report.plan is not None
    owner = Owner(name, namespace, body["metadata"]["uid"], 1)
    for obj in build(verdict.spec, owner, verdict.report.plan, verdict.report.hashes):
        kube.apply(obj)
    _floor_status(kube, namespace, name)


@dataclass
class Run:
    total: float
    cpu: CpuMeter
    converged: float | None = None
    # (deployments with Compatible, operator VmRSS MiB) at every 100.
    rss: list[tuple[int, float]] = field(default_factory=list)


def _end_to_end(
    api: client.ApiClient,
    namespace: str,
    count: int,
    cpu: CpuMeter,
    floor: bool,
    operator: Operator | None = None,
) -> Run:
    kube = Kube(api)
    names = [f"dd-{index}" for index in range(count)]
    observer = ConditionWatch(api, namespace)
    run = Run(0.0, cpu)
    if operator is not None:
        observer.on_seen = lambda seen: (
            run.rss.append((seen, operator.rss_mib())) if seen % 100 == 0 else None
        )
    timeout = max(600.0, 1.5 * count)
    start = time.perf_counter()
    cpu.start()
    try:
        for name in names:
            if floor:
                _floor_reconcile(kube, namespace, name)
            else:
                document = _document(namespace, name)
                kube.create_deployment(namespace, document)
        observer.wait(names, timeout=timeout)
        _wait_children(kube, namespace, count, timeout)
        run.total = time.perf_counter() - start
        cpu.stop()
        if not floor:
            observer.wait_final(names, timeout=timeout)
            run.converged = time.perf_counter() - start
    finally:
        observer.stop()
    return run


def _workloads_per_deployment() -> dict[str, int]:
    """How many StatefulSets and Deployments the operator builds for the example (the router adds one)."""
    verdict = judge(_document("ns", "dd")["spec"])
    assert verdict.spec is not None and verdict.report is not None and verdict.report.plan is not None
    built = build(verdict.spec, Owner("dd", "ns", "uid", 1), verdict.report.plan, verdict.report.hashes)
    return {kind: sum(obj["kind"] == kind for obj in built) for kind in ("StatefulSet", "Deployment")}


def _wait_children(kube: Kube, namespace: str, count: int, timeout: float) -> None:
    """Wait until every DisaggDeployment's StatefulSets and Deployments exist. `Compatible` alone does not
    say so: a child's event can refresh the status while the reconcile is still applying the rest."""

    def counted(lister: Callable[..., Any]) -> int:
        items: list[Any] = json.loads(lister(namespace, _preload_content=False).data)["items"]
        return len(items)

    apps = client.AppsV1Api(kube.api)
    listers = {
        "StatefulSet": apps.list_namespaced_stateful_set,
        "Deployment": apps.list_namespaced_deployment,
    }
    deadline = time.monotonic() + timeout
    for kind, each in _workloads_per_deployment().items():
        while (found := counted(listers[kind])) != count * each:
            if found > count * each or time.monotonic() > deadline:
                raise RuntimeError(f"expected {count * each} {kind}s, found {found}")
            time.sleep(0.2)


def _warnings(api: client.ApiClient, namespace: str) -> tuple[list[str], list[str]]:
    """Warning Events posted by the operator, and those posted by anyone else (the API server's own
    controllers warn when it is too loaded to create a Pod at once, and retry)."""
    response: Any = client.CoreV1Api(api).list_namespaced_event(namespace, _preload_content=False)
    events = [e for e in json.loads(response.data)["items"] if e.get("type") == "Warning"]
    ours: list[str] = []
    others: list[str] = []
    for event in events:
        source = event.get("reportingComponent") or (event.get("source") or {}).get("component")
        line = f"{source}: {event['reason']}: {event['message']}"
        (ours if source == FIELD_MANAGER else others).append(line)
    return ours, others


def _wait_gone(api: client.ApiClient, namespace: str, timeout: float) -> float:
    """A run's namespace is deleted, so its thousands of children do not load the next run; returns the
    seconds it took. A deletion still under way would load the next run alone: it raises rather than
    measure that."""
    core, start = client.CoreV1Api(api), time.monotonic()
    while time.monotonic() < start + timeout:
        try:
            core.read_namespace(namespace, _preload_content=False)
        except client.ApiException as error:
            if error.status == 404:
                return time.monotonic() - start
            raise
        time.sleep(1)
    raise TimeoutError(f"namespace {namespace} still there {timeout:.0f} s after its deletion")


def _growth(rss: list[tuple[int, float]]) -> str:
    """Per 100 deployments from the first sample to the last, and over the later half alone: growth that
    stops after the first hundreds (what fills once) shows in the first figure only; the second is what
    each further deployment keeps."""
    if len(rss) < 2:
        return "n/a"

    def per_100(a: tuple[int, float], b: tuple[int, float]) -> float:
        return (b[1] - a[1]) / (b[0] - a[0]) * 100

    whole = f"{per_100(rss[0], rss[-1]):+.1f} MiB per 100"
    if len(rss) < 4:
        return whole
    middle = rss[(len(rss) - 1) // 2]
    later = per_100(middle, rss[-1])
    return f"{whole}; {later:+.1f} MiB per 100 from {middle[0]} to {rss[-1][0]}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_operator", description=__doc__.splitlines()[0])
    parser.add_argument("--latency-samples", type=int, default=15)
    parser.add_argument(
        "--deployments", "--count", type=int, default=100, help="DisaggDeployments reconciled end to end."
    )
    args = parser.parse_args(argv)
    count = args.deployments
    with control_plane.shared() as (paths, _):
        apply_crd(paths)
        api = api_client(paths)
        deletion = max(300.0, count * 1.0)
        with fresh_namespace(api, "bench-floor-b") as floor_b:
            floor = _end_to_end(api, floor_b, count, CpuMeter.of(paths), floor=True)
        floor_deleted = _wait_gone(api, floor_b, deletion)
        with (
            fresh_namespace(api, "bench-floor-a") as floor_a,
            fresh_namespace(api, "bench-op-a") as a,
            fresh_namespace(api, "bench-op-b") as b,
        ):
            log = Path(f"/tmp/disagg-bench-operator-{os.getpid()}.log")
            operator = Operator(paths, [a, b], log)
            try:
                latencies = _apply_latency(paths, api, floor_a, a, args.latency_samples)
                meter = CpuMeter.of(paths, operator=operator.proc.pid)
                run = _end_to_end(api, b, count, meter, floor=False, operator=operator)
                rss = operator.peak_rss_mib()
                warnings, others = _warnings(api, b)
            finally:
                stopped = operator.stop()
            logged = operator.errors()
        operator_deleted = _wait_gone(api, b, deletion)
        with fresh_namespace(api, "bench-floor-c") as floor_c:
            floor_after = _end_to_end(api, floor_c, count, CpuMeter.of(paths), floor=True)
    # kopf logs each refused attempt of a request it retries at ERROR ("Request attempt #1/9 failed; will
    # retry"): the loaded API server's doing, like the controllers' warnings below, and not a failure unless
    # the last attempt fails too (which kopf logs without "will retry").
    retried = [line for line in logged if "; will retry" in line]
    errors = [line for line in logged if "; will retry" not in line]
    latency, floor_latency = statistics.median(latencies.operator), statistics.median(latencies.floor)
    print("operator bench: kube-apiserver v1.20.2 on 127.0.0.1, no kubelet (pods stay Pending)")
    print(
        f"  kubectl apply -> Compatible, median of {args.latency_samples} (alternating with the floor's): "
        f"operator {latency:.3f} s | "
        f"API floor (kubectl apply + one status patch) {floor_latency:.3f} s | "
        f"ratio {latency / floor_latency:.2f}x"
    )
    floor_mean = statistics.mean((floor.total, floor_after.total))
    print(
        f"  {count} DisaggDeployments end to end: operator {run.total:.2f} s | "
        f"API floor (one client applies the same objects) {floor.total:.2f} s before, "
        f"{floor_after.total:.2f} s after, mean {floor_mean:.2f} s | ratio {run.total / floor_mean:.2f}x"
    )
    print(f"  CPU seconds while each ran: operator's run: {run.cpu.describe()}")
    print(f"                              floor's run before: {floor.cpu.describe()}")
    print(f"                              floor's run after: {floor_after.cpu.describe()}")
    print(
        f"  namespaces deleted before the next run: the floor's in {floor_deleted:.1f} s, "
        f"the operator's in {operator_deleted:.1f} s"
    )
    print(f"  all {count} at their final conditions after {run.converged:.2f} s")
    print(
        "  operator RSS after every 100: "
        + ", ".join(f"{n}: {mib:.1f}" for n, mib in run.rss)
        + f" MiB; growth {_growth(run.rss)}"
    )
    print(f"  operator peak RSS: {rss:.1f} MiB; stopped {stopped:.1f} s after SIGTERM")
    print(f"  errors in the operator's log: {len(errors)}; Warning Events from the operator: {len(warnings)}")
    for line in (errors + warnings)[:10]:
        print(f"    {line}")
    if retried:
        print(f"  requests kopf retried after the API server refused them: {len(retried)}, first:")
        print(f"    {retried[0]}")
    if others:
        print(f"  Warning Events from the cluster's own controllers (they retry): {len(others)}, first:")
        print(f"    {others[0]}")
    return 1 if errors or warnings else 0


if __name__ == "__main__":
    sys.exit(main())
