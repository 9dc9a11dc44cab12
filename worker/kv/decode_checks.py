"""The checks a prefill rank runs on a decode rank's metadata before it writes to it.

Pure: no torch, nixl, I/O or clock. One sequence, shared by the transfer sidecar (`producer`, from a
registered `LocalKV`) and the watching sidecar (`watch`, from its engine's advertised metadata), so that both
refuse a decoder for the same reason: KV cache layout, Mamba state, prefill context parallelism
(`check_decode_agent`), then block size, decode TP under layer-name routing, alignment (by layer name, by PP
slice or as-is), region count, cache-group layout without layer-name routing, memory types and per-region
block length and stride (`check_decode_rank`). `plan_decode_write` is what the producer writes by once a
decode rank passes: the pairing, the destination descriptors and the head slice of each source block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from disagg.worker.kv import rules
from disagg.worker.kv.errors import (
    BlockSizeMismatch,
    HandshakeError,
    KernelBlockSizeMismatch,
    KVCacheLayoutMismatch,
    PackedRowsNotSupported,
    RegionGeometryMismatch,
)
from disagg.worker.kv.routing import (
    DescArray,
    RegionGeometry,
    RegionMetadata,
    StridedArray,
    TransferLayers,
    TransferPlan,
    align_remote_regions,
    check_group_layouts,
    expand_strided,
    head_split,
    local_descs,
    local_strided,
    pair_layers,
    plan_transfer,
    rank_offset_factor,
    remote_strided,
    slice_pp_regions,
)

BLOCK_OUTERMOST_LAYOUTS = frozenset({"BLHNC", "BHLNC"})
"""vLLM's packed (block-outermost) layouts: a block holds every layer's page in turn."""


class AgentMetadata(RegionMetadata, Protocol):
    """What a peer's `NixlAgentMetadata` says beyond its regions (the wire struct satisfies it)."""

    @property
    def kv_cache_layout(self) -> str: ...
    @property
    def ssm_sizes(self) -> tuple[int, int]: ...
    @property
    def pcp_size(self) -> int: ...
    @property
    def dcp_size(self) -> int: ...


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
    kv_cache_layout: str = "LBHNC"
    region_group_ids: tuple[int, ...] | None = None
    """The KV cache group of each local region (None when unknown, so the decoder's are not compared)."""
    blocks_per_logical: int = 1
    """Kernel blocks per logical block (vLLM's `physical_blocks_per_logical_kv_block`)."""
    whole_model: bool = False
    """A PP1 worker pairing by layer name as vLLM 0.34 (connector version 16) does: it holds every layer, so a
    decoder's layer with no counterpart here is refused, not skipped as a PP stage skips other stages'."""


def check_agent(local_layout: str, is_mla: bool, remote: AgentMetadata) -> None:
    """What a peer's metadata must say, whichever side reads it: the same KV cache layout, no Mamba state
    and no prefill or decode context parallelism. Raises the connector's typed refusal."""
    layout = rules.kv_cache_layout_mismatch(local_layout, remote.kv_cache_layout, is_mla)
    if layout is not None:
        raise KVCacheLayoutMismatch(layout.message)
    for violation in (
        rules.mamba_state_not_transferred(rules.PUSH, any(remote.ssm_sizes)),
        rules.prefill_context_parallel(remote.pcp_size),
        rules.decode_context_parallel(remote.dcp_size),
    ):
        if violation is not None:
            raise HandshakeError(violation.message, reason=violation.reason)


def check_decode_agent(
    rank: PrefillRank, remote: AgentMetadata, remote_tp: int
) -> tuple[RegionGeometry, list[int]]:
    """`check_agent`, the refusal of a packed vLLM decoder, then `check_decode_rank`."""
    check_agent(rank.kv_cache_layout, rank.is_mla, remote)
    _refuse_packed_rows(rank, remote, remote_tp)
    return check_decode_rank(rank, remote, remote_tp)


def check_decode_rank(
    rank: PrefillRank, remote: RegionMetadata, remote_tp: int
) -> tuple[RegionGeometry, list[int]]:
    """The decode rank's geometry aligned to `rank`'s transfer order, and the local region of each aligned
    remote region; raises the connector's typed refusal when `rank` cannot write to it."""
    aligned, local_regions, _ = _check_decode_rank(rank, remote, remote_tp)
    return aligned, local_regions


