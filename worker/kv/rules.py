"""Compatibility rules of the NIXL push connector under PP and HMA, as pure functions.

The worker applies them at handshake (`decode_checks`, raising the typed error with the rule's reason), the
operator before any pod exists (`disagg.operator.policies`).
Each rule returns a `Violation` (a CamelCase reason and a message that says what to change) or None.
Sources: `vllm-nixl-push-connector.md` §2.3, §2.4 and §4.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from disagg.worker.kv import wire
from disagg.worker.kv.errors import Violation

PUSH = "push"
PULL = "pull"


def decode_pipeline_parallel(decode_pp: int) -> Violation | None:
    """Completions are counted per consumer rank, so a decode engine must hold every layer."""
    if decode_pp == 1:
        return None
    return Violation(
        "DecodePipelineParallel",
        f"decode pipelineParallelSize is {decode_pp}; the push connector counts completions per consumer "
        "rank and supports only pipelineParallelSize 1 on decode: set decode pipelineParallelSize to 1",
    )


def pull_connector_with_hma_pp(transfer_mode: str, hma: bool, prefill_pp: int) -> Violation | None:
    """Only the push connector routes by layer name; the pull connector cannot pair HMA regions under PP."""
    if transfer_mode == PUSH or not hma or prefill_pp == 1:
        return None
    return Violation(
        "PullConnectorWithHybridPP",
        f"the {transfer_mode} connector does not support prefill pipelineParallelSize {prefill_pp} with a "
        "hybrid KV cache (HMA): use the push connector, or set prefill pipelineParallelSize to 1",
    )


def mamba_under_pp(has_mamba: bool, pp: int) -> Violation | None:
    if not has_mamba or pp == 1:
        return None
    return Violation(
        "MambaUnderPipelineParallel",
        f"the model has Mamba/SSM layers and pipelineParallelSize is {pp}; Mamba state cannot be routed by "
        "layer name: set pipelineParallelSize to 1",
    )


def block_size_mismatch(
    layer_routing: bool, prefill_block_size: int, decode_block_size: int
) -> Violation | None:
    if not layer_routing or prefill_block_size == decode_block_size:
        return None
    return Violation(
        "BlockSizeMismatch",
        f"layer-name routing (PP prefill with a hybrid KV cache) needs equal block sizes, but prefill uses "
        f"{prefill_block_size} and decode {decode_block_size}: set both blockSize fields to the same value",
    )


def unequal_block_sizes(
    transfer_mode: str, hma: bool, prefill_block_size: int, decode_block_size: int
) -> Violation | None:
    """Block sizes a prefill/decode pair may use, decided before any pod exists.

    disagg's push sidecar moves whole blocks (and vLLM's layer-routed push requires equal sizes), so push
    needs equal block sizes. vLLM's pull connector maps several smaller prefill blocks into one decode block,
    but only when prefill's size divides decode's and never with a hybrid KV cache.
    """
    if prefill_block_size == decode_block_size:
        return None
    if (
        transfer_mode == PULL
        and not hma
        and prefill_block_size < decode_block_size
        and decode_block_size % prefill_block_size == 0
    ):
        return None
    if transfer_mode == PUSH:
        why = "the push connector moves whole blocks"
    elif hma:
        why = "the pull connector cannot remap blocks of a hybrid KV cache (HMA)"
    else:
        why = "the pull connector only maps smaller prefill blocks that divide the decode block size"
    return Violation(
        "BlockSizeMismatch",
        f"prefill blockSize {prefill_block_size} and decode blockSize {decode_block_size} differ and {why}: "
        "set both blockSize fields to the same value",
    )


def kernel_block_mismatch(prefill: tuple[int, int], decode: tuple[int, int]) -> Violation | None:
    """Push moves whole kernel blocks, block id for block id: vLLM 0.34's push connector refuses a peer whose
    `(kernel block size, kernel blocks per logical block)` differs ("NixlPushConnector requires identical
    P/D block sizes"), and so does the push sidecar. The kernel block size follows from the attention
    backend (`contracts.attention_backends`)."""
    if prefill == decode:
        return None
    return Violation(
        "KernelBlockSizeMismatch",
        f"push needs the same (kernel block size, kernel blocks per logical block) on both sides, but "
        f"prefill has {prefill} and decode {decode}: run both roles with the same attention backend and "
        "blockSize",
    )


def decode_tp_exceeds_prefill_tp(
    is_mla: bool, prefill_tp: int, decode_tp: int, layer_routing: bool
) -> Violation | None:
    if not layer_routing or is_mla or decode_tp <= prefill_tp:
        return None
    return Violation(
        "DecodeTPExceedsPrefillTP",
        f"decode tensorParallelSize {decode_tp} exceeds prefill tensorParallelSize {prefill_tp}; layer-name "
        "routing of a non-MLA model cannot split one prefill block over several decode ranks: set decode "
        f"tensorParallelSize to at most {prefill_tp}",
    )


def tp_not_divisible(prefill_tp: int, decode_tp: int) -> Violation | None:
    if prefill_tp >= 1 and decode_tp >= 1 and max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp) == 0:
        return None
    return Violation(
        "TensorParallelNotDivisible",
        f"prefill tensorParallelSize {prefill_tp} and decode tensorParallelSize {decode_tp} must be positive "
        "and one must divide the other: choose sizes such as 4 and 2, or 2 and 2",
    )


def invalid_layer_partition(
    num_layers: int, pp_size: int, partition: Sequence[int] | None
) -> Violation | None:
    """An explicit partition (VLLM_PP_LAYER_PARTITION style) must give every stage layers, covering all."""
    if pp_size < 1:
        return Violation("InvalidLayerPartition", f"pipelineParallelSize must be at least 1, got {pp_size}")
    if partition is None:
        if num_layers < pp_size:
            return Violation(
                "InvalidLayerPartition",
                f"{num_layers} layers cannot fill {pp_size} pipeline stages: lower pipelineParallelSize to "
                f"at most {num_layers}",
            )
        return None
    stages = list(partition)
    if len(stages) != pp_size:
        return Violation(
            "InvalidLayerPartition",
            f"layerPartition {stages} has {len(stages)} entries but pipelineParallelSize is {pp_size}: "
            "give one layer count per stage",
        )
    empty = [stage for stage, size in enumerate(stages) if size < 1]
    if empty:
        return Violation(
            "InvalidLayerPartition",
            f"layerPartition {stages} leaves stage(s) {empty} without layers: "
            "give every stage at least one layer",
        )
    if sum(stages) != num_layers:
        return Violation(
            "InvalidLayerPartition",
            f"layerPartition {stages} sums to {sum(stages)} but the model has {num_layers} layers: make the "
            f"counts add up to {num_layers}",
        )
    return None


def mamba_state_not_transferred(transfer_mode: str, has_mamba: bool) -> Violation | None:
    """disagg's transfer sidecar has no Mamba semantics: vLLM passes a Mamba group's block ids through
    unexpanded and describes conv and temporal-state sub-regions, which the sidecar would instead expand
    and copy as attention pages."""
    if transfer_mode != PUSH or not has_mamba:
        return None
    return Violation(
        "MambaStateNotSupported",
        "the model has Mamba/SSM layers, and disagg's push transfer sidecar moves only attention KV pages "
        "(it does not describe Mamba conv and temporal state, or keep Mamba block ids unexpanded as vLLM "
        "does): serve this model with the Pull connector, or without disaggregation",
    )


def prefill_context_parallel(pcp_size: int) -> Violation | None:
    """vLLM's push connector has no PCP gate; disagg refuses a prefill that splits a request's context."""
    if pcp_size <= 1:
        return None
    return Violation(
        "PrefillContextParallel",
        f"prefill context parallel size is {pcp_size}; the push connector writes each request's KV from one "
        "prefill rank per head slice and cannot gather a context split over PCP ranks: remove "
        "--prefill-context-parallel-size (or set it to 1)",
    )


def decode_context_parallel(dcp_size: int) -> Violation | None:
    """disagg's push writes each block whole to a decode rank; it cannot shard a request's tokens over the
    decode context-parallel ranks a DCP decoder splits its KV cache into."""
    if dcp_size <= 1:
        return None
    return Violation(
        "DecodeContextParallel",
        f"decode context parallel size is {dcp_size}; disagg's push connector writes each KV block whole to "
        "one decode rank per head slice and does not shard a request's tokens over DCP ranks, so such a "
        "decoder would hold KV it does not own: remove --decode-context-parallel-size (or set it to 1)",
    )


_LAYOUT_ALIASES = {"HND": "LBHNC", "NHD": "LBNHC"}


def kv_cache_layout_mismatch(prefill_layout: str, decode_layout: str, is_mla: bool) -> Violation | None:
    """vLLM refuses a peer whose `kv_cache_layout` differs unless the model is MLA (one latent "head") or
    `enable_permute_local_kv` permutes it; disagg does not implement the permute, so it always refuses."""
    prefill = _LAYOUT_ALIASES.get(prefill_layout, prefill_layout)
    decode = _LAYOUT_ALIASES.get(decode_layout, decode_layout)
    if is_mla or prefill == decode:
        return None
    return Violation(
        "KVCacheLayoutMismatch",
        f"the prefill KV cache layout is {prefill_layout} and the decode layout is {decode_layout}; copying "
        "between them would scramble heads and tokens, and disagg does not permute KV (vLLM's "
        "enable_permute_local_kv): run both engines with the same kv_cache_layout (HND, that is LBHNC)",
    )


def tracks_region_layers(
    transfer_mode: str, hma: bool, packed: bool, has_mamba: bool, *, connector_version: int
) -> bool:
    """Whether a worker advertises `region_members` (any PP size): from connector version 16 (vLLM 0.34)
    every worker, push or pull, any layout; before it vLLM's `_tracks_region_layers` (push, HMA or packed,
    no Mamba).

    `hma` means the HMA layout is in use (`ModelGeometry.hma_required`).
    """
    if wire.pairs_by_layer_name(connector_version):
        return True
    return transfer_mode == PUSH and (hma or packed) and not has_mamba


def layer_routed_pp_push(transfer_mode: str, hma: bool, packed: bool, has_mamba: bool, pp_size: int) -> bool:
    """vLLM's PP push of an HMA or packed cache (`_supports_pp_hma`, PP > 1), the case whose rules hold in
    every release: equal block sizes and no decode TP above the prefill's for a non-MLA model."""
    return transfer_mode == PUSH and (hma or packed) and not has_mamba and pp_size > 1


