"""The policy on what the project's reference engine (`disagg engine serve`) cannot run. Pure.

`disagg engine serve` runs the reference model (`disagg.worker.engine.config.TinyConfig`): float32, one TP
rank per pod, 4 query heads, full attention every third layer with a fixed 32-token sliding window between,
layers split evenly over the stages. From the topology it takes the number of layers, the KV heads, the head
size, the block size, the pipeline size and the model name it serves (`disagg.worker.engine.settings`'s
`model_config` checks the rest); everything else that would change what it computes or how its KV is laid
out is refused here, before any pod exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from disagg.operator.api import (
    ROLES,
    Connector,
    DisaggDeploymentSpec,
    EngineKind,
    HybridKVCacheManager,
    KVCacheDType,
    KVCacheLayout,
    ModelDType,
)
from disagg.operator.builders.engine import user_args
from disagg.operator.engine_kind import engine_kind
from disagg.operator.policies.policy import PolicyInput
from disagg.worker.kv.errors import Violation
from disagg.worker.kv.layout import DEFAULT_LAYER_NAME_TEMPLATE, AttentionKind, pp_partition
from disagg.worker.kv.rules import invalid_layer_partition


def reference_engine_can_run(given: PolicyInput) -> Sequence[Violation]:
    """What the project's reference engine (`disagg engine serve`) cannot run, when a role's image is it."""
    return reference_engine_violations(given.spec)


# TinyConfig.num_heads: grouped-query attention needs the KV heads to divide them.
REFERENCE_QUERY_HEADS: Final = 4


# TinyConfig.full_every: the reference engine builds its layer pattern, not the topology's.
REFERENCE_FULL_EVERY: Final = 3


REFERENCE_ENGINE_FLAGS: Final = ("--num-blocks",)


# `disagg engine serve --num-blocks`: a pool of at least two blocks, at most 2**20.
REFERENCE_NUM_BLOCKS: Final = range(2, (1 << 20) + 1)


def _reference_refusal(problem: str) -> Violation:
    return Violation(
        "ReferenceEngineUnsupported",
        f"the image is the project's reference engine (disagg-transfer), which {problem}",
    )


def reference_tensor_parallel(role: str, tensor_parallel_size: int) -> Violation | None:
    """The reference engine runs one tensor-parallel rank per pod."""
    if tensor_parallel_size == 1:
        return None
    return _reference_refusal(
        f"runs one tensor-parallel rank per pod, but spec.{role}.tensorParallelSize is "
        f"{tensor_parallel_size}: set it to 1, or serve the model with vLLM"
    )


def reference_extra_args(args: Sequence[str]) -> Violation | None:
    """The only engine argument a spec may give the reference engine is `--num-blocks N` (its KV capacity)."""
    index = 0
    while index < len(args):
        name, has_inline, value = args[index].partition("=")
        index += 1
        if name not in REFERENCE_ENGINE_FLAGS:
            return _reference_refusal(
                f"takes no argument {args[index - 1][:100]!r}: the extra arguments may only give "
                f"{' or '.join(REFERENCE_ENGINE_FLAGS)} N"
            )
        if not has_inline:
            value = args[index] if index < len(args) else ""
            index += 1
        if not (value.isdecimal() and int(value) in REFERENCE_NUM_BLOCKS):
            return _reference_refusal(
                f"needs a whole number from {REFERENCE_NUM_BLOCKS.start} to {REFERENCE_NUM_BLOCKS.stop - 1} "
                f"after {name}, not {value[:100]!r}"
            )
    return None


def reference_engine_violations(spec: DisaggDeploymentSpec) -> list[Violation]:
    """Every spec field the reference engine cannot honour, when some role runs it."""
    roles = [role for role in ROLES if engine_kind(spec, role) is EngineKind.REFERENCE]
    if not roles:
        return []
    found: list[Violation | None] = []
    for role in roles:
        found.append(reference_tensor_parallel(role, spec.role(role).tensor_parallel_size))
        dtype = spec.effective(role, "dtype", spec.model.dtype)
        if dtype is not ModelDType.FLOAT32:
            found.append(
                _reference_refusal(
                    f"computes in float32 only, not {dtype.value}: set spec.model.dtype to float32"
                )
            )
        cache_dtype = spec.effective(role, "kv_cache_dtype", spec.model.kv_cache_dtype)
        if cache_dtype is not KVCacheDType.AUTO:
            found.append(
                _reference_refusal(
                    f"keeps its KV cache in the model dtype, not {cache_dtype.value}: set "
                    "spec.model.kvCacheDtype to auto"
                )
            )
        found.append(reference_extra_args(user_args(spec, role)))
    model = spec.model
    kinds = tuple(kind.to_layout() for kind in model.layer_kinds())
    pattern = tuple(
        AttentionKind.FULL if (i + 1) % REFERENCE_FULL_EVERY == 0 else AttentionKind.SLIDING_WINDOW
        for i in range(model.num_layers)
    )
    if kinds != pattern:
        found.append(
            _reference_refusal(
                f"has full attention every {REFERENCE_FULL_EVERY}rd layer and sliding-window layers between "
                f"(layer i is full iff (i + 1) % {REFERENCE_FULL_EVERY} == 0): set spec.model.layerPattern "
                f"to {{fullEvery: {REFERENCE_FULL_EVERY}}}"
            )
        )
    if spec.engine.hybrid_kv_cache_manager is HybridKVCacheManager.DISABLED:
        found.append(
            _reference_refusal(
                "pools its sliding-window and full-attention layers as the hybrid KV cache manager does: set "
                "spec.engine.hybridKvCacheManager to Enabled"
            )
        )
    partition = spec.prefill.layer_partition
    # Only a pipeline size the layers can fill has an even split; any other is `worker_topology_rules`'
    # InvalidLayerPartition (pp_partition raises on it), so there is no even split to compare against.
    pp_size = spec.prefill.pipeline_parallel_size
    fillable = invalid_layer_partition(model.num_layers, pp_size, None) is None
    even = [len(stage) for stage in pp_partition(model.num_layers, pp_size)] if fillable else None
    if partition is not None and even is not None and list(partition) != even:
        found.append(
            _reference_refusal(
                f"splits its layers over the pipeline stages evenly ({even}): remove "
                "spec.prefill.layerPartition"
            )
        )
    if REFERENCE_QUERY_HEADS % model.num_kv_heads:
        found.append(
            _reference_refusal(
                f"has {REFERENCE_QUERY_HEADS} query heads, which spec.model.numKvHeads {model.num_kv_heads} "
                "does not divide: set it to 1, 2 or 4"
            )
        )
    if model.head_size % 2:
        found.append(
            _reference_refusal(
                f"applies rotary embeddings, which need an even head size: spec.model.headSize is "
                f"{model.head_size}"
            )
        )
    if model.layer_name_template != DEFAULT_LAYER_NAME_TEMPLATE:
        found.append(
            _reference_refusal(
                f"names its layers {DEFAULT_LAYER_NAME_TEMPLATE!r}: remove spec.model.layerNameTemplate"
            )
        )
    if spec.engine.kv_cache_layout is not KVCacheLayout.LAYER_OUTERMOST:
        found.append(
            _reference_refusal(
                "lays its KV cache out layer-outermost: set spec.engine.kvCacheLayout to LayerOutermost"
            )
        )
    if spec.kv_transfer.connector is not Connector.PUSH:
        found.append(
            _reference_refusal(
                "is served by the push transfer sidecar: set spec.kvTransfer.connector to Push"
            )
        )
    return [violation for violation in found if violation is not None]
