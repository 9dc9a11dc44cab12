"""The topology a `DisaggDeploymentSpec` describes: which layers each prefill stage holds, and how it routes.

Pure: the layer split is the worker's own (`disagg.worker.kv.layout.pp_partition`, vLLM's even split or an
explicit partition), and the routing decision is the worker's rule (`requires_layer_name_routing`), so the
operator's plan and what the sidecars do cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from disagg.operator.api import (
    DisaggDeploymentSpec,
    HybridKVCacheManager,
    KVCacheLayout,
    Role,
    RoutingMode,
    StageStatus,
    TopologyStatus,
)
from disagg.operator.hma import hma_enabled
from disagg.worker.contracts.releases import LATEST, Release, release_of
from disagg.worker.contracts.topology import StageDocument
from disagg.worker.kv.layout import ModelGeometry, pp_partition
from disagg.worker.kv.rules import requires_layer_name_routing


@dataclass(frozen=True)
class StagePlan:
    """One prefill pipeline stage (the pod with this StatefulSet ordinal)."""

    stage: int
    layers: range
    layer_names: tuple[str, ...]
    routing_mode: RoutingMode


@dataclass(frozen=True)
class TopologyPlan:
    transfer_mode: Literal["push", "pull"]
    # Whether the KV cache is hybrid (HMA on and some layer not full attention), and whether the engines run
    # the hybrid KV cache manager at all (`disagg.operator.hma`).
    hma: bool
    packed: bool
    prefill_tp: int
    decode_tp: int
    stages: tuple[StagePlan, ...]
    routing_mode: RoutingMode
    hma_manager: bool = True

    @property
    def pp_size(self) -> int:
        return len(self.stages)

    @property
    def notifications_per_request(self) -> int:
        """Completion notifications a decode rank waits for per request: one per stage and prefill TP peer."""
        return self.pp_size * max(1, self.prefill_tp // self.decode_tp)

    def to_status(self) -> TopologyStatus:
        return TopologyStatus(
            routing_mode=self.routing_mode,
            hybrid_kv_cache_manager=(
                HybridKVCacheManager.ENABLED if self.hma_manager else HybridKVCacheManager.DISABLED
            ),
            stages=[
                StageStatus(
                    stage=stage.stage,
                    start_layer=stage.layers.start,
                    end_layer=stage.layers.stop,
                    routing_mode=stage.routing_mode,
                )
                for stage in self.stages
            ],
        )

    def stage_documents(self) -> tuple[StageDocument, ...]:
        """The stages as the topology document (`disagg.worker.contracts.topology`) lists them."""
        return tuple(
            StageDocument(
                stage=stage.stage,
                start_layer=stage.layers.start,
                end_layer=stage.layers.stop,
                routing_mode=stage.routing_mode.value,
                layers=stage.layer_names,
            )
            for stage in self.stages
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form for `disagg check -o json` and `disagg plan -o json`; the topology document's
        keys (the ConfigMap carries the same and more, `disagg.worker.contracts.topology`)."""
        return {
            "transferMode": self.transfer_mode,
            "hma": self.hma,
            "packed": self.packed,
            "routingMode": self.routing_mode.value,
            "prefillTensorParallelSize": self.prefill_tp,
            "decodeTensorParallelSize": self.decode_tp,
            "notificationsPerRequest": self.notifications_per_request,
            # Through JSON, so that the stages are lists and mappings as in the ConfigMap's document.
            "stages": msgspec.json.decode(msgspec.json.encode(self.stage_documents())),
        }


def model_geometry(spec: DisaggDeploymentSpec) -> ModelGeometry:
    """The worker's view of the model; raises `LayoutError` for a geometry no engine can build."""
    model = spec.model
    return ModelGeometry(
        kinds=tuple(kind.to_layout() for kind in model.layer_kinds()),
        num_kv_heads=model.num_kv_heads,
        head_size=model.head_size,
        dtype_bytes=model.dtype.num_bytes,
        layer_name_template=model.layer_name_template,
        hma=hma_enabled(spec),
    )


def role_release(spec: DisaggDeploymentSpec, role: Role) -> Release:
    """The row of `releases.RELEASES` the role's version selects; the newest for a version no row has
    (pre-flight refuses that spec as UnsupportedEngineVersion, so its hash is never relied on)."""
    return release_of(spec.effective(role, "version", spec.engine.version)) or LATEST


def plan_topology(spec: DisaggDeploymentSpec, geometry: ModelGeometry | None = None) -> TopologyPlan:
    """Stage → layers and routing mode; raises `LayoutError` when the layer partition is invalid."""
    geometry = geometry if geometry is not None else model_geometry(spec)
    prefill = spec.prefill
    transfer_mode = spec.kv_transfer.connector.transfer_mode
    packed = spec.engine.kv_cache_layout is KVCacheLayout.BLOCK_OUTERMOST
    # The prefill stages pair regions: by layer name always from vLLM 0.34 (connector version 16).
    routing = requires_layer_name_routing(
        transfer_mode,
        geometry.hma_required,
        packed,
        geometry.has_mamba,
        prefill.pipeline_parallel_size,
        connector_version=role_release(spec, "prefill").connector_version,
    )
    mode = RoutingMode.LAYER_NAME if routing else RoutingMode.REGION_INDEX
    ranges = pp_partition(geometry.num_layers, prefill.pipeline_parallel_size, prefill.layer_partition)
    stages = tuple(
        StagePlan(rank, layers, tuple(geometry.layer_name(i) for i in layers), mode)
        for rank, layers in enumerate(ranges)
    )
    return TopologyPlan(
        transfer_mode=transfer_mode,
        hma=geometry.hma_required,
        packed=packed,
        prefill_tp=prefill.tensor_parallel_size,
        decode_tp=spec.decode.tensor_parallel_size,
        stages=stages,
        routing_mode=mode,
        hma_manager=geometry.hma,
    )
