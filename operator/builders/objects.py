"""What every child of a `DisaggDeployment` shares: its owner metadata, the unprivileged security context,
container resources and the projected API token volume. Pure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from disagg.operator.api import Resources
from disagg.operator.naming import (
    COMPONENT_LABEL,
    DEPLOYMENT_ANNOTATION,
    GENERATION_ANNOTATION,
    REVISION_LABEL,
    SLOT_LABEL,
    Owner,
    owner_labels,
)

# The API server credentials the sidecar's in-cluster client reads (token, ca.crt, namespace), projected as
# the kubelet would: the pod mounts no token of its own (automountServiceAccountToken: false) and only the
# sidecar, which patches its Pod's condition, reads its peers and posts Events, gets this one.
API_ACCESS_VOLUME: Final = "kube-api-access"
API_ACCESS_DIR: Final = "/var/run/secrets/kubernetes.io/serviceaccount"
# The uid the watch sidecar runs as, the one the chart's operator runs the same image as.
SIDECAR_UID: Final = 65532
# A container that may not gain privileges, with every capability dropped; the ones that need more add it.
UNPRIVILEGED: Final = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def owned_object(
    api_version: str, kind: str, name: str, owner: Owner, component: str, **body: Any
) -> dict[str, Any]:
    """A child with the owner's labels, generation and name annotations and (when it has a uid) its owner
    reference."""
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": owner.namespace,
        "labels": {**owner_labels(owner.name), COMPONENT_LABEL: component},
        "annotations": {GENERATION_ANNOTATION: str(owner.generation), DEPLOYMENT_ANNOTATION: owner.name},
    }
    references = owner.references()
    if references:
        metadata["ownerReferences"] = references
    return {"apiVersion": api_version, "kind": kind, "metadata": metadata, **body}


def revision_labels(revision: str, slot: str) -> dict[str, str]:
    """What an engine workload and its pods carry of the revision they run and the slot they are in."""
    return {REVISION_LABEL: revision, SLOT_LABEL: slot}


def json_copy(value: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of a JSON-shaped mapping: no two built objects share a constant of this package."""
    copied: dict[str, Any] = json.loads(json.dumps(value))
    return copied


def container_resources(
    base: Resources | None, rdma: tuple[str, int] | None, huge_pages: tuple[str, str] | None
) -> dict[str, Any]:
    # Quantities are strings in the API's typed schema: server-side apply refuses a bare number.
    sections = base.sections() if base is not None else {}
    resources = {
        key: {name: str(amount) for name, amount in value.items()} for key, value in sections.items()
    }
    if rdma is not None:
        # Extended resources cannot be overcommitted: a limit alone also sets the request.
        resources.setdefault("limits", {})[rdma[0]] = str(rdma[1])
    if huge_pages is not None:
        # Kubernetes requires hugepages requests equal to limits; both are written so neither is inferred.
        for key in ("requests", "limits"):
            resources.setdefault(key, {})[huge_pages[0]] = huge_pages[1]
    return resources


def api_access_volume() -> dict[str, Any]:
    """The projected volume the kubelet mounts for a ServiceAccount (a bound, expiring token, the cluster's
    CA from the kube-root-ca.crt ConfigMap, and the namespace), as one volume only the sidecar mounts."""
    return {
        "name": API_ACCESS_VOLUME,
        "projected": {
            "defaultMode": 0o444,
            "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {
                    "downwardAPI": {
                        "items": [
                            {
                                "path": "namespace",
                                "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"},
                            }
                        ]
                    }
                },
            ],
        },
    }
