"""Fixtures for the two-node suite: `hack/node.sh up --nodes 2` (a second kubelet, containerd and kube-proxy
in a network namespace of their own), the user's path onto it, and the reference sample with its PP stages
kept apart by the prefill role's pod anti-affinity.

The suite holds the node lock from bringing the cluster up to taking it down, as the one-node suite does, and
takes it down after its last test when it brought it up. Not part of `make test` (`make test-node2`): a second
node costs the time and memory `docs/real-node.md` gives.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from node2_suite import MAX_TOKENS, NODE_LABEL, PROMPT

from disagg.rig import node_cluster
from disagg.rig.demo_serving import REFERENCE_SAMPLE, monolithic_text
from disagg.rig.node_cluster import NodeCluster, NodeError


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/node2/" in str(item.path):
            item.add_marker(pytest.mark.node2)


@pytest.fixture(scope="package")
def node() -> Iterator[NodeCluster]:
    def two_nodes() -> bool:
        return "node2" in node_cluster.script_paths()

    try:
        with node_cluster.held("--nodes", "2", running=two_nodes) as cluster:
            yield cluster
    except NodeError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="package")
def paths(node: NodeCluster) -> dict[str, str]:
    return node_cluster.script_paths()


@pytest.fixture(scope="package")
def operator_installed(node: NodeCluster) -> dict[str, Any]:
    node_cluster.push_images(node, node_cluster.image_version())
    node_cluster.helm_install(node)
    return node_cluster.wait_operator(node)


def stages_apart(sample: dict[str, Any]) -> dict[str, Any]:
    """The prefill role's pods may not share a node: a required pod anti-affinity on the node label."""
    name = sample["metadata"]["name"]
    return {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {
                        "matchLabels": {
                            "app.kubernetes.io/instance": name,
                            "app.kubernetes.io/component": "prefill",
                        }
                    },
                    "topologyKey": NODE_LABEL,
                }
            ]
        }
    }


@pytest.fixture(scope="package")
def spread_sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """examples/reference-pp2-hma.yaml with `spec.prefill.scheduling.affinity` keeping its stages apart."""
    sample: dict[str, Any] = yaml.safe_load(REFERENCE_SAMPLE.read_text())
    affinity = stages_apart(sample)
    sample["spec"]["prefill"]["scheduling"] = {"affinity": affinity}
    path = tmp_path_factory.mktemp("node2") / "reference-pp2-stages-apart.yaml"
    path.write_text(yaml.safe_dump(sample, sort_keys=False))
    return path, affinity


@pytest.fixture(scope="package")
def spread(node: NodeCluster, operator_installed: dict[str, Any], spread_sample: tuple[Path, Any]) -> str:
    """The sample applied; Routable, Available and its 5 pods Ready. Returns its name."""
    return node_cluster.apply_sample(node, spread_sample[0], pods=5)


@pytest.fixture(scope="package")
def expected_text() -> str:
    return monolithic_text(PROMPT, MAX_TOKENS)
