"""The operator against the real kube-apiserver: children, conditions, refusals, updates, scaling, deletion
and the KVTransferReady aggregation of the sidecars' Pod conditions. One operator process serves the module
(no webhook here, so incompatible specs reach the operator); every test has its own namespace."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from local_cluster import REPO
from operator_harness import Cluster, example, satisfied, wait_for

from disagg.operator.control.webhook import refusal
from disagg.operator.naming import DEFAULT_WORKER_CLUSTER_ROLE

NAME = "gemma"


def create(cluster: Cluster, ns: str, file: str = "pp2-hma.yaml", **spec_patch: Any) -> None:
    result = cluster.kubectl_apply(example(file, ns, NAME, spec_patch or None))
    assert result.returncode == 0, result.stderr


def test_valid_spec_creates_owned_children_and_conditions(cluster: Cluster, ns: str) -> None:
    create(cluster, ns)
    compatible = cluster.wait_condition(ns, NAME, "Compatible", "True", "Compatible")
    assert compatible["observedGeneration"] == 1
    # The example's sliding-window model on vLLM 0.33 runs without HMA (Auto, issue 42): pairs by index.
    assert "2 prefill stage(s)" in compatible["message"] and "region-index routing" in compatible["message"]
    names = wait_for(
        "every child",
        # The router's Deployment is applied last.
        lambda: satisfied(cluster.names(ns, NAME), lambda n: "gemma-router" in n["Deployment"]),
    )
    assert names == {
        "StatefulSet": ["gemma-prefill-0"],
        "Deployment": ["gemma-decode", "gemma-router"],
        "Service": ["gemma-decode", "gemma-prefill-0", "gemma-router"],
        "ConfigMap": ["gemma-topology"],
    }
    body = cluster.get(ns, NAME)
    assert body is not None
    children = cluster.children(ns, NAME)
    for kind in ("StatefulSet", "Deployment", "Service", "ConfigMap"):
        for item in children[kind]:
            (ref,) = item["metadata"]["ownerReferences"]
            assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
                "DisaggDeployment",
                NAME,
                body["metadata"]["uid"],
                True,
            )
            managers = {
                entry["manager"]
                for entry in item["metadata"]["managedFields"]
                if entry["operation"] == "Apply"
            }
            assert managers == {"disagg-operator"}
    # kube-controller-manager made the pods: one per stage, and the decode replicas; no kubelet runs them.
    pods = wait_for("the pods", lambda: satisfied(cluster.children(ns, NAME)["Pod"], lambda p: len(p) == 4))
    stage_pods = sorted(
        p["metadata"]["name"] for p in pods if p["metadata"]["labels"]["disagg.io/role"] == "prefill"
    )
    assert stage_pods == ["gemma-prefill-0-0", "gemma-prefill-0-1"]
    status = body["status"]
    assert [s["endLayer"] - s["startLayer"] for s in status["topology"]["stages"]] == [31, 31]
    assert status["compatibilityHashes"]["prefill"] == status["compatibilityHashes"]["decode"]
    cluster.wait_condition(ns, NAME, "Available", "False", "AwaitingPods")
    cluster.wait_condition(ns, NAME, "Progressing", "True", "Creating")
    cluster.wait_condition(ns, NAME, "KVTransferReady", "Unknown", "AwaitingHandshake")


def test_a_huge_page_kv_pool_reaches_the_pods(cluster: Cluster, ns: str) -> None:
    """The API server validates hugepages (requests == limits, beside cpu or memory) on each pod it admits."""
    engine = {"resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "1Gi", "nvidia.com/gpu": 2}}}
    create(
        cluster,
        ns,
        kvTransfer={"kvPool": {"medium": "HugePages-2Mi", "sizeLimit": "64Mi"}},
        prefill=engine,
        decode=engine,
        worker={"resources": {"requests": {"cpu": "100m", "memory": "128Mi"}}},
    )
    cluster.wait_condition(ns, NAME, "Compatible", "True", "Compatible")
    pods = wait_for("the pods", lambda: satisfied(cluster.children(ns, NAME)["Pod"], lambda p: len(p) == 4))
    for pod in pods:
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["kv-pool"]["emptyDir"] == {"medium": "HugePages-2Mi", "sizeLimit": "64Mi"}
        for container in pod["spec"]["containers"]:
            resources = container["resources"]
            assert resources["requests"]["hugepages-2Mi"] == resources["limits"]["hugepages-2Mi"] == "64Mi"
            variables = {item["name"]: item.get("value") for item in container["env"]}
            assert variables["DISAGG_KV_POOL"] == "/dev/hugepages/kv-pool"


def test_a_huge_page_kv_pool_without_a_size_is_refused(cluster: Cluster, ns: str) -> None:
    create(cluster, ns, kvTransfer={"kvPool": {"medium": "HugePages-2Mi"}})
    refused = cluster.wait_condition(ns, NAME, "Compatible", "False")
    assert refused["reason"] == "KVPoolSizeInvalid" and "sizeLimit" in refused["message"]
    assert cluster.names(ns, NAME) == {"StatefulSet": [], "Deployment": [], "Service": [], "ConfigMap": []}


def test_incompatible_spec_creates_nothing(cluster: Cluster, ns: str) -> None:
    create(cluster, ns, "bad-decode-pp.yaml")
    refused = cluster.wait_condition(ns, NAME, "Compatible", "False")
    assert refused["reason"] == "DecodePipelineParallel"
    # Word for word what the admission webhook refuses the same spec with.
    assert refused["message"] == refusal(example("bad-decode-pp.yaml", ns, NAME)["spec"])
    assert "decode" in refused["message"] and "pipelineParallelSize" in refused["message"]
    assert cluster.names(ns, NAME) == {"StatefulSet": [], "Deployment": [], "Service": [], "ConfigMap": []}
    events = wait_for(
        "the SpecRefused event",
        lambda: [e for e in cluster.core.list_namespaced_event(ns).items if e.reason == "SpecRefused"],
    )
    assert events[0].involved_object.name == NAME and events[0].type == "Warning"


def test_a_spec_without_a_worker_image_is_refused_when_the_operator_has_no_default(
    cluster: Cluster, ns: str
) -> None:
    if os.environ.get("DISAGG_WORKER_IMAGE"):
        pytest.skip("the operator inherits DISAGG_WORKER_IMAGE from this environment")
    document = example("pp2-hma.yaml", ns, NAME)
    del document["spec"]["worker"]
    result = cluster.kubectl_apply(document)
    assert result.returncode == 0, result.stderr
    refused = cluster.wait_condition(ns, NAME, "Compatible", "False")
    assert refused["reason"] == "WorkerImageMissing"
    assert "spec.worker.image" in refused["message"] and "DISAGG_WORKER_IMAGE" in refused["message"]
    assert cluster.names(ns, NAME) == {"StatefulSet": [], "Deployment": [], "Service": [], "ConfigMap": []}
    assert _get(cluster, "serviceaccount", ns, "gemma-kv-worker") is None


def test_incompatible_update_leaves_running_objects(cluster: Cluster, ns: str) -> None:
    create(cluster, ns)
    cluster.wait_condition(ns, NAME, "Compatible", "True")
    sts = wait_for("the StatefulSet", lambda: cluster.children(ns, NAME)["StatefulSet"])[0]
    cluster.patch_spec(ns, NAME, {"decode": {"blockSize": 16}})
    refused = cluster.wait_condition(ns, NAME, "Compatible", "False")
    assert refused["observedGeneration"] == 2
    assert "The running objects from generation 1 were left unchanged." in refused["message"]
    cluster.wait_condition(ns, NAME, "Progressing", "False", "SpecRefused")
    after = cluster.children(ns, NAME)["StatefulSet"][0]
    # Not resourceVersion: the controller manager writes the StatefulSet's status meanwhile. Its spec and
    # generation change only when someone (the operator) writes the spec.
    assert after["metadata"]["generation"] == sts["metadata"]["generation"]
    assert after["spec"] == sts["spec"]
    assert after["metadata"]["annotations"]["disagg.io/generation"] == "1"
    # Fixing the spec converges again.
    cluster.patch_spec(ns, NAME, {"decode": {"blockSize": 32}})
    cluster.wait_condition(ns, NAME, "Compatible", "True")
    wait_for(
        "generation 3 applied",
        lambda: (
            cluster.children(ns, NAME)["StatefulSet"][0]["metadata"]["annotations"]["disagg.io/generation"]
            == "3"
        ),
    )


def test_scaling_and_spec_changes_converge(cluster: Cluster, ns: str) -> None:
    create(cluster, ns, prefill={"replicas": 2})
    wait_for("two prefill instances", lambda: len(cluster.names(ns, NAME)["StatefulSet"]) == 2)
    cluster.patch_spec(ns, NAME, {"prefill": {"replicas": 1}, "decode": {"replicas": 3}})
    wait_for(
        "prefill scaled in (its StatefulSet and Service pruned)",
        lambda: satisfied(
            cluster.names(ns, NAME),
            lambda n: (
                n["StatefulSet"] == ["gemma-prefill-0"]
                and n["Service"] == ["gemma-decode", "gemma-prefill-0", "gemma-router"]
            ),
        ),
    )
    deployment = cluster.apps.read_namespaced_deployment("gemma-decode", ns)
    assert deployment.spec.replicas == 3
    # Another block size needs new pairs: the new revision comes up beside the old one, in the other slot,
    # and the old one stays as it was until the new one serves (no kubelet runs here: it never does).
    cluster.patch_spec(ns, NAME, {"prefill": {"blockSize": 64}, "decode": {"blockSize": 64}})

    def block_size(name: str) -> str:
        sts = cluster.apps.read_namespaced_stateful_set(name, ns)
        args = sts.spec.template.spec.containers[0].args
        return str(args[args.index("--block-size") + 1])

    wait_for(
        "the new revision beside the old",
        lambda: satisfied(
            cluster.names(ns, NAME),
            lambda n: (
                n["StatefulSet"] == ["gemma-b-prefill-0", "gemma-prefill-0"]
                and n["Deployment"] == ["gemma-b-decode", "gemma-decode", "gemma-router"]
            ),
        ),
    )
    assert (block_size("gemma-b-prefill-0"), block_size("gemma-prefill-0")) == ("64", "32")
    progressing = cluster.wait_condition(ns, NAME, "Progressing", "True", "RolloutWaitingForRoutablePairs")
    assert "0/1 prefill engines and 0/3 decoders" in progressing["message"]
    status = (cluster.get(ns, NAME) or {})["status"]
    assert status["oldRevision"] != status["revision"]
    wait_for(
        "Compatible for generation 3",
        lambda: (cluster.condition(ns, NAME, "Compatible") or {}).get("observedGeneration") == 3,
    )


def test_deletion_cleans_up_through_owner_references(cluster: Cluster, ns: str) -> None:
    create(cluster, ns)
    wait_for("children", lambda: cluster.names(ns, NAME)["Deployment"])
    cluster.delete(ns, NAME)
    # The garbage collector learns a CRD's kind from discovery, which can take one resync (30 s).
    wait_for(
        "garbage collection",
        lambda: not any(cluster.names(ns, NAME).values()),
        timeout=90,
    )


def _ready(pod_ip: str, kv: dict[str, Any]) -> dict[str, Any]:
    """What a kubelet (Ready) and the sidecar (its own condition) would write to a pod's status."""
    return {
        "phase": "Running",
        "podIP": pod_ip,
        "conditions": [
            {"type": "Ready", "status": "True"},
            {"type": "ContainersReady", "status": "True"},
            {"type": "disagg.io/kv-transfer-ready", **kv},
        ],
    }


