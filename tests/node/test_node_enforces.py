"""What only a real kubelet shows: the security contexts as generated, the KV pool volume the engine and its
sidecar share, requests and limits as cgroups, DNS names of StatefulSet pods, the readiness gate and probe as
the kubelet runs them, a container killed and restarted by the kubelet with its pair verified again, and a pod
deleted and replaced."""

from __future__ import annotations

import threading
from typing import Any

from node_suite import curl_text

from disagg.rig.node_cluster import OPERATOR_NAMESPACE, NodeCluster, NodeError, pod_ready, wait_for
from disagg.worker.contracts.pod_contract import POD_CONDITION
from disagg.worker.router.config import RouterConfig


def one_pod(node: NodeCluster, name: str, role: str) -> dict[str, Any]:
    pods = sorted(
        node.pods("default", f"app.kubernetes.io/instance={name},app.kubernetes.io/component={role}"),
        key=lambda p: p["metadata"]["name"],
    )
    return pods[0]


def exec_in(node: NodeCluster, pod: str, container: str, script: str, namespace: str = "default") -> str:
    return node.kubectl(
        "-n", namespace, "exec", pod, "-c", container, "--", "sh", "-c", script
    ).stdout.strip()


def test_security_contexts_as_generated(node: NodeCluster, reference: str) -> None:
    pod = one_pod(node, reference, "decode")
    name = pod["metadata"]["name"]
    # engine: runAsNonRoot with the image's user, every capability dropped, no privilege escalation.
    assert exec_in(node, name, "engine", "id -u; id -g") == "65532\n65532"
    status = exec_in(node, name, "engine", "grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status")
    fields = dict(line.split(":\t") for line in status.splitlines())
    assert fields["CapEff"] == fields["CapBnd"] == "0000000000000000", fields
    assert fields["NoNewPrivs"] == "1" and fields["Seccomp"] == "2", (
        fields
    )  # 2: a seccomp filter (RuntimeDefault)
    # kv-worker: a read-only root filesystem; only IPC_LOCK in its bounding set.
    refused = node.kubectl("exec", name, "-c", "kv-worker", "--", "sh", "-c", "touch /probe", check=False)
    assert refused.returncode != 0 and "Read-only file system" in refused.stderr, refused
    bounding = exec_in(node, name, "kv-worker", "grep '^CapBnd:' /proc/self/status").split()[1]
    assert int(bounding, 16) == 1 << 14, bounding  # CAP_IPC_LOCK is capability 14


def test_kv_pool_volume_is_shared_by_engine_and_sidecar(node: NodeCluster, reference: str) -> None:
    name = one_pod(node, reference, "prefill")["metadata"]["name"]
    exec_in(node, name, "engine", "echo from-engine > /dev/shm/node-suite-probe")
    try:
        assert exec_in(node, name, "kv-worker", "cat /dev/shm/node-suite-probe") == "from-engine"
        assert "tmpfs" in exec_in(node, name, "kv-worker", "grep ' /dev/shm ' /proc/mounts")
    finally:
        exec_in(node, name, "engine", "rm -f /dev/shm/node-suite-probe")


def test_requests_and_limits_are_cgroups(
    node: NodeCluster, reference: str, operator_installed: dict[str, Any]
) -> None:
    name = one_pod(node, reference, "decode")["metadata"]["name"]
    # The engine's requests.cpu (the sample's) is its cpu.shares: millicores * 1024 / 1000.
    spec = node.json("get", "pod", name)["spec"]
    [engine] = [c for c in spec["containers"] if c["name"] == "engine"]
    cpu = engine["resources"]["requests"]["cpu"]
    millicores = int(cpu.removesuffix("m")) if cpu.endswith("m") else int(float(cpu) * 1000)
    assert exec_in(node, name, "engine", "cat /sys/fs/cgroup/cpu/cpu.shares") == str(
        millicores * 1024 // 1000
    )
    # The operator's memory limit (the chart's resources.limits.memory, 256Mi) is its memory cgroup's limit.
    op = operator_installed["metadata"]["name"]
    limit = exec_in(
        node, op, "operator", "cat /sys/fs/cgroup/memory/memory.limit_in_bytes", OPERATOR_NAMESPACE
    )
    assert limit == str(256 * 1024 * 1024)


