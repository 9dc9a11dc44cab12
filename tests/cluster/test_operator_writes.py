"""The operator writes only what changes, counted on the real API server: a pod event that changes nothing
writes no status, and a resume (an operator restart) over converged children posts no Event and applies
nothing that moves a resourceVersion. At a thousand deployments these are what keep the API server's load
proportional to what happens, not to how many objects exist."""

from __future__ import annotations

import time
from typing import Any

from kubernetes import watch
from kubernetes.client import ApiException, RbacAuthorizationV1Api
from operator_harness import Cluster, OperatorProcess, example, satisfied, wait_for

from disagg.operator.api import GROUP, PLURAL, VERSION
from disagg.operator.control.kopf_tuning import CHILD_SELECTOR

NAME = "gemma"
KV = "disagg.io/kv-transfer-ready"
CHILD_KINDS = ("ConfigMap", "Service", "StatefulSet", "Deployment")


def _settled(cluster: Cluster, ns: str) -> dict[str, Any]:
    """Created, every pod and replica seen by the status, kopf's own bookkeeping written: nothing left to
    write."""
    result = cluster.kubectl_apply(example("pp2-hma.yaml", ns, NAME))
    assert result.returncode == 0, result.stderr
    cluster.wait_condition(ns, NAME, "KVTransferReady", "Unknown", "AwaitingHandshake")
    wait_for(
        "every pod in KVTransferReady",
        lambda: (
            (cluster.condition(ns, NAME, "KVTransferReady") or {}).get("message", "").startswith("4 of 4")
        ),
    )
    body = wait_for(
        "kopf's last-handled-configuration",
        lambda: satisfied(
            cluster.get(ns, NAME) or {},
            lambda b: (
                f"{GROUP}/last-handled-configuration" in (b["metadata"].get("annotations") or {})
                and b["status"].get("prefill", {}).get("replicas") == 2
                and b["status"].get("decode", {}).get("replicas") == 2
            ),
        ),
    )
    return body


def _kv_condition(reason: str, status: str = "True") -> dict[str, Any]:
    return {"conditions": [{"type": KV, "status": status, "reason": reason, "message": "test"}]}


def _status_writes_until(cluster: Cluster, ns: str, since: str, done: str) -> list[dict[str, Any]]:
    """The DisaggDeployment's MODIFIED events after resourceVersion `since`, up to the first whose
    KVTransferReady message starts with `done`."""
    events: list[dict[str, Any]] = []
    stream = watch.Watch().stream(  # type: ignore[no-untyped-call]
        cluster.custom.list_namespaced_custom_object,
        GROUP,
        VERSION,
        ns,
        PLURAL,
        resource_version=since,
        timeout_seconds=150,
    )
    for event in stream:
        obj = event["object"]
        if obj["metadata"]["name"] != NAME:
            continue
        events.append(obj)
        conditions = {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or ()}
        if conditions.get("KVTransferReady", {}).get("message", "").startswith(done):
            return events
    raise AssertionError(f"no KVTransferReady message starting {done!r} after {len(events)} writes")


def test_a_pod_event_that_changes_nothing_writes_no_status(cluster: Cluster, ns: str) -> None:
    body = _settled(cluster, ns)
    since = body["metadata"]["resourceVersion"]
    pod = "gemma-prefill-0-0"
    # A pod event the status does not depend on (an annotation, a condition of another type) ...
    cluster.core.patch_namespaced_pod(pod, ns, {"metadata": {"annotations": {"disagg.io/test-noise": "1"}}})
    cluster.patch_pod_status(ns, pod, {"conditions": [{"type": "disagg.io/unrelated", "status": "True"}]})
    # ... given time to be handled (a write it caused would come before the next one), then one that counts.
    time.sleep(2)
    cluster.patch_pod_status(ns, pod, _kv_condition("HandshakesSucceeded"))
    writes = _status_writes_until(cluster, ns, since, "3 of 4")
    assert len(writes) == 1, [w["metadata"]["resourceVersion"] for w in writes]


def _child_versions(cluster: Cluster, ns: str) -> dict[tuple[str, str], str]:
    children = cluster.children(ns, NAME)
    versions = {
        (kind, item["metadata"]["name"]): item["metadata"]["resourceVersion"]
        for kind in ("ConfigMap", "Service")
        for item in children[kind]
    }
    # The controllers keep writing the workloads' status; their spec is what an apply would move.
    versions.update(
        {
            (kind, item["metadata"]["name"]): str(item["metadata"]["generation"])
            for kind in ("StatefulSet", "Deployment")
            for item in children[kind]
        }
    )
    return versions


def _events(cluster: Cluster, ns: str, reason: str) -> list[str]:
    return sorted(
        f"{e.metadata.uid} {e.count} {e.message}"
        for e in cluster.core.list_namespaced_event(ns).items
        if e.reason == reason and e.involved_object.name == NAME
    )