def test_available_and_kv_transfer_ready_follow_the_pods(cluster: Cluster, ns: str) -> None:
    create(cluster, ns)
    pods = wait_for("the pods", lambda: satisfied(cluster.children(ns, NAME)["Pod"], lambda p: len(p) == 4))
    ok = {"status": "True", "reason": "HandshakesSucceeded", "message": "handshook every peer"}
    for index, pod in enumerate(pods):
        cluster.patch_pod_status(ns, pod["metadata"]["name"], _ready(f"10.244.0.{index + 10}", ok))
    cluster.wait_condition(ns, NAME, "KVTransferReady", "True", "HandshakesSucceeded")
    cluster.wait_condition(ns, NAME, "Available", "True", "AllReplicasReady")
    # The rollout includes the router's: complete once its pod is ready too.
    [router] = wait_for("the router pod", lambda: router_pods(cluster, ns))
    cluster.patch_pod_status(
        ns,
        router["metadata"]["name"],
        {
            "phase": "Running",
            "podIP": "10.244.0.9",
            "conditions": [
                {"type": "Ready", "status": "True"},
                {"type": "ContainersReady", "status": "True"},
            ],
        },
    )
    cluster.wait_condition(ns, NAME, "Progressing", "False", "RolloutComplete")

    decode = sorted(
        p["metadata"]["name"] for p in pods if p["metadata"]["labels"]["disagg.io/role"] == "decode"
    )[0]
    fault = {
        "status": "False",
        "reason": "CompatibilityHashMismatch",
        "message": f"decode pod {decode} advertises compatibility hash 1f2e3d, expected 9a8b7c",
    }
    cluster.patch_pod_status(
        ns, "gemma-prefill-0-1", {"conditions": [{"type": "disagg.io/kv-transfer-ready", **fault}]}
    )
    failed = cluster.wait_condition(ns, NAME, "KVTransferReady", "False", "CompatibilityHashMismatch")
    assert failed["message"] == (
        "1 of 4 sidecars report a failed KV handshake: prefill stage 1 (pod gemma-prefill-0-1): "
        f"CompatibilityHashMismatch: decode pod {decode} advertises compatibility hash 1f2e3d, "
        "expected 9a8b7c"
    )
    cluster.patch_pod_status(
        ns, "gemma-prefill-0-1", {"conditions": [{"type": "disagg.io/kv-transfer-ready", **ok}]}
    )
    healed = cluster.wait_condition(ns, NAME, "KVTransferReady", "True", "HandshakesSucceeded")
    assert healed["lastTransitionTime"] >= failed["lastTransitionTime"]


