"""The engine pod template: the engine container beside the KV worker sidecar. Pure.

Every engine pod gets the KV worker sidecar (downward-API identity, shared memory; the side channel, RDMA and
`IPC_LOCK` go to whichever container moves the KV) and a readiness gate on the condition the sidecar writes,
and runs as the deployment's own ServiceAccount; only the sidecar mounts its token. Every container drops all
capabilities. A huge page KV pool (`spec.kvTransfer.kvPool`) is a hugetlbfs volume of its own beside
`/dev/shm`, which stays tmpfs because the engine's other shared-memory files (sockets, NCCL, torch) have sizes
hugetlbfs refuses. The prefill StatefulSet and the decode Deployment both wrap this template.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from disagg.operator.api import DisaggDeploymentSpec, EngineKind, KVPoolMedium, Role
from disagg.operator.builders.engine import HTTP_PORT, engine_container
from disagg.operator.builders.objects import (
    API_ACCESS_DIR,
    API_ACCESS_VOLUME,
    SIDECAR_UID,
    UNPRIVILEGED,
    api_access_volume,
    container_resources,
    json_copy,
    revision_labels,
)
from disagg.operator.builders.topology import TOPOLOGY_DIR, TOPOLOGY_KEY, revision
from disagg.operator.engine_kind import engine_kind, role_image
from disagg.operator.naming import (
    DEPLOYMENT_ANNOTATION,
    HASH_ANNOTATION,
    SLOTS,
    TOPOLOGY_ANNOTATION,
    Installation,
    Owner,
    owner_labels,
    topology_name,
    worker_account_name,
)
from disagg.operator.plan import TopologyPlan
from disagg.worker.contracts.pod_contract import (
    BLOCK_SIZE_ENV,
    COMPATIBILITY_HASH_ENV,
    DEPLOYMENT_ENV,
    KV_POOL_ENV,
    KV_TRANSPORT_ENV,
    METRICS_PORT_ENV,
    NODE_NAME_ENV,
    PIPELINE_PARALLEL_SIZE_ENV,
    POD_CONDITION,
    POD_IP_ENV,
    POD_NAME_ENV,
    POD_NAMESPACE_ENV,
    POD_UID_ENV,
    ROLE_ENV,
    SIDE_CHANNEL_PORT_ENV,
    SIDE_CHANNEL_PORT_NAME,
    SIDECAR_CONTAINER,
    TENSOR_PARALLEL_SIZE_ENV,
    TOPOLOGY_FILE_ENV,
    UCX_LOG_FILE,
    UCX_LOG_FILE_ENV,
)
from disagg.worker.contracts.ucx_lanes import ucx_env

KV_POOL_VOLUME: Final = "kv-pool"
KV_POOL_DIR: Final = "/dev/hugepages"
KV_POOL_FILE: Final = f"{KV_POOL_DIR}/kv-pool"
ENGINE_CONTAINER: Final = "engine"
MODEL_VOLUME: Final = "model"
# What the pod mounts besides the model: a model volume at, under or over one of these would hide it or be
# hidden (policies.pods refuses it, ModelVolumeInvalid). The API token's folder is only the sidecar's.
RESERVED_MOUNTS: Final = ("/dev/shm", KV_POOL_DIR, TOPOLOGY_DIR)

# RDMA memory registration pins pages (ibv_reg_mr, and NIXL/UCX through it) beyond RLIMIT_MEMLOCK, which
# needs CAP_IPC_LOCK; Kubernetes grants a capability effectively only to a root process (it sets no ambient
# capabilities), so the container that moves the KV runs as its image's user with IPC_LOCK alone.
_MOVES_KV: Final = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}
# The watch sidecar moves nothing and writes nothing outside its mounts.
_WATCHES: Final = {
    **UNPRIVILEGED,
    "runAsNonRoot": True,
    "runAsUser": SIDECAR_UID,
    "runAsGroup": SIDECAR_UID,
    "readOnlyRootFilesystem": True,
}


def _engine_user(spec: DisaggDeploymentSpec, role: Role) -> dict[str, Any]:
    """The engine container's user: the reference engine's image user, or the spec's; none for a vLLM or
    custom engine without `spec.engine.runAsUser` (it runs as its image says)."""
    user = spec.engine.run_as_user
    if user is None and engine_kind(spec, role) is EngineKind.REFERENCE:
        user = SIDECAR_UID
    return {} if user is None else {"runAsNonRoot": True, "runAsUser": user, "runAsGroup": user}


def _identity_env(spec: DisaggDeploymentSpec, owner: Owner, role: Role) -> list[dict[str, Any]]:
    def field(name: str, path: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}

    this = spec.role(role)
    return [
        field(POD_NAME_ENV, "metadata.name"),
        field(POD_NAMESPACE_ENV, "metadata.namespace"),
        field(POD_UID_ENV, "metadata.uid"),
        field(POD_IP_ENV, "status.podIP"),
        field(NODE_NAME_ENV, "spec.nodeName"),
        {"name": DEPLOYMENT_ENV, "value": owner.name},
        {"name": ROLE_ENV, "value": role},
        {"name": PIPELINE_PARALLEL_SIZE_ENV, "value": str(this.pipeline_parallel_size)},
        {"name": TENSOR_PARALLEL_SIZE_ENV, "value": str(this.tensor_parallel_size)},
        {"name": BLOCK_SIZE_ENV, "value": str(this.block_size)},
        {"name": SIDE_CHANNEL_PORT_ENV, "value": str(spec.kv_transfer.side_channel_port)},
        {"name": TOPOLOGY_FILE_ENV, "value": f"{TOPOLOGY_DIR}/{TOPOLOGY_KEY}"},
    ]


def _huge_pages(spec: DisaggDeploymentSpec) -> tuple[str, str] | None:
    """(resource name, quantity) a huge page pool reserves in each container that maps it, or None."""
    pool = spec.kv_transfer.kv_pool
    resource = None if pool is None else pool.medium.resource_name
    if pool is None or resource is None:
        return None
    if pool.size_limit is None:
        # The reconcile refuses such a spec (KVPoolSizeInvalid) before building; reaching this is a bug.
        raise ValueError(f"a {pool.medium.value} KV pool needs spec.kvTransfer.kvPool.sizeLimit")
    return resource, pool.size_limit


def _pool_volumes(spec: DisaggDeploymentSpec) -> list[dict[str, Any]]:
    pool = spec.kv_transfer.kv_pool
    dshm: dict[str, Any] = {"medium": "Memory"}
    if pool is None or pool.medium is KVPoolMedium.MEMORY:
        if pool is not None and pool.size_limit is not None:
            dshm["sizeLimit"] = pool.size_limit
        return [{"name": "dshm", "emptyDir": dshm}]
    return [
        {"name": "dshm", "emptyDir": dshm},
        {"name": KV_POOL_VOLUME, "emptyDir": {"medium": pool.medium.value, "sizeLimit": pool.size_limit}},
    ]


def _model_volume(spec: DisaggDeploymentSpec) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The model's volume and the engine container's read-only mount of it, or None without one."""
    volume = spec.model.volume
    if volume is None:
        return None
    if volume.host_path is not None:
        source: dict[str, Any] = {"hostPath": {"path": volume.host_path.path, "type": "Directory"}}
    elif volume.persistent_volume_claim is not None:
        claim = volume.persistent_volume_claim.claim_name
        source = {"persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    else:
        # The API refuses a volume without a source (ModelVolume._one_source); reaching this is a bug.
        raise ValueError("spec.model.volume has neither hostPath nor persistentVolumeClaim")
    mount = {"name": MODEL_VOLUME, "mountPath": volume.mount_for(spec.model.name), "readOnly": True}
    return {"name": MODEL_VOLUME, **source}, mount


def engine_pod_template(
    spec: DisaggDeploymentSpec,
    owner: Owner,
    plan: TopologyPlan,
    role: Role,
    selector: dict[str, str],
    compat_hash: str,
    checksum: str,
    stage_service: str | None,
    installation: Installation,
    engine_env: list[dict[str, Any]] | None = None,
    slot: str = SLOTS[0],
) -> dict[str, Any]:
    this = spec.role(role)
    # A vLLM engine runs the NIXL connector in-process and moves the KV itself; the sidecar then only watches
    # the handshakes. Otherwise the sidecar owns the NIXL agent. The RDMA devices, IPC_LOCK and the side
    # channel go to whichever container moves the data.
    kind = engine_kind(spec, role)
    engine_moves_kv = kind is EngineKind.VLLM
    sidecar_image = installation.sidecar_image(spec, transfer=not engine_moves_kv)
    if sidecar_image is None:
        # The reconcile refuses such a spec (WorkerImageMissing) before building; reaching this is a bug.
        raise ValueError("no sidecar image: spec.worker.image and the installation's default are both unset")
    huge_pages = _huge_pages(spec)
    # Both containers learn the pool's path: the engine creates the pool there, the sidecar maps only it.
    identity = _identity_env(spec, owner, role) + (
        [{"name": KV_POOL_ENV, "value": KV_POOL_FILE}] if huge_pages else []
    )
    engine = engine_container(spec, role, plan, stage_service=stage_service, identity_env=identity)
    # Whichever process owns the NIXL agent gets UCX's settings for the demanded transport and prints its lane
    # selection into /dev/shm, which both containers mount: the transfer sidecar reads its own, a watching
    # sidecar its vLLM engine's, and both report each pair's real transport.
    transport = spec.kv_transfer.transport.value
    ucx = [
        {"name": key, "value": value}
        for key, value in {**ucx_env(transport), UCX_LOG_FILE_ENV: UCX_LOG_FILE}.items()
    ]
    side_channel = {
        "name": SIDE_CHANNEL_PORT_NAME,
        "containerPort": spec.kv_transfer.side_channel_port,
        "protocol": "TCP",
    }
    rdma = (
        (spec.kv_transfer.rdma.resource_name, spec.kv_transfer.rdma.count) if spec.kv_transfer.rdma else None
    )
    mounts = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "topology", "mountPath": TOPOLOGY_DIR, "readOnly": True},
    ] + ([{"name": KV_POOL_VOLUME, "mountPath": KV_POOL_DIR}] if huge_pages else [])
    model = _model_volume(spec)
    engine_container_spec: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": role_image(spec, role),
        "env": list(engine.env) + (ucx if engine_moves_kv else []),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}]
        + ([side_channel] if engine_moves_kv else []),
        "resources": container_resources(this.resources, rdma if engine_moves_kv else None, huge_pages),
        # Only the engine reads the model.
        "volumeMounts": mounts + ([model[1]] if model else []),
    }
    if engine.command:
        engine_container_spec["command"] = list(engine.command)
    if engine.args:
        engine_container_spec["args"] = list(engine.args)
    if kind is EngineKind.REFERENCE:
        # `disagg engine serve` advertises the hash its sidecar checks peers against.
        engine_container_spec["env"].append({"name": COMPATIBILITY_HASH_ENV, "value": compat_hash})
        if role == "decode":
            # A decoder takes requests once its server is up. Not on prefill: the StatefulSet's template is
            # every stage's, and only the head serves HTTP (the other stages run headless).
            engine_container_spec["readinessProbe"] = {
                "httpGet": {"path": "/readyz", "port": "http"},
                "periodSeconds": 5,
                "timeoutSeconds": 3,
                "failureThreshold": 3,
            }
    # The engine writes its caches (torch.compile, Triton, model downloads) under its root filesystem.
    engine_container_spec["securityContext"] = {
        **json_copy(_MOVES_KV if engine_moves_kv else UNPRIVILEGED),
        **_engine_user(spec, role),
    }
    sidecar = {
        "name": SIDECAR_CONTAINER,
        "image": sidecar_image,
        "command": ["disagg"],
        "args": ["worker", "sidecar", "--mode", "watch" if engine_moves_kv else "transfer"],
        "env": [
            *identity,
            {"name": COMPATIBILITY_HASH_ENV, "value": compat_hash},
            {"name": METRICS_PORT_ENV, "value": str(spec.worker.metrics_port)},
            {"name": KV_TRANSPORT_ENV, "value": transport},
            *(engine_env or ()),
            *([] if engine_moves_kv else ucx),
        ],
        "ports": [{"name": "metrics", "containerPort": spec.worker.metrics_port, "protocol": "TCP"}]
        + ([] if engine_moves_kv else [side_channel]),
        "resources": container_resources(
            spec.worker.resources, None if engine_moves_kv else rdma, huge_pages
        ),
        # The transfer sidecar maps the engine's pool and registers it with NIXL: it runs as the engine does.
        "securityContext": json_copy(
            _WATCHES if engine_moves_kv else {**_MOVES_KV, "readOnlyRootFilesystem": True}
        ),
        "volumeMounts": [*mounts, {"name": API_ACCESS_VOLUME, "mountPath": API_ACCESS_DIR, "readOnly": True}],
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": worker_account_name(owner.name),
        "automountServiceAccountToken": False,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [engine_container_spec, sidecar],
        "readinessGates": [{"conditionType": POD_CONDITION}],
        "enableServiceLinks": False,
        "volumes": [
            # The engine's KV pool is a shared-memory file the sidecar maps and registers with NIXL.
            *_pool_volumes(spec),
            {"name": "topology", "configMap": {"name": topology_name(owner.name, slot)}},
            api_access_volume(),
            *([model[0]] if model else []),
        ],
    }
    scheduling = this.scheduling
    if scheduling is not None and scheduling.node_selector:
        pod_spec["nodeSelector"] = dict(scheduling.node_selector)
    if scheduling is not None and scheduling.tolerations:
        pod_spec["tolerations"] = [dict(toleration) for toleration in scheduling.tolerations]
    affinity = _affinity(
        scheduling.affinity if scheduling is not None else None, spec.kv_transfer.node_selector or {}
    )
    if affinity:
        pod_spec["affinity"] = affinity
    return {
        "metadata": {
            "labels": {
                **owner_labels(owner.name),
                **selector,
                **revision_labels(revision(checksum), slot),
            },
            "annotations": {
                HASH_ANNOTATION: compat_hash,
                TOPOLOGY_ANNOTATION: checksum,
                DEPLOYMENT_ANNOTATION: owner.name,
            },
        },
        "spec": pod_spec,
    }


def _affinity(user: Mapping[str, Any] | None, rdma_nodes: Mapping[str, str]) -> dict[str, Any]:
    """The user's affinity with the RDMA node requirement ANDed into every required node selector term."""
    affinity: dict[str, Any] = json.loads(json.dumps(dict(user or {})))
    if not rdma_nodes:
        return affinity
    expressions = [
        {"key": key, "operator": "In", "values": [value]} for key, value in sorted(rdma_nodes.items())
    ]
    node = affinity.setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    required["nodeSelectorTerms"] = [
        {**term, "matchExpressions": [*term.get("matchExpressions", []), *expressions]} for term in terms
    ]
    return affinity
