"""The `DisaggDeployment` API (`disagg.io/v1alpha1`): pydantic models that are the single source of truth.

`crds/` is generated from these models (`disagg.operator.crd`): field descriptions become `kubectl explain`
text; the cross-field rules live in `crd.SPEC_RULES` (CEL) and `disagg.operator.policies` (Python). Python
names are snake_case, the wire names camelCase (`alias_generator=to_camel`, `populate_by_name=True`).
Optional fields are omitted, never null, so the generated schema stays structural.
"""

from __future__ import annotations

import enum
import re
from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any, Final, Literal, TypeVar, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StringConstraints,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from disagg.worker.kv import layout
from disagg.worker.kv.pod_contract import DEFAULT_SIDE_CHANNEL_PORT

GROUP: Final = "disagg.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "DisaggDeployment"
PLURAL: Final = "disaggdeployments"
SINGULAR: Final = "disaggdeployment"
SHORT_NAMES: Final = ("disagg",)
Role = Literal["prefill", "decode"]
ROLES: Final[tuple[Role, Role]] = ("prefill", "decode")
_T = TypeVar("_T")
# Bounds on lists that CEL rules iterate and strings they compare: without maxItems/maxLength the API
# server's CEL cost estimate assumes the largest possible request and can refuse the CRD.
MAX_LAYERS: Final = 4096
MAX_STAGES: Final = 256
# A Kubernetes resource quantity in the forms a pool size takes (no exponent notation, no milli).
QUANTITY_PATTERN: Final = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
_QUANTITY_SUFFIXES: Final[dict[str, int]] = {
    "": 1,
    **{suffix: 1024 ** (i + 1) for i, suffix in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{suffix: 1000 ** (i + 1) for i, suffix in enumerate(("k", "M", "G", "T", "P", "E"))},
}

# The builders write one StatefulSet and one Service per prefill replica, and reconcile applies each: the
# bound keeps what one spec asks of the API server bounded (and a build of 2**32 replicas from hanging).
MAX_REPLICAS: Final = 256
MAX_TENSOR_PARALLEL: Final = 1024
MAX_BLOCK_SIZE: Final = 4096
MAX_EXTRA_ARGS: Final = 256
MAX_ARG_LENGTH: Final = 4096
# Real Affinity and Toleration objects are under ten levels deep; a bound keeps a hostile one from recursing.
MAX_FREE_FORM_DEPTH: Final = 32

# metav1.Condition's reason: CamelCase, for machines.
REASON_PATTERN: Final = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"

# A resource quantity as Kubernetes parses it (resource.Quantity), unsigned because a container's request or
# limit is never negative, with a bounded exponent; and a resource name (a qualified name, `nvidia.com/gpu`).
KUBE_QUANTITY_PATTERN: Final = (
    r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]{1,2})?$"
)
RESOURCE_NAME_PATTERN: Final = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_INT64_MAX: Final = 2**63 - 1


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON-like `value` nests more than `limit` levels (iteratively: a deep one must not recurse)."""
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        node, depth = pending.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        pending.extend((child, depth + 1) for child in children)
    return False


def _bounded_depth(value: Any) -> Any:
    if nested_deeper_than(value, MAX_FREE_FORM_DEPTH):
        raise ValueError(f"is nested more than {MAX_FREE_FORM_DEPTH} levels deep")
    return value


# Kubernetes objects the operator passes through untouched (Affinity, Toleration): typing them here would copy
# the core API into this CRD and drift from it.
FreeForm = Annotated[
    dict[str, Any],
    AfterValidator(_bounded_depth),
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]


def _quantity(value: int | str) -> int | str:
    if isinstance(value, int) and not 0 <= value <= _INT64_MAX:
        raise ValueError(f"{value} is not a quantity: a whole number must be between 0 and 2**63 - 1")
    if isinstance(value, str) and (len(value) > 64 or not re.fullmatch(KUBE_QUANTITY_PATTERN, value)):
        raise ValueError(f"{value[:64]!r} is not a Kubernetes quantity such as 2, 500m or 16Gi")
    return value


_QUANTITY_SCHEMA: Final = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "x-kubernetes-int-or-string": True,
    "pattern": KUBE_QUANTITY_PATTERN,
}
Quantity = Annotated[StrictInt | str, AfterValidator(_quantity)]
ResourceName = Annotated[str, StringConstraints(max_length=253, pattern=RESOURCE_NAME_PATTERN)]
# A structural schema cannot constrain map keys (no patternProperties): the names are checked in Python.
ResourceList = Annotated[
    dict[ResourceName, Quantity],
    WithJsonSchema({"type": "object", "additionalProperties": _QUANTITY_SCHEMA, "maxProperties": 64}),
]
ExtraArg = Annotated[str, StringConstraints(max_length=MAX_ARG_LENGTH)]


class ApiModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )


class AttentionKind(enum.StrEnum):
    """What a layer keeps in the KV cache; decides HMA, MLA (replicated cache) and Mamba handling."""

    FULL = "Full"
    SLIDING_WINDOW = "SlidingWindow"
    MLA = "MLA"
    MAMBA = "Mamba"

    def to_layout(self) -> layout.AttentionKind:
        return _LAYOUT_KINDS[self]


_LAYOUT_KINDS: Final = {
    AttentionKind.FULL: layout.AttentionKind.FULL,
    AttentionKind.SLIDING_WINDOW: layout.AttentionKind.SLIDING_WINDOW,
    AttentionKind.MLA: layout.AttentionKind.MLA,
    AttentionKind.MAMBA: layout.AttentionKind.MAMBA,
}


class ModelDType(enum.StrEnum):
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"

    @property
    def num_bytes(self) -> int:
        return 4 if self is ModelDType.FLOAT32 else 2


class KVCacheDType(enum.StrEnum):
    """vLLM's `--kv-cache-dtype` spellings; `auto` follows the model dtype."""

    AUTO = "auto"
    FP8 = "fp8"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"


