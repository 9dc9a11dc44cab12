"""Two nodes: the second kubelet in its own network namespace with its own node address. The PP stages of the
reference sample, kept apart by the prefill role's anti-affinity on the label each kubelet registered, run on
different nodes, reach each other by their StatefulSet DNS names across them, and the router's Service serves
what the monolithic run writes. With a stage's node cordoned, its replacement is refused the head's node."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Any

from node2_suite import MAX_TOKENS, NODE_LABEL, PROMPT

from disagg.rig import node_cluster
from disagg.rig.node_cluster import NodeCluster, pod_ready, wait_for


def pod_cidrs(node: NodeCluster, paths: dict[str, str]) -> dict[str, ipaddress.IPv4Network]:
    """Each node's pod range: the /24 of its address (the address is its CNI bridge's gateway)."""
    return {
        name: ipaddress.ip_network(f"{address}/24", strict=False)
        for name, address in ((node.node, node.node_ip), (paths["node2"], paths["node2_ip"]))
    }


def stages(node: NodeCluster, name: str) -> list[dict[str, Any]]:
    return sorted(
        node.pods("default", f"app.kubernetes.io/instance={name},app.kubernetes.io/component=prefill"),
        key=lambda p: p["metadata"]["name"],
    )


def test_two_nodes_ready_with_the_labels_their_kubelets_registered(
    node: NodeCluster, paths: dict[str, str]
) -> None:
    print(node.kubectl("get", "nodes", "-o", "wide").stdout)
    nodes = {n["metadata"]["name"]: n for n in node.json("get", "nodes")["items"]}
    expected = {node.node: node.node_ip, paths["node2"]: paths["node2_ip"]}
    assert sorted(nodes) == sorted(expected), sorted(nodes)
    for name, address in expected.items():
        status = nodes[name]["status"]
        ready = [c["status"] for c in status["conditions"] if c["type"] == "Ready"]
        assert ready == ["True"], status["conditions"]
        assert {"type": "InternalIP", "address": address} in status["addresses"], status["addresses"]
        runtime = status["nodeInfo"]["containerRuntimeVersion"]
        assert runtime.startswith("containerd://1.6."), runtime
        labels = nodes[name]["metadata"]["labels"]
        assert labels[NODE_LABEL] == name, labels
        assert labels["kubernetes.io/hostname"] == name, labels
        assert labels["kubernetes.io/os"] == "linux", labels


def test_pp_stages_run_on_different_nodes_as_the_affinity_says(
    node: NodeCluster, paths: dict[str, str], spread: str, spread_sample: tuple[Path, dict[str, Any]]
) -> None:
    print(node.kubectl("get", "pods", "-o", "wide").stdout)
    # The operator put the role's affinity on the stages' StatefulSet as the spec gave it.
    [statefulset] = node.json("get", "statefulsets", "-l", "app.kubernetes.io/component=prefill")["items"]
    assert statefulset["spec"]["template"]["spec"]["affinity"] == spread_sample[1]
    pods = stages(node, spread)
    assert [p["metadata"]["name"] for p in pods] == [f"{spread}-prefill-0-0", f"{spread}-prefill-0-1"]
    assert all(pod_ready(p) for p in pods)
    on = [p["spec"]["nodeName"] for p in pods]
    assert sorted(on) == sorted([node.node, paths["node2"]]), on
    cidrs = pod_cidrs(node, paths)
    for pod in node.pods("default", f"disagg.io/deployment={spread}"):
        address = ipaddress.ip_address(pod["status"]["podIP"])
        assert address in cidrs[pod["spec"]["nodeName"]], (pod["metadata"]["name"], address)


def test_stages_reach_each_other_by_dns_names_across_nodes(node: NodeCluster, spread: str) -> None:
    head, other = stages(node, spread)
    assert head["spec"]["nodeName"] != other["spec"]["nodeName"]
    port = json.loads(node.kubectl("get", "disagg", spread, "-o", "json").stdout)["spec"]["kvTransfer"][
        "sideChannelPort"
    ]
    # Stage 1's sidecar container dials the head's side channel by its DNS name, on the other node.
    host = f"{head['spec']['hostname']}.{head['spec']['subdomain']}.default.svc"
    script = (
        f"import socket; s = socket.create_connection(({host!r}, {port}), timeout=10); "
        "print(s.getpeername()[0])"
    )
    peer = node.kubectl(
        "exec", other["metadata"]["name"], "-c", "kv-worker", "--", "python3", "-c", script
    ).stdout.strip()
    assert peer == head["status"]["podIP"], (host, peer)
    # The head's sidecar fetched stage 1's handshake payload from stage 1's DNS name (its republisher).
    log = node.kubectl("logs", head["metadata"]["name"], "-c", "kv-worker", "--tail", "-1").stdout
    fetched = [json.loads(line) for line in log.splitlines() if "republishing worker payload" in line]
    assert [(e["pp_rank"], e["tp_rank"]) for e in fetched] == [(1, 0)], log[-3000:]


def test_curl_of_the_router_service_equals_monolithic(
    node: NodeCluster, spread: str, expected_text: str
) -> None:
    model = str(node.json("get", "disagg", spread)["spec"]["model"]["name"])
    for _ in range(2):
        got = node_cluster.curl_text(node, spread, model, PROMPT, MAX_TOKENS)
        print(f"through the router's Service: {got!r}\nmonolithic run:              {expected_text!r}")
        assert got == expected_text


def test_anti_affinity_keeps_a_replaced_stage_off_its_peers_node(
    node: NodeCluster, spread: str, expected_text: str
) -> None:
    """With its own node cordoned, a deleted stage's replacement could only go to the head's node, which the
    anti-affinity refuses: it stays Pending with the scheduler's reason until its node is back."""
    head, stage = stages(node, spread)
    name, home, old_uid = stage["metadata"]["name"], stage["spec"]["nodeName"], stage["metadata"]["uid"]
    node.kubectl("cordon", home)
    try:
        node.kubectl("delete", "pod", name, "--wait=false")

        def refused() -> str | None:
            got = node.kubectl("get", "pod", name, "-o", "json", check=False)
            if got.returncode != 0:
                return None
            pod = json.loads(got.stdout)
            if pod["metadata"]["uid"] == old_uid:
                return None
            for cond in pod["status"].get("conditions") or []:
                if cond["type"] == "PodScheduled" and cond.get("reason") == "Unschedulable":
                    return str(cond["message"])
            return None

        message = wait_for(f"{name}'s replacement refused by the scheduler", refused, timeout_s=180)
        print(f"{name}: {message}")
        assert "anti-affinity" in message and "unschedulable" in message, message
        assert not node.json("get", "pod", name)["spec"].get("nodeName")
    finally:
        node.kubectl("uncordon", home)
    back = wait_for(
        f"{name} Ready on {home} again",
        lambda: [p for p in stages(node, spread) if p["metadata"]["name"] == name and pod_ready(p)],
        timeout_s=300,
        interval_s=2,
    )
    assert back[0]["spec"]["nodeName"] == home != head["spec"]["nodeName"]
    wait_for(f"{spread} serving, its 5 pods Ready", lambda: node_cluster.serving(node, spread, 5), 300)
    model = str(node.json("get", "disagg", spread)["spec"]["model"]["name"])
    assert node_cluster.curl_text(node, spread, model, PROMPT, MAX_TOKENS) == expected_text