@pytest.fixture(scope="module")
def worker_cluster_role(
    cluster: Cluster, helm: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The chart's worker ClusterRole as release "disagg" names it: the operator's default binding target."""
    chart = str(REPO / "charts" / "disagg")
    rendered = subprocess.run(
        [str(helm), "template", "disagg", chart, "--show-only", "templates/clusterrole-worker.yaml"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert rendered.returncode == 0, rendered.stderr
    role = yaml.safe_load(rendered.stdout)
    assert role["metadata"]["name"] == DEFAULT_WORKER_CLUSTER_ROLE
    path = tmp_path_factory.mktemp("worker-role") / "clusterrole.yaml"
    path.write_text(rendered.stdout)
    applied = cluster.cp.kubectl("apply", "-f", str(path))
    assert applied.returncode == 0, applied.stderr
    try:
        yield DEFAULT_WORKER_CLUSTER_ROLE
    finally:
        cluster.cp.kubectl("delete", "clusterrole", DEFAULT_WORKER_CLUSTER_ROLE, "--ignore-not-found")


def _get(cluster: Cluster, kind: str, ns: str, name: str) -> dict[str, Any] | None:
    proc = cluster.cp.kubectl("get", kind, name, "-n", ns, "-o", "json")
    if proc.returncode != 0:
        assert "NotFound" in proc.stderr, proc.stderr
        return None
    found: dict[str, Any] = json.loads(proc.stdout)
    return found


def _can(cluster: Cluster, user: str, ns: str, verb: str, resource: str) -> str:
    # `can-i patch pods/status` would ask about the pod named "status": a subresource is a flag.
    kind, _, sub = resource.partition("/")
    flags = [f"--subresource={sub}"] if sub else []
    proc = cluster.cp.kubectl("auth", "can-i", verb, kind, *flags, f"--as={user}", "-n", ns)
    return proc.stdout.strip()


def test_sidecars_run_as_their_own_account_with_the_worker_role_in_their_namespace_only(
    cluster: Cluster, ns: str, worker_cluster_role: str
) -> None:
    create(cluster, ns)
    account = "gemma-kv-worker"
    binding = wait_for("the worker RoleBinding", lambda: _get(cluster, "rolebinding", ns, account))
    service_account = wait_for(
        "the worker ServiceAccount", lambda: _get(cluster, "serviceaccount", ns, account)
    )
    body = cluster.get(ns, NAME)
    assert body is not None
    for obj in (binding, service_account):
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"]) == ("DisaggDeployment", NAME, body["metadata"]["uid"])
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": worker_cluster_role,
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": ns}]
    pods = wait_for("the pods", lambda: satisfied(cluster.children(ns, NAME)["Pod"], lambda p: len(p) == 4))
    assert {pod["spec"]["serviceAccountName"] for pod in pods} == {account}

    sidecar = f"system:serviceaccount:{ns}:{account}"
    assert _can(cluster, sidecar, ns, "patch", "pods/status") == "yes"
    assert _can(cluster, sidecar, ns, "list", "pods") == "yes"
    assert _can(cluster, sidecar, ns, "create", "events") == "yes"
    assert _can(cluster, sidecar, ns, "delete", "pods") == "no"
    assert _can(cluster, sidecar, ns, "patch", "pods") == "no"
    assert _can(cluster, sidecar, ns, "get", "secrets") == "no"
    assert _can(cluster, sidecar, "default", "patch", "pods/status") == "no"


ROUTER = "gemma-router"
ROUTER_KINDS = ("serviceaccount", "role", "rolebinding", "service", "deployment")


def router_pods(cluster: Cluster, ns: str) -> list[dict[str, Any]]:
    selector = f"disagg.io/deployment={NAME},disagg.io/component=router"
    response = cluster.core.list_namespaced_pod(ns, label_selector=selector, _preload_content=False)
    items: list[dict[str, Any]] = json.loads(response.data)["items"]
    return items


def _engine_state(cluster: Cluster, ns: str) -> dict[str, Any]:
    """What must not move when only the router changes: the engine objects' specs and the engine pods. (Not a
    Deployment's generation: the API server bumps it when its annotations change, and the operator stamps the
    spec's generation on every child it applies.)"""
    children = cluster.children(ns, NAME)
    state: dict[str, Any] = {
        f"{kind} {item['metadata']['name']}": item.get("spec")
        for kind in ("StatefulSet", "Deployment", "Service")
        for item in children[kind]
        if item["metadata"]["name"] != ROUTER
    }
    state |= {f"ConfigMap {c['metadata']['name']}": c["data"] for c in children["ConfigMap"]}
    state["pods"] = sorted((p["metadata"]["name"], p["metadata"]["uid"]) for p in children["Pod"])
    state["worker binding"] = (_get(cluster, "rolebinding", ns, "gemma-kv-worker") or {}).get("roleRef")
    return state


def test_the_router_is_applied_server_side_and_removed_when_disabled(cluster: Cluster, ns: str) -> None:
    create(cluster, ns)
    router = {
        kind: wait_for(f"the router {kind}", lambda k=kind: _get(cluster, k, ns, ROUTER))
        for kind in ROUTER_KINDS
    }
    body = cluster.get(ns, NAME)
    assert body is not None
    for kind, obj in router.items():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "DisaggDeployment",
            NAME,
            body["metadata"]["uid"],
            True,
        ), kind
        applies = {e["manager"] for e in obj["metadata"]["managedFields"] if e["operation"] == "Apply"}
        assert applies == {"disagg-operator"}, kind
        assert obj["metadata"]["labels"]["disagg.io/component"] == "router", kind
    assert router["role"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert router["rolebinding"]["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": ROUTER,
    }
    assert router["rolebinding"]["subjects"] == [{"kind": "ServiceAccount", "name": ROUTER, "namespace": ns}]
    service = router["service"]["spec"]
    assert service["type"] == "ClusterIP" and service["clusterIP"] not in ("", "None")
    assert service["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    template = router["deployment"]["spec"]["template"]
    assert service["selector"].items() <= template["metadata"]["labels"].items()
    [container] = template["spec"]["containers"]
    assert container["args"] == ["router", "run", "--deployment", NAME, "--namespace", ns, "--port", "8000"]
    # No DISAGG_ROUTER_IMAGE (unless this environment gives the operator one): the sidecar's image.
    assert container["image"] == (os.environ.get("DISAGG_ROUTER_IMAGE") or "ghcr.io/disagg/disagg:0.1.0")
    assert template["spec"]["serviceAccountName"] == ROUTER
    # The controller manager made its pod; it is no engine pod (those carry the instance label).
    [pod] = wait_for("the router pod", lambda: router_pods(cluster, ns))
    assert "disagg.io/role" not in pod["metadata"]["labels"]
    engine_pods = wait_for(
        "the engine pods", lambda: satisfied(cluster.children(ns, NAME)["Pod"], lambda p: len(p) == 4)
    )
    assert pod["metadata"]["name"] not in {p["metadata"]["name"] for p in engine_pods}
    # Its account reads the namespace's pods and does nothing else.
    account = f"system:serviceaccount:{ns}:{ROUTER}"
    for verb in ("get", "list", "watch"):
        assert _can(cluster, account, ns, verb, "pods") == "yes", verb
    for verb, resource in (
        ("patch", "pods"),
        ("patch", "pods/status"),
        ("list", "services"),
        ("get", "secrets"),
    ):
        assert _can(cluster, account, ns, verb, resource) == "no", (verb, resource)
    assert _can(cluster, account, "default", "list", "pods") == "no"
    endpoint = f"http://{ROUTER}.{ns}.svc:8000"
    wait_for(
        "status.endpoint", lambda: (cluster.get(ns, NAME) or {}).get("status", {}).get("endpoint") == endpoint
    )

    before = _engine_state(cluster, ns)
    cluster.patch_spec(ns, NAME, {"router": {"enabled": False}})
    wait_for(
        "the router's objects pruned",
        lambda: all(_get(cluster, kind, ns, ROUTER) is None for kind in ROUTER_KINDS),
    )
    wait_for(
        "no status.endpoint", lambda: "endpoint" not in ((cluster.get(ns, NAME) or {}).get("status") or {})
    )
    compatible = cluster.wait_condition(ns, NAME, "Compatible", "True")
    assert compatible["observedGeneration"] == 2
    assert _engine_state(cluster, ns) == before

    cluster.patch_spec(ns, NAME, {"router": {"enabled": True, "replicas": 2, "port": 9000}})
    deployment = wait_for(
        "the router back with two replicas",
        lambda: satisfied(
            _get(cluster, "deployment", ns, ROUTER), lambda d: d is not None and d["spec"]["replicas"] == 2
        ),
    )
    assert deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] == 9000
    assert (_get(cluster, "service", ns, ROUTER) or {})["spec"]["ports"][0]["port"] == 9000
    wait_for(
        "status.endpoint on the new port",
        lambda: (
            (cluster.get(ns, NAME) or {}).get("status", {}).get("endpoint")
            == f"http://{ROUTER}.{ns}.svc:9000"
        ),
    )
    assert _engine_state(cluster, ns) == before
