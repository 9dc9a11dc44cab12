"""`LeanDiffBaseStorage` builds the essence kopf's own storage builds, from a body with everything kopf drops
(managedFields, status, system metadata) and with the fields a handler may name; `LeanProgressStorage` clears
an essence of kopf's progress annotations as kopf's own storage does, and leaves the essence it is given as
it was."""

from __future__ import annotations

import copy
import json
from typing import Any, cast

import kopf
import pytest

from disagg.operator.api import GROUP
from disagg.operator.control.kopf_tuning import LeanDiffBaseStorage, LeanProgressStorage

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


def _essences() -> list[dict[str, Any]]:
    spec = _body()["spec"]
    progress = {
        f"{GROUP}/reconcile_spec": json.dumps({"started": "2026-12-03T15:00:00", "retries": 0}),
        f"{GROUP}/touch-dummy": "2026-12-03T15:00:01",
    }
    return [
        {"spec": spec},
        {"spec": spec, "metadata": {"labels": {"team": "a"}}},
        {"spec": spec, "metadata": {"annotations": progress}},
        {"spec": spec, "metadata": {"labels": {"team": "a"}, "annotations": {**progress, "note": "kept"}}},
        {"spec": spec, "metadata": {"annotations": {"note": "kept", "other.io/x": "y"}}},
        {"spec": spec, "metadata": {"annotations": {}, "labels": {}}, "status": {}},
        {"spec": spec, "status": {"conditions": [{"type": "Compatible"}]}},
        {},
    ]


@pytest.mark.parametrize("essence", _essences())
def test_clearing_is_kopfs_and_leaves_the_essence_as_it_was(essence: dict[str, Any]) -> None:
    given = copy.deepcopy(essence)
    ours = LeanProgressStorage(prefix=GROUP).clear(essence=cast(kopf.BodyEssence, essence))
    kopfs = kopf.AnnotationsProgressStorage(prefix=GROUP).clear(essence=cast(kopf.BodyEssence, given))
    assert ours == kopfs
    assert essence == given