class HybridKVCacheManager(enum.StrEnum):
    """vLLM's hybrid KV cache manager (HMA); `Disabled` is `--disable-hybrid-kv-cache-manager`."""

    ENABLED = "Enabled"
    DISABLED = "Disabled"


class KVCacheLayout(enum.StrEnum):
    """`LayerOutermost` is one region per layer (LBHNC); `BlockOutermost` packs every layer's page of a block
    together (BLHNC, vLLM #50499) and, like HMA, needs layer-name routing under PP."""

    LAYER_OUTERMOST = "LayerOutermost"
    BLOCK_OUTERMOST = "BlockOutermost"


class Connector(enum.StrEnum):
    """`Push`: prefill WRITEs KV into decode (NixlPushConnector). `Pull`: decode READs it (NixlConnector)."""

    PUSH = "Push"
    PULL = "Pull"

    @property
    def transfer_mode(self) -> Literal["push", "pull"]:
        return "push" if self is Connector.PUSH else "pull"

    @property
    def vllm_class(self) -> str:
        return "NixlPushConnector" if self is Connector.PUSH else "NixlConnector"


class NixlBackend(enum.StrEnum):
    UCX = "UCX"
    LIBFABRIC = "LIBFABRIC"
    GDS = "GDS"


class LayerPattern(ApiModel):
    """A periodic attention pattern (Gemma-style): layer i is Full iff (i + 1) % fullEvery == 0."""

    full_every: int = Field(
        ge=1, description="Period of full-attention layers: 6 gives the 5:1 sliding/full mix."
    )
    other_kind: AttentionKind = Field(
        default=AttentionKind.SLIDING_WINDOW,
        description="Kind of every layer that is not a full-attention layer.",
    )


