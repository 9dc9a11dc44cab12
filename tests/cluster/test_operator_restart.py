"""Restart the operator mid-reconcile (SIGKILL while it is still applying children) and check that the new
process converges on the same objects: every child exactly once, one owner reference, one apply manager."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import pytest
from operator_harness import Cluster, OperatorProcess, example, satisfied, wait_for

NAME = "big"
REPLICAS = 10


@pytest.fixture
def ns(cluster: Cluster) -> Iterator[str]:
    name = cluster.create_namespace(f"ops-{secrets.token_hex(2)}")
    try:
        yield name
    finally:
        cluster.delete_namespace(name)


def test_killed_mid_reconcile_converges_without_duplicates(
    cluster: Cluster, ns: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    expected = {
        "StatefulSet": sorted(f"{NAME}-prefill-{r}" for r in range(REPLICAS)),
        "Deployment": [f"{NAME}-decode", f"{NAME}-router"],
        "Service": sorted(
            [f"{NAME}-decode", f"{NAME}-router", *(f"{NAME}-prefill-{r}" for r in range(REPLICAS))]
        ),
        "ConfigMap": [f"{NAME}-topology"],
    }
    operator = OperatorProcess(cluster.cp, [ns], tmp_path_factory.mktemp("restart") / "operator.log")
    operator.start()
    try:
        result = cluster.kubectl_apply(example("pp2-hma.yaml", ns, NAME, {"prefill": {"replicas": REPLICAS}}))
        assert result.returncode == 0, result.stderr
        # The first wave (ConfigMap, accounts, RBAC, Services; eight at a time) precedes the workloads, so a
        # kill as its first Service shows lands before the StatefulSets.
        wait_for("the first Service", lambda: cluster.names(ns, NAME)["Service"], interval=0.005)
        operator.kill()
        at_kill = cluster.names(ns, NAME)
        assert at_kill != expected, (
            f"the reconcile finished before the kill, so this run proves nothing: {at_kill}"
        )
        # Time passes with nobody reconciling: nothing more appears.
        time.sleep(1)
        assert cluster.names(ns, NAME) == at_kill
        operator.start()
        cluster.wait_condition(ns, NAME, "Compatible", "True")
        wait_for(
            "every child",
            lambda: satisfied(cluster.names(ns, NAME), lambda n: n == expected),
        )
    finally:
        operator.stop()
    children = cluster.children(ns, NAME)
    for kind in ("StatefulSet", "Deployment", "Service", "ConfigMap"):
        for item in children[kind]:
            assert len(item["metadata"]["ownerReferences"]) == 1
            applies = [e["manager"] for e in item["metadata"]["managedFields"] if e["operation"] == "Apply"]
            assert applies == ["disagg-operator"]
    pods = wait_for(
        "one pod per stage and decode replica",
        lambda: satisfied(children_pods(cluster, ns), lambda p: len(p) == REPLICAS * 2 + 2),
    )
    assert len(set(pods)) == len(pods)


def children_pods(cluster: Cluster, ns: str) -> list[str]:
    return sorted(p["metadata"]["name"] for p in cluster.children(ns, NAME)["Pod"])
