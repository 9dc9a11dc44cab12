"""The only module of the operator that talks to the API server: server-side apply, listing, pruning, status,
access reviews.

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
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from disagg.operator.api import GROUP, KIND, PLURAL, VERSION
from disagg.operator.naming import FIELD_MANAGER, INSTANCE_LABEL, MANAGED_BY_LABEL, label_value

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


# How many requests one `Kube` sends at a time for `apply_all` and `children` (every reconcile shares them):
# a reconcile's requests are independent within a wave, and sent one after another each waited a round trip
# on the API server. `disagg bench operator` measured apply → Compatible at 0.63 s sequential.
PARALLEL_REQUESTS: Final = 8

# An Event's message is cut at 1 KiB, as kopf cuts its own (events.k8s.io refuses a longer note).
MAX_EVENT_MESSAGE: Final = 1024

# The URL prefix of each client API named in CHILD_APIS.
_API_PATHS: Final = {"core": "/api/v1", "apps": "/apis/apps/v1", "rbac": "/apis/rbac.authorization.k8s.io/v1"}
_DEPLOYMENTS: Final = f"/apis/{GROUP}/{VERSION}/namespaces/{{namespace}}/{PLURAL}"


def _collection(kind: str) -> str:
    """`/apis/apps/v1/namespaces/{namespace}/statefulsets` for a kind (plural: the noun, unsplit, +s)."""
    api, noun = CHILD_APIS[kind]
    return f"{_API_PATHS[api]}/namespaces/{{namespace}}/{noun.replace('_', '')}s"


def api_client(connections: int | None = None) -> client.ApiClient:
    """A client for the pod's ServiceAccount in a cluster, else for the kubeconfig ($KUBECONFIG), pooling
    `connections` connections (urllib3's default otherwise)."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    configuration = client.Configuration.get_default_copy()
    if connections is not None:
        configuration.connection_pool_maxsize = connections
    return client.ApiClient(configuration)


@dataclass
class Kube:
    api: client.ApiClient
    # Per kind, the newest resourceVersion this process has written (`children` lists no older than it).
    _written: dict[str, int] = field(default_factory=dict, repr=False)
    # Per deployment, the status this process last wrote, until a newer body shows it (`latest_status`).
    _statuses: dict[tuple[str, str], _WrittenStatus] = field(default_factory=dict, repr=False)
    # Per deployment with a status write under way, the newest version the watch showed meanwhile (-1: none).
    _writing: dict[tuple[str, str], int] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # Threads start on first use, so a Kube that only reads (the bench, the tests) starts none.
    _pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(PARALLEL_REQUESTS, thread_name_prefix="disagg-request"),
        repr=False,
    )

    def _call(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Mapping[str, Any] | None = None,
        content_type: str | None = None,
        read: bool = True,
    ) -> dict[str, Any]:
        """One request; a status other than 2xx raises the client's `ApiException` (404 as `status` 404).
        `read=False` returns {} without parsing the response: a status write or a delete gets the whole
        object back, managedFields included, and parsing what nobody reads is garbage made per write."""
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
        if not read:
            return {}
        body_read: dict[str, Any] = json.loads(data)
        return body_read

    def _method(self, verb: str, kind: str) -> Callable[..., dict[str, Any]]:
        """The request `patch`, `list` or `delete` for a child kind, called as the client's
        `<verb>_namespaced_<noun>(name, namespace, ...)` would be (`list`: `(namespace, selector)`)."""
        collection = _collection(kind)
        if verb == "list":
            return lambda namespace, selector: self._call(
                "GET",
                collection.format(namespace=namespace),
                query={"labelSelector": selector, "resourceVersion": self._not_older_than(kind)},
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
                read=False,
            )
        raise ValueError(f"no {verb} request for {kind}")

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply of a built object; a second apply of the same body writes nothing (the returned
        object, as stored, keeps its resourceVersion)."""
        metadata = obj["metadata"]
        stored = self._method("patch", obj["kind"])(metadata["name"], metadata["namespace"], obj)
        version = str((stored.get("metadata") or {}).get("resourceVersion") or "")
        if version.isdigit():
            with self._lock:
                self._written[obj["kind"]] = max(self._written.get(obj["kind"], 0), int(version))
        return stored

    def apply_all(self, objects: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """`apply` every object at once (at most `PARALLEL_REQUESTS` in flight); the stored objects, in the
        order given. The first failure is raised once every apply has ended (each is idempotent: a retry
        applies them all again)."""
        futures = [self._pool.submit(self.apply, obj) for obj in objects]
        return [future.result() for future in futures]

    def _not_older_than(self, kind: str) -> str:
        """The resourceVersion a list of `kind` asks for: served from the API server's watch cache, no older
        than this process's own last write of the kind ("0", any, before the first).

        A list without one is read from etcd, which means reading every object of the kind in the namespace
        to filter by label: with a thousand deployments in one namespace each reconcile cost in proportion
        to the namespace, and the API server spent its time there. The cache trails etcd by milliseconds but
        never the version asked for, so the list shows every child this operator has applied (what pruning
        needs). A write by someone else in those milliseconds can make an apply that wrote nothing count as
        changed (one Applied Event too many), never the reverse. Before this process's first write of a
        kind, "0" accepts any cached state: the previous process's writes are older than the cache's lag."""
        with self._lock:
            return str(self._written.get(kind, 0))

    def children(self, namespace: str, owner: str, owner_uid: str) -> list[dict[str, Any]]:
        """Every object of the kinds the operator applies that this owner controls (by label, then uid)."""
        selector = _owned_by(owner)
        listings = {
            kind: self._pool.submit(self._method("list", kind), namespace, selector) for kind in CHILD_APIS
        }
        found: list[dict[str, Any]] = []
        for kind, listing in listings.items():
            for item in listing.result().get("items") or []:
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

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str | None]) -> None:
        """Merge `annotations` into a Pod's (the drain mark; None removes one); a pod already gone is fine."""
        try:
            self._call(
                "PATCH",
                f"/api/v1/namespaces/{namespace}/pods/{name}",
                query={"fieldManager": FIELD_MANAGER},
                body={"metadata": {"annotations": dict(annotations)}},
                content_type=MERGE,
                read=False,
            )
        except ApiException as error:
            if error.status != 404:
                raise

    def delete_pod(self, namespace: str, name: str) -> None:
        """Delete an engine pod a rollout step or a scale-down has drained; already gone is fine."""
        try:
            self._call(
                "DELETE",
                f"/api/v1/namespaces/{namespace}/pods/{name}",
                body={"propagationPolicy": "Background"},
                content_type="application/json",
                read=False,
            )
        except ApiException as error:
            if error.status != 404:
                raise

    def scale_deployment(self, namespace: str, name: str, replicas: int) -> None:
        """Set a Deployment's replicas (a rollout step lowering the old revision's decoders, right after
        deleting the pods that go: the ReplicaSet then removes the replacements it began, not a serving
        pod)."""
        self._call(
            "PATCH",
            f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}",
            query={"fieldManager": FIELD_MANAGER},
            body={"spec": {"replicas": replicas}},
            content_type=MERGE,
            read=False,
        )

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        """The pods a label selector matches (the router pods the planner scrapes), from the watch cache."""
        found = self._call(
            "GET",
            f"/api/v1/namespaces/{namespace}/pods",
            query={"labelSelector": selector, "resourceVersion": "0"},
        )
        return list(found.get("items") or ())

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
        """Merge-patch the status subresource; lists (conditions) are written whole. The status as stored
        is remembered for `latest_status` until the operator's watch shows it. The watch may show it before
        the response is read (the event and the response leave the API server together: 195 of 1,217
        writes for 300 deployments), and a write remembered after that would stay, some 8 KiB, until the
        deployment next changed, which a settled one never does: so a version shown meanwhile counts."""
        key = (namespace, name)
        with self._lock:
            self._writing.setdefault(key, -1)
        try:
            stored = self._call(
                "PATCH",
                f"{_DEPLOYMENTS.format(namespace=namespace)}/{name}/status",
                query={"fieldManager": FIELD_MANAGER},
                body={"status": dict(status)},
                content_type=MERGE,
            )
        finally:
            with self._lock:
                shown = self._writing.pop(key, -1)
        metadata = stored.get("metadata") or {}
        version = _version(metadata)
        if version is not None and shown < version:
            written = _WrittenStatus(str(metadata.get("uid")), version, dict(stored.get("status") or {}))
            with self._lock:
                self._statuses[key] = written

    def latest_status(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The deployment's status as it is now: `body`'s (from the watch, or a handler's event), or the one
        this process wrote after it. A status is judged against its predecessor (a condition keeps its
        lastTransitionTime unless it flips), and a watch event can trail the operator's own last write."""
        written = self._unseen_write(body["metadata"])
        return dict(written.status if written is not None else body.get("status") or {})

    def saw(self, metadata: Mapping[str, Any]) -> None:
        """The watch shows this version of a deployment: a write of this process it shows is dropped here,
        not at the next `latest_status`, which a deployment that stays as it is never asks for: its last
        write, some 8 KiB, would stay as long as the deployment."""
        self._unseen_write(metadata)

    def _unseen_write(self, metadata: Mapping[str, Any]) -> _WrittenStatus | None:
        """This process's last status write of the deployment if `metadata`'s version predates it; a write
        that it shows (or a newer state, or another object of the name) is forgotten."""
        key = (metadata["namespace"], metadata["name"])
        version = _version(metadata)
        with self._lock:
            if version is not None and key in self._writing:
                self._writing[key] = max(self._writing[key], version)
            written = self._statuses.get(key)
            if written is None:
                return None
            if written.uid != metadata.get("uid") or version is None or version >= written.version:
                del self._statuses[key]
                return None
            return written

    def forget_status(self, namespace: str, name: str) -> None:
        """The deployment is gone: drop what `latest_status` remembers of it."""
        with self._lock:
            self._statuses.pop((namespace, name), None)

    def allowed(self, verb: str, group: str, resource: str, *, namespace: str = "", name: str = "") -> bool:
        """Whether the API server's authorizer lets this process's account do `verb` on `resource`
        (`plural` or `plural/subresource`) in `namespace` ("" is every namespace, or a cluster-scoped kind),
        on the object `name` if one is given: a SelfSubjectAccessReview, which every account may create."""
        plural, _, subresource = resource.partition("/")
        attributes = {"verb": verb, "group": group, "resource": plural}
        attributes |= {
            k: v for k, v in (("subresource", subresource), ("namespace", namespace), ("name", name)) if v
        }
        review = self._call(
            "POST",
            "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
            body={
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SelfSubjectAccessReview",
                "spec": {"resourceAttributes": attributes},
            },
        )
        return bool((review.get("status") or {}).get("allowed"))

    def post_event(self, owner: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on the DisaggDeployment whose `metadata` is `owner`'s, as kopf posts them (the
        "From" column of `kubectl describe` is the field manager); steps run outside a kopf handler use it."""
        metadata = owner["metadata"]
        now = datetime.now(UTC).isoformat()
        self._call(
            "POST",
            f"/api/v1/namespaces/{metadata['namespace']}/events",
            body={
                "metadata": {"generateName": f"{FIELD_MANAGER}-", "namespace": metadata["namespace"]},
                "involvedObject": {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": KIND,
                    "name": metadata["name"],
                    "namespace": metadata["namespace"],
                    "uid": metadata["uid"],
                },
                "type": type_,
                "reason": reason,
                "message": message[:MAX_EVENT_MESSAGE],
                "source": {"component": FIELD_MANAGER},
                "reportingComponent": FIELD_MANAGER,
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            },
            read=False,
        )

    def namespace_names(self) -> list[str]:
        """Every namespace's name (to resolve `--namespace` globs as kopf does)."""
        listed = self._call("GET", "/api/v1/namespaces").get("items") or []
        return [item["metadata"]["name"] for item in listed]


@dataclass(frozen=True)
class _WrittenStatus:
    uid: str
    version: int
    status: dict[str, Any]


def _version(metadata: Mapping[str, Any]) -> int | None:
    """An object's resourceVersion as a number: the API server's are etcd revisions (opaque by contract, but
    the operator already relies on their order to read its own writes, `Kube._not_older_than`)."""
    version = str(metadata.get("resourceVersion") or "")
    return int(version) if version.isdigit() else None


def _owned_by(owner: str) -> str:
    """The label selector of every object the operator made for this owner."""
    return f"{INSTANCE_LABEL}={label_value(owner)},{MANAGED_BY_LABEL}={FIELD_MANAGER}"
