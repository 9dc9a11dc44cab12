"""Layer-name routing (vLLM PR #50494's cases), each for a PP=1 prefill and a PP=2 HMA prefill stage.

Expected byte addresses come from the layout's documented byte layout (`addr_of`), never from the routing
code under test: a descriptor pair is right when it moves the same layer's page of the same position in its
group's block list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import pytest

from disagg.worker.kv.errors import BlockIdOutOfRange, MissingLayers, RegionGeometryMismatch
from disagg.worker.kv.layout import AttentionKind, ModelGeometry, StageLayout, build_stage_layout
from disagg.worker.kv.routing import (
    IdArray,
    IdBuffer,
    RegionGeometry,
    TransferLayers,
    TransferPlan,
    align_remote_regions,
    compute_desc_ids,
    expand_logical_blocks,
    group_mapped_desc_ids,
    layer_routed_desc_ids,
    local_descs,
    plan_transfer,
    rank_offset_factor,
    region_desc_ids,
    remote_descs,
    slice_pp_regions,
)
from disagg.worker.kv.rules import requires_layer_name_routing
from disagg.worker.kv.wire import NixlAgentMetadata, decode_agent_metadata, encode_agent_metadata

GEMMA_30 = ModelGeometry.with_full_every(30, 6, num_kv_heads=8, head_size=128, dtype_bytes=2)
DENSE_8 = ModelGeometry.with_full_every(8, 1, num_kv_heads=8, head_size=128, dtype_bytes=2)
P_BASE = 0x7E00_0000_0000
D_BASE = 0x7F00_0000_0000
P_BLOCKS, D_BLOCKS = 300, 200  # P stages hold fewer slots, so more blocks (§5.2): capacities differ per side


def name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


@dataclass(frozen=True)
class Side:
    layout: StageLayout
    meta: RegionGeometry


def side(geometry: ModelGeometry, *, pp_rank: int, pp_size: int, num_blocks: int, base: int) -> Side:
    layout = build_stage_layout(
        geometry, pp_rank=pp_rank, pp_size=pp_size, tp_size=1, block_size=16, num_blocks=num_blocks
    )
    tracks = geometry.hma_required  # push + HMA, no Mamba: vLLM advertises region_members
    meta = RegionGeometry.from_layout(
        layout, base_addr=base, device_id=pp_rank, mem_type="DRAM", advertise_members=tracks
    )
    return Side(layout, meta)


def to_wire(meta: RegionGeometry, engine_id: str = "engine") -> NixlAgentMetadata:
    return NixlAgentMetadata(
        engine_id=engine_id,
        agent_metadata=b"\x00agent",
        kv_caches_base_addr=meta.kv_caches_base_addr,
        device_id=meta.device_id,
        num_blocks=meta.num_blocks,
        block_lens=meta.block_lens,
        block_strides=meta.block_strides,
        kv_cache_layout="LBHNC",
        block_size=meta.block_size,
        ssm_sizes=(0, 0),
        attn_backend_name="FLASHINFER",
        physical_blocks_per_logical_kv_block=meta.physical_blocks_per_logical_kv_block,
        region_num_blocks=meta.region_num_blocks,
        region_group_ids=meta.region_group_ids,
        region_names=meta.region_names,
        region_mem_types=meta.region_mem_types,
        region_members=meta.region_members,
    )


def addr_of(s: Side, layer: str, block: int) -> int:
    """The byte address of `layer`'s page of kernel block `block`, from the documented byte layout."""
    (region,) = [r for r, members in enumerate(s.layout.region_members) if layer in members]
    return int(s.meta.kv_caches_base_addr[region] + block * s.layout.block_strides[region])


PREFILL_CASES = {
    "pp1": [(0, 1)],
    "pp2-hma": [(0, 2), (1, 2)],
}


def prefill_stages(case: str, geometry: ModelGeometry = GEMMA_30) -> list[Side]:
    return [
        side(geometry, pp_rank=rank, pp_size=pp, num_blocks=P_BLOCKS, base=P_BASE + rank * 2**36)
        for rank, pp in PREFILL_CASES[case]
    ]