def test_statefulset_pods_resolve_by_their_dns_names(node: NodeCluster, reference: str) -> None:
    stages = sorted(
        node.pods("default", f"app.kubernetes.io/instance={reference},app.kubernetes.io/component=prefill"),
        key=lambda p: p["metadata"]["name"],
    )
    for pod in stages:
        host = f"{pod['spec']['hostname']}.{pod['spec']['subdomain']}.default.svc"
        script = f"import socket; print(socket.gethostbyname('{host}'))"
        got = node.kubectl(
            "exec", stages[0]["metadata"]["name"], "-c", "engine", "--", "python3", "-c", script
        ).stdout.strip()
        assert got == pod["status"]["podIP"], (host, got)


def condition(pod: dict[str, Any], kind: str) -> dict[str, Any]:
    [found] = [c for c in pod["status"].get("conditions") or [] if c["type"] == kind]
    return found


def engine_status(pod: dict[str, Any]) -> dict[str, Any]:
    [status] = [s for s in pod["status"]["containerStatuses"] if s["name"] == "engine"]
    return status


def pod_if(node: NodeCluster, name: str, *, ready: bool) -> dict[str, Any] | None:
    pod: dict[str, Any] = node.json("get", "pod", name)
    return pod if pod_ready(pod) == ready else None


def test_readiness_gate_and_probe_as_the_kubelet_runs_them(
    node: NodeCluster, reference: str, expected_text: str
) -> None:
    model = node.json("get", "disagg", reference)["spec"]["model"]["name"]
    pod = one_pod(node, reference, "decode")
    name = pod["metadata"]["name"]
    assert pod["spec"]["readinessGates"] == [{"conditionType": POD_CONDITION}]
    gate, ready = condition(pod, POD_CONDITION), condition(pod, "Ready")
    assert gate["status"] == ready["status"] == "True", (gate, ready)
    # The kubelet counts the gate: the pod turned Ready no earlier than the sidecar's condition did.
    assert ready["lastTransitionTime"] >= gate["lastTransitionTime"], (gate, ready)

    # The engine frozen in its cgroup (still running, answering nothing): only the kubelet's own readiness
    # probe, with its period, timeout and failure threshold, can take the pod out.
    engine = engine_status(pod)
    task = engine["containerID"].removeprefix("containerd://")
    node.ctr("tasks", "pause", task)
    try:
        frozen = wait_for(
            f"{name} unready by its engine's readiness probe", lambda: pod_if(node, name, ready=False), 120
        )
        assert condition(frozen, "Ready")["reason"] == "ContainersNotReady", condition(frozen, "Ready")
        status = engine_status(frozen)
        assert status["ready"] is False and "running" in status["state"], status
        # The router takes the other decoder meanwhile.
        for _ in range(4):
            assert curl_text(node, reference, model) == expected_text
    finally:
        node.ctr("tasks", "resume", task)
    thawed = wait_for(f"{name} Ready again once it answers", lambda: pod_if(node, name, ready=True), 120)
    # A readiness probe never restarts a container: the same one, not restarted.
    assert engine_status(thawed)["containerID"] == engine["containerID"]
    assert engine_status(thawed)["restartCount"] == engine["restartCount"]
    requests_until_one_crosses(node, reference, name, expected_text)


def ready_since(pod: dict[str, Any]) -> str | None:
    """When the pod's Ready condition last turned True; None while it is not Ready."""
    for cond in pod["status"].get("conditions") or []:
        if cond["type"] == "Ready" and cond["status"] == "True":
            return str(cond["lastTransitionTime"])
    return None


def kv_received(node: NodeCluster, decode_pod: str) -> int:
    """How many requests' KV the decode pod's sidecar has received (its log says `KV ready` for each)."""
    log = node.kubectl("logs", decode_pod, "-c", "kv-worker", "--tail", "-1").stdout
    return sum(1 for line in log.splitlines() if '"msg": "KV ready"' in line)


def requests_until_one_crosses(
    node: NodeCluster, reference: str, decode_pod: str, expected_text: str
) -> None:
    """Requests through the router until one has crossed `decode_pod`'s pair (its sidecar received the KV),
    every text identical to the monolithic run."""
    model = node.json("get", "disagg", reference)["spec"]["model"]["name"]
    received = kv_received(node, decode_pod)
    for _ in range(24):
        assert curl_text(node, reference, model) == expected_text
        if kv_received(node, decode_pod) > received:
            return
    raise AssertionError(f"24 requests through the router, none crossed {decode_pod}'s pair")


