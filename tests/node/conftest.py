"""Fixtures for the node suite: the real one-node cluster of `hack/node.sh`, and the user's path onto it.

The cluster is brought up here unless it already runs (`make cluster-up`), and taken down at the end only if
this session brought it up. The user's path runs once per session, as the README writes it: the images that
`make image` built are pushed to the node's registry with `skopeo copy`, the chart is installed with `helm`
pointing at them (the operator runs as a Deployment from its image), and `examples/reference-pp2-hma.yaml` is
applied as it is (containerd mirrors ghcr.io from the node's registry).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from node_suite import MAX_TOKENS, PROMPT

from disagg.rig import node_cluster
from disagg.rig.demo_serving import REFERENCE_SAMPLE, ROUTABLE, monolithic_text
from disagg.rig.node_cluster import NodeCluster, NodeError, failure, pod_ready, wait_for


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/node/" in str(item.path):
            item.add_marker(pytest.mark.node)


@pytest.fixture(scope="session")
def node() -> Iterator[NodeCluster]:
    started_here = node_cluster.call_script("status").returncode != 0
    if started_here:
        up = node_cluster.call_script("up")
        if up.returncode != 0:
            pytest.fail(failure(up), pytrace=False)
    try:
        yield NodeCluster.from_script()
    finally:
        if started_here:
            down = node_cluster.call_script("down")
            if down.returncode != 0:
                pytest.fail(failure(down), pytrace=False)


@pytest.fixture(scope="session")
def version() -> str:
    return node_cluster.image_version()


@pytest.fixture(scope="session")
def operator_installed(node: NodeCluster, version: str) -> dict[str, Any]:
    """Both images pushed, the chart installed; the operator's pod, Ready."""
    node_cluster.push_images(node, version)
    node_cluster.helm_install(node)
    pods = wait_for(
        "the operator's pod Ready",
        lambda: [
            p
            for p in node.pods(node_cluster.OPERATOR_NAMESPACE, "app.kubernetes.io/component=operator")
            if pod_ready(p)
        ],
        timeout_s=180,
    )
    pod: dict[str, Any] = pods[0]
    return pod


@pytest.fixture(scope="session")
def reference(node: NodeCluster, operator_installed: dict[str, Any]) -> str:
    """`kubectl apply -f examples/reference-pp2-hma.yaml`, then Routable, Available and every pod Ready;
    returns its name."""
    node.kubectl("apply", "-f", str(REFERENCE_SAMPLE))
    name = "tiny-pp2"

    def ready() -> bool:
        # Routable (the READY column) holds with one pair; Available once every engine pod is ready; and the
        # router's pod itself.
        status = node.json("get", "disagg", name).get("status") or {}
        true = {c.get("type") for c in status.get("conditions") or [] if c.get("status") == "True"}
        pods = node.pods("default", f"disagg.io/deployment={name}")
        return {ROUTABLE, "Available"} <= true and len(pods) == 5 and all(pod_ready(p) for p in pods)

    try:
        wait_for(
            f"DisaggDeployment {name} Routable and Available, its 5 pods Ready",
            ready,
            timeout_s=420,
            interval_s=2,
        )
    except NodeError as exc:
        pods = node.kubectl("get", "pods", "-o", "wide", check=False).stdout
        events = node.kubectl("get", "events", "--sort-by=.lastTimestamp", check=False).stdout[-4000:]
        raise NodeError(f"{exc}\n{pods}\n{events}") from exc
    return name


@pytest.fixture(scope="session")
def expected_text() -> str:
    return monolithic_text(PROMPT, MAX_TOKENS)