def decoder(geometry: ModelGeometry = GEMMA_30) -> Side:
    return side(geometry, pp_rank=0, pp_size=1, num_blocks=D_BLOCKS, base=D_BASE)


def plan(stage: Side, dec: Side) -> TransferPlan:
    routing = requires_layer_name_routing(
        "push", GEMMA_30.hma_required, False, GEMMA_30.has_mamba, stage.layout.pp_size, connector_version=15
    )
    layers = TransferLayers.from_layout(stage.layout) if routing else None
    result, _ = plan_transfer(stage.meta, dec.meta, transfer_layers=layers)
    return result


def request_blocks(num_groups: int, length: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(seed)
    p = [rng.choice(np.arange(1, D_BLOCKS), length, replace=False).tolist() for _ in range(num_groups)]
    d = [rng.choice(np.arange(1, D_BLOCKS), length, replace=False).tolist() for _ in range(num_groups)]
    return p, d


@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_descriptor_routing_pairs_each_layer_with_itself(case: str) -> None:
    dec = decoder()
    p_blocks, d_blocks = request_blocks(6, 9, seed=len(case))
    moved: set[tuple[int, int]] = set()
    for stage in prefill_stages(case):
        the_plan = plan(stage, dec)
        assert the_plan.layer_routing is (case == "pp2-hma")
        local_ids, remote_ids = the_plan.desc_ids(p_blocks, d_blocks)
        assert len(local_ids) == len(remote_ids)
        src = local_descs(the_plan.local, regions=the_plan.local_regions)
        dst = remote_descs(the_plan.remote, the_plan.local, local_regions=the_plan.local_regions)
        pairs = list(zip(src[local_ids, 0].tolist(), dst[remote_ids, 0].tolist(), strict=True))
        expected = [
            (addr_of(stage, layer, p_blocks[g][j]), addr_of(dec, layer, d_blocks[g][j]))
            for layer in stage.layout.layer_names
            for g in [stage.layout.group_index_by_layer[layer]]
            for j in range(9)
        ]
        if the_plan.layer_routing:
            assert pairs == expected  # exactly the stage's layers, in transfer order, nothing else
        else:
            # The region path copies whole slots (every group's blocks into every region); it must cover
            # every layer and never pair different slots.
            assert set(expected) <= set(pairs)
        moved.update(expected)
    # Across all stages every layer of the model is moved once per block.
    assert len(moved) == 30 * 9


@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_metadata_round_trip(case: str) -> None:
    dec = decoder()
    for stage in prefill_stages(case):
        for meta in (stage.meta, dec.meta):
            wire = to_wire(meta)
            decoded = decode_agent_metadata(encode_agent_metadata(wire))
            assert RegionGeometry.from_metadata(decoded) == meta
        aligned = plan_transfer(
            stage.meta, to_wire(dec.meta), transfer_layers=TransferLayers.from_layout(stage.layout)
        )[1]
        assert isinstance(aligned, NixlAgentMetadata)
        again = decode_agent_metadata(encode_agent_metadata(aligned))
        assert again == aligned
        assert again.region_members == [[n] for n in stage.layout.layer_names]


@pytest.mark.parametrize("pp", [1, 2])
def test_non_hma_path_is_unchanged(pp: int) -> None:
    assert not requires_layer_name_routing(
        "push", DENSE_8.hma_required, False, False, pp, connector_version=15
    )
    dec = decoder(DENSE_8)
    assert dec.meta.region_members == []  # a non-HMA worker advertises no layers
    blocks = [[3, 1, 4, 15]]
    for rank in range(pp):
        stage = side(DENSE_8, pp_rank=rank, pp_size=pp, num_blocks=D_BLOCKS, base=P_BASE)
        remote = dec.meta
        if pp > 1:
            remote = slice_pp_regions(
                remote,
                start_layer=stage.layout.layers.start,
                num_local_layers=len(stage.layout.layers),
                num_local_regions=len(stage.layout.regions),
            )
        the_plan, _ = plan_transfer(stage.meta, remote, transfer_layers=None)
        local_ids, remote_ids = the_plan.desc_ids(blocks, blocks)
        n_regions = len(stage.layout.regions)
        # vLLM v0.11's single-group formula: r * num_blocks + b.
        assert local_ids.tolist() == legacy_desc_ids(blocks[0], n_regions, D_BLOCKS).tolist()
        assert remote_ids.tolist() == local_ids.tolist()
        dst = remote_descs(the_plan.remote, the_plan.local)
        first_layer = stage.layout.layers.start
        assert dst[remote_ids[0], 0] == addr_of(dec, name(first_layer), 3)


@pytest.mark.parametrize("case", list(PREFILL_CASES))
@pytest.mark.parametrize("container", [RegionGeometry, NixlAgentMetadata])
def test_missing_layer_fails_loudly(case: str, container: type) -> None:
    dec = decoder()
    stage = prefill_stages(case)[-1]
    members = [[n for n in region if n != name(17)] for region in dec.meta.region_members]
    broken = RegionGeometry(**{**dec.meta.__dict__, "region_members": members})
    remote = to_wire(broken) if container is NixlAgentMetadata else broken
    with pytest.raises(MissingLayers, match=r"model\.layers\.17\.self_attn\.attn"):
        align_remote_regions(remote, stage.layout.layer_names)


@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_duplicate_empty_and_ragged_remote_regions_are_refused(case: str) -> None:
    dec = decoder()
    layers = prefill_stages(case)[-1].layout.layer_names
    duplicated = [*dec.meta.region_members[:-1], [*dec.meta.region_members[-1], name(3)]]
    with pytest.raises(MissingLayers, match=r"more than once: \['model\.layers\.3\.self_attn\.attn'\]"):
        align_remote_regions(RegionGeometry(**{**dec.meta.__dict__, "region_members": duplicated}), layers)
    with pytest.raises(MissingLayers, match="no region_members"):
        align_remote_regions(RegionGeometry(**{**dec.meta.__dict__, "region_members": []}), layers)
    ragged = RegionGeometry(**{**dec.meta.__dict__, "block_strides": dec.meta.block_strides[:-1]})
    with pytest.raises(RegionGeometryMismatch, match="block_strides"):
        align_remote_regions(ragged, layers)


@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_alignment_reorders_every_field_and_is_idempotent(case: str) -> None:
    dec = decoder()
    wire = to_wire(dec.meta)
    for stage in prefill_stages(case):
        layers = stage.layout.layer_names
        aligned = align_remote_regions(wire, layers)
        assert aligned.engine_id == wire.engine_id and wire.region_members == dec.meta.region_members
        assert aligned.region_names == list(layers)
        d_region = [next(r for r, m in enumerate(dec.layout.region_members) if n in m) for n in layers]
        assert aligned.kv_caches_base_addr == [dec.meta.kv_caches_base_addr[r] for r in d_region]
        assert aligned.region_num_blocks == [D_BLOCKS] * len(layers)
        assert aligned.region_group_ids == [-1] * len(layers)
        assert align_remote_regions(aligned, layers) == aligned


@pytest.mark.parametrize(
    ("case", "rank", "expected_layers", "expected_regions", "expected_groups"),
    [
        ("pp1", 0, list(range(30)), [s for s in range(5) for _ in range(6)], [0, 1, 2, 3, 4, 5] * 5),
        (
            "pp2-hma",
            1,
            list(range(15, 30)),
            [0] * 6 + [1] * 6 + [2] * 3,
            [3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5],
        ),
    ],
)
def test_pooled_region_expansion(
    case: str, rank: int, expected_layers: list[int], expected_regions: list[int], expected_groups: list[int]
) -> None:
    stage = prefill_stages(case)[rank]
    layers = TransferLayers.from_layout(stage.layout)
    assert layers.names == tuple(name(i) for i in expected_layers)
    assert list(layers.region_indices) == expected_regions
    assert list(layers.group_ids) == expected_groups
    assert layers.capacities(stage.meta) == [P_BLOCKS] * len(expected_layers)


@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_descriptor_geometry_push_with_tp_rank_offset(case: str) -> None:
    """Push: P (TP=2) rank 1 writes its half of the heads into D's (TP=1) whole block."""
    d_layout = build_stage_layout(
        GEMMA_30, pp_rank=0, pp_size=1, tp_size=1, block_size=16, num_blocks=D_BLOCKS
    )
    dec = RegionGeometry.from_layout(
        d_layout, base_addr=D_BASE, device_id=0, mem_type="VRAM", advertise_members=True
    )
    pp = PREFILL_CASES[case][-1][1]
    p_layout = build_stage_layout(
        GEMMA_30, pp_rank=pp - 1, pp_size=pp, tp_size=2, block_size=16, num_blocks=P_BLOCKS
    )
    local = RegionGeometry.from_layout(
        p_layout, base_addr=P_BASE, device_id=1, mem_type="VRAM", advertise_members=True
    )
    layers = TransferLayers.from_layout(p_layout)
    aligned = align_remote_regions(dec, layers.names)
    factor = rank_offset_factor(1, 2, 1, 8, False)
    sources = attention_source_ranks(1, 2, 1, 8, False)
    assert (factor, sources) == (1, (0,))
    src = local_descs(local, regions=layers.region_indices)
    dst = remote_descs(
        aligned,
        local,
        local_regions=layers.region_indices,
        replicated=p_layout.region_replicated,
        num_reads=len(sources),
        rank_offset_factor=factor,
    )
    p_len = 2 * 16 * 4 * 128 * 2
    assert len(src) == len(layers.names) * P_BLOCKS and len(dst) == len(layers.names) * D_BLOCKS
    assert set(src[:, 1].tolist()) == {p_len} and set(dst[:, 1].tolist()) == {p_len}
    assert set(src[:, 2].tolist()) == {1} and set(dst[:, 2].tolist()) == {0}
    first = layers.names[0]
    d_region = next(r for r, m in enumerate(d_layout.region_members) if first in m)
    # Block 5 of the first transfer layer: D's stride is the whole (TP=1) block, plus rank 1's head slice.
    assert dst[5, 0] == D_BASE + d_layout.base_offsets[d_region] + 5 * 2 * p_len + p_len
    assert src[5, 0] == P_BASE + p_layout.base_offsets[layers.region_indices[0]] + 5 * p_len


@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_descriptor_geometry_pull_with_block_size_ratio(case: str) -> None:
    """Pull: D (block 32) reads from P (block 16); each local block splits into two sub-descriptors."""
    pp = PREFILL_CASES[case][-1][1]
    p_layout = build_stage_layout(GEMMA_30, pp_rank=0, pp_size=pp, tp_size=1, block_size=16, num_blocks=40)
    d_layout = build_stage_layout(GEMMA_30, pp_rank=0, pp_size=1, tp_size=1, block_size=32, num_blocks=10)
    d_meta = RegionGeometry.from_layout(
        d_layout, base_addr=D_BASE, device_id=0, mem_type="VRAM", advertise_members=True
    )
    p_meta = RegionGeometry.from_layout(
        p_layout, base_addr=P_BASE, device_id=0, mem_type="VRAM", advertise_members=True
    )
    ratio = d_layout.block_size // p_layout.block_size
    src = local_descs(d_meta, block_size_ratio=ratio)
    d_len = d_layout.block_lens[0]
    assert len(src) == len(d_layout.regions) * 10 * ratio
    assert src[:4, 0].tolist() == [D_BASE, D_BASE + d_len // 2, D_BASE + d_len, D_BASE + d_len + d_len // 2]
    assert set(src[:, 1].tolist()) == {d_len // 2}
    # Local ids with the ratio: capacities scale by the ratio, kernel ids are the expanded logical ids.
    local_ids = region_desc_ids(expand_logical_blocks([[1]], ratio), [10 * ratio] * len(d_layout.regions))
    assert src[local_ids[:2], 0].tolist() == [D_BASE + d_len, D_BASE + d_len + d_len // 2]
    # The P side keeps its own (smaller) blocks: one descriptor per P block, the local sub-block length.
    remote = (
        slice_pp_regions(p_meta, start_layer=0, num_local_layers=1, num_local_regions=1) if pp > 1 else p_meta
    )
    dst = remote_descs(
        remote,
        d_meta,
        local_regions=[0] * len(remote.kv_caches_base_addr),
        block_size_ratio=ratio,
    )
    assert dst[3, 0] == P_BASE + 3 * p_layout.block_lens[0]
    assert set(dst[:, 1].tolist()) == {d_len // 2}


def test_mla_regions_move_whole_blocks_to_every_rank() -> None:
    mla = ModelGeometry((AttentionKind.MLA,) * 4, num_kv_heads=1, head_size=576, dtype_bytes=2)
    layout = build_stage_layout(mla, pp_rank=0, pp_size=2, tp_size=1, block_size=16, num_blocks=4)
    d_layout = build_stage_layout(mla, pp_rank=0, pp_size=1, tp_size=2, block_size=16, num_blocks=4)
    meta = RegionGeometry.from_layout(
        layout, base_addr=0, device_id=0, mem_type="VRAM", advertise_members=True
    )
    dec = RegionGeometry.from_layout(
        d_layout, base_addr=D_BASE, device_id=0, mem_type="VRAM", advertise_members=True
    )
    layers = TransferLayers.from_layout(layout)
    aligned = align_remote_regions(dec, layers.names)
    assert rank_offset_factor(0, 1, 2, 1, True) == 0 and attention_source_ranks(0, 1, 2, 1, True) == (0,)
    # Even when asked to split (as for a non-MLA cache), a replicated region keeps the whole block.
    dst = remote_descs(
        aligned,
        meta,
        local_regions=layers.region_indices,
        replicated=layout.region_replicated,
        num_reads=2,
        rank_offset_factor=1,
    )
    assert dst[1].tolist() == [D_BASE + d_layout.block_lens[0], 16 * 576 * 2, 0]


def test_desc_id_formulas() -> None:
    blocks = [[1, 2], [7]]
    assert layer_routed_desc_ids(blocks, [10, 20, 30], [1, 0, 1]).tolist() == [7, 11, 12, 37]
    assert region_desc_ids(blocks, [10, 20]).tolist() == [1, 2, 7, 11, 12, 17]
    assert group_mapped_desc_ids(blocks, [10, 20, 30], [0, 1, -1]).tolist() == [1, 2, 31, 32, 17, 37]
    assert compute_desc_ids(blocks, [10, 20, 30], region_group_ids=[0, 1, -1]).tolist() == [
        1,
        2,
        31,
        32,
        17,
        37,
    ]
    assert compute_desc_ids(blocks, [10, 20], region_group_ids=[-1, -1]).tolist() == [1, 2, 7, 11, 12, 17]
    assert legacy_desc_ids([1, 2], 3, 10).tolist() == [1, 2, 11, 12, 21, 22]
    assert [a.tolist() for a in expand_logical_blocks([[0, 3]], 2)] == [[0, 1, 6, 7]]


def test_out_of_range_block_ids_are_refused() -> None:
    with pytest.raises(BlockIdOutOfRange, match="group 1"):
        layer_routed_desc_ids([[1], [20]], [10, 20, 30], [1, 0, 1])
    with pytest.raises(BlockIdOutOfRange):
        region_desc_ids([[-1]], [10])
    with pytest.raises(RegionGeometryMismatch, match="group 2"):
        layer_routed_desc_ids([[1]], [10], [2])


def test_a_reused_id_buffer_gives_the_ids_a_fresh_array_does() -> None:
    # The producer computes every request's ids, for every decode rank, into one buffer: requests that grow
    # and shrink it, plans with and without layer routing, each pair checked before the next overwrites it.
    dec = decoder()
    buffer = IdBuffer()
    for length, case in [(9, "pp2-hma"), (3, "pp1"), (40, "pp2-hma"), (1, "pp1")]:
        for stage in prefill_stages(case):
            the_plan = plan(stage, dec)
            p_blocks, d_blocks = request_blocks(6, length, seed=length)
            fresh = the_plan.desc_ids(p_blocks, d_blocks)
            reused = the_plan.desc_ids(p_blocks, d_blocks, buffer)
            assert [ids.tolist() for ids in reused] == [ids.tolist() for ids in fresh]
            assert len(reused[0]) == len(fresh[0]) > 0
    with pytest.raises(BlockIdOutOfRange):
        the_plan.desc_ids([[1]] * 6, [[D_BLOCKS]] * 6, buffer)


def test_unequal_group_lengths_cannot_pair() -> None:
    dec = decoder()
    stage = prefill_stages("pp2-hma")[0]
    the_plan = plan(stage, dec)
    p_blocks, d_blocks = request_blocks(6, 3, seed=1)
    with pytest.raises(RegionGeometryMismatch, match=r"groups \[2\]"):
        the_plan.desc_ids(p_blocks, [*d_blocks[:2], d_blocks[2][:1], *d_blocks[3:]])


def test_region_path_refuses_different_group_layouts() -> None:
    dec = decoder()
    stage = prefill_stages("pp1")[0]
    other = RegionGeometry(**{**dec.meta.__dict__, "region_group_ids": [0, 1, 2, 3, 4]})
    with pytest.raises(RegionGeometryMismatch, match="region group ids differ"):
        plan_transfer(stage.meta, other, transfer_layers=None)


def test_struct_replace_keeps_the_wire_type() -> None:
    wire = to_wire(decoder().meta)
    aligned = align_remote_regions(wire, [name(3)])
    assert type(aligned) is NixlAgentMetadata
    assert msgspec.structs.asdict(aligned)["region_members"] == [[name(3)]]


def test_aligning_vllm_golden_decoder_metadata() -> None:
    """vLLM's own encoding of a PP=1 HMA decoder: regions [[L0, L2], [L1, L3], [L4], [L5]]."""
    golden = Path(__file__).resolve().parents[1] / "golden" / "agent_metadata_pp1_decode_hma.msgpack"
    meta = decode_agent_metadata(golden.read_bytes())
    stage_layers = [name(2), name(3), name(4)]  # a stage owning L2-L4; L0, L1, L5 belong to other stages
    aligned = align_remote_regions(meta, stage_layers)
    assert aligned.kv_caches_base_addr == [meta.kv_caches_base_addr[r] for r in (0, 1, 2)]
    assert aligned.region_group_ids == [-1, -1, 0]
    assert aligned.region_names == stage_layers
    assert aligned.region_members == [[n] for n in stage_layers]
    assert decode_agent_metadata(encode_agent_metadata(aligned)) == aligned
    with pytest.raises(MissingLayers, match=r"model\.layers\.6\.self_attn\.attn"):
        align_remote_regions(meta, [name(5), name(6)])


# ---- vLLM's formulas the product does not run, kept here as oracles ------------------------------------


def legacy_desc_ids(block_ids: Sequence[int], num_regions: int, num_blocks: int) -> IdArray:
    """vLLM v0.11's single-group formula, region-major: `r * num_blocks + b`."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise BlockIdOutOfRange(f"block ids in [{ids.min()}, {ids.max()}] exceed capacity {num_blocks}")
    return (np.arange(num_regions, dtype=np.int64)[:, None] * num_blocks + ids[None, :]).reshape(-1)


def attention_source_ranks(
    tp_rank: int, local_tp: int, remote_tp: int, total_kv_heads: int, is_mla: bool
) -> tuple[int, ...]:
    """Remote ranks whose heads this rank's block covers (vLLM `compute_tp_mapping`, attention part)."""
    if is_mla or local_tp >= remote_tp:
        return (tp_rank * remote_tp // local_tp,)
    k = remote_tp // local_tp
    ranks: list[int] = []
    heads: set[int] = set()
    for rank in range(tp_rank * k, tp_rank * k + k):
        head = rank * total_kv_heads // remote_tp
        if head not in heads:
            heads.add(head)
            ranks.append(rank)
    return tuple(ranks)
