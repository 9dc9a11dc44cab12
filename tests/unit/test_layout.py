"""KV layout: grouping, pooling and PP projection, against the worked examples of the HMA layout note."""

from __future__ import annotations

import pytest

from disagg.worker.kv.errors import LayoutError
from disagg.worker.kv.layout import (
    SHARED_REGION_GROUP_ID,
    AttentionKind,
    ModelGeometry,
    build_stage_layout,
    kv_cache_groups,
    natural_sorted,
    pp_partition,
    transfer_group_index_by_layer,
)


def names(*indices: int) -> tuple[str, ...]:
    return tuple(f"model.layers.{i}.self_attn.attn" for i in indices)


def gemma_30() -> ModelGeometry:
    return ModelGeometry.with_full_every(30, 6, num_kv_heads=8, head_size=128, dtype_bytes=2)


def gpt_oss_24() -> ModelGeometry:
    return ModelGeometry.with_full_every(24, 2, num_kv_heads=8, head_size=64, dtype_bytes=2)


# --- §1.3: groups ------------------------------------------------------------------------------------------


def test_30_layer_5_to_1_groups_match_the_note() -> None:
    assert kv_cache_groups(gemma_30()) == (
        names(0, 6, 12, 18, 24),
        names(1, 7, 13, 19, 25),
        names(2, 8, 14, 20, 26),
        names(3, 9, 15, 21, 27),
        names(4, 10, 16, 22, 28),
        names(5, 11, 17, 23, 29),
    )


def test_gpt_oss_groups_are_sliding_then_full() -> None:
    assert kv_cache_groups(gpt_oss_24()) == (names(*range(0, 24, 2)), names(*range(1, 24, 2)))


def test_group_size_takes_the_max_when_buckets_are_close() -> None:
    # gpt-oss + EAGLE: 12 sliding and 13 full layers become two groups of (up to) 13, not 12 + 2x(12|1).
    kinds = (AttentionKind.SLIDING_WINDOW, AttentionKind.FULL) * 12 + (AttentionKind.FULL,)
    groups = kv_cache_groups(ModelGeometry(kinds, 8, 64, 2))
    assert [len(g) for g in groups] == [12, 13]


def test_group_size_is_min_not_gcd() -> None:
    # The note's FIXME: 20 full + 30 sliding uses group size 20 (2 sliding groups of 15, 1 full of 20).
    kinds = (AttentionKind.SLIDING_WINDOW,) * 30 + (AttentionKind.FULL,) * 20
    groups = kv_cache_groups(ModelGeometry(kinds, 8, 64, 2))
    assert [len(g) for g in groups] == [15, 15, 20]
    assert groups[0] == names(*range(0, 30, 2))


def test_transfer_group_index_by_layer_follows_group_order() -> None:
    index = transfer_group_index_by_layer(gemma_30())
    assert [index[n] for n in names(0, 6, 12, 18, 24)] == [0] * 5
    assert [index[n] for n in names(5, 11, 17, 23, 29)] == [5] * 5
    assert index[names(13)[0]] == 1


def test_hma_off_promotes_sliding_to_one_group() -> None:
    geometry = ModelGeometry.with_full_every(12, 6, num_kv_heads=8, head_size=128, dtype_bytes=2, hma=False)
    assert kv_cache_groups(geometry) == (names(*range(12)),)
    assert not geometry.hma_required


def test_hma_off_refuses_a_mamba_hybrid() -> None:
    kinds = (AttentionKind.MAMBA, AttentionKind.FULL)
    with pytest.raises(LayoutError, match="mamba"):
        kv_cache_groups(ModelGeometry(kinds, 8, 64, 2, hma=False))


# --- §2.2 and §5.2: slots, PP projection -------------------------------------------------------------------


def members(layout_members: list[list[str]]) -> list[list[int]]:
    return [[int(n.split(".")[2]) for n in region] for region in layout_members]


def test_30_layer_pp1_slots_are_pattern_periods() -> None:
    layout = build_stage_layout(gemma_30(), pp_rank=0, pp_size=1, tp_size=1, block_size=16, num_blocks=64)
    assert members(layout.region_members) == [list(range(6 * s, 6 * s + 6)) for s in range(5)]
    assert layout.region_group_ids == [SHARED_REGION_GROUP_ID] * 5


@pytest.mark.parametrize(
    ("rank", "expected_layers", "expected_slots"),
    [
        (0, range(0, 15), [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14]]),
        # Stage 1's slot 0 mixes the decoder's slots 2 (L15-L17) and 3 (L18-L20).
        (1, range(15, 30), [[15, 16, 17, 18, 19, 20], [21, 22, 23, 24, 25, 26], [27, 28, 29]]),
    ],
)
def test_30_layer_pp2_even_split_slots_match_the_note(
    rank: int, expected_layers: range, expected_slots: list[list[int]]
) -> None:
    layout = build_stage_layout(gemma_30(), pp_rank=rank, pp_size=2, tp_size=1, block_size=16, num_blocks=64)
    assert layout.layers == expected_layers
    assert members(layout.region_members) == expected_slots
    # Projected groups keep the global indices (§5.2 table).
    if rank == 1:
        assert layout.groups[0] == names(18, 24)
        assert layout.groups[3] == names(15, 21, 27)


