"""`builders.decode`: the decode Deployment."""

from __future__ import annotations

import pytest
from built import objects
from dd_specs import spec


class TestDeployment:
    @pytest.mark.parametrize("replicas", [0, 2, 5])
    def test_decode_replicas(self, replicas: int) -> None:
        deployment = objects(spec({"decode": {"replicas": replicas}}))["Deployment", "gemma-pp2-decode"]
        assert deployment["apiVersion"] == "apps/v1"
        assert deployment["spec"]["replicas"] == replicas
        assert deployment["spec"]["selector"]["matchLabels"]["disagg.io/role"] == "decode"

    def test_an_external_autoscaler_owns_the_replicas(self) -> None:
        # Never named in the apply, the field stays with the HPA that writes it.
        external = spec({"decode": {"replicas": 2, "autoscaling": {"mode": "external"}}})
        assert "replicas" not in objects(external)["Deployment", "gemma-pp2-decode"]["spec"]
        planned = spec(
            {"decode": {"replicas": 2, "autoscaling": {"maxReplicas": 4, "target": {"runningRequests": 2}}}}
        )
        assert objects(planned)["Deployment", "gemma-pp2-decode"]["spec"]["replicas"] == 2
