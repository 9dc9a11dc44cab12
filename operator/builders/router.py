"""The router's objects for a `DisaggDeployment` (`spec.router`): what `disagg router run` needs. Pure.

When `spec.router.enabled` (the default): a ServiceAccount, a Role that may only get, list and watch the pods
of the namespace (the router learns the engines and their sidecars' peer reports from them) and its
RoleBinding, a ClusterIP Service and a Deployment, all named `<name>-router`. When disabled, none is built,
and the reconcile prunes the ones that exist like any other child the spec no longer wants.

The router pods carry `disagg.io/deployment` and `disagg.io/component: router` but neither the instance nor
the managed-by label of the engine pods: the operator (and kopf's pod watch) select engine pods by those two,
and a router pod has no KV condition to aggregate. The router Deployment itself carries every owner label, so
its rollout is watched and counted like the engines'.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from disagg.operator.api import DisaggDeploymentSpec
from disagg.operator.builders.objects import (
    API_ACCESS_DIR,
    API_ACCESS_VOLUME,
    SIDECAR_UID,
    UNPRIVILEGED,
    api_access_volume,
    container_resources,
    json_copy,
    owned_object,
)
from disagg.operator.hma import window_edges
from disagg.operator.naming import (
    COMPONENT_LABEL,
    DEPLOYMENT_ANNOTATION,
    NAME_LABEL,
    PART_OF_LABEL,
    Installation,
    Owner,
    router_name,
    router_selector,
)
from disagg.worker.contracts.pod_contract import (
    ROUTER_COMPONENT,
    ROUTER_COMPONENT_LABEL,
)

ROUTER_CONTAINER: Final = "router"
ROUTER_PORT_NAME: Final = "http"
# Everything the router reads; `get` serves a single pod's re-read, `watch` the informer it routes from.
ROUTER_RULES: Final = ({"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},)
# Python, its HTTP stack and the Prometheus client may write temporary files; the root filesystem is
# read-only.
_TMP_VOLUME: Final = "tmp"


def router_endpoint(name: str, namespace: str, port: int) -> str:
    return f"http://{name}.{namespace}.svc:{port}"


def router_objects(
    spec: DisaggDeploymentSpec, owner: Owner, installation: Installation
) -> list[dict[str, Any]]:
    """The router's objects in apply order (its identity first), or none when `spec.router.enabled` is off."""
    if not spec.router.enabled:
        return []
    name = router_name(owner.name)
    return [
        _router_object("v1", "ServiceAccount", name, owner),
        _router_object(
            "rbac.authorization.k8s.io/v1",
            "Role",
            name,
            owner,
            rules=[json_copy(rule) for rule in ROUTER_RULES],
        ),
        _router_object(
            "rbac.authorization.k8s.io/v1",
            "RoleBinding",
            name,
            owner,
            roleRef={"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            subjects=[{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
        ),
        _router_object(
            "v1",
            "Service",
            name,
            owner,
            spec={
                "type": "ClusterIP",
                "selector": router_selector(owner.name),
                "ports": [
                    {
                        "name": ROUTER_PORT_NAME,
                        "port": spec.router.port,
                        "targetPort": ROUTER_PORT_NAME,
                        "protocol": "TCP",
                    }
                ],
            },
        ),
        _router_object(
            "apps/v1",
            "Deployment",
            name,
            owner,
            spec={
                "replicas": spec.router.replicas,
                "selector": {"matchLabels": router_selector(owner.name)},
                "template": _pod_template(spec, owner, installation),
            },
        ),
    ]


def _router_object(api_version: str, kind: str, name: str, owner: Owner, **body: Any) -> dict[str, Any]:
    obj = owned_object(api_version, kind, name, owner, ROUTER_COMPONENT, **body)
    obj["metadata"]["labels"][ROUTER_COMPONENT_LABEL] = ROUTER_COMPONENT
    return obj


def _pod_template(spec: DisaggDeploymentSpec, owner: Owner, installation: Installation) -> dict[str, Any]:
    router = spec.router
    image = installation.router_image_of(spec)
    if image is None:
        # The reconcile refuses such a spec (WorkerImageMissing) before building; reaching this is a bug.
        raise ValueError("no router image: spec.router.image, the installation's and the sidecar's are unset")
    ready = {"periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3}
    # A restart drops every stream in flight, so the kubelet restarts the router only after a minute without
    # an answer: on a node whose engines hold every core, /healthz can take longer than readiness' 3 s.
    alive = {"periodSeconds": 10, "timeoutSeconds": 10, "failureThreshold": 6}
    container: dict[str, Any] = {
        "name": ROUTER_CONTAINER,
        "image": image,
        "command": ["disagg"],
        "args": [
            "router",
            "run",
            "--deployment",
            owner.name,
            "--namespace",
            owner.namespace,
            "--port",
            str(router.port),
            *(f"--recompute-window-edge={window}:{block}" for window, block in window_edges(spec)),
        ],
        "ports": [{"name": ROUTER_PORT_NAME, "containerPort": router.port, "protocol": "TCP"}],
        # Ready once it has listed the pods (it routes nothing before); alive while its server answers.
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": ROUTER_PORT_NAME}, **ready},
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": ROUTER_PORT_NAME},
            **alive,
            "initialDelaySeconds": 10,
        },
        "resources": container_resources(router.resources, None, None),
        "securityContext": {
            **json_copy(UNPRIVILEGED),
            "runAsNonRoot": True,
            "runAsUser": SIDECAR_UID,
            "runAsGroup": SIDECAR_UID,
            "readOnlyRootFilesystem": True,
        },
        "volumeMounts": [
            {"name": _TMP_VOLUME, "mountPath": "/tmp"},
            {"name": API_ACCESS_VOLUME, "mountPath": API_ACCESS_DIR, "readOnly": True},
        ],
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": router_name(owner.name),
        # The token is projected into the router container alone, as the kubelet would (see pod_template).
        "automountServiceAccountToken": False,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "enableServiceLinks": False,
        "volumes": [{"name": _TMP_VOLUME, "emptyDir": {"sizeLimit": "64Mi"}}, api_access_volume()],
    }
    scheduling = router.scheduling
    if scheduling is not None and scheduling.node_selector:
        pod_spec["nodeSelector"] = dict(scheduling.node_selector)
    if scheduling is not None and scheduling.tolerations:
        pod_spec["tolerations"] = [json_copy(toleration) for toleration in scheduling.tolerations]
    if scheduling is not None and scheduling.affinity:
        pod_spec["affinity"] = json_copy(scheduling.affinity)
    return {
        "metadata": {
            "labels": {
                NAME_LABEL: "disagg",
                PART_OF_LABEL: "disagg",
                COMPONENT_LABEL: ROUTER_COMPONENT,
                **router_selector(owner.name),
            },
            "annotations": {DEPLOYMENT_ANNOTATION: owner.name},
        },
        "spec": pod_spec,
    }


def endpoint_of(children: Iterable[Mapping[str, Any]]) -> str | None:
    """The URL of the router Service among a deployment's observed children, or None when there is none."""
    for child in children:
        metadata = child.get("metadata") or {}
        labels = metadata.get("labels") or {}
        if child.get("kind") != "Service" or labels.get(ROUTER_COMPONENT_LABEL) != ROUTER_COMPONENT:
            continue
        for port in (child.get("spec") or {}).get("ports") or ():
            if port.get("name") == ROUTER_PORT_NAME and isinstance(port.get("port"), int):
                return router_endpoint(
                    str(metadata.get("name")), str(metadata.get("namespace")), port["port"]
                )
    return None
