"""The node itself: a Ready node on containerd, the operator's pod from its image, engine pods in containers
with CNI addresses, and the request path through kube-proxy equal to the monolithic run."""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any

from node_suite import curl_text

from disagg.operator.naming import ROUTER_IMAGE_ENV
from disagg.rig.demo_node import BROKEN_SAMPLE
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


def test_the_operator_pod_with_only_the_charts_rbac_reconciles_and_its_webhook_refuses_through_its_service(
    node: NodeCluster, operator_installed: dict[str, Any], reference: str
) -> None:
    """The chart's Deployment as the kubelet runs it: its command line, its ServiceAccount's token (so only
    the chart's RBAC applies) and the webhook Secret's certificate, which the API server verifies when it
    calls the webhook through its Service. A missing permission or an unknown flag fails here."""
    # Refused at admission by the webhook (a 1.20 API server has no CEL rules), naming its reason.
    refused = node.kubectl("apply", "-f", str(BROKEN_SAMPLE), check=False)
    assert refused.returncode != 0, refused.stdout
    assert 'admission webhook "' in refused.stderr and "denied the request" in refused.stderr, refused.stderr
    assert "DecodePipelineParallel" in refused.stderr, refused.stderr
    listed = node.kubectl("get", "disagg", "-A", "-o", "name").stdout.split()
    assert listed == [f"disaggdeployment.disagg.io/{reference}"], listed

    # The reference sample was admitted and reconciled with the chart's permissions alone: its children are
    # owned by it, the router's Role is what the operator may grant, the router runs the chart's image.
    statefulsets = node.json("get", "statefulsets", "-l", f"disagg.io/deployment={reference}")["items"]
    assert statefulsets
    assert all(s["metadata"]["ownerReferences"][0]["name"] == reference for s in statefulsets)
    rules = node.json("get", "role", f"{reference}-router")["rules"]
    assert rules == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    [operator] = operator_installed["spec"]["containers"]
    chart_router_image = next(e["value"] for e in operator["env"] if e["name"] == ROUTER_IMAGE_ENV)
    [router] = node.json("get", "deployment", f"{reference}-router")["spec"]["template"]["spec"]["containers"]
    assert router["image"] == chart_router_image
    events = node.json("get", "events", "--field-selector", f"involvedObject.name={reference}")["items"]
    assert any(e["reason"] == "Applied" for e in events), [e["reason"] for e in events]
    log = node.kubectl("-n", OPERATOR_NAMESPACE, "logs", operator_installed["metadata"]["name"]).stdout
    # A 403 anywhere but in a timestamp's milliseconds (",403").
    assert "Forbidden" not in log and not re.search(r"(?<![,\d])403(?!\d)", log), log[-3000:]
