"""Manifests for a `DisaggDeployment`: `desired = build(...)`, then the handlers apply each object. Pure.

Per prefill replica: a StatefulSet with one pod per pipeline stage (pod ordinal = PP rank, started in
parallel) and the headless Service that governs it. Decode: a Deployment and a headless Service. A ConfigMap
carries the topology plan every sidecar reads. Every engine pod gets the KV worker sidecar (downward-API
identity, shared memory; the side channel, RDMA and `IPC_LOCK` go to whichever container moves the KV) and a
readiness gate on the condition the sidecar writes, and runs as the deployment's own ServiceAccount, which a
RoleBinding gives the installation's worker ClusterRole (the sidecar patches its Pod's condition, reads its
peers and posts Events); only the sidecar mounts its token. Every container drops all capabilities. A huge
page KV pool (`spec.kvTransfer.kvPool`) is a hugetlbfs volume of its own beside `/dev/shm`, which stays tmpfs
because the engine's other shared-memory files (sockets, NCCL, torch) have sizes hugetlbfs refuses. Everything
carries an owner reference to the DisaggDeployment, so deletion is garbage collection, and only fields that
exist in Kubernetes 1.20 (apps/v1, core/v1, rbac.authorization.k8s.io/v1). `disagg plan` builds the same
objects from a file, which has no uid yet: then the owner reference is left out (the operator adds it).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from disagg.operator.api import API_VERSION, KIND, DisaggDeploymentSpec, KVPoolMedium, Resources, Role
from disagg.operator.builders_engine import (
    HTTP_PORT,
    engine_container,
    is_reference_engine_image,
    is_vllm_image,
    role_image,
    role_release,
    stage_dns,
)
from disagg.operator.plan import TopologyPlan
from disagg.worker.contracts.pod_contract import (
    BLOCK_SIZE_ENV,
    COMPATIBILITY_HASH_ENV,
    DEPLOYMENT_ENV,
    DEPLOYMENT_LABEL,
    ENGINE_SIDE_CHANNEL_HOST_ENV,
    ENGINE_WORKERS_ENV,
    KV_POOL_ENV,
    METRICS_PORT_ENV,
    NODE_NAME_ENV,
    PIPELINE_PARALLEL_SIZE_ENV,
    POD_CONDITION,
    POD_IP_ENV,
    POD_NAME_ENV,
    POD_NAMESPACE_ENV,
    POD_UID_ENV,
    ROLE_ENV,
    ROLE_LABEL,
    SIDE_CHANNEL_PORT_ENV,
    SIDE_CHANNEL_PORT_NAME,
    SIDECAR_CONTAINER,
    TENSOR_PARALLEL_SIZE_ENV,
    TOPOLOGY_FILE_ENV,
)
from disagg.worker.contracts.topology import ModelDocument, TopologyDocument, encode_topology

FIELD_MANAGER: Final = "disagg-operator"
NAME_LABEL: Final = "app.kubernetes.io/name"
INSTANCE_LABEL: Final = "app.kubernetes.io/instance"
COMPONENT_LABEL: Final = "app.kubernetes.io/component"
MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
PART_OF_LABEL: Final = "app.kubernetes.io/part-of"
# The owner's full name: a label value is capped at 63 characters, an object name is not.
DEPLOYMENT_ANNOTATION: Final = "disagg.io/deployment"
MAX_LABEL_VALUE: Final = 63
REPLICA_LABEL: Final = "disagg.io/replica"
GENERATION_ANNOTATION: Final = "disagg.io/generation"
HASH_ANNOTATION: Final = "disagg.io/compatibility-hash"
TOPOLOGY_ANNOTATION: Final = "disagg.io/topology-checksum"
TOPOLOGY_KEY: Final = "topology.json"
TOPOLOGY_DIR: Final = "/etc/disagg/topology"
KV_POOL_VOLUME: Final = "kv-pool"
KV_POOL_DIR: Final = "/dev/hugepages"
KV_POOL_FILE: Final = f"{KV_POOL_DIR}/kv-pool"
ENGINE_CONTAINER: Final = "engine"
WORKER_IMAGE_ENV: Final = "DISAGG_WORKER_IMAGE"
ROUTER_IMAGE_ENV: Final = "DISAGG_ROUTER_IMAGE"
# The transfer sidecar's default image (it needs NIXL and torch: the chart's disagg-transfer image); the watch
# sidecar's is WORKER_IMAGE_ENV (the light image). Either stands in for the other when only one is set: the
# transfer image runs the watch sidecar too, and a single all-in-one image runs both.
TRANSFER_IMAGE_ENV: Final = "DISAGG_TRANSFER_IMAGE"
WORKER_CLUSTER_ROLE_ENV: Final = "DISAGG_WORKER_CLUSTERROLE"
DEFAULT_WORKER_CLUSTER_ROLE: Final = "disagg-worker"
# The API server credentials the sidecar's in-cluster client reads (token, ca.crt, namespace), projected as
# the kubelet would: the pod mounts no token of its own (automountServiceAccountToken: false) and only the
# sidecar, which patches its Pod's condition, reads its peers and posts Events, gets this one.
API_ACCESS_VOLUME: Final = "kube-api-access"
API_ACCESS_DIR: Final = "/var/run/secrets/kubernetes.io/serviceaccount"
# The uid the watch sidecar runs as, the one the chart's operator runs the same image as.
SIDECAR_UID: Final = 65532
# A container that may not gain privileges, with every capability dropped; the ones that need more add it.
_UNPRIVILEGED: Final = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
# RDMA memory registration pins pages (ibv_reg_mr, and NIXL/UCX through it) beyond RLIMIT_MEMLOCK, which
# needs CAP_IPC_LOCK; Kubernetes grants a capability effectively only to a root process (it sets no ambient
# capabilities), so the container that moves the KV runs as its image's user with IPC_LOCK alone.
_MOVES_KV: Final = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}
# The watch sidecar moves nothing and writes nothing outside its mounts.
_WATCHES: Final = {
    **_UNPRIVILEGED,
    "runAsNonRoot": True,
    "runAsUser": SIDECAR_UID,
    "runAsGroup": SIDECAR_UID,
    "readOnlyRootFilesystem": True,
}

# A StatefulSet's pods carry `controller-revision-hash: <name>-<10 chars>`, a label value capped at 63.
MAX_CHILD_NAME: Final = 52


@dataclass(frozen=True)
class Owner:
    """The DisaggDeployment the children belong to (passed explicitly: builders have no kopf context)."""

    name: str
    namespace: str
    # None for a spec read from a file (`disagg plan`): the object does not exist yet, so nothing can own.
    uid: str | None
    generation: int

    def references(self) -> list[dict[str, Any]]:
        if self.uid is None:
            return []
        return [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": self.name,
                "uid": self.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]


@dataclass(frozen=True)
class Installation:
    """What the operator's installation (the Helm chart, through environment variables) decides."""

    worker_cluster_role: str = DEFAULT_WORKER_CLUSTER_ROLE
    # The sidecar images of a spec that names none: the watch sidecar's, and the transfer sidecar's.
    worker_image: str | None = None
    # The router image of a spec that names none.
    router_image: str | None = None
    transfer_image: str | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Installation:
        return cls(
            worker_cluster_role=environ.get(WORKER_CLUSTER_ROLE_ENV) or DEFAULT_WORKER_CLUSTER_ROLE,
            worker_image=environ.get(WORKER_IMAGE_ENV) or None,
            router_image=environ.get(ROUTER_IMAGE_ENV) or None,
            transfer_image=environ.get(TRANSFER_IMAGE_ENV) or None,
        )

    def sidecar_image(self, spec: DisaggDeploymentSpec, *, transfer: bool = False) -> str | None:
        """The spec's sidecar image, else this installation's default for the sidecar's mode (the other
        mode's when only that one is set); None when none is named."""
        defaults = (
            (self.transfer_image, self.worker_image) if transfer else (self.worker_image, self.transfer_image)
        )
        return spec.worker.image or defaults[0] or defaults[1]

    def router_image_of(self, spec: DisaggDeploymentSpec) -> str | None:
        """The spec's router image, else this installation's default, else the sidecar image (every disagg
        image has `disagg router run`), so a spec the sidecar can run needs nothing new for its router."""
        return spec.router.image or self.router_image or self.sidecar_image(spec)


