"""The operator's API table: every kind the builders make can be applied, listed (to prune) and deleted."""

from __future__ import annotations

import pytest
from dd_specs import spec
from kubernetes import client

from disagg.operator.builders.children import build
from disagg.operator.control.k8s_apply import CHILD_APIS, Kube
from disagg.operator.naming import Installation, Owner
from disagg.operator.policies.compat import evaluate


def test_every_built_kind_is_one_the_operator_can_apply_and_prune() -> None:
    model = spec()
    report = evaluate(model)
    assert report.plan is not None, report.violations
    owner = Owner(name="dd", namespace="ns", uid="uid", generation=1)
    built = {
        obj["kind"] for obj in build(model, owner, report.plan, report.hashes, Installation(worker_image="w"))
    }
    # A kind missing from the table would be applied by nobody, or never pruned once the spec drops it.
    assert built == set(CHILD_APIS)


@pytest.mark.parametrize("kind", sorted(CHILD_APIS))
@pytest.mark.parametrize("verb", ["patch", "list", "delete"])
def test_each_kind_names_a_real_client_method(kind: str, verb: str) -> None:
    assert callable(Kube(client.ApiClient())._method(verb, kind))
