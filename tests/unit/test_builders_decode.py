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
