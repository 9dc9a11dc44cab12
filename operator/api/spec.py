"""The rest of `DisaggDeploymentSpec`: the KV transfer, the roles, the sidecar, the router, scheduling and
resources, and the spec itself."""

from __future__ import annotations

import enum
import re
from decimal import Decimal
from typing import Final, TypeVar, cast

from pydantic import (
    Field,
    model_validator,
)

from disagg.operator.api.autoscaling import DecodeAutoscaling, PrefillAutoscaling, ScalingMode
from disagg.operator.api.fields import (
    MAX_BLOCK_SIZE,
    MAX_EXTRA_ARGS,
    MAX_REPLICAS,
    MAX_STAGES,
    MAX_TENSOR_PARALLEL,
    QUANTITY_PATTERN,
    ApiModel,
    ExtraArg,
    FreeForm,
    IntOrPercent,
    ResourceList,
    Role,
)
from disagg.operator.api.model import Connector, EngineSpec, KVCacheDType, ModelDType, ModelSpec, NixlBackend
from disagg.worker.contracts.pod_contract import DEFAULT_SIDE_CHANNEL_PORT

_T = TypeVar("_T")
_QUANTITY_SUFFIXES: Final[dict[str, int]] = {
    "": 1,
    **{suffix: 1024 ** (i + 1) for i, suffix in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{suffix: 1000 ** (i + 1) for i, suffix in enumerate(("k", "M", "G", "T", "P", "E"))},
}


class RDMASpec(ApiModel):
    """The extended resource that grants a pod RDMA devices."""

    resource_name: str = Field(
        default="rdma/ib", min_length=1, description="Extended resource name, e.g. rdma/ib."
    )
    count: int = Field(default=1, ge=1, description="RDMA devices requested per engine pod.")


class KVPoolMedium(enum.StrEnum):
    """What backs the KV pool volume, spelled as Kubernetes spells an emptyDir medium."""

    MEMORY = "Memory"
    HUGE_PAGES_2MI = "HugePages-2Mi"
    HUGE_PAGES_1GI = "HugePages-1Gi"

    @property
    def huge_page_bytes(self) -> int | None:
        """The huge page size, or None for 4 KiB-paged tmpfs."""
        return _HUGE_PAGE_BYTES.get(self)

    @property
    def resource_name(self) -> str | None:
        """The container resource that reserves these huge pages (`hugepages-2Mi`), or None."""
        return None if self is KVPoolMedium.MEMORY else f"hugepages-{self.value.split('-', 1)[1]}"


_HUGE_PAGE_BYTES: Final = {KVPoolMedium.HUGE_PAGES_2MI: 2 << 20, KVPoolMedium.HUGE_PAGES_1GI: 1 << 30}


def quantity_bytes(quantity: str) -> Decimal:
    """A quantity matching QUANTITY_PATTERN in bytes (exact: `1.5Gi` is 1610612736)."""
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", quantity)
    if match is None or not re.fullmatch(QUANTITY_PATTERN, quantity):
        raise ValueError(f"{quantity!r} is not a quantity such as 16Gi or 4096Mi")
    return Decimal(match.group(1)) * _QUANTITY_SUFFIXES[match.group(2)]


class KVPoolSpec(ApiModel):
    """The shared-memory volume that holds each engine pod's KV pool, which the engine and the sidecar map.

    NIXL on one host (UCX CMA) writes into a pool in huge pages at about the speed of memcpy, and into one in
    4 KiB pages at well under half of it: give the decode pods huge pages where the nodes have them."""

    medium: KVPoolMedium = Field(
        default=KVPoolMedium.MEMORY,
        description="Memory: tmpfs in 4 KiB pages, the pod's /dev/shm (the default). HugePages-2Mi or "
        "HugePages-1Gi: a hugetlbfs volume of that page size mounted at /dev/hugepages, with the pool at "
        "/dev/hugepages/kv-pool (DISAGG_KV_POOL in both containers); the engine and sidecar containers then "
        "request and are limited to sizeLimit of hugepages-2Mi or hugepages-1Gi, and Kubernetes requires "
        "each of them to request or limit cpu or memory too (prefill.resources, decode.resources, "
        "worker.resources). The nodes must have the huge pages preallocated.",
    )
    size_limit: str | None = Field(
        default=None,
        pattern=QUANTITY_PATTERN,
        max_length=64,
        description="Size of the pool volume, a quantity such as 16Gi. Required for the HugePages media, a "
        "whole number of huge pages; optional for Memory (the /dev/shm volume's sizeLimit).",
    )

    def size_bytes(self) -> Decimal | None:
        return None if self.size_limit is None else quantity_bytes(self.size_limit)


class KVTransport(enum.StrEnum):
    """The transport the KV must take; the names of `disagg.worker.contracts.ucx_lanes.TRANSPORTS`."""

    ANY = "any"
    RDMA = "rdma"
    TCP = "tcp"
    SHM = "shm"
    CUDA_IPC = "cuda_ipc"


class KVTransferSpec(ApiModel):
    """How KV blocks move from prefill to decode."""

    connector: Connector = Field(
        default=Connector.PUSH, description="Push (prefill WRITEs) or Pull (decode READs)."
    )
    backends: list[NixlBackend] = Field(
        default_factory=lambda: [NixlBackend.UCX],
        min_length=1,
        json_schema_extra={"default": [NixlBackend.UCX.value]},
        description="NIXL backend plugins, in order.",
    )
    side_channel_port: int = Field(
        default=DEFAULT_SIDE_CHANNEL_PORT, ge=1, le=65535, description="Handshake side-channel TCP port."
    )
    lease_seconds: int = Field(
        default=30,
        ge=1,
        description="How long prefill keeps finished KV blocks for decode (kv_lease_duration).",
    )
    transport: KVTransport = Field(
        default=KVTransport.ANY,
        description="The transport KV must take: any (UCX chooses), rdma, tcp, shm or cuda_ipc. Anything "
        "but any leaves UCX only that transport (UCX_TLS), so a node without it fails at the sidecar's start "
        "or the handshake with UCX's reason instead of falling back; each pair's real transport is in "
        "status.kvTransports either way.",
    )
    rdma: RDMASpec | None = Field(
        default=None, description="RDMA devices per pod; omit on nodes without RDMA."
    )
    node_selector: dict[str, str] | None = Field(
        default=None,
        description="Labels of nodes that can do the transfer (RDMA-capable), applied to both roles.",
    )
    kv_pool: KVPoolSpec | None = Field(
        default=None,
        description="The volume of the engine pods' KV pool; omitted: tmpfs (/dev/shm) in 4 KiB pages.",
    )


class SchedulingSpec(ApiModel):
    """Where a role's pods may run."""

    node_selector: dict[str, str] | None = Field(default=None, description="Node labels the pods require.")
    tolerations: list[FreeForm] | None = Field(
        default=None, description="Pod tolerations (core/v1 Toleration)."
    )
    affinity: FreeForm | None = Field(default=None, description="Pod affinity (core/v1 Affinity).")


class Resources(ApiModel):
    """A container's requests and limits (core/v1 ResourceRequirements): resource names to quantities."""

    requests: ResourceList | None = Field(
        default=None, max_length=64, description="Minimum resources, e.g. {cpu: 2, memory: 8Gi}."
    )
    limits: ResourceList | None = Field(
        default=None, max_length=64, description="Maximum resources, e.g. {nvidia.com/gpu: 2}."
    )

    def sections(self) -> dict[str, dict[str, int | str]]:
        """The given sections as the pod spec spells them."""
        given = {"requests": self.requests, "limits": self.limits}
        return {key: dict(value) for key, value in given.items() if value is not None}


class RoleOverrides(ApiModel):
    """Per-role replacements for shared engine and model settings. Any compatibility factor that then differs
    between prefill and decode makes the deployment incompatible; overrides exist for the fields that may
    legitimately be spelled differently per role and so must be checked, not assumed, equal."""

    image: str | None = Field(
        default=None, min_length=1, max_length=512, description="Engine image for this role only."
    )
    version: str | None = Field(
        default=None, min_length=1, max_length=64, description="Engine version for this role only."
    )
    attention_backend: str | None = Field(
        default=None, min_length=1, max_length=64, description="Attention backend for this role only."
    )
    revision: str | None = Field(
        default=None, min_length=1, max_length=256, description="Model revision for this role only."
    )
    dtype: ModelDType | None = Field(default=None, description="Model dtype for this role only.")
    kv_cache_dtype: KVCacheDType | None = Field(
        default=None, description="KV cache dtype for this role only."
    )


class RoleSpec(ApiModel):
    """One role (prefill or decode): its parallel layout, size and placement."""

    replicas: int = Field(
        default=1,
        ge=0,
        le=MAX_REPLICAS,
        description="Engine instances; a prefill instance is one pod per PP stage.",
    )
    pipeline_parallel_size: int = Field(
        default=1, ge=1, le=MAX_STAGES, description="Pipeline stages per instance (decode: must be 1)."
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=MAX_TENSOR_PARALLEL, description="Tensor-parallel ranks per stage (GPUs per pod)."
    )
    block_size: int = Field(default=16, ge=1, le=MAX_BLOCK_SIZE, description="KV cache block size in tokens.")
    layer_partition: list[int] | None = Field(
        default=None,
        max_length=MAX_STAGES,
        description="Layers per pipeline stage (VLLM_PP_LAYER_PARTITION); omitted: vLLM's even split.",
    )
    extra_args: list[ExtraArg] = Field(
        default_factory=list, max_length=MAX_EXTRA_ARGS, description="Extra engine arguments for this role."
    )
    overrides: RoleOverrides | None = Field(default=None, description="Per-role engine and model settings.")
    resources: Resources | None = Field(default=None, description="Engine container resources (core/v1).")
    scheduling: SchedulingSpec | None = Field(default=None, description="Node selection for this role.")


class PrefillSpec(RoleSpec):
    """The prefill role: `replicas` engines, each a StatefulSet of one pod per pipeline stage."""

    autoscaling: PrefillAutoscaling | None = Field(
        default=None,
        description="Let the operator's planner set replicas within bounds from a TTFT or prompt-throughput "
        "target; omitted: replicas is fixed.",
    )


class DecodeSpec(RoleSpec):
    """The decode role: `replicas` pods of one Deployment (the DisaggDeployment's scale subresource)."""

    autoscaling: DecodeAutoscaling | None = Field(
        default=None,
        description="Let the operator's planner set replicas within bounds from an inter-token latency, "
        "KV-cache usage or running-requests target, or (mode External) leave the decode Deployment's "
        "replicas to your own autoscaler; omitted: replicas is fixed.",
    )


class WorkerSpec(ApiModel):
    """The KV-transfer worker sidecar injected into every engine pod."""

    image: str | None = Field(
        default=None,
        min_length=1,
        description="Sidecar container image. Default: the operator's DISAGG_WORKER_IMAGE (the Helm chart's "
        "worker.image); the spec is refused if neither is set.",
    )
    resources: Resources | None = Field(default=None, description="Sidecar container resources (core/v1).")
    metrics_port: int = Field(
        default=9400, ge=1, le=65535, description="Port of the sidecar's Prometheus metrics."
    )


# A router binds its port as a non-root user, which cannot bind below 1024 without a capability.
MIN_ROUTER_PORT: Final = 1024
MAX_ROUTER_REPLICAS: Final = 64


class RouterSpec(ApiModel):
    """The OpenAI-compatible request router in front of the engines (`disagg router run`): a Deployment and a
    ClusterIP Service named `<name>-router`, sending each request to a prefill engine and a decoder whose
    sidecars report a successful KV handshake with each other."""

    enabled: bool = Field(
        default=True,
        description="Create the router; false leaves it out (and removes one that exists), for a router of "
        "your own.",
    )
    replicas: int = Field(
        default=1, ge=0, le=MAX_ROUTER_REPLICAS, description="Router pods behind the Service."
    )
    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description="Router container image. Default: the operator's DISAGG_ROUTER_IMAGE (the Helm chart "
        "sets the operator's own image), else the sidecar image (every disagg image has the router).",
    )
    port: int = Field(
        default=8000,
        ge=MIN_ROUTER_PORT,
        le=65535,
        description="Port of the router's Service and container; 1024 or above (the router is not root).",
    )
    resources: Resources | None = Field(default=None, description="Router container resources (core/v1).")
    scheduling: SchedulingSpec | None = Field(default=None, description="Node selection for the router pods.")


