"""The checks a prefill rank runs on a decode rank's metadata before it writes to it.

Pure: no torch, nixl, I/O or clock. One sequence, shared by the transfer sidecar (`producer`, from a
registered `LocalKV`) and the watching sidecar (`watch`, from its engine's advertised metadata), so that both
refuse a decoder for the same reason: block size, decode TP under layer-name routing, alignment (by layer
name, by PP slice or as-is), region count, memory types and per-region block length and stride.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from disagg.worker.kv import rules
from disagg.worker.kv.errors import BlockSizeMismatch, HandshakeError, RegionGeometryMismatch
from disagg.worker.kv.routing import RegionGeometry, RegionMetadata, align_remote_regions, slice_pp_regions


@dataclass(frozen=True)
class LocalRegion:
    """One region of the prefill rank, as far as the checks read it."""

    name: str
    block_len: int
    """Bytes of one kernel block of the region on this TP rank."""
    replicated: bool
    """MLA region: the same bytes on every TP rank, never split by heads."""


@dataclass(frozen=True)
class PrefillRank:
    """What the checks need to know of one TP rank of a prefill stage."""

    block_size: int
    routed_layers: tuple[tuple[str, int], ...] | None
    """Under layer-name routing, each transfer layer with its local region (a pooled region repeats once
    per member), in local order; None when the stage does not route by layer name."""
    pp_size: int
    stage_layers: range
    """Model layer indices the stage owns (the PP slice of the decoder's regions without routing)."""
    regions: tuple[LocalRegion, ...]
    mem_types: frozenset[str] | None
    """Memory types the rank moves; None when unknown, so the decoder's are not compared."""
    tp_rank: int
    tp_size: int
    num_kv_heads: int
    is_mla: bool


def check_decode_rank(
    rank: PrefillRank, remote: RegionMetadata, remote_tp: int
) -> tuple[RegionGeometry, list[int]]:
    """The decode rank's geometry aligned to `rank`'s transfer order, and the local region of each aligned
    remote region; raises the connector's typed refusal when `rank` cannot write to it."""
    layer_routing = rank.routed_layers is not None
    if layer_routing:
        violation = rules.block_size_mismatch(True, rank.block_size, remote.block_size)
        if violation is not None:
            raise BlockSizeMismatch(violation.message)
        violation = rules.decode_tp_exceeds_prefill_tp(rank.is_mla, rank.tp_size, remote_tp, True)
        if violation is not None:
            raise HandshakeError(violation.message, reason=violation.reason)
    elif remote.block_size != rank.block_size:
        raise BlockSizeMismatch(
            f"prefill block size {rank.block_size} and decode block size {remote.block_size} differ; "
            "this connector moves whole blocks: use equal block sizes"
        )
    aligned, local_regions = _align(rank, RegionGeometry.from_metadata(remote))
    if len(aligned.kv_caches_base_addr) != len(local_regions):
        raise RegionGeometryMismatch(
            f"the decoder has {len(aligned.kv_caches_base_addr)} regions for this stage's "
            f"{len(local_regions)}"
        )
    if (
        aligned.region_mem_types is not None
        and rank.mem_types is not None
        and set(aligned.region_mem_types) != rank.mem_types
    ):
        raise RegionGeometryMismatch(
            f"decode regions are {sorted(set(aligned.region_mem_types))}, TP rank {rank.tp_rank} of this "
            f"stage moves {sorted(rank.mem_types)} (mixed-memory caches are not supported by push)"
        )
    _check_block_lens(rank, aligned, local_regions, remote_tp)
    return aligned, local_regions


def _align(rank: PrefillRank, remote: RegionGeometry) -> tuple[RegionGeometry, list[int]]:
    if rank.routed_layers is not None:
        names = [name for name, _ in rank.routed_layers]
        return align_remote_regions(remote, names), [region for _, region in rank.routed_layers]
    local_regions = list(range(len(rank.regions)))
    if rank.pp_size > 1:
        sliced = slice_pp_regions(
            remote,
            start_layer=rank.stage_layers.start,
            num_local_layers=len(rank.stage_layers),
            num_local_regions=len(rank.regions),
        )
        return sliced, local_regions
    return remote, local_regions


def _check_block_lens(
    rank: PrefillRank, aligned: RegionGeometry, local_regions: Sequence[int], remote_tp: int
) -> None:
    """A head-split region holds this rank's share of the decode rank's heads; a replicated (MLA) one is
    the same bytes on both sides. Either way a block must fit its stride."""
    local_heads = max(1, rank.num_kv_heads // rank.tp_size)
    remote_heads = max(1, rank.num_kv_heads // remote_tp)
    for i, r in enumerate(local_regions):
        region = rank.regions[r]
        want = region.block_len if region.replicated else region.block_len * remote_heads // local_heads
        got_len, stride = aligned.block_lens[i], aligned.block_strides[i]
        if got_len != want or stride < got_len:
            raise RegionGeometryMismatch(
                f"decode region for {region.name} has block length {got_len} (stride {stride}); "
                f"TP rank {rank.tp_rank} of this stage ({local_heads} of {rank.num_kv_heads} KV heads, "
                f"block length {region.block_len}) needs {want} with stride >= length"
            )
