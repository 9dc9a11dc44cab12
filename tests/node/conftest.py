"""Fixtures for the node suite: the real one-node cluster of `hack/node.sh`, and the user's path onto it.

The cluster is brought up here unless it already runs (`make cluster-up`), and taken down after the node
suite only if the suite brought it up (the rest of `make test` then runs without a kubelet beside it). The
user's path runs once per suite, as the README writes it: the images that `make image` built are pushed to the
node's registry with `skopeo copy`, the chart is installed with `helm` pointing at them (the operator runs as
a Deployment from its image), and `examples/reference-pp2-hma.yaml` is applied as it is (containerd mirrors
ghcr.io from the node's registry).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from node_suite import MAX_TOKENS, PROMPT

from disagg.rig import node_cluster
from disagg.rig.demo_serving import REFERENCE_SAMPLE, monolithic_text
from disagg.rig.node_cluster import NodeCluster, NodeError


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/node/" in str(item.path):
            item.add_marker(pytest.mark.node)


@pytest.fixture(scope="package")
def node() -> Iterator[NodeCluster]:
    try:
        with node_cluster.held() as cluster:
            yield cluster
    except NodeError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="package")
def version() -> str:
    return node_cluster.image_version()


@pytest.fixture(scope="package")
def operator_installed(node: NodeCluster, version: str) -> dict[str, Any]:
    """Both images pushed, the chart installed; the operator's pod, Ready."""
    node_cluster.push_images(node, version)
    node_cluster.helm_install(node)
    return node_cluster.wait_operator(node)


@pytest.fixture(scope="package")
def reference(node: NodeCluster, operator_installed: dict[str, Any]) -> str:
    """`kubectl apply -f examples/reference-pp2-hma.yaml`, then Routable, Available and its 5 pods Ready;
    returns its name."""
    return node_cluster.apply_sample(node, REFERENCE_SAMPLE, pods=5)


@pytest.fixture(scope="package")
def expected_text() -> str:
    return monolithic_text(PROMPT, MAX_TOKENS)