def _check_decode_rank(
    rank: PrefillRank, remote: RegionMetadata, remote_tp: int
) -> tuple[RegionGeometry, list[int], tuple[int, ...]]:
    """`check_decode_rank`, plus the decoder's region each aligned region came from (its pairing)."""
    layer_routing = rank.routed_layers is not None
    if layer_routing:
        violation = rules.block_size_mismatch(True, rank.block_size, remote.block_size)
        if violation is not None:
            raise BlockSizeMismatch(violation.message)
        # vLLM refuses it for a PP stage only (`_supports_pp_hma`, PP > 1); a PP1 worker pairing by layer
        # name (connector version 16) splits heads as the index path did.
        violation = rules.decode_tp_exceeds_prefill_tp(rank.is_mla, rank.tp_size, remote_tp, rank.pp_size > 1)
        if violation is not None:
            raise HandshakeError(violation.message, reason=violation.reason)
    elif remote.block_size != rank.block_size:
        raise BlockSizeMismatch(
            f"prefill block size {rank.block_size} and decode block size {remote.block_size} differ; "
            "this connector moves whole blocks: use equal block sizes"
        )
    violation = rules.kernel_block_mismatch(
        (rank.block_size, rank.blocks_per_logical),
        (remote.block_size, remote.physical_blocks_per_logical_kv_block),
    )
    if violation is not None:
        raise KernelBlockSizeMismatch(violation.message)
    aligned, local_regions, pairing = _align(rank, RegionGeometry.from_metadata(remote))
    if len(aligned.kv_caches_base_addr) != len(local_regions):
        raise RegionGeometryMismatch(
            f"the decoder has {len(aligned.kv_caches_base_addr)} regions for this stage's "
            f"{len(local_regions)}"
        )
    if not layer_routing and rank.region_group_ids is not None:
        check_group_layouts(rank.region_group_ids, aligned.region_group_ids)
    if (
        aligned.region_mem_types is not None
        and rank.mem_types is not None
        and set(aligned.region_mem_types) != rank.mem_types
    ):
        raise RegionGeometryMismatch(
            f"decode regions are {sorted(set(aligned.region_mem_types))}, TP rank {rank.tp_rank} of this "
            f"stage moves {sorted(rank.mem_types)} (mixed-memory caches are not supported by push)"
        )
    _check_shared_regions(rank, pairing, local_regions)
    _check_block_lens(rank, aligned, local_regions, remote_tp)
    return aligned, local_regions, pairing


def _align(rank: PrefillRank, remote: RegionGeometry) -> tuple[RegionGeometry, list[int], tuple[int, ...]]:
    """The aligned remote geometry, the local region of each aligned region, and the remote region each
    came from."""
    if rank.routed_layers is not None:
        names = [name for name, _ in rank.routed_layers]
        pairing = pair_layers(remote, names, whole_model=rank.whole_model)
        aligned = align_remote_regions(remote, names, whole_model=rank.whole_model)
        return aligned, [region for _, region in rank.routed_layers], tuple(pairing)
    local_regions = list(range(len(rank.regions)))
    if rank.pp_size > 1:
        sliced = slice_pp_regions(
            remote,
            start_layer=rank.stage_layers.start,
            num_local_layers=len(rank.stage_layers),
            num_local_regions=len(rank.regions),
        )
        start = len(rank.regions) // max(1, len(rank.stage_layers)) * rank.stage_layers.start
        return sliced, local_regions, tuple(range(start, start + len(local_regions)))
    return remote, local_regions, tuple(local_regions)


def _check_shared_regions(rank: PrefillRank, pairing: Sequence[int], local_regions: Sequence[int]) -> None:
    """One decoder region written from several local regions (a pooled decode region holding layers this
    rank keeps apart) must take pages of one size from all of them: vLLM 0.34 refuses "KV region R of engine
    X pairs with local regions of different block lengths"."""
    first: dict[int, int] = {}
    for remote_region, local in zip(pairing, local_regions, strict=True):
        other = first.setdefault(remote_region, local)
        a, b = rank.regions[other], rank.regions[local]
        if (a.block_len, a.replicated) != (b.block_len, b.replicated):
            raise RegionGeometryMismatch(
                f"decode region {remote_region} pairs with local regions of different block lengths "
                f"({a.name}: {a.block_len}, {b.name}: {b.block_len}); run the same KV cache plan on both "
                "sides"
            )


def check_same_layout(engine_id: str, writes: Sequence[DecodeWrite]) -> None:
    """Every TP rank of one decode engine pairs its regions with this rank's the same way: vLLM 0.34 refuses
    "The TP ranks of engine X lay out their KV regions differently", since one pairing serves the engine."""
    layouts = {write.pairing for write in writes}
    if len(layouts) > 1:
        raise RegionGeometryMismatch(
            f"the TP ranks of decode engine {engine_id!r} lay out their KV regions differently "
            f"({len(layouts)} different pairings with this rank's regions)"
        )