def crossed_canaries(node: NodeCluster, deployment: str, decode_pod: str) -> int:
    """How many KV canaries the router logged as crossed into the decode pod."""
    [router] = node.pods("default", f"disagg.io/deployment={deployment},disagg.io/component=router")
    log = node.kubectl("logs", router["metadata"]["name"], "--tail", "-1").stdout
    return sum(1 for line in log.splitlines() if "KV canary" in line and f"{decode_pod}: KV crossed" in line)


class Load(threading.Thread):
    """Requests through the router one after another until stopped, each answer counted right, wrong (a 200
    whose text differs from the monolithic run's) or failed (an HTTP error or an error in the stream)."""

    def __init__(self, node: NodeCluster, reference: str, model: str, expected_text: str) -> None:
        super().__init__(daemon=True)
        self.node, self.reference, self.model, self.expected = node, reference, model, expected_text
        self.stop = threading.Event()
        self.right = 0
        self.wrong: list[str] = []
        self.failed: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                text = curl_text(self.node, self.reference, self.model)
            except (NodeError, ValueError) as exc:
                self.failed.append(str(exc)[-300:])
                continue
            if text == self.expected:
                self.right += 1
            else:
                self.wrong.append(text)


def test_container_killed_is_restarted_and_its_pair_serves_again(
    node: NodeCluster, reference: str, expected_text: str
) -> None:
    pod = one_pod(node, reference, "decode")
    name = pod["metadata"]["name"]
    [engine] = [s for s in pod["status"]["containerStatuses"] if s["name"] == "engine"]
    was_ready_since = ready_since(pod)
    assert was_ready_since is not None
    model = node.json("get", "disagg", reference)["spec"]["model"]["name"]
    load = Load(node, reference, model, expected_text)
    load.start()
    wait_for("the load's first answer", lambda: load.right, 60)
    node.ctr("tasks", "kill", "--signal", "SIGKILL", engine["containerID"].removeprefix("containerd://"))

    def restarted_and_ready() -> dict[str, Any] | None:
        now = node.json("get", "pod", name)
        [status] = [s for s in now["status"]["containerStatuses"] if s["name"] == "engine"]
        since = ready_since(now)
        restarted = status["restartCount"] == engine["restartCount"] + 1
        return now if restarted and since is not None and since != was_ready_since else None

    canaries = crossed_canaries(node, reference, name)
    wait_for(f"{name}'s engine restarted by the kubelet and the pod Ready again", restarted_and_ready, 240)
    # The same pod, address and sidecar: only its restart count tells the router the pair is new, and the
    # router sends it a canary again before any client's request.
    wait_for(
        f"a KV canary across {name}'s pairs after the restart",
        lambda: crossed_canaries(node, reference, name) > canaries,
        120,
    )
    load.stop.set()
    load.join(timeout=180)
    # Through the kill, the restart and the canary: never a wrong answer, and no more failed requests than the
    # router's bound, the legs an engine may fail in a row before it is ejected (each failure a clean error).
    print(f"during the kill: {load.right} right, {len(load.failed)} failed: {load.failed}")
    assert not load.wrong, load.wrong
    assert len(load.failed) <= RouterConfig().eject_after_failures, load.failed
    requests_until_one_crosses(node, reference, name, expected_text)


def test_pod_deleted_is_replaced_and_serves(node: NodeCluster, reference: str, expected_text: str) -> None:
    model = node.json("get", "disagg", reference)["spec"]["model"]["name"]
    selector = f"app.kubernetes.io/instance={reference},app.kubernetes.io/component=decode"
    before = {p["metadata"]["uid"] for p in node.pods("default", selector)}
    old = one_pod(node, reference, "decode")
    node.kubectl("delete", "pod", old["metadata"]["name"], "--wait=true", timeout=180)

    def replaced() -> list[dict[str, Any]] | None:
        pods = node.pods("default", selector)
        uids = {p["metadata"]["uid"] for p in pods}
        fresh = uids - before
        ok = len(pods) == 2 and len(fresh) == 1 and old["metadata"]["uid"] not in uids
        return pods if ok and all(pod_ready(p) for p in pods) else None

    pods = wait_for("the deleted decoder replaced and Ready", replaced, 240)
    [new] = [p for p in pods if p["metadata"]["uid"] not in before]
    assert new["spec"]["nodeName"] == node.node and new["status"]["podIP"]
    for _ in range(4):
        assert curl_text(node, reference, model) == expected_text