class ModelSpec(ApiModel):
    """The served model's KV-cache geometry, identical on prefill and decode."""

    name: str = Field(
        min_length=1,
        max_length=512,
        description="Model name or path as the engine loads it (hashed by vLLM).",
    )
    revision: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="Model revision (commit or tag) to pin weights.",
    )
    dtype: ModelDType = Field(
        default=ModelDType.BFLOAT16, description="Resolved model dtype (vLLM hashes it)."
    )
    num_layers: int = Field(
        ge=1, le=MAX_LAYERS, description="Total hidden layers of the model (not a pipeline stage's share)."
    )
    num_kv_heads: int = Field(
        ge=1, description="Total KV heads of the model, before tensor-parallel splitting."
    )
    head_size: int = Field(ge=1, description="Size of one KV head (for MLA: the latent width).")
    kv_cache_dtype: KVCacheDType = Field(
        default=KVCacheDType.AUTO, description="KV cache dtype (--kv-cache-dtype)."
    )
    attention_kind: AttentionKind = Field(
        default=AttentionKind.FULL,
        description="Kind of every layer when neither layerPattern nor attentionKinds is given.",
    )
    layer_pattern: LayerPattern | None = Field(
        default=None, description="Periodic attention pattern; exclusive with attentionKinds."
    )
    attention_kinds: list[AttentionKind] | None = Field(
        default=None,
        max_length=MAX_LAYERS,
        description="Attention kind of each layer, one entry per layer; exclusive with layerPattern.",
    )
    layer_name_template: str = Field(
        default=layout.DEFAULT_LAYER_NAME_TEMPLATE,
        max_length=layout.MAX_LAYER_NAME_TEMPLATE,
        json_schema_extra={"pattern": layout.LAYER_NAME_TEMPLATE_PATTERN},
        description="Engine layer name with {i} for the layer index; names route KV between PP stages. "
        "{i} is the only field (no format spec or conversion); write a literal brace as {{ or }}.",
    )

    @field_validator("layer_name_template")
    @classmethod
    def _a_template_of_i(cls, template: str) -> str:
        # The pattern is in the CRD too; here it gets a message that says what to write.
        problem = layout.layer_name_template_problem(template)
        if problem is not None:
            raise ValueError(f"layerNameTemplate {problem}")
        return template

    @model_validator(mode="after")
    def _one_layer_description(self) -> ModelSpec:
        if self.layer_pattern is not None and self.attention_kinds is not None:
            raise ValueError("give either layerPattern or attentionKinds, not both")
        if self.attention_kinds is not None and len(self.attention_kinds) != self.num_layers:
            raise ValueError(
                f"attentionKinds has {len(self.attention_kinds)} entries but numLayers is {self.num_layers}: "
                "give one kind per layer"
            )
        return self

    def layer_kinds(self) -> tuple[AttentionKind, ...]:
        if self.attention_kinds is not None:
            return tuple(self.attention_kinds)
        if self.layer_pattern is not None:
            period, other = self.layer_pattern.full_every, self.layer_pattern.other_kind
            return tuple(
                AttentionKind.FULL if (i + 1) % period == 0 else other for i in range(self.num_layers)
            )
        return (self.attention_kind,) * self.num_layers


class EngineSpec(ApiModel):
    """The inference engine both roles run."""

    image: str = Field(min_length=1, max_length=512, description="Engine container image.")
    version: str = Field(
        min_length=1, max_length=64, description="Engine (vLLM) version in the image; part of the hash."
    )
    attention_backend: str = Field(
        default="FLASH_ATTN",
        min_length=1,
        max_length=64,
        description="Attention backend name the engine resolves (hashed by vLLM).",
    )
    hybrid_kv_cache_manager: HybridKVCacheManager = Field(
        default=HybridKVCacheManager.ENABLED,
        description="Hybrid KV cache manager (HMA) switch; part of the hash.",
    )
    kv_cache_layout: KVCacheLayout = Field(
        default=KVCacheLayout.LAYER_OUTERMOST, description="Physical KV cache layout."
    )
    extra_args: list[ExtraArg] = Field(
        default_factory=list, max_length=MAX_EXTRA_ARGS, description="Extra engine arguments for both roles."
    )


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


class DisaggDeploymentSpec(ApiModel):
    """A prefill/decode pair serving one model, with KV pushed from prefill stages to decode."""

    model: ModelSpec = Field(description="The served model's KV-cache geometry.")
    engine: EngineSpec = Field(description="The inference engine both roles run.")
    kv_transfer: KVTransferSpec = Field(
        default_factory=lambda: KVTransferSpec(),
        json_schema_extra={"default": {}},
        description="KV transfer settings.",
    )
    prefill: RoleSpec = Field(description="Prefill role: computes KV; may be pipeline-parallel.")
    decode: RoleSpec = Field(description="Decode role: receives KV and generates tokens; PP must be 1.")
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

    def role(self, role: Role) -> RoleSpec:
        return self.prefill if role == "prefill" else self.decode

    def effective(self, role: Role, name: str, shared: _T) -> _T:
        """A role's override (`spec.<role>.overrides.<name>`) of a shared setting, or the shared value."""
        overrides = self.role(role).overrides
        value = getattr(overrides, name) if overrides is not None else None
        return shared if value is None else cast(_T, value)


