"""The only module of the operator that talks to the API server: server-side apply, listing, pruning, status.

Every write names the field manager `disagg-operator`. Applies are forced: the operator is authoritative for
every field it builds, and a conflict with another manager would otherwise stall the reconcile forever.
Requests go through the kubernetes client's `ApiClient` (its configuration, authentication and connection
pool) as plain REST calls, and responses are read as plain camelCase dicts: that is the shape the pure code
reads, and it avoids the client's 201-on-create deserialisation gap for custom objects. The generated
`CoreV1Api` and `AppsV1Api` are not used: importing them (with the models they validate against) costs the
operator about 25 MiB of its memory for methods it never calls.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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


# The URL prefix of each client API named in CHILD_APIS.
_API_PATHS: Final = {"core": "/api/v1", "apps": "/apis/apps/v1", "rbac": "/apis/rbac.authorization.k8s.io/v1"}
_DEPLOYMENTS: Final = f"/apis/{GROUP}/{VERSION}/namespaces/{{namespace}}/{PLURAL}"


def _collection(kind: str) -> str:
    """`/apis/apps/v1/namespaces/{namespace}/statefulsets` for a kind (plural: the noun, unsplit, +s)."""
    api, noun = CHILD_APIS[kind]
    return f"{_API_PATHS[api]}/namespaces/{{namespace}}/{noun.replace('_', '')}s"


@dataclass
class Kube:
    api: client.ApiClient

    def _call(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Mapping[str, Any] | None = None,
        content_type: str | None = None,
    ) -> dict[str, Any]:
        """One request; a status other than 2xx raises the client's `ApiException` (404 as `status` 404)."""
        headers = {"Accept": "application/json"}
        if content_type is not None:
            headers["Content-Type"] = content_type
        verb, url, headers, payload, _ = self.api.param_serialize(
            method,
            path,
            query_params=list((query or {}).items()),
            header_params=headers,
            body=dict(body) if body is not None else None,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(verb, url, headers, payload)
        data: bytes = response.read()  # type: ignore[no-untyped-call]
        if not 200 <= response.status <= 299:
            raise ApiException.from_response(
                http_resp=response, body=data.decode("utf-8", errors="replace"), data=None
            )
        body_read: dict[str, Any] = json.loads(data)
        return body_read

    def _method(self, verb: str, kind: str) -> Callable[..., dict[str, Any]]:
        """The request `patch`, `list` or `delete` for a child kind, called as the client's
        `<verb>_namespaced_<noun>(name, namespace, ...)` would be (`list`: `(namespace, selector)`)."""
        collection = _collection(kind)
        if verb == "list":
            return lambda namespace, selector: self._call(
                "GET", collection.format(namespace=namespace), query={"labelSelector": selector}
            )
        if verb == "patch":
            return lambda name, namespace, body: self._call(
                "PATCH",
                f"{collection.format(namespace=namespace)}/{name}",
                query={"fieldManager": FIELD_MANAGER, "force": "true"},
                body=body,
                content_type=APPLY,
            )
        if verb == "delete":
            return lambda name, namespace: self._call(
                "DELETE",
                f"{collection.format(namespace=namespace)}/{name}",
                body={"propagationPolicy": "Background"},
                content_type="application/json",
            )
        raise ValueError(f"no {verb} request for {kind}")

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply of a built object; a second apply of the same body writes nothing (the returned
        object, as stored, keeps its resourceVersion)."""
        metadata = obj["metadata"]
        return self._method("patch", obj["kind"])(metadata["name"], metadata["namespace"], obj)

    def children(self, namespace: str, owner: str, owner_uid: str) -> list[dict[str, Any]]:
        """Every object of the kinds the operator applies that this owner controls (by label, then uid)."""
        selector = _owned_by(owner)
        found: list[dict[str, Any]] = []
        for kind in CHILD_APIS:
            items = self._method("list", kind)(namespace, selector).get("items") or []
            for item in items:
                if any(ref.get("uid") == owner_uid for ref in item["metadata"].get("ownerReferences") or ()):
                    found.append({**item, "kind": kind})
        return found

    def delete(self, kind: str, namespace: str, name: str) -> None:
        """Delete a child the spec no longer wants; already gone is fine (a concurrent reconcile did it)."""
        try:
            self._method("delete", kind)(name, namespace)
        except ApiException as error:
            if error.status != 404:
                raise

    def create_deployment(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self._call("POST", _DEPLOYMENTS.format(namespace=namespace), body=body)

    def read_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The DisaggDeployment, or None once it is gone."""
        try:
            return self._call("GET", f"{_DEPLOYMENTS.format(namespace=namespace)}/{name}")
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """Merge-patch the status subresource; lists (conditions) are written whole."""
        self._call(
            "PATCH",
            f"{_DEPLOYMENTS.format(namespace=namespace)}/{name}/status",
            query={"fieldManager": FIELD_MANAGER},
            body={"status": dict(status)},
            content_type=MERGE,
        )


def _owned_by(owner: str) -> str:
    """The label selector of every object the operator made for this owner."""
    return f"{INSTANCE_LABEL}={label_value(owner)},{MANAGED_BY_LABEL}={FIELD_MANAGER}"