# The router's longest bound on one request (`worker/router/config.py`, `request_timeout_s`): by default a
# draining pod is given as long as any request through the router may take.
DEFAULT_DRAIN_SECONDS: Final = 3600
MAX_DRAIN_SECONDS: Final = 86400
DEFAULT_PROGRESS_DEADLINE_SECONDS: Final = 600
DEFAULT_MAX_SURGE: Final = "25%"
DEFAULT_MAX_UNAVAILABLE: Final = 0


class RolloutSpec(ApiModel):
    """How a change that needs new prefill/decode pairs is rolled out (one that changes the compatibility
    hashes or the topology document: the engine version, the model's KV geometry, dtypes, block size,
    parallel sizes, the connector; see the table in docs/cluster.md). The new revision's prefill engines
    and decode pods come up beside the old ones in steps bounded by maxSurge and maxUnavailable; the router
    sends them traffic only once they pair with each other; old pods are drained before they are deleted.
    Any other change (replicas, resources, images of the same release, the router) is applied in place."""

    drain_seconds: int = Field(
        default=DEFAULT_DRAIN_SECONDS,
        ge=0,
        le=MAX_DRAIN_SECONDS,
        description="The longest an old engine drains: it takes no new request and is deleted once its "
        "sidecar reports nothing in flight (measured a few seconds after the drain began), or this many "
        "seconds after the drain began, whichever is first (default 3600: the router's bound on one "
        "request). Engines that never served are deleted without waiting.",
    )
    progress_deadline_seconds: int = Field(
        default=DEFAULT_PROGRESS_DEADLINE_SECONDS,
        ge=1,
        le=MAX_DRAIN_SECONDS,
        description="How long a new revision may take to have a routable pair before the rollout is "
        "stuck (Progressing False, RolloutStuck); the old revision keeps serving. A hash mismatch within "
        "the new revision, as the sidecars report it, stops the rollout at once.",
    )
    max_surge: IntOrPercent = Field(
        default=DEFAULT_MAX_SURGE,
        description="How many engines of a role may exist above its replicas while rolling out, per role: "
        "prefill engines (a pipeline-parallel prefill engine is its stage pods together, useless without "
        "all of them) and decode pods. A number, or a percentage of the role's replicas rounded up "
        "(default 25%). The new revision grows by a step only once its previous step's engines are in "
        "routable pairs; 100% brings the whole new revision up at once.",
    )
    max_unavailable: IntOrPercent = Field(
        default=DEFAULT_MAX_UNAVAILABLE,
        description="How many engines of a role may be out of service below its replicas while rolling "
        "out, per role, counted like maxSurge (a percentage rounds down; default 0: an old engine is "
        "drained only once a new one serves in its place). At least one routable pair is kept at every "
        "moment whatever this says. maxSurge and maxUnavailable may not both be 0.",
    )

    @model_validator(mode="after")
    def _steps_move(self) -> RolloutSpec:
        if _is_zero(self.max_surge) and _is_zero(self.max_unavailable):
            raise ValueError(
                "maxSurge and maxUnavailable are both 0: a rollout could neither add a new engine nor "
                "take an old one out; set maxSurge to at least 1 (or 25%)"
            )
        return self