def child_name(owner: str, *parts: str) -> str:
    """`<owner>-<parts>` as a DNS-1035 label (what a Service name must be) short enough for StatefulSet pods.

    A DisaggDeployment name is a DNS subdomain: it may hold dots, start with a digit or be long. Such a name
    is rewritten (dots to dashes, a leading letter, truncation), and a hash of the original keeps two
    rewritten names from colliding.
    """
    suffix = "-".join(parts)
    name = f"{owner}-{suffix}"
    if len(name) <= MAX_CHILD_NAME and "." not in owner and owner[:1].isalpha():
        return name
    digest = hashlib.sha256(owner.encode()).hexdigest()[:8]
    stem = owner.replace(".", "-")
    if not stem[:1].isalpha():
        stem = f"d-{stem}"
    keep = MAX_CHILD_NAME - len(suffix) - len(digest) - 2
    return f"{stem[:keep].rstrip('-')}-{digest}-{suffix}"


def prefill_name(owner: str, replica: int) -> str:
    return child_name(owner, "prefill", str(replica))


def decode_name(owner: str) -> str:
    return child_name(owner, "decode")


def topology_name(owner: str) -> str:
    return child_name(owner, "topology")


def worker_account_name(owner: str) -> str:
    """The engine pods' ServiceAccount and the RoleBinding that grants it the worker ClusterRole."""
    return child_name(owner, "kv-worker")


