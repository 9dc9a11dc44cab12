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
from disagg.rig.node_cluster import NodeCluster, NodeError, failure


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/node2/" in str(item.path):
            item.add_marker(pytest.mark.node2)


def script_paths() -> dict[str, str]:
    proc = node_cluster.call_script("paths")
    if proc.returncode != 0:
        raise NodeError(failure(proc))
    return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)


@pytest.fixture(scope="package")
def node() -> Iterator[NodeCluster]:
    with node_cluster.exclusive():
        started_here = node_cluster.call_script("status").returncode != 0 or "node2" not in script_paths()
        if started_here:
            up = node_cluster.call_script("up", "--nodes", "2")
            if up.returncode != 0:
                pytest.fail(failure(up), pytrace=False)
            print(up.stderr.strip().splitlines()[-1])
        try:
            yield NodeCluster.from_script()
        finally:
            if started_here:
                down = node_cluster.call_script("down")
                if down.returncode != 0:
                    pytest.fail(failure(down), pytrace=False)


@pytest.fixture(scope="package")
def paths(node: NodeCluster) -> dict[str, str]:
    return script_paths()


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