def requires_layer_name_routing(
    transfer_mode: str, hma: bool, packed: bool, has_mamba: bool, pp_size: int, *, connector_version: int
) -> bool:
    """Whether regions pair by layer name: always from connector version 16 (vLLM 0.34's `_pair_regions`,
    PP1 too); before it vLLM's `_requires_layer_name_routing` (`layer_routed_pp_push`).

    Every other case keeps the region-index path.
    """
    return wire.pairs_by_layer_name(connector_version) or layer_routed_pp_push(
        transfer_mode, hma, packed, has_mamba, pp_size
    )


@dataclass(frozen=True)
class RoleTopology:
    """The parallel layout of one role (prefill or decode) as far as the connector rules see it."""

    pp_size: int
    tp_size: int
    block_size: int
    layer_partition: tuple[int, ...] | None = None


def check_topology(
    *,
    transfer_mode: str,
    hma: bool,
    has_mamba: bool,
    is_mla: bool,
    num_layers: int,
    prefill: RoleTopology,
    decode: RoleTopology,
    packed: bool = False,
) -> list[Violation]:
    """Every rule a prefill/decode pair breaks, so all problems can be reported at once."""
    routing = layer_routed_pp_push(transfer_mode, hma, packed, has_mamba, prefill.pp_size)
    found = [
        decode_pipeline_parallel(decode.pp_size),
        pull_connector_with_hma_pp(transfer_mode, hma, prefill.pp_size),
        mamba_under_pp(has_mamba, prefill.pp_size),
        unequal_block_sizes(transfer_mode, hma, prefill.block_size, decode.block_size),
        decode_tp_exceeds_prefill_tp(is_mla, prefill.tp_size, decode.tp_size, routing),
        tp_not_divisible(prefill.tp_size, decode.tp_size),
        invalid_layer_partition(num_layers, prefill.pp_size, prefill.layer_partition),
    ]
    if decode.pp_size > 1 or decode.layer_partition is not None:
        found.append(invalid_layer_partition(num_layers, decode.pp_size, decode.layer_partition))
    unique: list[Violation] = []
    for violation in found:
        if violation is not None and violation not in unique:
            unique.append(violation)
    return unique
