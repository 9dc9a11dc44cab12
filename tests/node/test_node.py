"""The node itself: a Ready node on containerd, the operator's pod from its image, engine pods in containers
with CNI addresses, and the request path through kube-proxy equal to the monolithic run."""

from __future__ import annotations

import ipaddress
import json
from typing import Any

from node_suite import curl_text

from disagg.rig.node_cluster import OPERATOR_NAMESPACE, NodeCluster, pod_ready

POD_CIDR = ipaddress.ip_network("10.244.0.0/24")


def test_node_ready_on_containerd(node: NodeCluster) -> None:
    wide = node.kubectl("get", "nodes", "-o", "wide").stdout
    print(wide)
    header, *rows = wide.splitlines()
    assert len(rows) == 1, wide
    fields = dict(zip(header.split(), rows[0].split(), strict=False))
    assert fields["NAME"] == node.node
    assert fields["STATUS"] == "Ready"
    assert fields["VERSION"] == "v1.20.2"
    assert fields["INTERNAL-IP"] == node.node_ip
    runtime = rows[0].split()[-1]
    assert runtime.startswith("containerd://1.6."), runtime


def test_operator_runs_from_its_image(
    node: NodeCluster, operator_installed: dict[str, Any], version: str
) -> None:
    pod = node.json("-n", OPERATOR_NAMESPACE, "get", "pod", operator_installed["metadata"]["name"])
    [status] = pod["status"]["containerStatuses"]
    assert status["ready"] and "running" in status["state"]
    assert status["image"] == node.image_ref("disagg", version)
    # The digest the kubelet reports is the one the registry serves for the pushed tag.
    inspect = json.loads(
        node.run(
            "skopeo", "inspect", "--tls-verify=false", f"docker://{node.image_ref('disagg', version)}"
        ).stdout
    )
    assert status["imageID"].endswith(inspect["Digest"]), (status["imageID"], inspect["Digest"])
    # containerd runs it: the container id the kubelet reports is a running task.
    container_id = status["containerID"].removeprefix("containerd://")
    tasks = node.ctr("tasks", "ls").stdout
    assert any(line.split()[:1] == [container_id] and "RUNNING" in line for line in tasks.splitlines()), tasks


def test_engine_pods_in_containers_with_cni_addresses(node: NodeCluster, reference: str) -> None:
    pods = node.pods("default", f"disagg.io/deployment={reference}")
    print(node.kubectl("get", "pods", "-o", "wide").stdout)
    roles = sorted(p["metadata"]["labels"].get("app.kubernetes.io/component", "") for p in pods)
    assert roles.count("prefill") == 2 and roles.count("decode") == 2 and roles.count("router") == 1, roles
    tasks = node.ctr("tasks", "ls").stdout
    for pod in pods:
        assert pod_ready(pod), pod["metadata"]["name"]
        assert ipaddress.ip_address(pod["status"]["podIP"]) in POD_CIDR
        assert pod["spec"]["nodeName"] == node.node
        for status in pod["status"]["containerStatuses"]:
            cid = status["containerID"].removeprefix("containerd://")
            assert f"{cid} " in tasks and "running" in status["state"], (pod["metadata"]["name"], status)
    addresses = [p["status"]["podIP"] for p in pods]
    assert len(set(addresses)) == len(addresses), addresses


def test_curl_of_the_router_service_equals_monolithic(
    node: NodeCluster, reference: str, expected_text: str
) -> None:
    model = node.json("get", "disagg", reference)["spec"]["model"]["name"]
    got = curl_text(node, reference, model)
    print(f"through the router's Service: {got!r}\nmonolithic run:              {expected_text!r}")
    assert got == expected_text