def _check_block_lens(
    rank: PrefillRank, aligned: RegionGeometry, local_regions: Sequence[int], remote_tp: int
) -> None:
    """A head-split region holds this rank's share of the decode rank's heads; a replicated (MLA) one is
    the same bytes on both sides. Either way a block must fit its stride."""
    local_heads = max(1, rank.num_kv_heads // rank.tp_size)
    for i, r in enumerate(local_regions):
        region = rank.regions[r]
        want = _decode_page(rank, region, remote_tp)
        got_len, stride = aligned.block_lens[i], aligned.block_strides[i]
        if got_len != want or stride < got_len:
            raise RegionGeometryMismatch(
                f"decode region for {region.name} has block length {got_len} (stride {stride}); "
                f"TP rank {rank.tp_rank} of this stage ({local_heads} of {rank.num_kv_heads} KV heads, "
                f"block length {region.block_len}) needs {want} with stride >= length"
            )


def _decode_page(rank: PrefillRank, region: LocalRegion, remote_tp: int) -> int:
    """The bytes of one block of `region` on a decode rank of `remote_tp`: this rank's block (replicated,
    MLA), or the decode rank's share of this rank's heads."""
    if region.replicated:
        return region.block_len
    local_heads = max(1, rank.num_kv_heads // rank.tp_size)
    remote_heads = max(1, rank.num_kv_heads // remote_tp)
    return region.block_len * remote_heads // local_heads


def _refuse_packed_rows(rank: PrefillRank, remote: AgentMetadata, remote_tp: int) -> None:
    """vLLM describes a block-outermost cache with one region per row, every layer's page of a block in
    turn (the pages in `packed_member_layouts`, wire v13+); disagg pairs one page per layer. Such a row is
    a region of a block-outermost layout longer than any page this rank writes to that decode rank."""
    if remote.kv_cache_layout not in BLOCK_OUTERMOST_LAYOUTS or not rank.regions:
        return
    page = max(_decode_page(rank, region, remote_tp) for region in rank.regions)
    rows = [(r, length) for r, length in enumerate(remote.block_lens) if length > page]
    if rows:
        region, length = rows[0]
        members = remote.region_members[region] if region < len(remote.region_members) else []
        raise PackedRowsNotSupported(
            f"the decoder's KV cache is block-outermost ({remote.kv_cache_layout}) and its region {region} "
            f"is a packed row of {length} bytes ({len(members)} layers) where this rank writes {page}-byte "
            "pages; disagg pairs one page per layer and does not read vLLM's per-row member layouts: run "
            "the decoder with a layer-outermost KV cache layout, or behind a disagg sidecar"
        )


@dataclass(frozen=True)
class DecodeWrite:
    """What a prefill rank writes to one decode rank: the plan pairing their regions, the destination
    descriptors (`routing.remote_strided`) and the head slice of each source block (`routing.head_split`)."""

    plan: TransferPlan
    remote_strided: StridedArray
    """The destination descriptors in NIXL's strided form, one row per remote region: what the producer
    prepares. A handshake never builds a row per block (`remote_descs` expands them)."""
    head_slice: tuple[int, int]
    replicated: tuple[bool, ...]
    """Per local region: MLA, so the whole block goes to every decode rank."""
    pairing: tuple[int, ...] = ()
    """The decode rank's region each aligned region came from: equal on every TP rank of one engine
    (`check_same_layout`)."""

    @property
    def remote_descs(self) -> DescArray:
        """The destination descriptors, a row per block (`routing.remote_descs`)."""
        return expand_strided(self.remote_strided)

    def source_strided(self) -> StridedArray:
        """`source_descs` in the strided form, one row per transfer layer (or region)."""
        return local_strided(
            self.plan.local,
            regions=self.plan.local_regions,
            head_slice=self.head_slice,
            replicated=self.replicated,
        )

    def source_descs(self) -> DescArray:
        """The local descriptors the plan's local ids index: whole blocks, or this decode rank's head slice
        of each (vLLM's local split handle)."""
        return local_descs(
            self.plan.local,
            regions=self.plan.local_regions,
            head_slice=self.head_slice,
            replicated=self.replicated,
        )


def plan_decode_write(
    rank: PrefillRank,
    local: RegionMetadata,
    transfer_layers: TransferLayers | None,
    remote: AgentMetadata,
    remote_tp: int,
    remote_tp_rank: int,
) -> DecodeWrite:
    """Every check that can refuse decode rank `remote_tp_rank` (`check_decode_agent`, then `plan_transfer`),
    and what this rank writes to it. Pure: the producer, the peer check and the property tests run it."""
    check_agent(rank.kv_cache_layout, rank.is_mla, remote)
    _refuse_packed_rows(rank, remote, remote_tp)
    checked, _, pairing = _check_decode_rank(rank, remote, remote_tp)
    # Aligned (by layer name) or sliced (to this PP stage) already: aligning again changes nothing.
    plan, aligned = plan_transfer(local, checked, transfer_layers=transfer_layers)
    replicated = tuple(region.replicated for region in rank.regions)
    slot, count = head_split(
        rank.tp_rank, rank.tp_size, remote_tp_rank, remote_tp, rank.num_kv_heads, rank.is_mla
    )
    offset_factor = rank_offset_factor(rank.tp_rank, rank.tp_size, remote_tp, rank.num_kv_heads, rank.is_mla)
    descs = remote_strided(
        aligned,
        local,
        local_regions=plan.local_regions,
        replicated=replicated,
        num_reads=count,
        rank_offset_factor=offset_factor,
    )
    return DecodeWrite(plan, descs, (slot, count), replicated, pairing)
