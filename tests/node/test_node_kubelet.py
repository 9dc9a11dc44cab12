"""The kubelet itself restarted (`hack/node.sh restart-kubelet`: SIGTERM, then the same flags again), as a
node upgrade or a kubelet crash does: the containers containerd runs outlive it, and the new kubelet adopts
them instead of starting them again. After the other node tests (the file name sorts after theirs): every pod
on the node is checked."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from node_suite import curl_text

from disagg.rig import node_cluster
from disagg.rig.node_cluster import NodeCluster, failure, pod_ready, wait_for


def containers(pods: list[dict[str, Any]]) -> dict[tuple[str, str], tuple[str, int]]:
    """(pod uid, container) -> (containerd id, restart count)."""
    return {
        (pod["metadata"]["uid"], status["name"]): (status["containerID"], status["restartCount"])
        for pod in pods
        for status in pod["status"]["containerStatuses"]
    }


def node_heartbeat(node: NodeCluster) -> datetime:
    conditions = node.json("get", "node", node.node)["status"]["conditions"]
    [ready] = [c for c in conditions if c["type"] == "Ready" and c["status"] == "True"]
    return datetime.fromisoformat(ready["lastHeartbeatTime"].replace("Z", "+00:00"))


def test_kubelet_restarted_adopts_its_running_containers_and_serves(
    node: NodeCluster, reference: str, expected_text: str
) -> None:
    model = node.json("get", "disagg", reference)["spec"]["model"]["name"]
    before: list[dict[str, Any]] = node.json("get", "pods", "--all-namespaces")["items"]
    assert before and all(pod_ready(p) for p in before), [p["metadata"]["name"] for p in before]
    # The API server stores whole seconds: the restart began no earlier than this.
    restarted_at = datetime.now(UTC).replace(microsecond=0)
    restarted = node_cluster.call_script("restart-kubelet")
    assert restarted.returncode == 0, failure(restarted)
    assert "kubelet restarted: pid" in restarted.stderr, restarted.stderr

    wait_for("a heartbeat from the new kubelet", lambda: node_heartbeat(node) >= restarted_at, 120)

    def all_ready_again() -> list[dict[str, Any]] | None:
        pods: list[dict[str, Any]] = node.json("get", "pods", "--all-namespaces")["items"]
        return pods if len(pods) == len(before) and all(pod_ready(p) for p in pods) else None

    after = wait_for("every pod Ready under the new kubelet", all_ready_again, 180)
    # The same pods and the same containers, none restarted: the kubelet found them running in containerd.
    assert containers(after) == containers(before)
    for _ in range(4):
        assert curl_text(node, reference, model) == expected_text