class ConditionStatus(enum.StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(ApiModel):
    """One aspect of the object's state (metav1.Condition)."""

    type: str = Field(
        min_length=1, max_length=316, description="Condition type, CamelCase (e.g. Compatible)."
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        min_length=1,
        max_length=1024,
        pattern=REASON_PATTERN,
        description="CamelCase reason for the last transition, for machines.",
    )
    # Required but possibly empty, as in metav1.Condition; an empty-string schema default is refused by
    # the 1.20 API server ("must be of type string: null").
    message: str = Field(max_length=32768, description="What happened and what to change, for people.")
    observed_generation: int | None = Field(
        default=None,
        ge=0,
        json_schema_extra={"format": "int64"},
        description="Spec generation this was computed from.",
    )
    last_transition_time: datetime = Field(description="When status last changed.")


class RoleStatus(ApiModel):
    """Observed pods of one role."""

    replicas: int = Field(default=0, ge=0, description="Engine pods that exist.")
    ready_replicas: int = Field(
        default=0, ge=0, description="Engine pods that are ready (readiness gate included)."
    )


class RoutingMode(enum.StrEnum):
    """How a prefill stage pairs its KV regions with decode's."""

    LAYER_NAME = "layer-name"
    REGION_INDEX = "region-index"


class StageStatus(ApiModel):
    """One prefill pipeline stage: its layers [startLayer, endLayer) and how they are routed."""

    stage: int = Field(ge=0, description="Pipeline rank (the StatefulSet pod ordinal).")
    start_layer: int = Field(ge=0, description="First layer of the stage.")
    end_layer: int = Field(ge=1, description="One past the last layer of the stage.")
    routing_mode: RoutingMode = Field(description="layer-name or region-index.")


class TopologyStatus(ApiModel):
    """The computed prefill-to-decode topology."""

    routing_mode: RoutingMode = Field(description="Routing mode of the prefill stages.")
    stages: list[StageStatus] = Field(default_factory=list, description="Prefill stages in rank order.")


class RoleHashes(ApiModel):
    """vLLM NIXL compatibility hash each role will advertise."""

    prefill: str = Field(description="sha256 of the prefill role's factors.")
    decode: str = Field(description="sha256 of the decode role's factors.")


class DisaggDeploymentStatus(ApiModel):
    """Observed state; conditions are the summary, there is no phase."""

    observed_generation: int | None = Field(
        default=None,
        ge=0,
        json_schema_extra={"format": "int64"},
        description="Spec generation last reconciled.",
    )
    conditions: list[Condition] | None = Field(
        default=None,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        description="Compatible, Available, Progressing, KVTransferReady and Routable.",
    )
    prefill: RoleStatus | None = Field(default=None, description="Observed prefill pods.")
    decode: RoleStatus | None = Field(default=None, description="Observed decode pods.")
    topology: TopologyStatus | None = Field(default=None, description="Computed stage-to-layer topology.")
    compatibility_hashes: RoleHashes | None = Field(
        default=None, description="Compatibility hashes per role."
    )
    routable_pairs: str | None = Field(
        default=None,
        max_length=64,
        description="Routable (prefill engine, decode pod) pairs of all pairs, e.g. 3/4 (see Routable).",
    )
    endpoint: str | None = Field(
        default=None,
        max_length=512,
        description="URL of the router's Service, the deployment's OpenAI-compatible API "
        "(http://<name>-router.<namespace>.svc:<port>); absent while no router Service exists.",
    )


class ObjectMeta(BaseModel):
    """The metadata fields the operator reads; the rest is kept as given."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str | None = None
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class DisaggDeployment(ApiModel):
    """A whole `DisaggDeployment` object as read from a file or the API server."""

    api_version: Literal["disagg.io/v1alpha1"] = "disagg.io/v1alpha1"
    kind: Literal["DisaggDeployment"] = "DisaggDeployment"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: DisaggDeploymentSpec
    status: DisaggDeploymentStatus | None = None

    def to_dict(self) -> dict[str, Any]:
        """camelCase JSON-ready dict without omitted fields, as the API server would store it."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