def _is_zero(value: int | str) -> bool:
    return value in (0, "0%")


class DisaggDeploymentSpec(ApiModel):
    """A prefill/decode pair serving one model, with KV pushed from prefill stages to decode."""

    model: ModelSpec = Field(description="The served model's KV-cache geometry.")
    engine: EngineSpec = Field(description="The inference engine both roles run.")
    kv_transfer: KVTransferSpec = Field(
        default_factory=lambda: KVTransferSpec(),
        json_schema_extra={"default": {}},
        description="KV transfer settings.",
    )
    prefill: PrefillSpec = Field(description="Prefill role: computes KV; may be pipeline-parallel.")
    decode: DecodeSpec = Field(description="Decode role: receives KV and generates tokens; PP must be 1.")
    worker: WorkerSpec = Field(
        default_factory=lambda: WorkerSpec(),
        json_schema_extra={"default": {}},
        description="The KV-transfer worker sidecar.",
    )
    router: RouterSpec = Field(
        default_factory=lambda: RouterSpec(),
        json_schema_extra={"default": {}},
        description="The OpenAI-compatible router in front of the engines (on by default).",
    )
    rollout: RolloutSpec = Field(
        default_factory=lambda: RolloutSpec(),
        json_schema_extra={"default": {}},
        description="How a change that needs new prefill/decode pairs rolls out: beside the old "
        "revision, which is drained once the new one is routable.",
    )

    def role(self, role: Role) -> RoleSpec:
        return self.prefill if role == "prefill" else self.decode

    def autoscaling(self, role: Role) -> PrefillAutoscaling | DecodeAutoscaling | None:
        return self.prefill.autoscaling if role == "prefill" else self.decode.autoscaling

    def planned(self, role: Role) -> bool:
        """Whether the operator's planner sets this role's replica count."""
        scaling = self.autoscaling(role)
        return scaling is not None and scaling.mode == ScalingMode.PLANNER

    def external(self, role: Role) -> bool:
        """Whether the user's own autoscaler owns this role's workload replicas."""
        scaling = self.autoscaling(role)
        return scaling is not None and scaling.mode == ScalingMode.EXTERNAL

    def effective(self, role: Role, name: str, shared: _T) -> _T:
        """A role's override (`spec.<role>.overrides.<name>`) of a shared setting, or the shared value."""
        overrides = self.role(role).overrides
        value = getattr(overrides, name) if overrides is not None else None
        return shared if value is None else cast(_T, value)