def label_value(owner: str) -> str:
    """The owner's name as a label value: itself when it fits, else a prefix and a hash of the whole."""
    if len(owner) <= MAX_LABEL_VALUE:
        return owner
    digest = hashlib.sha256(owner.encode()).hexdigest()[:8]
    return f"{owner[: MAX_LABEL_VALUE - len(digest) - 1].rstrip('-.')}-{digest}"


def owner_labels(owner: str) -> dict[str, str]:
    """Labels on every child; the handlers list children (and kopf watches pods) by these."""
    return {
        NAME_LABEL: "disagg",
        INSTANCE_LABEL: label_value(owner),
        MANAGED_BY_LABEL: FIELD_MANAGER,
        PART_OF_LABEL: "disagg",
        DEPLOYMENT_LABEL: label_value(owner),
    }


def selector_labels(owner: str, role: Role, replica: int | None = None) -> dict[str, str]:
    """Immutable selector of one workload: never includes anything a spec change could alter."""
    labels = {INSTANCE_LABEL: label_value(owner), COMPONENT_LABEL: role, ROLE_LABEL: role}
    if replica is not None:
        labels[REPLICA_LABEL] = str(replica)
    return labels


def topology_document(
    spec: DisaggDeploymentSpec,
    owner: Owner,
    plan: TopologyPlan,
    hashes: Mapping[Role, str],
    factors: Mapping[Role, Mapping[str, Any]] | None = None,
) -> TopologyDocument:
    """The plan plus what a sidecar needs to build its KV layout (the sidecar decodes it at startup)."""
    model = spec.model
    return TopologyDocument(
        deployment=owner.name,
        transfer_mode=plan.transfer_mode,
        hma=plan.hma,
        packed=plan.packed,
        routing_mode=plan.routing_mode.value,
        prefill_tensor_parallel_size=plan.prefill_tp,
        decode_tensor_parallel_size=plan.decode_tp,
        notifications_per_request=plan.notifications_per_request,
        stages=plan.stage_documents(),
        block_size=spec.prefill.block_size,
        kv_lease_duration_seconds=spec.kv_transfer.lease_seconds,
        model=ModelDocument(
            name=model.name,
            dtype=model.dtype.value,
            dtype_bytes=model.dtype.num_bytes,
            num_kv_heads=model.num_kv_heads,
            head_size=model.head_size,
            layer_kinds=tuple(kind.to_layout() for kind in model.layer_kinds()),
            layer_name_template=model.layer_name_template,
            hma=plan.hma,
            attention_backend=spec.engine.attention_backend,
        ),
        compatibility_hashes={role: value for role, value in hashes.items()},
        # What each predicted hash is of: a sidecar names the factor a live engine's hash differs in.
        compatibility_factors={role: dict(value) for role, value in (factors or {}).items()},
        # Pre-flight refuses a pair whose releases differ, so prefill's release is the deployment's.
        vllm_version=spec.effective("prefill", "version", spec.engine.version),
        connector_version=role_release(spec, "prefill").connector_version,
    )


