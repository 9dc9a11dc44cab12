"""`builders.children.build`: every child of a deployment, in apply order."""

from __future__ import annotations

import pytest
from built import objects
from dd_specs import spec


class TestObjectSet:
    def test_example_builds_topology_services_and_workloads(self) -> None:
        assert list(objects(spec())) == [
            ("ConfigMap", "gemma-pp2-topology"),
            ("ServiceAccount", "gemma-pp2-kv-worker"),
            ("RoleBinding", "gemma-pp2-kv-worker"),
            ("Service", "gemma-pp2-prefill-0"),
            ("StatefulSet", "gemma-pp2-prefill-0"),
            ("Service", "gemma-pp2-decode"),
            ("Deployment", "gemma-pp2-decode"),
            ("ServiceAccount", "gemma-pp2-router"),
            ("Role", "gemma-pp2-router"),
            ("RoleBinding", "gemma-pp2-router"),
            ("Service", "gemma-pp2-router"),
            ("Deployment", "gemma-pp2-router"),
        ]

    @pytest.mark.parametrize("replicas", [0, 1, 3])
    def test_one_statefulset_and_headless_service_per_prefill_replica(self, replicas: int) -> None:
        built = objects(spec({"prefill": {"replicas": replicas}}))
        sets = [name for kind, name in built if kind == "StatefulSet"]
        assert sets == [f"gemma-pp2-prefill-{r}" for r in range(replicas)]
        for name in sets:
            assert built["Service", name]["spec"]["clusterIP"] == "None"
            assert built["StatefulSet", name]["spec"]["serviceName"] == name

    def test_build_is_deterministic(self) -> None:
        assert objects(spec()) == objects(spec())
