"""Smoke tests of the local control plane: the parts the operator relies on really work."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kubernetes import client
from local_cluster import ControlPlane

APPLY = "application/apply-patch+yaml"


def wait_until_gone(read: Callable[[], object], what: str, deadline_s: float = 60.0) -> None:
    """Poll until `read` raises 404; the deadline only bounds a hang, it is not what the test checks."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            read()
        except client.ApiException as exc:
            if exc.status == 404:
                return
            raise
        time.sleep(0.2)
    pytest.fail(f"{what} still exists after {deadline_s} s")


def test_api_server_is_v1_20_2_and_serves_the_groups_the_operator_uses(control_plane: ControlPlane) -> None:
    version = client.VersionApi(control_plane.api_client).get_code()
    assert version.git_version == "v1.20.2"
    groups = {g.name for g in client.ApisApi(control_plane.api_client).get_api_versions().groups}
    assert {
        "apps",
        "apiextensions.k8s.io",
        "rbac.authorization.k8s.io",
        "admissionregistration.k8s.io",
    } <= groups
    names = {meta(ns).name for ns in client.CoreV1Api(control_plane.api_client).list_namespace().items}
    assert {"default", "kube-system"} <= names


def test_namespace_is_created_and_finalized_by_the_controller_manager(control_plane: ControlPlane) -> None:
    core = client.CoreV1Api(control_plane.api_client)
    name = f"smoke-ns-{time.time_ns():x}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    status = core.read_namespace(name).status
    assert status is not None and status.phase == "Active"
    core.delete_namespace(name)
    # Removing the `kubernetes` finalizer is the namespace controller's job: this proves KCM runs.
    wait_until_gone(lambda: core.read_namespace(name), f"namespace {name}")


def meta(obj: client.V1Namespace | client.V1ConfigMap) -> client.V1ObjectMeta:
    assert obj.metadata is not None, f"{type(obj).__name__} without metadata"
    return obj.metadata


def config_map(namespace: str, data: dict[str, str]) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "ssa-smoke", "namespace": namespace},
        "data": data,
    }


def test_server_side_apply_of_a_config_map_with_field_manager_disagg(
    control_plane: ControlPlane, namespace: str
) -> None:
    core = client.CoreV1Api(control_plane.api_client)

    def apply(data: dict[str, str], force: bool = True) -> client.V1ConfigMap:
        return core.patch_namespaced_config_map(
            "ssa-smoke",
            namespace,
            config_map(namespace, data),
            field_manager="disagg",
            force=force,
            _content_type=APPLY,
        )

    created = apply({"role": "prefill", "blockSize": "16"})
    assert created.data == {"role": "prefill", "blockSize": "16"}
    managers = {(m.manager, m.operation) for m in meta(created).managed_fields or []}
    assert managers == {("disagg", "Apply")}

    again = apply({"role": "prefill", "blockSize": "16"})
    assert meta(again).resource_version == meta(created).resource_version, "identical apply wrote"

    # Applying without a field the manager owned removes that field: SSA ownership, not a merge.
    shrunk = apply({"role": "prefill"})
    assert shrunk.data == {"role": "prefill"}

    core.patch_namespaced_config_map(
        "ssa-smoke", namespace, {"data": {"role": "decode"}}, field_manager="other-actor"
    )
    with pytest.raises(client.ApiException) as conflict:
        apply({"role": "prefill"}, force=False)
    assert conflict.value.status == 409
    assert "other-actor" in str(conflict.value.body)
    assert apply({"role": "prefill"}).data == {"role": "prefill"}


def test_garbage_collector_deletes_dependents_of_a_deleted_owner(
    control_plane: ControlPlane, namespace: str
) -> None:
    core = client.CoreV1Api(control_plane.api_client)
    owner = core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner"))
    )
    uid = meta(owner).uid
    assert uid is not None
    reference = client.V1OwnerReference(api_version="v1", kind="ConfigMap", name="owner", uid=uid)
    dependent = client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="dependent", owner_references=[reference])
    )
    core.create_namespaced_config_map(namespace, dependent)
    core.delete_namespaced_config_map("owner", namespace)
    wait_until_gone(
        lambda: core.read_namespaced_config_map("dependent", namespace), "the dependent ConfigMap"
    )


def test_kubectl_and_helm_reach_the_control_plane(control_plane: ControlPlane, helm: Path) -> None:
    nodes = control_plane.kubectl("get", "namespace", "default", "-o", "name")
    assert nodes.returncode == 0, nodes.stderr
    assert nodes.stdout.strip() == "namespace/default"

    version = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith("v3.17."), version.stdout
    listed = subprocess.run(
        [str(helm), "list", "--all-namespaces", "--output", "json"],
        capture_output=True,
        text=True,
        env=control_plane.env(),
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
