"""`builders.pod_template`: the engine pod, its sidecar, its image, its KV pool and its security."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
from built import OWNER, container, env, objects, pod_spec
from dd_specs import DELETE, spec, spec_dict
from kubernetes.config import incluster_config

from disagg.operator.api import DisaggDeploymentSpec
from disagg.operator.builders.children import build
from disagg.operator.builders.pod_template import ENGINE_CONTAINER
from disagg.operator.builders.topology import TOPOLOGY_KEY
from disagg.operator.control.reconcile import judge
from disagg.operator.naming import Installation
from disagg.operator.policies.compat import evaluate
from disagg.operator.policies.pods import worker_image_violations
from disagg.operator.settings import installation_from_environ
from disagg.worker.contracts.pod_contract import POD_CONDITION, SIDECAR_CONTAINER
from disagg.worker.reporting.status_loop import SERVICE_ACCOUNT_TOKEN
from disagg.worker.sidecar.config import from_env


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
        assert installation_from_environ({}).worker_image is None
        assert installation_from_environ({"DISAGG_WORKER_IMAGE": "w:1"}).worker_image == "w:1"
        assert installation_from_environ({}).transfer_image is None
        assert installation_from_environ({"DISAGG_TRANSFER_IMAGE": "t:1"}).transfer_image == "t:1"

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
    def test_the_reference_engine_runs_as_its_images_non_root_user(self, key: tuple[str, str]) -> None:
        workload = objects(spec({"engine": {"image": "ghcr.io/disagg/disagg-transfer:0.1.0"}}))[key]
        # It moves no KV and needs nothing of root: the image's user (tests/image checks it), declared.
        assert container(workload, ENGINE_CONTAINER)["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "runAsGroup": 65532,
        }

    @pytest.mark.parametrize("key", WORKLOADS)
    def test_a_vllm_engine_runs_as_the_user_the_spec_names(self, key: tuple[str, str]) -> None:
        workload = objects(spec({"engine": {"runAsUser": 1001}}))[key]
        assert container(workload, ENGINE_CONTAINER)["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
            "runAsNonRoot": True,
            "runAsUser": 1001,
            "runAsGroup": 1001,
        }

    @pytest.mark.parametrize("key", WORKLOADS)
    def test_a_pod_whose_sidecar_moves_the_kv(self, key: tuple[str, str]) -> None:
        workload = objects(spec({"engine": {"image": "ghcr.io/disagg/reference-engine:0.1.0"}}))[key]
        engine, sidecar = container(workload, ENGINE_CONTAINER), container(workload, SIDECAR_CONTAINER)
        # Another engine image: its user is its image's.
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


class TestModelVolume:
    """`spec.model.volume`: the model reaches every engine container read-only, and a volume that cannot
    hold the model is refused before anything is built."""

    MODELS: ClassVar[dict[str, Any]] = {"model": {"name": "/var/lib/disagg/models/gemma"}}

    def test_a_host_path_is_mounted_read_only_at_the_models_folder_in_every_engine_container(self) -> None:
        volume = {"model": {**self.MODELS["model"], "volume": {"hostPath": {"path": "/srv/models"}}}}
        built = objects(spec(volume))
        for key in (("StatefulSet", "gemma-pp2-prefill-0"), ("Deployment", "gemma-pp2-decode")):
            volumes = {v["name"]: v for v in pod_spec(built[key])["volumes"]}
            host_path = {"path": "/srv/models", "type": "Directory"}
            assert volumes["model"] == {"name": "model", "hostPath": host_path}
            engine = container(built[key], ENGINE_CONTAINER)
            assert {"name": "model", "mountPath": "/var/lib/disagg/models", "readOnly": True} in engine[
                "volumeMounts"
            ]
            # The engine is the only reader of the model.
            sidecar = container(built[key], SIDECAR_CONTAINER)
            assert all(m["name"] != "model" for m in sidecar["volumeMounts"])

    def test_a_claim_is_mounted_read_only_at_the_mount_path_given(self) -> None:
        claim = {"persistentVolumeClaim": {"claimName": "weights"}, "mountPath": "/var/lib/disagg"}
        built = objects(spec({"model": {**self.MODELS["model"], "volume": claim}}))
        decode = built["Deployment", "gemma-pp2-decode"]
        volumes = {v["name"]: v for v in pod_spec(decode)["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
        mounts = container(decode, ENGINE_CONTAINER)["volumeMounts"]
        assert {"name": "model", "mountPath": "/var/lib/disagg", "readOnly": True} in mounts

    def test_without_a_volume_the_engine_gets_no_model_mount(self) -> None:
        built = objects(spec(self.MODELS))
        decode = built["Deployment", "gemma-pp2-decode"]
        assert all(v["name"] != "model" for v in pod_spec(decode)["volumes"])

    @pytest.mark.parametrize(
        "volume",
        [{}, {"hostPath": {"path": "/srv"}, "persistentVolumeClaim": {"claimName": "weights"}}],
        ids=["no-source", "two-sources"],
    )
    def test_a_volume_needs_exactly_one_source(self, volume: dict[str, Any]) -> None:
        with pytest.raises(ValueError, match="exactly one of hostPath and persistentVolumeClaim"):
            spec({"model": {**self.MODELS["model"], "volume": volume}})

    @pytest.mark.parametrize(
        ("name", "mount_path", "says"),
        [
            ("google/gemma-3-1b", None, "does not lie beneath"),
            ("/models/gemma", "/srv", "does not lie beneath"),
            ("/models", "/models", "does not lie beneath"),
            ("/gemma", None, "the root file system"),
            ("/dev/models/gemma", "/dev", "/dev/shm"),
            ("/etc/disagg/topology/m", "/etc/disagg/topology", "/etc/disagg/topology"),
        ],
    )
    def test_a_volume_that_cannot_hold_the_model_is_refused(
        self, name: str, mount_path: str | None, says: str
    ) -> None:
        volume: dict[str, Any] = {"hostPath": {"path": "/srv/models"}}
        if mount_path is not None:
            volume["mountPath"] = mount_path
        report = evaluate(spec({"model": {"name": name, "volume": volume}}))
        assert report.reasons == ["ModelVolumeInvalid"]
        assert says in report.violations[0].message

    def test_a_model_beneath_its_volume_is_accepted(self) -> None:
        volume = {"hostPath": {"path": "/srv/models"}, "mountPath": "/models/"}
        assert evaluate(spec({"model": {"name": "/models/gemma/", "volume": volume}})).compatible
