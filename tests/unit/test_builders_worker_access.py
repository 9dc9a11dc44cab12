"""`builders.worker_access`: the engine pods' ServiceAccount and RoleBinding."""

from __future__ import annotations

import re

from built import objects, pod_spec
from dd_specs import spec

from disagg.operator.naming import Installation, Owner
from disagg.operator.settings import installation_from_environ


class TestWorkerAccess:
    def test_every_engine_pod_runs_as_the_deployments_worker_account(self) -> None:
        built = objects(spec({"prefill": {"replicas": 2}}))
        workloads = [
            obj
            for (kind, name), obj in built.items()
            if kind in ("StatefulSet", "Deployment") and name != "gemma-pp2-router"
        ]
        assert len(workloads) == 3
        assert {pod_spec(obj)["serviceAccountName"] for obj in workloads} == {"gemma-pp2-kv-worker"}
        assert built["ServiceAccount", "gemma-pp2-kv-worker"]["metadata"]["namespace"] == "ns1"

    def test_the_rolebinding_grants_the_installations_cluster_role_in_the_namespace_only(self) -> None:
        binding = objects(spec(), installation=Installation(worker_cluster_role="rel-disagg-worker"))[
            "RoleBinding", "gemma-pp2-kv-worker"
        ]
        assert binding["apiVersion"] == "rbac.authorization.k8s.io/v1"
        assert binding["metadata"]["namespace"] == "ns1"
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "rel-disagg-worker",
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "gemma-pp2-kv-worker", "namespace": "ns1"}
        ]

    def test_the_cluster_role_comes_from_the_environment(self) -> None:
        assert installation_from_environ({}).worker_cluster_role == "disagg-worker"
        assert (
            installation_from_environ({"DISAGG_WORKER_CLUSTERROLE": ""}).worker_cluster_role
            == "disagg-worker"
        )
        named = installation_from_environ({"DISAGG_WORKER_CLUSTERROLE": "ops-disagg-worker"})
        assert named.worker_cluster_role == "ops-disagg-worker"

    def test_long_owner_names_give_a_valid_account_name(self) -> None:
        owner = Owner(name="m" * 120, namespace="ns1", uid="u", generation=1)
        built = objects(spec(), owner)
        [account] = [name for kind, name in built if kind == "ServiceAccount" and "kv-worker" in name]
        assert len(account) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", account)
        assert ("RoleBinding", account) in built
