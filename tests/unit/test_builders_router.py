"""The router's objects (`spec.router`), the reference engine's pods and what the operator refuses it."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from dd_specs import DELETE, EXAMPLES, load, patched
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes.config import incluster_config
from pydantic import ValidationError

from disagg.operator.api import DisaggDeployment, DisaggDeploymentSpec, EngineKind, RouterSpec
from disagg.operator.builders.children import build
from disagg.operator.builders.engine import HTTP_PORT, MASTER_PORT, stage_dns
from disagg.operator.builders.pod_template import ENGINE_CONTAINER
from disagg.operator.builders.router import ROUTER_CONTAINER, endpoint_of, router_objects
from disagg.operator.builders.topology import TOPOLOGY_KEY
from disagg.operator.control.k8s_apply import CHILD_APIS, _owned_by
from disagg.operator.engine_kind import kind_of_image
from disagg.operator.naming import Installation, Owner
from disagg.operator.plan import model_geometry
from disagg.operator.policies.chain import REFUSAL_CHAIN
from disagg.operator.policies.compat import evaluate
from disagg.operator.policies.reference_engine import (
    REFERENCE_FULL_EVERY,
    REFERENCE_QUERY_HEADS,
    reference_tensor_parallel,
)
from disagg.operator.settings import installation_from_environ
from disagg.operator.status import Workload, compute
from disagg.worker.contracts.pairing import routing_from_pods
from disagg.worker.contracts.pod_contract import POD_CONDITION, ROLE_LABEL, SIDECAR_CONTAINER
from disagg.worker.contracts.topology import decode_topology
from disagg.worker.engine.config import TinyConfig
from disagg.worker.sidecar.config import from_env

OWNER = Owner(name="gemma-pp2", namespace="ns1", uid="0f0e-uid", generation=7)
REFERENCE = EXAMPLES / "reference-pp2-hma.yaml"
TRANSFER_IMAGE = "ghcr.io/disagg/disagg-transfer:0.1.0"
NO_DEFAULTS = Installation()


def gemma(patch: dict[str, Any] | None = None) -> DisaggDeploymentSpec:
    document = load(EXAMPLES / "pp2-hma.yaml")
    return DisaggDeployment.model_validate(patched(document, {"spec": patch or {}})).spec


def reference(patch: dict[str, Any] | None = None) -> DisaggDeploymentSpec:
    return DisaggDeployment.model_validate(patched(load(REFERENCE), {"spec": patch or {}})).spec


def built(
    spec: DisaggDeploymentSpec, installation: Installation = NO_DEFAULTS, owner: Owner = OWNER
) -> dict[tuple[str, str], dict[str, Any]]:
    report = evaluate(spec, REFUSAL_CHAIN, installation)
    assert report.compatible and report.plan is not None, report.violations
    objects = build(spec, owner, report.plan, report.hashes, installation)
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def router_pod(objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    template: dict[str, Any] = objects["Deployment", "gemma-pp2-router"]["spec"]["template"]
    return template


def containers(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in workload["spec"]["template"]["spec"]["containers"]}


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}


def reasons(spec: DisaggDeploymentSpec) -> list[str]:
    return evaluate(spec, REFUSAL_CHAIN, Installation()).reasons


ROUTER_KEYS = [
    ("ServiceAccount", "gemma-pp2-router"),
    ("Role", "gemma-pp2-router"),
    ("RoleBinding", "gemma-pp2-router"),
    ("Service", "gemma-pp2-router"),
    ("Deployment", "gemma-pp2-router"),
]


# ---- spec.router -------------------------------------------------------------------------------------------


def test_the_router_defaults_keep_every_committed_example_valid() -> None:
    assert RouterSpec() == RouterSpec(enabled=True, replicas=1, port=8000)
    for path in sorted(EXAMPLES.glob("*.yaml")):
        document = load(path)
        assert "router" not in document["spec"] or path == REFERENCE
        assert DisaggDeployment.model_validate(document).spec.router.enabled


@pytest.mark.parametrize(
    "router", [{"replicas": 65}, {"replicas": -1}, {"port": 80}, {"port": 65536}, {"image": ""}, {"x": 1}]
)
def test_router_fields_are_bounded(router: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        gemma({"router": router})


# ---- the router's objects ----------------------------------------------------------------------------------


def test_an_enabled_router_is_five_owned_objects_after_the_engines() -> None:
    objects = built(gemma())
    assert list(objects)[-5:] == ROUTER_KEYS
    for key in ROUTER_KEYS:
        metadata = objects[key]["metadata"]
        assert metadata["namespace"] == "ns1"
        assert metadata["labels"] == {
            "app.kubernetes.io/name": "disagg",
            "app.kubernetes.io/instance": "gemma-pp2",
            "app.kubernetes.io/managed-by": "disagg-operator",
            "app.kubernetes.io/part-of": "disagg",
            "app.kubernetes.io/component": "router",
            "disagg.io/deployment": "gemma-pp2",
            "disagg.io/component": "router",
        }
        assert metadata["annotations"] == {"disagg.io/generation": "7", "disagg.io/deployment": "gemma-pp2"}
        assert [ref["uid"] for ref in metadata["ownerReferences"]] == ["0f0e-uid"]
        # Every kind is one the reconcile lists and prunes.
        assert key[0] in CHILD_APIS


def test_the_routers_role_reads_pods_and_nothing_else_and_binds_its_own_account() -> None:
    objects = built(gemma())
    role = objects["Role", "gemma-pp2-router"]
    assert role["apiVersion"] == "rbac.authorization.k8s.io/v1"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = objects["RoleBinding", "gemma-pp2-router"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "gemma-pp2-router",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gemma-pp2-router", "namespace": "ns1"}]
    assert router_pod(objects)["spec"]["serviceAccountName"] == "gemma-pp2-router"


def test_the_service_sends_its_http_port_to_the_router_pods() -> None:
    objects = built(gemma({"router": {"port": 9000}}))
    service = objects["Service", "gemma-pp2-router"]["spec"]
    assert service["type"] == "ClusterIP" and "clusterIP" not in service
    assert service["ports"] == [{"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]
    template = router_pod(objects)
    assert service["selector"].items() <= template["metadata"]["labels"].items()
    [container] = template["spec"]["containers"]
    assert container["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]


def test_the_router_deployment_runs_disagg_router_run_unprivileged_with_probes() -> None:
    objects = built(
        gemma(
            {
                "router": {
                    "replicas": 3,
                    "resources": {"requests": {"cpu": 1}, "limits": {"memory": "256Mi"}},
                    "scheduling": {
                        "nodeSelector": {"pool": "cpu"},
                        "tolerations": [{"key": "k", "operator": "Exists"}],
                        "affinity": {"podAntiAffinity": {}},
                    },
                }
            }
        ),
        Installation(router_image="registry.example/disagg:1.0"),
    )
    deployment = objects["Deployment", "gemma-pp2-router"]
    assert deployment["apiVersion"] == "apps/v1" and deployment["spec"]["replicas"] == 3
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector == {"disagg.io/deployment": "gemma-pp2", "disagg.io/component": "router"}
    template = deployment["spec"]["template"]
    assert selector.items() <= template["metadata"]["labels"].items()
    pod = template["spec"]
    [container] = pod["containers"]
    assert container["name"] == ROUTER_CONTAINER == "router"
    assert container["image"] == "registry.example/disagg:1.0"
    assert container["command"] == ["disagg"]
    assert container["args"] == [
        "router",
        "run",
        "--deployment",
        "gemma-pp2",
        "--namespace",
        "ns1",
        "--port",
        "8000",
    ]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    # A loaded node must not restart a serving router (and drop its streams) for one slow answer.
    alive = container["livenessProbe"]
    assert alive["periodSeconds"] * alive["failureThreshold"] >= 60 and alive["timeoutSeconds"] >= 10
    assert container["resources"] == {"requests": {"cpu": "1"}, "limits": {"memory": "256Mi"}}
    context = container["securityContext"]
    assert context["runAsNonRoot"] is True and context["runAsUser"] != 0
    assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["nodeSelector"] == {"pool": "cpu"}
    assert pod["tolerations"] == [{"key": "k", "operator": "Exists"}]
    assert pod["affinity"] == {"podAntiAffinity": {}}
    assert "readinessGates" not in pod


def test_the_router_gets_its_own_projected_token_as_the_sidecar_does() -> None:
    objects = built(gemma())
    pod = router_pod(objects)["spec"]
    assert pod["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    sidecar_pod = objects["Deployment", "gemma-pp2-decode"]["spec"]["template"]["spec"]
    assert volumes["kube-api-access"] == {v["name"]: v for v in sidecar_pod["volumes"]}["kube-api-access"]
    [container] = pod["containers"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    token_dir = str(Path(incluster_config.SERVICE_TOKEN_FILENAME).parent)
    assert mounts[token_dir] == {"name": "kube-api-access", "mountPath": token_dir, "readOnly": True}
    assert mounts["/tmp"]["name"] in volumes  # the one writable path under the read-only root


def test_router_pods_are_not_engine_pods() -> None:
    """The operator's pod listing (and kopf's pod watch) select engine pods; a router pod must not match."""
    labels = router_pod(built(gemma()))["metadata"]["labels"]
    selector = dict(term.split("=", 1) for term in _owned_by("gemma-pp2").split(","))
    assert not selector.items() <= labels.items()
    assert ROLE_LABEL not in labels


def test_the_image_is_the_specs_then_the_installations_then_the_sidecars() -> None:
    def image(spec: DisaggDeploymentSpec, installation: Installation) -> str:
        [container] = router_pod(built(spec, installation))["spec"]["containers"]
        return str(container["image"])

    installed = Installation(router_image="op:1")
    assert image(gemma({"router": {"image": "mine:2"}}), installed) == "mine:2"
    assert image(gemma(), installed) == "op:1"
    assert image(gemma(), Installation()) == "ghcr.io/disagg/disagg:0.1.0"  # the example's worker.image
    assert installation_from_environ({"DISAGG_ROUTER_IMAGE": "op:3"}).router_image == "op:3"
    assert installation_from_environ({"DISAGG_ROUTER_IMAGE": ""}).router_image is None


def test_a_disabled_router_builds_nothing_and_changes_nothing_else() -> None:
    enabled = built(gemma())
    disabled = built(gemma({"router": {"enabled": False, "replicas": 4, "image": "x:1"}}))
    assert set(enabled) - set(disabled) == set(ROUTER_KEYS)
    assert disabled == {key: obj for key, obj in enabled.items() if key not in ROUTER_KEYS}
    assert router_objects(gemma({"router": {"enabled": False}}), OWNER, Installation()) == []


def test_the_endpoint_is_read_from_the_router_service_that_exists() -> None:
    objects = list(built(gemma({"router": {"port": 8080}})).values())
    assert endpoint_of(objects) == "http://gemma-pp2-router.ns1.svc:8080"
    assert endpoint_of([o for o in objects if o["metadata"]["name"] != "gemma-pp2-router"]) is None


def _workload(name: str, role: str, desired: int, ready: int) -> Workload:
    return Workload("Deployment", name, role, desired, desired, ready, desired, True, 7)


def test_available_counts_the_engines_and_progressing_waits_for_the_router() -> None:
    report = evaluate(gemma())
    engines = [
        _workload("gemma-pp2-prefill-0", "prefill", 2, 2),
        _workload("gemma-pp2-decode", "decode", 2, 2),
    ]
    router = _workload("gemma-pp2-router", "router", 1, 0)
    status = compute(
        generation=7,
        previous=(),
        violations=(),
        report=report,
        workloads=[*engines, router],
        pods=[],
        routing=routing_from_pods([]),
        reported=False,
        now=datetime(2026, 12, 1, tzinfo=UTC),
        endpoint="http://gemma-pp2-router.ns1.svc:8000",
    )
    conditions = {c.type: c for c in status.conditions or ()}
    assert (conditions["Available"].status, conditions["Available"].reason) == ("True", "AllReplicasReady")
    assert conditions["Progressing"].reason == "Creating"
    assert "gemma-pp2-router 0/1 ready" in conditions["Progressing"].message
    assert status.endpoint == "http://gemma-pp2-router.ns1.svc:8000"
    assert status.decode is not None and status.decode.replicas == 2


# ---- the reference engine's pods ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ("ghcr.io/disagg/disagg-transfer:0.1.0", True),
        ("disagg-transfer", True),
        ("localhost:5000/team/disagg-transfer@sha256:" + "0" * 64, True),
        ("registry.example:5000/disagg-transfer:1.2", True),
        ("ghcr.io/disagg/disagg:0.1.0", False),
        ("ghcr.io/disagg/disagg-transfer-dev:1", False),
        ("ghcr.io/disagg-transfer/engine:1", False),
        ("vllm/vllm-openai:v0.33.0", False),
    ],
)
def test_the_reference_engine_is_recognised_by_its_repository_name(image: str, expected: bool) -> None:
    assert (kind_of_image(image) is EngineKind.REFERENCE) is expected


def _reference_objects(patch: dict[str, Any] | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    return built(reference(patch), owner=Owner("tiny-pp2", "ns1", "u", 1))


def test_reference_pods_run_disagg_engine_serve_beside_the_transfer_sidecar() -> None:
    objects = _reference_objects({"engine": {"extraArgs": ["--num-blocks", "64"]}})
    head = stage_dns("tiny-pp2-prefill-0", "tiny-pp2-prefill-0", "ns1")
    assert head == "tiny-pp2-prefill-0-0.tiny-pp2-prefill-0.ns1.svc"
    expected = {
        ("StatefulSet", "tiny-pp2-prefill-0"): [
            "engine",
            "serve",
            "--port",
            str(HTTP_PORT),
            "--master-addr",
            head,
            "--master-port",
            str(MASTER_PORT),
            "--num-blocks",
            "64",
        ],
        ("Deployment", "tiny-pp2-decode"): ["engine", "serve", "--port", "8000", "--num-blocks", "64"],
    }
    for key, args in expected.items():
        pod = containers(objects[key])
        engine, sidecar = pod[ENGINE_CONTAINER], pod[SIDECAR_CONTAINER]
        assert engine["image"] == TRANSFER_IMAGE
        assert engine["command"] == ["disagg"] and engine["args"] == args
        assert engine["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
        assert sidecar["args"] == ["worker", "sidecar", "--mode", "transfer"]
        # The engine advertises the hash its sidecar checks peers against.
        assert env(engine)["DISAGG_COMPATIBILITY_HASH"] == env(sidecar)["DISAGG_COMPATIBILITY_HASH"]
        assert objects[key]["spec"]["template"]["spec"]["readinessGates"] == [
            {"conditionType": POD_CONDITION}
        ]
    decode_engine = containers(objects["Deployment", "tiny-pp2-decode"])[ENGINE_CONTAINER]
    assert decode_engine["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    # Only the head of a PP engine serves HTTP; a probe on the stages' shared template would fail stage 1.
    assert "readinessProbe" not in containers(objects["StatefulSet", "tiny-pp2-prefill-0"])[ENGINE_CONTAINER]


def test_a_pp1_reference_prefill_has_no_rendezvous() -> None:
    objects = _reference_objects({"prefill": {"pipelineParallelSize": 1}})
    engine = containers(objects["StatefulSet", "tiny-pp2-prefill-0"])[ENGINE_CONTAINER]
    assert engine["args"] == ["engine", "serve", "--port", "8000"]


@pytest.mark.parametrize(
    ("key", "pod", "rank"),
    [("StatefulSet", "tiny-pp2-prefill-0-1", 1), ("Deployment", "tiny-pp2-decode-7c-x", 0)],
)
def test_the_engine_containers_environment_configures_it_as_its_sidecar(
    tmp_path: Path, key: str, pod: str, rank: int
) -> None:
    objects = _reference_objects()
    name = "tiny-pp2-prefill-0" if key == "StatefulSet" else "tiny-pp2-decode"
    engine = containers(objects[key, name])[ENGINE_CONTAINER]
    sidecar = containers(objects[key, name])[SIDECAR_CONTAINER]
    topology = tmp_path / TOPOLOGY_KEY
    topology.write_text(objects["ConfigMap", "tiny-pp2-topology"]["data"][TOPOLOGY_KEY])

    def resolved(container: dict[str, Any]) -> dict[str, str]:
        # What the kubelet resolves from the downward API, then the builders' literal values.
        variables = {"POD_NAME": pod, "POD_IP": "10.0.0.9"}
        variables |= {k: v for k, v in env(container).items() if isinstance(v, str)}
        variables["DISAGG_TOPOLOGY_FILE"] = str(topology)
        return variables

    engine_config, sidecar_config = from_env(resolved(engine)), from_env(resolved(sidecar))
    assert engine_config.pp_rank == sidecar_config.pp_rank == rank
    assert engine_config.engine_id == sidecar_config.engine_id
    assert engine_config.compat_hash == sidecar_config.compat_hash is not None
    assert engine_config.engine_socket == sidecar_config.engine_socket
    assert engine_config.topology.block_size == 16


# ---- what the reference engine cannot run ------------------------------------------------------------------


def test_the_reference_example_is_accepted_and_is_the_reference_models_geometry() -> None:
    spec = reference()
    assert reasons(spec) == []
    tiny = TinyConfig()
    assert model_geometry(spec) == tiny.geometry
    assert spec.prefill.block_size == spec.decode.block_size == tiny.block_size


REFUSALS = [
    ({"prefill": {"tensorParallelSize": 2}}, "spec.prefill.tensorParallelSize"),
    ({"decode": {"tensorParallelSize": 2}}, "spec.decode.tensorParallelSize"),
    ({"model": {"dtype": "bfloat16"}}, "float32"),
    (
        {"decode": {"overrides": {"dtype": "float16"}}, "prefill": {"overrides": {"dtype": "float16"}}},
        "float32",
    ),
    ({"model": {"kvCacheDtype": "fp8"}}, "kvCacheDtype"),
    (
        {"model": {"layerPattern": DELETE, "attentionKinds": ["Full", "SlidingWindow"] * 4 + ["Full"]}},
        "layerPattern",
    ),
    ({"model": {"layerPattern": {"fullEvery": 3, "otherKind": "MLA"}}}, "layerPattern"),
    ({"model": {"layerPattern": {"fullEvery": 1}}}, "layerPattern"),
    ({"model": {"layerPattern": {"fullEvery": 6}}}, "layerPattern"),
    ({"engine": {"hybridKvCacheManager": "Disabled"}}, "hybridKvCacheManager"),
    (
        {"model": {"layerPattern": DELETE}, "engine": {"hybridKvCacheManager": "Disabled"}},
        "hybridKvCacheManager",
    ),
    ({"prefill": {"layerPartition": [4, 5]}}, "layerPartition"),
    ({"model": {"numKvHeads": 3}}, "numKvHeads"),
    ({"model": {"headSize": 15}}, "headSize"),
    ({"model": {"layerNameTemplate": "layers.{i}.attn"}}, "layerNameTemplate"),
    ({"engine": {"kvCacheLayout": "BlockOutermost"}}, "kvCacheLayout"),
    ({"engine": {"extraArgs": ["--max-model-len", "512"]}}, "--max-model-len"),
    ({"decode": {"extraArgs": ["--num-blocks", "1"]}}, "--num-blocks"),
    ({"decode": {"extraArgs": [f"--num-blocks={(1 << 20) + 1}"]}}, "--num-blocks"),
    ({"prefill": {"extraArgs": ["--num-blocks"]}}, "--num-blocks"),
    ({"prefill": {"extraArgs": ["--master-port", "1"]}}, "--master-port"),
]


@pytest.mark.parametrize(("patch", "named"), REFUSALS, ids=[named for _, named in REFUSALS])
def test_what_the_reference_engine_cannot_run_is_refused_before_any_pod(
    patch: dict[str, Any], named: str
) -> None:
    report = evaluate(reference(patch), REFUSAL_CHAIN, Installation())
    refusals = [v for v in report.violations if v.reason == "ReferenceEngineUnsupported"]
    assert refusals, report.violations
    assert any(named in v.message and "reference engine" in v.message for v in refusals), refusals


def test_a_pull_connector_is_refused_for_the_reference_engine() -> None:
    found = [
        v.message
        for v in evaluate(
            reference({"kvTransfer": {"connector": "Pull"}, "prefill": {"pipelineParallelSize": 1}}),
            REFUSAL_CHAIN,
            Installation(),
        ).violations
        if v.reason == "ReferenceEngineUnsupported"
    ]
    assert found and "connector to Push" in found[0]


@pytest.mark.parametrize(
    "patch",
    [
        {"engine": {"extraArgs": ["--num-blocks=128"]}},
        {"decode": {"extraArgs": ["--num-blocks", "2"]}},
        {"model": {"layerPattern": DELETE, "attentionKinds": ["SlidingWindow", "SlidingWindow", "Full"] * 3}},
        {"prefill": {"layerPartition": [5, 4]}},
        {"model": {"numKvHeads": 4, "headSize": 8, "numLayers": 12}},
        {"prefill": {"blockSize": 32}, "decode": {"blockSize": 32, "replicas": 1}},
        {"prefill": {"pipelineParallelSize": 3, "layerPartition": [3, 3, 3]}},
    ],
)
def test_what_the_reference_engine_honours_is_accepted(patch: dict[str, Any]) -> None:
    assert reasons(reference(patch)) == []


def test_the_same_spec_of_another_engine_kind_is_not_judged_as_the_reference_engine() -> None:
    other = {
        "engine": {"image": "registry.example/my-engine:1", "kind": "Custom"},
        "prefill": {"tensorParallelSize": 2},
    }
    assert "ReferenceEngineUnsupported" not in reasons(reference(other))
    # Without the kind, the image's name decides: one that names no engine is a custom one.
    unnamed = {
        "engine": {"image": "registry.example/my-engine:1", "kind": DELETE},
        "prefill": {"tensorParallelSize": 2},
    }
    assert "ReferenceEngineUnsupported" not in reasons(reference(unnamed))
    # The reference engine under a mirrored name is judged as one when the spec says so.
    mirrored = {"engine": {"image": "registry.corp/ml/inference:1"}, "prefill": {"tensorParallelSize": 2}}
    assert "ReferenceEngineUnsupported" in reasons(reference(mirrored))
    assert reference_tensor_parallel("prefill", 1) is None


@given(
    num_layers=st.integers(1, 40),
    kv_heads=st.sampled_from([1, 2, 4]),
    half_head=st.integers(1, 32),
    pp_size=st.integers(1, 4),
    block_size=st.integers(1, 64),
)
@settings(max_examples=40, deadline=None)
def test_every_accepted_geometry_is_one_the_reference_engine_serves(
    num_layers: int, kv_heads: int, half_head: int, pp_size: int, block_size: int
) -> None:
    """What the operator accepts, `disagg engine serve` builds its model from: its own check of the topology
    the operator writes (`settings.model_config`) passes for both roles."""
    from disagg.worker.engine.settings import model_config

    spec = reference(
        {
            "model": {"numLayers": num_layers, "numKvHeads": kv_heads, "headSize": 2 * half_head},
            "prefill": {"blockSize": block_size, "pipelineParallelSize": min(pp_size, num_layers)},
            "decode": {"blockSize": block_size},
        }
    )
    assert reasons(spec) == []
    objects = built(spec, owner=Owner("tiny-pp2", "ns1", "u", 1))
    topology = decode_topology(json.loads(objects["ConfigMap", "tiny-pp2-topology"]["data"][TOPOLOGY_KEY]))
    for role in ("prefill", "decode"):
        assert model_config(topology, role).geometry == model_geometry(spec)


def test_the_policy_constants_are_the_reference_models() -> None:
    tiny = TinyConfig()
    assert (tiny.num_heads, tiny.full_every) == (REFERENCE_QUERY_HEADS, REFERENCE_FULL_EVERY)
