"""The autoscaling API on the real API server: the CRD's scale subresource is decode's, and under mode
external an autoscaler's write to the decode Deployment's replicas survives the operator's next apply."""

from __future__ import annotations

import json
from typing import Any

import pytest
from operator_harness import Cluster, example, satisfied, wait_for

from disagg.operator.api import GROUP, PLURAL, VERSION

pytestmark = pytest.mark.cluster
NAME = "scaled"


def _decode(cluster: Cluster, ns: str) -> dict[str, Any] | None:
    try:
        response: Any = cluster.apps.read_namespaced_deployment(f"{NAME}-decode", ns, _preload_content=False)
    except Exception:  # not there yet
        return None
    body: dict[str, Any] = json.loads(response.data)
    return body


def test_kubectl_scale_sets_the_decode_count(cluster: Cluster, ns: str) -> None:
    result = cluster.kubectl_apply(example("pp2-hma.yaml", ns, NAME, {"decode": {"replicas": 1}}))
    assert result.returncode == 0, result.stderr
    wait_for("the decode Deployment", lambda: _decode(cluster, ns))
    scaled = cluster.cp.kubectl("scale", "disagg", NAME, "-n", ns, "--replicas", "3")
    assert scaled.returncode == 0, scaled.stderr
    assert scaled.stdout.strip() == f"disaggdeployment.{GROUP}/{NAME} scaled"
    body = cluster.get(ns, NAME)
    assert body is not None and body["spec"]["decode"]["replicas"] == 3
    wait_for(
        "3 decode replicas",
        lambda: satisfied(_decode(cluster, ns) or {}, lambda d: d.get("spec", {}).get("replicas") == 3),
    )
    scale: Any = cluster.custom.get_namespaced_custom_object_scale(
        GROUP, VERSION, ns, PLURAL, NAME, _preload_content=False
    )
    read = json.loads(scale.data)
    assert read["spec"]["replicas"] == 3
    assert read["status"]["selector"] == f"app.kubernetes.io/instance={NAME},disagg.io/role=decode"
    status = wait_for(
        "the status's desired count",
        lambda: satisfied(
            (cluster.get(ns, NAME) or {}).get("status") or {},
            lambda s: (s.get("decode") or {}).get("desiredReplicas") == 3,
        ),
    )
    assert status["prefill"]["desiredReplicas"] == 1  # prefill engines, each a PP2 StatefulSet


def test_an_autoscalers_write_to_the_decode_replicas_survives_the_operators_apply(
    cluster: Cluster, ns: str
) -> None:
    document = example("pp2-hma.yaml", ns, NAME, {"decode": {"autoscaling": {"mode": "external"}}})
    result = cluster.kubectl_apply(document)
    assert result.returncode == 0, result.stderr
    created = wait_for("the decode Deployment", lambda: _decode(cluster, ns))
    assert created["spec"]["replicas"] == 1  # the Deployment's default: the operator names none
    # What an HPA does: an update of the Deployment's scale subresource, as another field manager.
    scaled = cluster.cp.kubectl("scale", "deployment", f"{NAME}-decode", "-n", ns, "--replicas", "4")
    assert scaled.returncode == 0, scaled.stderr
    # A spec change makes the operator apply every child again.
    cluster.patch_spec(ns, NAME, {"router": {"replicas": 2}})

    def router_replicas() -> int | None:
        router: Any = cluster.apps.read_namespaced_deployment(f"{NAME}-router", ns, _preload_content=False)
        replicas = json.loads(router.data)["spec"]["replicas"]
        return replicas if replicas == 2 else None

    wait_for("the reconcile of the new generation (2 routers)", router_replicas)
    decode = _decode(cluster, ns)
    assert decode is not None and decode["spec"]["replicas"] == 4
    owners = {
        entry["manager"]
        for entry in decode["metadata"]["managedFields"]
        if "f:replicas" in json.dumps(entry.get("fieldsV1", {}).get("f:spec", {}))
    }
    assert "disagg-operator" not in owners
    status = (cluster.get(ns, NAME) or {}).get("status") or {}
    assert "desiredReplicas" not in (status.get("decode") or {})
