"""The only module of the operator that talks to the API server: server-side apply, listing, pruning, status.

Every write names the field manager `disagg-operator`. Applies are forced: the operator is authoritative for
every field it builds, and a conflict with another manager would otherwise stall the reconcile forever.
Responses are read as plain camelCase dicts (`_preload_content=False`): that is the shape the pure code reads,
and it avoids the client's 201-on-create deserialisation gap for custom objects.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from disagg.operator.api import GROUP, PLURAL, VERSION
from disagg.operator.builders import FIELD_MANAGER, INSTANCE_LABEL, MANAGED_BY_LABEL, label_value

APPLY: Final = "application/apply-patch+yaml"
MERGE: Final = "application/merge-patch+json"
# Every kind the operator applies, with the client API that serves it and the noun in its method names.
CHILD_APIS: Final = {
    "StatefulSet": ("apps", "stateful_set"),
    "Deployment": ("apps", "deployment"),
    "Service": ("core", "service"),
    "ConfigMap": ("core", "config_map"),
    "ServiceAccount": ("core", "service_account"),
    "Role": ("rbac", "role"),
    "RoleBinding": ("rbac", "role_binding"),
}


@dataclass
class Kube:
    api: client.ApiClient
    apps: client.AppsV1Api = field(init=False)
    core: client.CoreV1Api = field(init=False)
    custom: client.CustomObjectsApi = field(init=False)
    rbac: client.RbacAuthorizationV1Api = field(init=False)

    def __post_init__(self) -> None:
        self.apps = client.AppsV1Api(self.api)
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.rbac = client.RbacAuthorizationV1Api(self.api)

    def _method(self, verb: str, kind: str) -> Callable[..., Any]:
        """The client's `<verb>_namespaced_<noun>` for a child kind (`patch`, `list` or `delete`)."""
        api, noun = CHILD_APIS[kind]
        method: Callable[..., Any] = getattr(getattr(self, api), f"{verb}_namespaced_{noun}")
        return method

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply of a built object; a second apply of the same body writes nothing (the returned
        object, as stored, keeps its resourceVersion)."""
        metadata = obj["metadata"]
        response = self._method("patch", obj["kind"])(
            metadata["name"],
            metadata["namespace"],
            dict(obj),
            field_manager=FIELD_MANAGER,
            force=True,
            _content_type=APPLY,
            _preload_content=False,
        )
        return _read(response)

    def children(self, namespace: str, owner: str, owner_uid: str) -> list[dict[str, Any]]:
        """Every object of the kinds the operator applies that this owner controls (by label, then uid)."""
        selector = _owned_by(owner)
        found: list[dict[str, Any]] = []
        for kind in CHILD_APIS:
            response = self._method("list", kind)(namespace, label_selector=selector, _preload_content=False)
            items = _read(response).get("items") or []
            for item in items:
                if any(ref.get("uid") == owner_uid for ref in item["metadata"].get("ownerReferences") or ()):
                    found.append({**item, "kind": kind})
        return found

    def delete(self, kind: str, namespace: str, name: str) -> None:
        """Delete a child the spec no longer wants; already gone is fine (a concurrent reconcile did it)."""
        try:
            self._method("delete", kind)(
                name, namespace, propagation_policy="Background", _preload_content=False
            )
        except ApiException as error:
            if error.status != 404:
                raise

    def read_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The DisaggDeployment, or None once it is gone."""
        try:
            response = self.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _preload_content=False
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return _read(response)

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """Merge-patch the status subresource; lists (conditions) are written whole."""
        self.custom.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            {"status": dict(status)},
            field_manager=FIELD_MANAGER,
            _content_type=MERGE,
            _preload_content=False,
        )


def _owned_by(owner: str) -> str:
    """The label selector of every object the operator made for this owner."""
    return f"{INSTANCE_LABEL}={label_value(owner)},{MANAGED_BY_LABEL}={FIELD_MANAGER}"


def _read(response: Any) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(response.data)
    return body
