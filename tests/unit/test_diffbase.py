"""`LeanDiffBaseStorage` builds the essence kopf's own storage builds, from a body with everything kopf drops
(managedFields, status, system metadata) and with the fields a handler may name."""

from __future__ import annotations

import json
from typing import Any, cast

import kopf
import pytest

from disagg.operator.api import GROUP
from disagg.operator.control.diffbase import LeanDiffBaseStorage

KEY = "last-handled-configuration"


def _body() -> dict[str, Any]:
    spec = {"model": {"name": "m", "numLayers": 62}, "prefill": {"replicas": 1}, "decode": {"replicas": 2}}
    return {
        "apiVersion": f"{GROUP}/v1alpha1",
        "kind": "DisaggDeployment",
        "metadata": {
            "name": "dd",
            "namespace": "ns",
            "uid": "u1",
            "resourceVersion": "42",
            "generation": 3,
            "labels": {"team": "a"},
            "annotations": {
                "note": "kept",
                f"{GROUP}/{KEY}": json.dumps({"spec": spec}),
                "kubectl.kubernetes.io/last-applied-configuration": "{}",
            },
            "finalizers": ["x/y"],
            "ownerReferences": [{"kind": "Thing", "name": "t", "uid": "o1"}],
            "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {"f:model": {}}}}],
        },
        "spec": spec,
        "status": {"observedGeneration": 3, "conditions": [{"type": "Compatible", "status": "True"}]},
    }


@pytest.mark.parametrize(
    "extra_fields",
    [
        None,
        [],
        [("spec",)],
        ["spec.prefill"],
        [("status", "conditions")],
        [("metadata", "finalizers")],
        ["metadata"],
    ],
)
def test_the_essence_is_kopfs(extra_fields: Any) -> None:
    body = kopf.Body(cast(kopf.RawBody, _body()))
    ours = LeanDiffBaseStorage(prefix=GROUP, key=KEY).build(body=body, extra_fields=extra_fields)
    kopfs = kopf.AnnotationsDiffBaseStorage(prefix=GROUP, key=KEY).build(body=body, extra_fields=extra_fields)
    assert ours == kopfs


def test_the_essence_is_a_copy() -> None:
    raw = _body()
    essence = LeanDiffBaseStorage(prefix=GROUP, key=KEY).build(
        body=kopf.Body(cast(kopf.RawBody, raw)), extra_fields=None
    )
    raw["spec"]["prefill"]["replicas"] = 5
    raw["metadata"]["labels"]["team"] = "b"
    assert essence["spec"]["prefill"]["replicas"] == 1
    assert essence["metadata"]["labels"] == {"team": "a"}
