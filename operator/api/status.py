"""`DisaggDeploymentStatus` (conditions, roles, topology, hashes) and the whole `DisaggDeployment` object."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)

from disagg.operator.api.fields import REASON_PATTERN, ApiModel
from disagg.operator.api.model import EngineKind, HybridKVCacheManager
from disagg.operator.api.spec import DisaggDeploymentSpec


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
    """Observed pods of one role, and the replica count the operator applies to it."""

    replicas: int = Field(
        default=0,
        ge=0,
        description="Engine pods that exist (decode: the scale subresource's status replicas).",
    )
    ready_replicas: int = Field(
        default=0, ge=0, description="Engine pods that are ready (readiness gate included)."
    )
    desired_replicas: int | None = Field(
        default=None,
        ge=0,
        description="Replicas (prefill engines, decode pods) the role is to have: spec.<role>.replicas, or "
        "the planner's count under autoscaling (the Scaling condition says why it last changed); absent "
        "when an external autoscaler owns it.",
    )
    selector: str | None = Field(
        default=None,
        max_length=1024,
        description="Label selector of the role's pods (the scale subresource's, for an autoscaler).",
    )
    engine_kind: EngineKind | None = Field(
        default=None,
        description="The engine kind the role's pods were built for: spec.engine.kind, or the one the "
        "image's name gives when it is unset.",
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
    hybrid_kv_cache_manager: HybridKVCacheManager | None = Field(
        default=None,
        description="Whether the engines run the hybrid KV cache manager: spec.engine.hybridKvCacheManager, "
        "with Auto resolved to what the operator chose (`disagg check` says why).",
    )
    stages: list[StageStatus] = Field(default_factory=list, description="Prefill stages in rank order.")


class RoleHashes(ApiModel):
    """vLLM NIXL compatibility hash each role will advertise."""

    prefill: str = Field(description="sha256 of the prefill role's factors.")
    decode: str = Field(description="sha256 of the decode role's factors.")


class PairTransportStatus(ApiModel):
    """The transport one prefill pod's worker's KV took to one decode pod, as UCX itself chose it."""

    prefill_pod: str = Field(max_length=253, description="The prefill pod (one PP stage) that writes the KV.")
    decode_pod: str = Field(max_length=253, description="The decode pod it writes into.")
    transport: str = Field(
        max_length=64, description="The lanes' family: rdma, tcp, shm, cuda_ipc, or several joined by +."
    )
    lanes: str | None = Field(
        default=None, max_length=96, description="The UCX lanes as UCX printed them, e.g. cma/memory."
    )
    kv_bytes: int = Field(default=0, ge=0, description="Bytes of KV written to the pair's decode engine.")
    gbps: float = Field(default=0.0, ge=0, description="Those bytes over the WRITEs' seconds, in GB/s.")


class RevisionStatus(ApiModel):
    """One revision of the engines (what their pairs depend on) while it has workloads."""

    revision: str = Field(max_length=64, description="The revision: a hash of the topology document.")
    slot: str = Field(max_length=8, description="Which set of children holds it: a (the plain names) or b.")
    routable_pairs: int = Field(default=0, ge=0, description="Routable pairs within this revision.")
    draining: bool = Field(default=False, description="Some of its pods take no new request and are to go.")
    prefill_replicas: int = Field(
        default=0, ge=0, description="Prefill engines it runs at this step of the rollout."
    )
    decode_replicas: int = Field(
        default=0, ge=0, description="Decode pods it runs at this step of the rollout."
    )


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
        description="Compatible, Available, Progressing, KVTransferReady, Routable and (under "
        "autoscaling) Scaling.",
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
    kv_transport: str | None = Field(
        default=None,
        max_length=64,
        description="The transports of the pairs the prefill pods reported, e.g. shm 2/2.",
    )
    kv_transports: list[PairTransportStatus] | None = Field(
        default=None,
        max_length=256,
        description="Per pair, the transport UCX chose for its KV (from UCX's own protocol selection), with "
        "bytes and GB/s.",
    )
    revision: str | None = Field(
        default=None,
        max_length=64,
        description="The spec's revision: a hash of what pairs depend on (the topology document, with the "
        "compatibility hashes); a change of it rolls out beside the old revision.",
    )
    old_revision: str | None = Field(
        default=None,
        max_length=64,
        description="The revision being replaced while a rollout is under way; absent otherwise.",
    )
    revisions: list[RevisionStatus] | None = Field(
        default=None, max_length=2, description="The revisions that have workloads, the spec's first."
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