def test_30_layer_pp2_split_12_18_matches_decoder_slots() -> None:
    geometry = gemma_30()
    stage1 = build_stage_layout(
        geometry, pp_rank=1, pp_size=2, tp_size=1, block_size=16, num_blocks=64, partition=(12, 18)
    )
    assert members(stage1.region_members) == [list(range(12, 18)), list(range(18, 24)), list(range(24, 30))]


def test_gpt_oss_pp2_slots_are_pairs() -> None:
    for rank in (0, 1):
        layout = build_stage_layout(
            gpt_oss_24(), pp_rank=rank, pp_size=2, tp_size=1, block_size=16, num_blocks=8
        )
        start = 12 * rank
        assert members(layout.region_members) == [[start + 2 * i, start + 2 * i + 1] for i in range(6)]


def test_byte_geometry_of_the_30_layer_stage() -> None:
    # §2.2 numbers: 8 KV heads per rank, head_dim 128, bf16, block 16 -> a 64 KiB page.
    layout = build_stage_layout(gemma_30(), pp_rank=0, pp_size=2, tp_size=1, block_size=16, num_blocks=1000)
    assert layout.block_lens == [65536] * 3
    assert layout.block_strides == [65536] * 3
    assert layout.base_offsets == [0, 1000 * 65536, 2000 * 65536]
    assert layout.total_bytes == 3 * 1000 * 65536
    assert layout.kv_cache_layout == "LBHNC"


def test_tp_divides_heads_and_kernel_blocks_split_logical_ones() -> None:
    layout = build_stage_layout(
        gemma_30(), pp_rank=0, pp_size=1, tp_size=2, block_size=32, num_blocks=10, kernel_block_size=16
    )
    assert layout.block_lens[0] == 2 * 16 * 4 * 128 * 2
    assert layout.physical_blocks_per_logical == 2
    assert layout.block_size == 16
    assert layout.region_num_blocks == [20] * 5


def test_packed_layout_is_block_outer() -> None:
    layout = build_stage_layout(
        gemma_30(), pp_rank=0, pp_size=1, tp_size=1, block_size=16, num_blocks=10, packed=True
    )
    assert layout.base_offsets == [r * 65536 for r in range(5)]
    assert layout.block_strides == [5 * 65536] * 5
    assert layout.total_bytes == 5 * 65536 * 10
    assert layout.kv_cache_layout == "BLHNC"


def test_non_hma_model_has_one_region_per_layer() -> None:
    geometry = ModelGeometry.with_full_every(8, 1, num_kv_heads=8, head_size=128, dtype_bytes=2)
    layout = build_stage_layout(geometry, pp_rank=1, pp_size=2, tp_size=1, block_size=16, num_blocks=4)
    assert members(layout.region_members) == [[4], [5], [6], [7]]
    assert layout.region_group_ids == [0] * 4


def test_mla_regions_are_replicated_and_not_head_split() -> None:
    geometry = ModelGeometry((AttentionKind.MLA,) * 4, num_kv_heads=1, head_size=576, dtype_bytes=2)
    layout = build_stage_layout(geometry, pp_rank=0, pp_size=1, tp_size=4, block_size=16, num_blocks=4)
    assert layout.block_lens == [16 * 576 * 2] * 4
    assert all(layout.region_replicated)


# --- PP partition ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_layers", "pp", "sizes"),
    [
        (30, 2, [15, 15]),
        (10, 4, [2, 3, 3, 2]),  # vLLM get_pp_indices: remainder goes to the stages before the last
        (11, 4, [3, 3, 3, 2]),
        (7, 3, [2, 3, 2]),
        (64, 1, [64]),
    ],
)
def test_even_split_remainder_rule(num_layers: int, pp: int, sizes: list[int]) -> None:
    assert [len(r) for r in pp_partition(num_layers, pp)] == sizes
    assert pp_partition(num_layers, pp)[-1].stop == num_layers


def test_explicit_partition() -> None:
    assert pp_partition(30, 2, (12, 18)) == [range(0, 12), range(12, 30)]


@pytest.mark.parametrize("partition", [(10, 10), (30, 0), (10, 10, 10)])
def test_invalid_partition_is_refused(partition: tuple[int, ...]) -> None:
    with pytest.raises(LayoutError) as info:
        pp_partition(30, 2, partition)
    assert info.value.reason == "InvalidLayerPartition"


def test_natural_sort_order() -> None:
    assert natural_sorted(["model.layers.10.a", "model.layers.2.a", "model.layers.1.b"]) == [
        "model.layers.1.b",
        "model.layers.2.a",
        "model.layers.10.a",
    ]


def test_bad_geometry_is_refused() -> None:
    with pytest.raises(LayoutError, match="cannot be split over TP 3"):
        build_stage_layout(gemma_30(), pp_rank=0, pp_size=1, tp_size=3, block_size=16, num_blocks=4)
    with pytest.raises(LayoutError, match="outside pipeline"):
        build_stage_layout(gemma_30(), pp_rank=2, pp_size=2, tp_size=1, block_size=16, num_blocks=4)
