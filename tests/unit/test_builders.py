"""Pure manifest builders: workloads, services, topology ConfigMap, sidecar and the vLLM engine args."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from dd_specs import DELETE, spec, spec_dict
from hypothesis import given
from hypothesis import strategies as st
from kubernetes.config import incluster_config

from disagg.operator.api import DisaggDeploymentSpec
from disagg.operator.builders.children import build
from disagg.operator.builders.engine import arg_violations, engine_container, is_vllm_image
from disagg.operator.builders.pod_template import ENGINE_CONTAINER
from disagg.operator.builders.topology import TOPOLOGY_KEY
from disagg.operator.control.reconcile import judge
from disagg.operator.naming import MAX_CHILD_NAME, Installation, Owner, child_name, label_value
from disagg.operator.policies.compat import evaluate
from disagg.operator.policies.pods import worker_image_violations
from disagg.worker.kv.pod_contract import POD_CONDITION, SIDECAR_CONTAINER
from disagg.worker.kv.topology import decode_topology
from disagg.worker.reporting.status_loop import SERVICE_ACCOUNT_TOKEN
from disagg.worker.sidecar.config import from_env

OWNER = Owner(name="gemma-pp2", namespace="ns1", uid="0f0e-uid", generation=7)
CHART_DEFAULT = Installation()


def objects(
    model: DisaggDeploymentSpec, owner: Owner = OWNER, installation: Installation = CHART_DEFAULT
) -> dict[tuple[str, str], dict[str, Any]]:
    report = evaluate(model)
    assert report.compatible and report.plan is not None, report.violations
    built = build(model, owner, report.plan, report.hashes, installation)
    return {(o["kind"], o["metadata"]["name"]): o for o in built}


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = obj["spec"]["template"]["spec"]
    return result


def container(obj: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod_spec(obj)["containers"] if c["name"] == name)


def env(c: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in c["env"]}


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


class TestObjectSet:
    def test_example_builds_topology_services_and_workloads(self) -> None:
        assert list(objects(spec())) == [
            ("ConfigMap", "gemma-pp2-topology"),
            ("ServiceAccount", "gemma-pp2-kv-worker"),
            ("RoleBinding", "gemma-pp2-kv-worker"),
            ("Service", "gemma-pp2-prefill-0"),
            ("StatefulSet", "gemma-pp2-prefill-0"),
            ("Service", "gemma-pp2-decode"),
            ("Deployment", "gemma-pp2-decode"),
            ("ServiceAccount", "gemma-pp2-router"),
            ("Role", "gemma-pp2-router"),
            ("RoleBinding", "gemma-pp2-router"),
            ("Service", "gemma-pp2-router"),
            ("Deployment", "gemma-pp2-router"),
        ]

    @pytest.mark.parametrize("replicas", [0, 1, 3])
    def test_one_statefulset_and_headless_service_per_prefill_replica(self, replicas: int) -> None:
        built = objects(spec({"prefill": {"replicas": replicas}}))
        sets = [name for kind, name in built if kind == "StatefulSet"]
        assert sets == [f"gemma-pp2-prefill-{r}" for r in range(replicas)]
        for name in sets:
            assert built["Service", name]["spec"]["clusterIP"] == "None"
            assert built["StatefulSet", name]["spec"]["serviceName"] == name

    def test_every_object_is_owned_labelled_and_stamped(self) -> None:
        for obj in objects(spec()).values():
            metadata = obj["metadata"]
            assert metadata["namespace"] == "ns1"
            assert metadata["ownerReferences"] == [
                {
                    "apiVersion": "disagg.io/v1alpha1",
                    "kind": "DisaggDeployment",
                    "name": "gemma-pp2",
                    "uid": "0f0e-uid",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
            assert metadata["labels"]["app.kubernetes.io/instance"] == "gemma-pp2"
            assert metadata["labels"]["app.kubernetes.io/managed-by"] == "disagg-operator"
            assert metadata["labels"]["app.kubernetes.io/name"] == "disagg"
            assert metadata["annotations"]["disagg.io/generation"] == "7"

    def test_without_a_uid_nothing_is_owned_and_nothing_else_differs(self) -> None:
        # `disagg plan` builds from a file, which has no uid: the operator adds the reference.
        unowned = objects(spec(), Owner(name="gemma-pp2", namespace="ns1", uid=None, generation=7))
        owned = objects(spec())
        assert all("ownerReferences" not in obj["metadata"] for obj in unowned.values())
        for key, obj in owned.items():
            metadata = {k: v for k, v in obj["metadata"].items() if k != "ownerReferences"}
            assert unowned[key] == {**obj, "metadata": metadata}

    def test_build_is_deterministic(self) -> None:
        assert objects(spec()) == objects(spec())

    def test_topology_configmap_carries_the_plan_and_hashes(self) -> None:
        model = spec()
        report = evaluate(model)
        document = json.loads(objects(model)["ConfigMap", "gemma-pp2-topology"]["data"][TOPOLOGY_KEY])
        assert report.plan is not None
        assert document["stages"] == report.plan.to_dict()["stages"]
        assert document["compatibilityHashes"] == dict(report.hashes)
        assert [s["endLayer"] - s["startLayer"] for s in document["stages"]] == [31, 31]
        assert document["blockSize"] == 32 and document["kvLeaseDurationSeconds"] == 120
        kinds = document["model"]["layerKinds"]
        assert len(kinds) == 62 and kinds[:6] == ["sliding_window"] * 5 + ["full"]
        assert document["model"]["numKVHeads"] == 16 and document["model"]["dtypeBytes"] == 2

    def test_the_sidecar_accepts_the_topology_document(self) -> None:
        document = objects(spec())["ConfigMap", "gemma-pp2-topology"]["data"][TOPOLOGY_KEY]
        topology = decode_topology(json.loads(document))
        assert topology.block_size == 32

    def test_service_ports_name_their_protocol(self) -> None:
        # Server-side apply on 1.20 refuses Service ports without protocol (list-map key).
        service = objects(spec())["Service", "gemma-pp2-decode"]
        assert {(p["name"], p["port"], p["protocol"]) for p in service["spec"]["ports"]} == {
            ("http", 8000, "TCP"),
            ("side-channel", 5600, "TCP"),
        }
        assert service["spec"]["publishNotReadyAddresses"] is True


class TestStatefulSet:
    def test_one_pod_per_stage_started_together(self) -> None:
        sts = objects(spec({"prefill": {"replicas": 2}}))["StatefulSet", "gemma-pp2-prefill-1"]
        assert sts["apiVersion"] == "apps/v1"
        assert sts["spec"]["replicas"] == 2
        assert sts["spec"]["podManagementPolicy"] == "Parallel"

    def test_selector_is_in_template_labels_and_distinguishes_replicas(self) -> None:
        built = objects(spec({"prefill": {"replicas": 2}}))
        selectors = []
        for replica in (0, 1):
            sts = built["StatefulSet", f"gemma-pp2-prefill-{replica}"]
            selector = sts["spec"]["selector"]["matchLabels"]
            assert selector.items() <= sts["spec"]["template"]["metadata"]["labels"].items()
            assert built["Service", f"gemma-pp2-prefill-{replica}"]["spec"]["selector"] == selector
            selectors.append(selector)
        assert selectors[0] != selectors[1]

    def test_selector_does_not_change_with_the_spec(self) -> None:
        one = objects(spec())["StatefulSet", "gemma-pp2-prefill-0"]["spec"]["selector"]
        other = objects(
            spec({"prefill": {"replicas": 1, "tensorParallelSize": 4}, "decode": {"replicas": 3}})
        )
        assert other["StatefulSet", "gemma-pp2-prefill-0"]["spec"]["selector"] == one


class TestDeployment:
    @pytest.mark.parametrize("replicas", [0, 2, 5])
    def test_decode_replicas(self, replicas: int) -> None:
        deployment = objects(spec({"decode": {"replicas": replicas}}))["Deployment", "gemma-pp2-decode"]
        assert deployment["apiVersion"] == "apps/v1"
        assert deployment["spec"]["replicas"] == replicas
        assert deployment["spec"]["selector"]["matchLabels"]["disagg.io/role"] == "decode"


class TestWorkerAccess:
    def test_every_engine_pod_runs_as_the_deployments_worker_account(self) -> None:
        built = objects(spec({"prefill": {"replicas": 2}}))
        workloads = [
            obj
            for (kind, name), obj in built.items()
            if kind in ("StatefulSet", "Deployment") and name != "gemma-pp2-router"
        ]
        assert len(workloads) == 3
        assert {pod_spec(obj)["serviceAccountName"] for obj in workloads} == {"gemma-pp2-kv-worker"}
        assert built["ServiceAccount", "gemma-pp2-kv-worker"]["metadata"]["namespace"] == "ns1"

    def test_the_rolebinding_grants_the_installations_cluster_role_in_the_namespace_only(self) -> None:
        binding = objects(spec(), installation=Installation(worker_cluster_role="rel-disagg-worker"))[
            "RoleBinding", "gemma-pp2-kv-worker"
        ]
        assert binding["apiVersion"] == "rbac.authorization.k8s.io/v1"
        assert binding["metadata"]["namespace"] == "ns1"
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "rel-disagg-worker",
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "gemma-pp2-kv-worker", "namespace": "ns1"}
        ]

    def test_the_cluster_role_comes_from_the_environment(self) -> None:
        assert Installation.from_environ({}).worker_cluster_role == "disagg-worker"
        assert (
            Installation.from_environ({"DISAGG_WORKER_CLUSTERROLE": ""}).worker_cluster_role
            == "disagg-worker"
        )
        named = Installation.from_environ({"DISAGG_WORKER_CLUSTERROLE": "ops-disagg-worker"})
        assert named.worker_cluster_role == "ops-disagg-worker"

    def test_long_owner_names_give_a_valid_account_name(self) -> None:
        owner = Owner(name="m" * 120, namespace="ns1", uid="u", generation=1)
        built = objects(spec(), owner)
        [account] = [name for kind, name in built if kind == "ServiceAccount" and "kv-worker" in name]
        assert len(account) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", account)
        assert ("RoleBinding", account) in built


class TestSidecarImage:
    def test_a_spec_without_a_worker_gets_the_installations_image(self) -> None:
        bare = spec({"worker": DELETE})
        assert bare.worker.image is None and bare.worker.metrics_port == 9400
        built = objects(bare, installation=Installation(worker_image="registry.example/worker:2.0"))
        for key in (("StatefulSet", "gemma-pp2-prefill-0"), ("Deployment", "gemma-pp2-decode")):
            assert container(built[key], SIDECAR_CONTAINER)["image"] == "registry.example/worker:2.0"

    def test_the_specs_image_wins_over_the_installations(self) -> None:
        built = objects(spec(), installation=Installation(worker_image="registry.example/worker:2.0"))
        sidecar = container(built["Deployment", "gemma-pp2-decode"], SIDECAR_CONTAINER)
        assert sidecar["image"] == "ghcr.io/disagg/disagg:0.1.0"

    def test_the_default_image_comes_from_the_environment(self) -> None:
        assert Installation.from_environ({}).worker_image is None
        assert Installation.from_environ({"DISAGG_WORKER_IMAGE": "w:1"}).worker_image == "w:1"
        assert Installation.from_environ({}).transfer_image is None
        assert Installation.from_environ({"DISAGG_TRANSFER_IMAGE": "t:1"}).transfer_image == "t:1"

    def test_the_watch_sidecar_gets_the_light_image_and_the_transfer_sidecar_the_transfer_image(self) -> None:
        both = Installation(worker_image="r/disagg:1", transfer_image="r/disagg-transfer:1")
        vllm = objects(spec({"worker": DELETE}), installation=both)
        assert container(vllm["Deployment", "gemma-pp2-decode"], SIDECAR_CONTAINER)["image"] == "r/disagg:1"
        reference = spec({"worker": DELETE, "engine": {"image": "r/disagg-transfer:1"}})
        built = objects(reference, installation=both)
        sidecar = container(built["Deployment", "gemma-pp2-decode"], SIDECAR_CONTAINER)
        assert sidecar["args"][-1] == "transfer" and sidecar["image"] == "r/disagg-transfer:1"
        # Either default stands in for the other when it is the only one set.
        only_light = objects(reference, installation=Installation(worker_image="r/disagg:1"))
        assert (
            container(only_light["Deployment", "gemma-pp2-decode"], SIDECAR_CONTAINER)["image"]
            == "r/disagg:1"
        )
        only_transfer = objects(spec({"worker": DELETE}), installation=Installation(transfer_image="t:1"))
        assert container(only_transfer["Deployment", "gemma-pp2-decode"], SIDECAR_CONTAINER)["image"] == "t:1"

    def test_with_no_image_anywhere_the_spec_is_refused_and_nothing_is_built(self) -> None:
        bare = spec({"worker": DELETE})
        [violation] = worker_image_violations(bare, Installation())
        assert violation.reason == "WorkerImageMissing"
        assert "spec.worker.image" in violation.message and "DISAGG_WORKER_IMAGE" in violation.message
        assert worker_image_violations(bare, Installation(worker_image="w:1")) == []
        assert worker_image_violations(spec(), Installation()) == []
        verdict = judge(spec_dict(bare), Installation())
        assert [v.reason for v in verdict.violations] == ["WorkerImageMissing"]
        report = evaluate(bare)
        assert report.plan is not None
        with pytest.raises(ValueError, match="no sidecar image"):
            build(bare, OWNER, report.plan, report.hashes, Installation())


class TestSidecar:
    @pytest.mark.parametrize(
        "key", [("StatefulSet", "gemma-pp2-prefill-0"), ("Deployment", "gemma-pp2-decode")]
    )
    def test_identity_gate_memory_and_capabilities(self, key: tuple[str, str]) -> None:
        workload = objects(spec())[key]
        sidecar = container(workload, SIDECAR_CONTAINER)
        variables = env(sidecar)
        assert variables["POD_IP"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}
        assert variables["POD_NAME"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}
        assert variables["DISAGG_ROLE"] == workload["metadata"]["labels"]["app.kubernetes.io/component"]
        assert variables["DISAGG_COMPATIBILITY_HASH"] == evaluate(spec()).hashes[variables["DISAGG_ROLE"]]
        # The vLLM engine moves the KV, so the sidecar only watches: non-root, nothing added.
        assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert sidecar["image"] == "ghcr.io/disagg/disagg:0.1.0"
        assert pod_spec(workload)["readinessGates"] == [{"conditionType": POD_CONDITION}]
        volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
        assert volumes["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory"}}
        assert volumes["topology"]["configMap"]["name"] == "gemma-pp2-topology"
        for c in pod_spec(workload)["containers"]:
            assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]

    def test_vllm_engine_moves_the_kv_so_it_gets_rdma_and_the_side_channel(self) -> None:
        workload = objects(spec())["Deployment", "gemma-pp2-decode"]
        engine, sidecar = container(workload, ENGINE_CONTAINER), container(workload, SIDECAR_CONTAINER)
        assert engine["resources"]["limits"] == {"nvidia.com/gpu": "2", "rdma/ib": "1"}
        assert "rdma/ib" not in sidecar.get("resources", {}).get("limits", {})
        assert "side-channel" in {p["name"] for p in engine["ports"]}
        assert sidecar["args"][-1] == "watch"

    def test_other_engines_leave_rdma_and_the_side_channel_to_the_sidecar(self) -> None:
        model = spec({"engine": {"image": "ghcr.io/disagg/reference-engine:0.1.0"}})
        workload = objects(model)["Deployment", "gemma-pp2-decode"]
        engine, sidecar = container(workload, ENGINE_CONTAINER), container(workload, SIDECAR_CONTAINER)
        assert sidecar["resources"]["limits"] == {"rdma/ib": "1"}
        assert "side-channel" in {p["name"] for p in sidecar["ports"]}
        assert "side-channel" not in {p["name"] for p in engine["ports"]}
        assert sidecar["args"][-1] == "transfer"

    def test_rdma_nodes_are_anded_into_the_users_node_affinity(self) -> None:
        user_term = {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
        model = spec(
            {
                "kvTransfer": {"nodeSelector": {"rdma.example/capable": "true"}},
                "decode": {
                    "scheduling": {
                        "nodeSelector": {"pool": "decode"},
                        "affinity": {
                            "nodeAffinity": {
                                "requiredDuringSchedulingIgnoredDuringExecution": {
                                    "nodeSelectorTerms": [user_term]
                                }
                            }
                        },
                    }
                },
            }
        )
        built = objects(model)
        decode = pod_spec(built["Deployment", "gemma-pp2-decode"])
        assert decode["nodeSelector"] == {"pool": "decode"}
        terms = decode["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
        assert terms == [
            {
                "matchExpressions": [
                    {"key": "gpu", "operator": "In", "values": ["h100"]},
                    {"key": "rdma.example/capable", "operator": "In", "values": ["true"]},
                ]
            }
        ]
        prefill = pod_spec(built["StatefulSet", "gemma-pp2-prefill-0"])
        assert prefill["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "rdma.example/capable", "operator": "In", "values": ["true"]}]}
            ]
        }


ENGINE_RESOURCES = {"resources": {"requests": {"memory": "2Gi"}, "limits": {"nvidia.com/gpu": 2}}}
WORKER_RESOURCES = {"resources": {"requests": {"cpu": "1"}}}


class TestKVPool:
    def pool_spec(self, pool: dict[str, Any], image: str | None = None) -> DisaggDeploymentSpec:
        patch: dict[str, Any] = {
            "kvTransfer": {"kvPool": pool},
            "prefill": ENGINE_RESOURCES,
            "decode": ENGINE_RESOURCES,
            "worker": WORKER_RESOURCES,
        }
        if image is not None:
            patch["engine"] = {"image": image}
        return spec(patch)

    @pytest.mark.parametrize(
        ("medium", "resource"), [("HugePages-2Mi", "hugepages-2Mi"), ("HugePages-1Gi", "hugepages-1Gi")]
    )
    @pytest.mark.parametrize("image", [None, "ghcr.io/disagg/reference-engine:0.1.0"])
    def test_a_huge_page_pool_is_its_own_volume_reserved_in_both_containers(
        self, medium: str, resource: str, image: str | None
    ) -> None:
        built = objects(self.pool_spec({"medium": medium, "sizeLimit": "4Gi"}, image))
        for key in (("StatefulSet", "gemma-pp2-prefill-0"), ("Deployment", "gemma-pp2-decode")):
            workload = built[key]
            volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
            assert volumes["kv-pool"] == {
                "name": "kv-pool",
                "emptyDir": {"medium": medium, "sizeLimit": "4Gi"},
            }
            # /dev/shm stays tmpfs: the engine's sockets and other shared memory need 4 KiB pages.
            assert volumes["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory"}}
            engine, sidecar = container(workload, ENGINE_CONTAINER), container(workload, SIDECAR_CONTAINER)
            for c in (engine, sidecar):
                assert {"name": "kv-pool", "mountPath": "/dev/hugepages"} in c["volumeMounts"]
                assert env(c)["DISAGG_KV_POOL"] == "/dev/hugepages/kv-pool"
                assert c["resources"]["requests"][resource] == c["resources"]["limits"][resource] == "4Gi"
            assert engine["resources"]["requests"]["memory"] == "2Gi"
            assert engine["resources"]["limits"]["nvidia.com/gpu"] == "2"
            assert sidecar["resources"]["requests"]["cpu"] == "1"

    def test_the_sidecar_takes_the_pool_path_the_builders_give(self, tmp_path: Path) -> None:
        built = objects(self.pool_spec({"medium": "HugePages-2Mi", "sizeLimit": "4Gi"}))
        sidecar = container(built["Deployment", "gemma-pp2-decode"], SIDECAR_CONTAINER)
        topology = tmp_path / TOPOLOGY_KEY
        topology.write_text(built["ConfigMap", "gemma-pp2-topology"]["data"][TOPOLOGY_KEY])
        # What the kubelet resolves from the downward API, then the builders' literal values.
        variables = {"POD_NAME": "gemma-pp2-decode-abc", "POD_IP": "10.0.0.9"}
        variables |= {k: v for k, v in env(sidecar).items() if isinstance(v, str)}
        variables["DISAGG_TOPOLOGY_FILE"] = str(topology)
        assert from_env(variables).kv_pool == "/dev/hugepages/kv-pool"

    def test_a_memory_pool_is_todays_dev_shm_with_an_optional_size(self) -> None:
        plain = objects(spec())
        same = objects(self.pool_spec({"medium": "Memory"}))
        sized = objects(self.pool_spec({"medium": "Memory", "sizeLimit": "8Gi"}))
        for key in (("StatefulSet", "gemma-pp2-prefill-0"), ("Deployment", "gemma-pp2-decode")):
            for workload in (plain[key], same[key]):
                assert [v["name"] for v in pod_spec(workload)["volumes"]] == [
                    "dshm",
                    "topology",
                    "kube-api-access",
                ]
                assert all("DISAGG_KV_POOL" not in env(c) for c in pod_spec(workload)["containers"])
                assert all(
                    not any(name.startswith("hugepages") for name in c["resources"].get("limits", {}))
                    for c in pod_spec(workload)["containers"]
                )
            volumes = {v["name"]: v for v in pod_spec(sized[key])["volumes"]}
            assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}


class TestVllmEngine:
    def test_prefill_is_push_producer_with_its_stage_layout(self) -> None:
        engine = container(objects(spec())["StatefulSet", "gemma-pp2-prefill-0"], ENGINE_CONTAINER)
        args = engine["args"]
        assert args[0] == "google/gemma-3-27b-it"
        assert json.loads(flag(args, "--kv-transfer-config")) == {
            "kv_connector": "NixlPushConnector",
            "kv_role": "kv_producer",
            "engine_id": "@DISAGG_ENGINE_ID@",
            "kv_connector_extra_config": {"backends": ["UCX"], "kv_lease_duration": 120},
        }
        assert (flag(args, "--tensor-parallel-size"), flag(args, "--pipeline-parallel-size")) == ("2", "2")
        assert flag(args, "--block-size") == "32"
        assert flag(args, "--nnodes") == "2"
        assert flag(args, "--master-addr") == "gemma-pp2-prefill-0-0.gemma-pp2-prefill-0.ns1.svc"
        # The pipeline rank is the pod ordinal, read from the pod name at start.
        assert engine["command"][:2] == ["/bin/sh", "-c"]
        assert "${POD_NAME##*-}" in engine["command"][2]
        variables = env(engine)
        assert variables["VLLM_PP_LAYER_PARTITION"] == "31,31"
        assert variables["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
        names = [item["name"] for item in engine["env"]]
        # $(POD_IP) expands only from a variable defined earlier in the list.
        assert variables["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)"
        assert names.index("POD_IP") < names.index("VLLM_NIXL_SIDE_CHANNEL_HOST")

    def test_decode_is_consumer_without_pipeline_launcher(self) -> None:
        engine = container(objects(spec())["Deployment", "gemma-pp2-decode"], ENGINE_CONTAINER)
        assert engine["command"][:2] == ["/bin/sh", "-c"]
        assert (
            engine["command"][2].endswith('exec vllm serve "$@"') and "--headless" not in engine["command"][2]
        )
        config = json.loads(flag(engine["args"], "--kv-transfer-config"))
        assert (config["kv_connector"], config["kv_role"]) == ("NixlPushConnector", "kv_consumer")
        assert "--nnodes" not in engine["args"]
        assert "VLLM_PP_LAYER_PARTITION" not in env(engine)

    def test_pull_connector(self) -> None:
        model = spec({"kvTransfer": {"connector": "Pull"}, "prefill": {"pipelineParallelSize": 1}})
        engine = container(objects(model)["Deployment", "gemma-pp2-decode"], ENGINE_CONTAINER)
        assert json.loads(flag(engine["args"], "--kv-transfer-config"))["kv_connector"] == "NixlConnector"

    def test_user_args_are_kept_and_redundant_owned_ones_dropped(self) -> None:
        model = spec(
            {
                "engine": {"extraArgs": ["--enforce-eager", "--block-size=32"]},
                "decode": {"extraArgs": ["-tp", "2"]},
            }
        )
        assert arg_violations(model) == []
        args = container(objects(model)["Deployment", "gemma-pp2-decode"], ENGINE_CONTAINER)["args"]
        assert args[-1] == "--enforce-eager"
        assert args.count("--block-size") == 1 and "-tp" not in args

    @pytest.mark.parametrize(
        ("extra", "field"),
        [
            (["--block-size", "16"], "spec.prefill.blockSize"),
            (["--tensor_parallel_size=4"], "spec.prefill.tensorParallelSize"),
            (["--kv-transfer-config", '{"kv_connector":"NixlConnector"}'], "spec.kvTransfer"),
            (["--disable-hybrid-kv-cache-manager"], "spec.engine.hybridKvCacheManager"),
            (["--node-rank", "1"], "the pod's StatefulSet ordinal"),
        ],
    )
    def test_contradicting_args_are_refused_with_the_field_to_use(self, extra: list[str], field: str) -> None:
        model = spec({"prefill": {"extraArgs": extra}})
        (violation,) = arg_violations(model)
        assert violation.reason == "EngineArgumentConflict"
        assert field in violation.message and "spec.prefill.extraArgs" in violation.message
        report = evaluate(model)
        assert report.plan is not None
        with pytest.raises(ValueError, match="EngineArgumentConflict"):
            engine_container(model, "prefill", report.plan, stage_service="s", identity_env=[])

    @pytest.mark.parametrize(
        ("extra", "field"),
        [
            # Issue 22 (finding 8): each exits vLLM 0.33's parser with status 2, so the engine crash-loops.
            (["-tp4"], "spec.prefill.tensorParallelSize"),
            (["-pp2"], "spec.prefill.pipelineParallelSize"),
            (["--no-enable-hybrid-kv-cache-manager"], "spec.engine.hybridKvCacheManager"),
            (["-tp2=2"], "spec.prefill.tensorParallelSize"),
            (["-t4"], "spec.prefill.tensorParallelSize"),
            (["--no-block-size"], "spec.prefill.blockSize"),
            (["--block-size32"], "spec.prefill.blockSize"),
            (["--attention-backendFLASH_ATTN"], "spec.engine.attentionBackend"),
            (["--no_tensor_parallel_size"], "spec.prefill.tensorParallelSize"),
            (["--no-headless"], "the pod's StatefulSet ordinal"),
            (["-pp2.x", "1"], "spec.prefill.pipelineParallelSize"),
            # argparse splits a value off a one-letter option: `-n3` is `--nnodes 3`, `-r1` `--node-rank 1`.
            (["-n3"], "spec.prefill.pipelineParallelSize"),
            (["-r1"], "the pod's StatefulSet ordinal"),
        ],
    )
    def test_args_vllms_parser_refuses_or_reads_as_owned_are_refused(
        self, extra: list[str], field: str
    ) -> None:
        model = spec({"prefill": {"extraArgs": extra}})
        (violation,) = arg_violations(model)
        assert violation.reason == "EngineArgumentConflict"
        assert field in violation.message and f"sets '{extra[0]}" in violation.message

    def test_an_agreeing_attached_value_is_dropped_and_vllm_options_near_owned_ones_kept(self) -> None:
        # `-n2` is the PP2 prefill's own `--nnodes 2`; `--kv-cache-dtype-skip-layers` and
        # `--no-enable-prefix-caching` are vLLM options that only look like owned ones.
        kept = ["--kv-cache-dtype-skip-layers", "sliding_window", "--no-enable-prefix-caching"]
        model = spec({"prefill": {"extraArgs": ["-n2", *kept]}})
        assert arg_violations(model) == []
        report = evaluate(model)
        assert report.plan is not None
        built = engine_container(model, "prefill", report.plan, stage_service="s", identity_env=[])
        assert list(built.args[-3:]) == kept and "-n2" not in built.args

    def test_other_engines_get_user_args_verbatim(self) -> None:
        model = spec(
            {"engine": {"image": "ghcr.io/disagg/reference-engine:0.1.0", "extraArgs": ["--block-size", "8"]}}
        )
        assert arg_violations(model) == []
        engine = container(objects(model)["Deployment", "gemma-pp2-decode"], ENGINE_CONTAINER)
        assert engine["args"] == ["--block-size", "8"] and "command" not in engine

    @pytest.mark.parametrize(
        ("image", "expected"),
        [
            ("vllm/vllm-openai:v0.33.0", True),
            ("registry.local:5000/team/vllm-tpu@sha256:abc", True),
            ("ghcr.io/vllm-like/engine:1", False),
            ("sglang/sglang:latest", False),
        ],
    )
    def test_vllm_images_are_recognised_by_repository(self, image: str, expected: bool) -> None:
        assert is_vllm_image(image) is expected


class TestNames:
    def test_long_owner_names_are_shortened_stably_and_distinctly(self) -> None:
        owner = "a" * 200
        names = {child_name(owner, "prefill", str(r)) for r in range(12)}
        assert len(names) == 12
        assert all(len(name) <= MAX_CHILD_NAME for name in names)
        assert child_name(owner, "decode") == child_name(owner, "decode")
        assert child_name(owner, "decode") != child_name("a" * 199 + "b", "decode")

    def test_long_owner_names_fit_label_values_and_stay_in_an_annotation(self) -> None:
        owner = Owner(name="m" * 120, namespace="ns1", uid="u", generation=1)
        for obj in objects(spec(), owner).values():
            labels = obj["metadata"]["labels"]
            assert all(len(value) <= 63 for value in labels.values())
            assert labels["app.kubernetes.io/instance"] == label_value(owner.name)
            assert obj["metadata"]["annotations"]["disagg.io/deployment"] == owner.name
            if "template" in obj.get("spec", {}):
                template = obj["spec"]["template"]["metadata"]
                assert template["annotations"]["disagg.io/deployment"] == owner.name
                assert obj["spec"]["selector"]["matchLabels"].items() <= template["labels"].items()
        assert label_value("m" * 120) != label_value("m" * 119 + "n")

    def test_short_names_are_plain(self) -> None:
        assert child_name("gemma", "prefill", "0") == "gemma-prefill-0"

    def test_dotted_and_digit_names_become_distinct_service_names(self) -> None:
        dotted, dashed = child_name("gemma.v1", "decode"), child_name("gemma-v1", "decode")
        assert dashed == "gemma-v1-decode"
        assert dotted.startswith("gemma-v1-") and dotted != dashed
        assert child_name("3b-model", "decode").startswith("d-3b-model-")


DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# DNS subdomains, as Kubernetes allows for a custom object's name.
owner_names = st.from_regex(r"[a-z0-9]([-a-z0-9.]{0,200}[a-z0-9])?", fullmatch=True).filter(
    lambda name: ".." not in name and "-." not in name and ".-" not in name
)


@given(owner=owner_names, replica=st.integers(min_value=0, max_value=999))
def test_child_names_are_dns_labels_short_enough_for_statefulset_pods(owner: str, replica: int) -> None:
    for name in (
        child_name(owner, "prefill", str(replica)),
        child_name(owner, "decode"),
        child_name(owner, "topology"),
    ):
        assert len(name) <= MAX_CHILD_NAME
        assert DNS_LABEL.match(name), name


class TestPodSecurity:
    """Each container gets the tightest securityContext it can run with, and only the sidecar a token."""

    WORKLOADS = (("StatefulSet", "gemma-pp2-prefill-0"), ("Deployment", "gemma-pp2-decode"))

    @pytest.mark.parametrize("key", WORKLOADS)
    def test_a_vllm_pod(self, key: tuple[str, str]) -> None:
        workload = objects(spec())[key]
        pod = pod_spec(workload)
        assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
        assert pod["automountServiceAccountToken"] is False
        engine, sidecar = container(workload, ENGINE_CONTAINER), container(workload, SIDECAR_CONTAINER)
        assert engine["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
        }
        assert sidecar["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "runAsGroup": 65532,
            "readOnlyRootFilesystem": True,
        }

    @pytest.mark.parametrize("key", WORKLOADS)
    def test_a_pod_whose_sidecar_moves_the_kv(self, key: tuple[str, str]) -> None:
        workload = objects(spec({"engine": {"image": "ghcr.io/disagg/reference-engine:0.1.0"}}))[key]
        engine, sidecar = container(workload, ENGINE_CONTAINER), container(workload, SIDECAR_CONTAINER)
        assert engine["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        }
        assert sidecar["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
            "readOnlyRootFilesystem": True,
        }

    @pytest.mark.parametrize("key", WORKLOADS)
    def test_only_the_sidecar_mounts_the_api_credentials_its_client_reads(self, key: tuple[str, str]) -> None:
        workload = objects(spec())[key]
        volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
        sources = volumes["kube-api-access"]["projected"]["sources"]
        paths = [
            item["path"]
            for source in sources
            for item in (
                [source["serviceAccountToken"]]
                if "serviceAccountToken" in source
                else source.get("configMap", source.get("downwardAPI", {})).get("items", [])
            )
        ]
        assert paths == ["token", "ca.crt", "namespace"]
        mounted = {
            c["name"]: [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "kube-api-access"]
            for c in pod_spec(workload)["containers"]
        }
        assert mounted == {ENGINE_CONTAINER: [], SIDECAR_CONTAINER: [str(SERVICE_ACCOUNT_TOKEN.parent)]}
        # What the sidecar's pod_api_client looks for, and the files kubernetes' load_incluster_config reads.
        directory = SERVICE_ACCOUNT_TOKEN.parent
        assert {str(directory / "token"), str(directory / "ca.crt")} == {
            incluster_config.SERVICE_TOKEN_FILENAME,
            incluster_config.SERVICE_CERT_FILENAME,
        }