def build(
    spec: DisaggDeploymentSpec,
    owner: Owner,
    plan: TopologyPlan,
    hashes: Mapping[Role, str],
    installation: Installation = Installation(),
    factors: Mapping[Role, Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Every object the deployment needs, in apply order (what the pods mount or run as comes first)."""
    # Imported here: builders_router builds on this module's helpers.
    from disagg.operator.builders_router import router_objects

    topology = encode_topology(topology_document(spec, owner, plan, hashes, factors))
    checksum = hashlib.sha256(topology.encode()).hexdigest()[:16]
    objects: list[dict[str, Any]] = [
        _object(
            "v1", "ConfigMap", topology_name(owner.name), owner, "topology", data={TOPOLOGY_KEY: topology}
        ),
        *_worker_access(owner, installation),
    ]
    for replica in range(spec.prefill.replicas):
        name = prefill_name(owner.name, replica)
        objects.append(
            _service(spec, owner, name, selector_labels(owner.name, "prefill", replica), "prefill")
        )
        objects.append(_statefulset(spec, owner, plan, hashes["prefill"], checksum, replica, installation))
    name = decode_name(owner.name)
    objects.append(_service(spec, owner, name, selector_labels(owner.name, "decode"), "decode"))
    objects.append(_deployment(spec, owner, plan, hashes["decode"], checksum, installation))
    objects += router_objects(spec, owner, installation)
    return objects


def _object(
    api_version: str, kind: str, name: str, owner: Owner, component: str, **body: Any
) -> dict[str, Any]:
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


def _worker_access(owner: Owner, installation: Installation) -> list[dict[str, Any]]:
    """The sidecars' identity: a ServiceAccount per deployment, bound in its namespace only.

    A RoleBinding to the shared ClusterRole (rather than a Role per deployment) keeps the permission set in
    one place, the chart, and lets the operator grant it with `bind` alone instead of holding it.
    """
    name = worker_account_name(owner.name)
    return [
        _object("v1", "ServiceAccount", name, owner, "kv-worker"),
        _object(
            "rbac.authorization.k8s.io/v1",
            "RoleBinding",
            name,
            owner,
            "kv-worker",
            roleRef={
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": installation.worker_cluster_role,
            },
            subjects=[{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
        ),
    ]


def _service(
    spec: DisaggDeploymentSpec, owner: Owner, name: str, selector: dict[str, str], role: Role
) -> dict[str, Any]:
    return _object(
        "v1",
        "Service",
        name,
        owner,
        role,
        spec={
            "clusterIP": "None",
            # Stages rendezvous and sidecars handshake before any pod is Ready (the gate waits on them).
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [
                {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                {
                    "name": SIDE_CHANNEL_PORT_NAME,
                    "port": spec.kv_transfer.side_channel_port,
                    "targetPort": SIDE_CHANNEL_PORT_NAME,
                    "protocol": "TCP",
                },
            ],
        },
    )


def _statefulset(
    spec: DisaggDeploymentSpec,
    owner: Owner,
    plan: TopologyPlan,
    compat_hash: str,
    checksum: str,
    replica: int,
    installation: Installation,
) -> dict[str, Any]:
    name = prefill_name(owner.name, replica)
    selector = selector_labels(owner.name, "prefill", replica)
    master = stage_dns(name, name, owner.namespace)
    return _object(
        "apps/v1",
        "StatefulSet",
        name,
        owner,
        "prefill",
        spec={
            "serviceName": name,
            "replicas": spec.prefill.pipeline_parallel_size,
            # Every stage holds a slice of the model: they start (and restart) together.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector},
            "template": _pod_template(
                spec,
                owner,
                plan,
                "prefill",
                selector,
                compat_hash,
                checksum,
                master,
                installation,
                _engine_side_channel_env(spec, owner, name),
            ),
        },
    )


def _engine_side_channel_env(spec: DisaggDeploymentSpec, owner: Owner, name: str) -> list[dict[str, Any]]:
    """Where a PP prefill engine's one side channel is: its head pod (stage 0) answers for every rank.

    A vLLM engine serves it from node rank 0 itself, so every stage's watcher reads its ranks there. The
    transfer sidecars serve the same shape: the head's fetches the other stages' payloads from their pods,
    whose DNS names the StatefulSet keeps stable across restarts (and a restarted stage's new agent is
    fetched again on the head's next refresh), so no stage needs to know whether the head is up.
    """
    pp = spec.prefill.pipeline_parallel_size
    if pp == 1:
        return []
    port = spec.kv_transfer.side_channel_port
    if is_vllm_image(role_image(spec, "prefill")):
        return [{"name": ENGINE_SIDE_CHANNEL_HOST_ENV, "value": stage_dns(name, name, owner.namespace)}]
    # One transfer sidecar per stage pod, serving TP rank 0 (the reference engine runs TP 1 per pod).
    workers = [
        {"ppRank": stage, "tpRank": 0, "host": f"{name}-{stage}.{name}.{owner.namespace}.svc", "port": port}
        for stage in range(1, pp)
    ]
    return [{"name": ENGINE_WORKERS_ENV, "value": json.dumps(workers, separators=(",", ":"))}]


def _deployment(
    spec: DisaggDeploymentSpec,
    owner: Owner,
    plan: TopologyPlan,
    compat_hash: str,
    checksum: str,
    installation: Installation,
) -> dict[str, Any]:
    selector = selector_labels(owner.name, "decode")
    return _object(
        "apps/v1",
        "Deployment",
        decode_name(owner.name),
        owner,
        "decode",
        spec={
            "replicas": spec.decode.replicas,
            "selector": {"matchLabels": selector},
            "template": _pod_template(
                spec, owner, plan, "decode", selector, compat_hash, checksum, None, installation
            ),
        },
    )


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


def _resources(
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


def _pod_template(
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
) -> dict[str, Any]:
    this = spec.role(role)
    # A vLLM engine runs the NIXL connector in-process and moves the KV itself; the sidecar then only watches
    # the handshakes. Otherwise the sidecar owns the NIXL agent. The RDMA devices, IPC_LOCK and the side
    # channel go to whichever container moves the data.
    engine_moves_kv = is_vllm_image(role_image(spec, role))
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
    engine_container_spec: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": role_image(spec, role),
        "env": list(engine.env),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}]
        + ([side_channel] if engine_moves_kv else []),
        "resources": _resources(this.resources, rdma if engine_moves_kv else None, huge_pages),
        "volumeMounts": mounts,
    }
    if engine.command:
        engine_container_spec["command"] = list(engine.command)
    if engine.args:
        engine_container_spec["args"] = list(engine.args)
    if is_reference_engine_image(role_image(spec, role)):
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
    engine_container_spec["securityContext"] = _copy(_MOVES_KV if engine_moves_kv else _UNPRIVILEGED)
    sidecar = {
        "name": SIDECAR_CONTAINER,
        "image": sidecar_image,
        "command": ["disagg"],
        "args": ["worker", "sidecar", "--mode", "watch" if engine_moves_kv else "transfer"],
        "env": [
            *identity,
            {"name": COMPATIBILITY_HASH_ENV, "value": compat_hash},
            {"name": METRICS_PORT_ENV, "value": str(spec.worker.metrics_port)},
            *(engine_env or ()),
        ],
        "ports": [{"name": "metrics", "containerPort": spec.worker.metrics_port, "protocol": "TCP"}]
        + ([] if engine_moves_kv else [side_channel]),
        "resources": _resources(spec.worker.resources, None if engine_moves_kv else rdma, huge_pages),
        # The transfer sidecar maps the engine's pool and registers it with NIXL: it runs as the engine does.
        "securityContext": _copy(
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
            {"name": "topology", "configMap": {"name": topology_name(owner.name)}},
            _api_access_volume(),
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
            "labels": {**owner_labels(owner.name), **selector},
            "annotations": {
                HASH_ANNOTATION: compat_hash,
                TOPOLOGY_ANNOTATION: checksum,
                DEPLOYMENT_ANNOTATION: owner.name,
            },
        },
        "spec": pod_spec,
    }


def _copy(value: Mapping[str, Any]) -> dict[str, Any]:
    copied: dict[str, Any] = json.loads(json.dumps(value))
    return copied


def _api_access_volume() -> dict[str, Any]:
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
