"""No descriptor of a WRITE ever leaves the destination block it targets, over random TP pairs, block
sizes, layouts, models and PP stages, planned by the code the producer runs
(`decode_checks.plan_decode_write`) and paired by `TransferPlan.desc_ids`.

The destination block of a remote descriptor id is found from the decoder's own layout (which region holds
which layer, and that region's base, stride and block length), never from the code under test. Each decode
rank's bytes of a block are, over the prefill ranks that write to it, covered exactly once.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from disagg.worker.connector.side_channel import handshake_target_tp_ranks
from disagg.worker.kv import rules
from disagg.worker.kv.decode_checks import LocalRegion, PrefillRank, plan_decode_write
from disagg.worker.kv.errors import DisaggError
from disagg.worker.kv.layout import AttentionKind, ModelGeometry, StageLayout, build_stage_layout
from disagg.worker.kv.routing import (
    RegionGeometry,
    TransferLayers,
    cumulative_offsets,
    expand_logical_blocks,
    region_capacities,
)
from disagg.worker.kv.wire import NixlAgentMetadata

P_BASE, D_BASE = 1 << 40, 1 << 44


def wire_of(layout: StageLayout, meta: RegionGeometry) -> NixlAgentMetadata:
    return NixlAgentMetadata(
        engine_id="decode",
        agent_metadata=b"agent",
        kv_caches_base_addr=meta.kv_caches_base_addr,
        device_id=meta.device_id,
        num_blocks=meta.num_blocks,
        block_lens=meta.block_lens,
        block_strides=meta.block_strides,
        kv_cache_layout=layout.kv_cache_layout,
        block_size=meta.block_size,
        ssm_sizes=(0, 0),
        attn_backend_name="FLASH_ATTN",
        physical_blocks_per_logical_kv_block=meta.physical_blocks_per_logical_kv_block,
        region_num_blocks=meta.region_num_blocks,
        region_group_ids=meta.region_group_ids,
        region_names=meta.region_names,
        region_mem_types=meta.region_mem_types,
        region_members=meta.region_members,
    )


@dataclass(frozen=True)
class Topology:
    geometry: ModelGeometry
    p_tp: int
    d_tp: int
    pp: int
    block_size: int
    kernel_block_size: int
    packed: bool
    p_blocks: int
    d_blocks: int

    def layout(self, *, pp_rank: int, pp_size: int, tp_size: int, num_blocks: int) -> StageLayout:
        return build_stage_layout(
            self.geometry,
            pp_rank=pp_rank,
            pp_size=pp_size,
            tp_size=tp_size,
            block_size=self.block_size,
            num_blocks=num_blocks,
            packed=self.packed,
            kernel_block_size=self.kernel_block_size,
        )


@st.composite
def topologies(draw: st.DrawFn) -> Topology:
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    kind = draw(st.sampled_from(["dense", "hybrid", "mla"]))
    num_layers = draw(st.integers(2, 12))
    if kind == "mla":
        geometry = ModelGeometry(
            (AttentionKind.MLA,) * num_layers, num_kv_heads=1, head_size=16, dtype_bytes=2
        )
    else:
        period = 1 if kind == "dense" else draw(st.integers(2, 4))
        geometry = ModelGeometry.with_full_every(
            num_layers, period, num_kv_heads=heads, head_size=8, dtype_bytes=2
        )
    tp = st.sampled_from([1, 2, 4, 8])
    block_size = draw(st.sampled_from([16, 32]))
    return Topology(
        geometry=geometry,
        p_tp=draw(tp),
        d_tp=draw(tp),
        pp=draw(st.integers(1, min(3, num_layers))),
        block_size=block_size,
        kernel_block_size=block_size // draw(st.sampled_from([1, 2])),
        packed=draw(st.booleans()),
        p_blocks=draw(st.integers(8, 32)),
        d_blocks=draw(st.integers(8, 32)),
    )


def prefill_rank(
    layout: StageLayout, geometry: ModelGeometry, tp_rank: int, routed: bool, whole_model: bool = False
) -> PrefillRank:
    layers = TransferLayers.from_layout(layout)
    return PrefillRank(
        block_size=layout.block_size,
        routed_layers=tuple(zip(layers.names, layers.region_indices, strict=True)) if routed else None,
        pp_size=layout.pp_size,
        stage_layers=layout.layers,
        regions=tuple(LocalRegion(r.name, r.block_len, r.replicated) for r in layout.regions),
        mem_types=frozenset({"DRAM"}),
        tp_rank=tp_rank,
        tp_size=layout.tp_size,
        num_kv_heads=geometry.num_kv_heads,
        is_mla=geometry.is_mla,
        kv_cache_layout=layout.kv_cache_layout,
        region_group_ids=tuple(layout.region_group_ids),
        blocks_per_logical=layout.physical_blocks_per_logical,
        whole_model=whole_model,
    )


def destination_block(d_layout: StageLayout, d_meta: RegionGeometry, layer: str, block: int) -> range:
    """The decoder's bytes of `layer`'s page of kernel block `block`, from its own layout."""
    (r,) = [r for r, region in enumerate(d_layout.regions) if layer in region.members]
    start = d_meta.kv_caches_base_addr[r] + block * d_layout.regions[r].block_stride
    return range(start, start + d_layout.regions[r].block_len)


@settings(max_examples=120, deadline=None)
@given(topology=topologies(), data=st.data(), version=st.sampled_from([15, 16]))
def test_no_write_descriptor_leaves_its_destination_block(
    topology: Topology, data: st.DataObject, version: int
) -> None:
    """At connector version 15 (vLLM 0.31-0.33) only a PP + HMA/packed stage routes by layer name; at 16
    (0.34) every stage does, PP1 and dense models too."""
    geometry, p_tp, d_tp, pp = topology.geometry, topology.p_tp, topology.d_tp, topology.pp
    d_layout = topology.layout(pp_rank=0, pp_size=1, tp_size=d_tp, num_blocks=topology.d_blocks)
    d_meta = RegionGeometry.from_layout(
        d_layout, base_addr=D_BASE, device_id=1, mem_type="DRAM", advertise_members=True
    )
    groups = len(d_layout.groups)
    logical = min(topology.p_blocks, topology.d_blocks)
    # Groups that pool one region alias its blocks, so the scheduler gives them disjoint block ids.
    assume(groups <= logical)
    count = data.draw(st.integers(1, logical // groups), label="blocks per group")
    ids = st.lists(st.integers(0, logical - 1), min_size=count * groups, max_size=count * groups, unique=True)
    p_flat, d_flat = data.draw(ids, label="P blocks"), data.draw(ids, label="D blocks")
    p_logical = [p_flat[g * count : (g + 1) * count] for g in range(groups)]
    d_logical = [d_flat[g * count : (g + 1) * count] for g in range(groups)]
    routed = rules.requires_layer_name_routing(
        rules.PUSH, geometry.hma_required, topology.packed, False, pp, connector_version=version
    )

    # Per decode rank: how often each byte was written, and the blocks the WRITEs targeted.
    covered: dict[int, defaultdict[int, int]] = {d: defaultdict(int) for d in range(d_tp)}
    targeted: dict[int, set[range]] = {d: set() for d in range(d_tp)}
    planned = 0
    for p_rank in range(pp):
        p_layout = topology.layout(pp_rank=p_rank, pp_size=pp, tp_size=p_tp, num_blocks=topology.p_blocks)
        p_meta = RegionGeometry.from_layout(
            p_layout, base_addr=P_BASE, device_id=0, mem_type="DRAM", advertise_members=True
        )
        layers = TransferLayers.from_layout(p_layout) if routed else None
        local_k = expand_logical_blocks(p_logical, p_layout.physical_blocks_per_logical)
        remote_k = expand_logical_blocks(d_logical, d_layout.physical_blocks_per_logical)
        for t in range(p_tp):
            rank = prefill_rank(p_layout, geometry, t, routed, whole_model=routed and pp == 1)
            for d in handshake_target_tp_ranks(p_tp, t, d_tp):
                try:
                    write = plan_decode_write(rank, p_meta, layers, wire_of(d_layout, d_meta), d_tp, d)
                except DisaggError:
                    # Refused at handshake (decode TP above prefill TP under layer-name routing, a PP slice
                    # that is not a whole number of regions per layer): nothing is written.
                    continue
                planned += 1
                local_ids, remote_ids = write.plan.desc_ids(local_k, remote_k)
                src, dst = write.source_descs()[local_ids], write.remote_descs[remote_ids]
                assert np.array_equal(src[:, 1], dst[:, 1]), "a WRITE pairs descriptors of unequal length"
                offsets = cumulative_offsets(region_capacities(write.plan.remote))
                names = (
                    list(layers.names)
                    if layers is not None
                    else [p_layout.regions[r].members[0] for r in write.plan.local_regions]
                )
                for rid, (addr, length, _dev) in zip(remote_ids.tolist(), dst.tolist(), strict=True):
                    i = int(np.searchsorted(offsets, rid, side="right")) - 1
                    block = destination_block(d_layout, d_meta, names[i], rid - int(offsets[i]))
                    assert block.start <= addr and addr + length <= block.stop, (
                        f"WRITE [{addr}, {addr + length}) leaves {names[i]}'s block "
                        f"[{block.start}, {block.stop})"
                    )
                    targeted[d].add(block)
                    for byte in range(addr, addr + length):
                        covered[d][byte] += 1
    # Without layer-name routing, and for a PP1 stage with it (v16), every pairing is accepted (nothing here
    # is refused by rule); only a PP stage routing by layer name refuses decode TP above its own.
    assert planned or (routed and pp > 1)
    # Prefill ranks holding the same heads (MLA, or more prefill ranks than heads) write the same bytes.
    shared_heads = geometry.is_mla or p_tp > geometry.num_kv_heads
    for d in range(d_tp):
        # The WRITEs into a decode rank tile every block they target: its head slices cover it whole.
        assert sum(len(block) for block in targeted[d]) == len(covered[d])
        if not shared_heads:
            assert all(times == 1 for times in covered[d].values())