def test_a_resume_that_changes_nothing_posts_no_event(
    cluster: Cluster, ns: str, operator: OperatorProcess
) -> None:
    body = _settled(cluster, ns)
    applied = wait_for("the Applied Event", lambda: _events(cluster, ns, "Applied"))
    children = _child_versions(cluster, ns)
    assert len(children) == 7 and all(kind in CHILD_KINDS for kind, _ in children)
    operator.stop()
    start = len(operator.log.read_text(errors="replace"))
    operator.start()
    # The resume handler says how many children its apply changed; wait for that line from the new process.
    wait_for(
        "the resume of the deployment",
        lambda: f"{ns}/{NAME}: 0 children changed" in operator.log.read_text(errors="replace")[start:],
    )
    assert _events(cluster, ns, "Applied") == applied
    assert _child_versions(cluster, ns) == children
    after = cluster.get(ns, NAME)
    assert after is not None and after["status"] == body["status"]


def test_a_create_writes_its_status_once_before_any_child(cluster: Cluster, ns: str) -> None:
    """`kubectl apply` → `Compatible` waits for the verdict alone: a create's first status write comes before
    any child exists, and already says what the apply waves are about to create, so the reconcile writes no
    second status after them: the next write is news of a pod or of a workload's count."""
    listed = cluster.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)
    result = cluster.kubectl_apply(example("pp2-hma.yaml", ns, NAME))
    assert result.returncode == 0, result.stderr
    stream = watch.Watch().stream(  # type: ignore[no-untyped-call]
        cluster.custom.list_namespaced_custom_object,
        GROUP,
        VERSION,
        ns,
        PLURAL,
        resource_version=listed["metadata"]["resourceVersion"],
        timeout_seconds=60,
    )
    # Each status the deployment shows, with the resourceVersion that first showed it.
    statuses: list[tuple[int, dict[str, Any]]] = []
    for event in stream:
        status = event["object"].get("status") or {}
        if status and (not statuses or statuses[-1][1] != status):
            statuses.append((int(event["object"]["metadata"]["resourceVersion"]), status))
        if len(statuses) == 2:
            break
    assert len(statuses) == 2, statuses
    (written, first), (_, second) = statuses
    conditions = {c["type"]: c for c in first["conditions"]}
    assert (conditions["Compatible"]["status"], conditions["Compatible"]["observedGeneration"]) == ("True", 1)
    assert (conditions["Available"]["reason"], conditions["Progressing"]["reason"]) == (
        "AwaitingPods",
        "Creating",
    ), conditions
    assert first["endpoint"].startswith(f"http://{NAME}-router.{ns}.svc:"), first
    # The first apply wave's ConfigMap is never written again: its resourceVersion is its creation's.
    config_maps = cluster.core.list_namespaced_config_map(ns, label_selector=CHILD_SELECTOR).items
    assert config_maps and all(written < int(cm.metadata.resource_version) for cm in config_maps)
    later = {c["type"]: c for c in second["conditions"]}
    counted = second["prefill"]["replicas"] + second["decode"]["replicas"]
    assert counted > 0 or later["KVTransferReady"]["reason"] != "NoPods", (first, second)


def _namespaced_lists(cluster: Cluster, resource: str) -> float:
    """LISTs of `resource` in one namespace, in JSON, the API server has answered (its own request
    counter). Only the operator's lookup of a deployment's children lists Roles so here: the controllers
    ask in protobuf (the namespace controller lists each kind in a namespace it deletes) or every namespace
    at once, and no router runs without a kubelet."""
    result = cluster.cp.kubectl("get", "--raw", "/metrics")
    assert result.returncode == 0, result.stderr
    total = 0.0
    for line in result.stdout.splitlines():
        if line.startswith("apiserver_request_total{") and all(
            f'{label}="{value}"' in line
            for label, value in (
                ("verb", "LIST"),
                ("resource", resource),
                ("scope", "namespace"),
                ("contentType", "application/json"),
            )
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_create_lists_no_children_and_a_spec_change_does(cluster: Cluster, ns: str) -> None:
    """A deployment just created can own no child, so its children are not listed: each list reads every
    object of its kind in the namespace at the API server (a thousand deployments, a thousand of each) for
    an empty answer. A spec change lists them (an apply must know what it replaces), which shows that the
    count sees the operator's lists."""
    before = _namespaced_lists(cluster, "roles")
    result = cluster.kubectl_apply(example("pp2-hma.yaml", ns, NAME))
    assert result.returncode == 0, result.stderr
    cluster.wait_condition(ns, NAME, "Available", "False", "AwaitingPods")
    rbac = RbacAuthorizationV1Api(cluster.cp.api_client)

    def role() -> object | None:
        # A GET, not a LIST: the Role was applied all the same.
        try:
            return rbac.read_namespaced_role(f"{NAME}-router", ns)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    wait_for("the router's Role", role)
    assert _namespaced_lists(cluster, "roles") == before

    cluster.patch_spec(ns, NAME, {"router": {"replicas": 2}})
    wait_for(
        "the spec change's verdict",
        lambda: (cluster.condition(ns, NAME, "Compatible") or {}).get("observedGeneration") == 2 or None,
    )
    wait_for("the spec change's list", lambda: _namespaced_lists(cluster, "roles") > before or None)
