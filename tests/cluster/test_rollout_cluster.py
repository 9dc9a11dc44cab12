"""A KV-incompatible engine version change rolled out on the real API server under load, with the operator
killed (SIGKILL) and restarted mid-rollout twice, while the new revision waits for its pairs and while the
old one drains; then a revision the policies refuse, and one only the live hashes tell apart.

The scenario is `disagg bench rollout`'s (`rig.bench_rollout.RolloutRun`): a reference-engine deployment
(a PP2 prefill engine, two decoders, the router; `maxSurge: 1`) with every container a local process, a
load of completions at concurrency 8 through the router's Service, and every state the pods pass through
seen in the API server's order (`rig.pod_states.PodStates`: a list, then a watch). Beside it, the API call
a step removes old decoders with: exactly the chosen pods go.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from operator_harness import Cluster, OperatorProcess

from disagg.operator.control.k8s_apply import Kube
from disagg.rig.bench_rollout import MIN_REQUESTS, NEW_VERSION, RolloutRun, document, surge_bound

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_a_version_change_rolls_out_beside_the_old_revision_with_no_failed_request(
    cluster: Cluster, ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    def apply(document: dict[str, Any]) -> None:
        result = cluster.kubectl_apply(document)
        assert result.returncode == 0, result.stderr

    restarts: list[str] = []

    def restart_operator() -> None:
        operator.kill()
        operator.start()
        restarts.append("restarted")

    run = RolloutRun(
        cluster.cp.api_client, cluster.cp.kubeconfig, ns, apply, tmp_path, during_rollout=restart_operator
    )
    result = run.run()

    change = result["version_change"]
    # Killed while waiting for the new pairs and again while the old revision drained.
    assert restarts == ["restarted", "restarted"], change["phases"]
    assert change["failed"] == 0 and change["mismatched"] == 0, change["failures"]
    assert change["requests"] >= MIN_REQUESTS
    # Every state the pods passed through, in order, none skipped however loaded the machine: a pairless
    # moment cannot fall between two of them. Only a watch the server ends as too old loses states.
    assert change["unseen_s"] == [], f"pod states lost to a watch ended as too old: {change['unseen_s']}"
    assert change["min_pairs"] >= 1, f"a pod state with no routable pair (of {change['states']})"
    assert (
        change["max_engine_pods"]
        <= change["surge_bound"]
        < surge_bound(document(ns, NEW_VERSION, run.port))[1]
    )
    # The ReplicaSet's replacement for the decoder a step deleted, until the step's scale-down reaches it:
    # one step at a time (maxSurge 1), so one at most.
    assert change["max_replacements"] <= 1
    # Stepped: the new revision's second decoder came after its first step paired.
    assert len(change["steps"]) >= 2, change["steps"]
    assert change["revisions"][0] != change["revisions"][1]
    assert {"RolloutWaitingForRoutablePairs", "RolloutDraining"} <= set(change["phases"])
    assert "RolloutStuck" not in change["phases"]
    # drainSeconds is its default, an hour: the old pods' sidecars reported them idle long before.
    assert change["drain_s"] < 600, change["phases"]
    # The drains and prunes are the operator's clock's steps (no spec event brings them): their Events are on
    # the deployment, posted by the operator.
    events = client.CoreV1Api(cluster.cp.api_client).list_namespaced_event(
        ns, field_selector="involvedObject.kind=DisaggDeployment,involvedObject.name=roll"
    )
    posted = {(e.reason, e.source.component) for e in events.items}
    assert {("Draining", "disagg-operator"), ("Pruned", "disagg-operator")} <= posted, posted

    refused = result["refused"]
    assert refused["reason"] == "CompatibilityHashMismatch" and refused["unchanged"]

    stuck = result["stuck"]
    assert (stuck["status"], stuck["reason"]) == ("False", "RolloutStuck")
    assert "CompatibilityHashMismatch" in stuck["message"] and "keeps serving" in stuck["message"]
    assert stuck["failed"] == 0 and stuck["mismatched"] == 0, stuck["failures"]
    assert stuck["unseen_s"] == [], stuck["unseen_s"]
    assert stuck["min_pairs"] >= 1, f"a pod state with no routable pair (of {stuck['states']})"
    names = cluster.names(ns, "roll")
    # Rolled back: one revision's engines are all that is left, in one slot.
    assert len([n for n in names["StatefulSet"] if "prefill" in n]) == 1
    assert len([n for n in names["Deployment"] if "decode" in n]) == 1


def test_deleting_chosen_pods_then_scaling_down_leaves_exactly_the_others(cluster: Cluster, ns: str) -> None:
    """What a rollout step does to the old decode Deployment (`Kube.delete_pod`, then
    `Kube.scale_deployment`): the ReplicaSet's replacement for the deleted pod is the newest and unready,
    so the scale-down removes it, and every other pod survives."""
    apps, core = client.AppsV1Api(cluster.cp.api_client), client.CoreV1Api(cluster.cp.api_client)
    labels = {"app": "scale-down"}
    container = client.V1Container(name="c", image="example.invalid/none:1")
    apps.create_namespaced_deployment(
        ns,
        client.V1Deployment(
            metadata=client.V1ObjectMeta(name="scale-down"),
            spec=client.V1DeploymentSpec(
                replicas=3,
                selector=client.V1LabelSelector(match_labels=labels),
                template=client.V1PodTemplateSpec(
                    metadata=client.V1ObjectMeta(labels=labels),
                    spec=client.V1PodSpec(containers=[container]),
                ),
            ),
        ),
    )

    def pods() -> list[str]:
        items = core.list_namespaced_pod(ns, label_selector="app=scale-down").items
        return sorted(p.metadata.name for p in items if p.metadata.deletion_timestamp is None)

    def settle(count: int) -> list[str]:
        """The pods once there are `count` and a few seconds more change nothing."""
        deadline = time.monotonic() + 60
        while True:
            found = pods()
            if len(found) == count:
                time.sleep(3)
                if pods() == found:
                    return found
            assert time.monotonic() < deadline, found
            time.sleep(0.5)

    before = settle(3)
    chosen = before[1]
    kube = Kube(cluster.cp.api_client)
    kube.delete_pod(ns, chosen)
    kube.scale_deployment(ns, "scale-down", 2)
    after = settle(2)
    assert after == [name for name in before if name != chosen]
