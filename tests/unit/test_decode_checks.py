"""`decode_checks.check_decode_rank`: each refusal a prefill rank gives a decode rank, with its reason, and
what it accepts on the three alignment paths (layer names under PP + HMA, the PP slice, PP=1 as-is).

Both sides are built from `build_stage_layout` and `RegionGeometry.from_layout`, as the workers advertise
them; expected pairings come from the decoder's own layout (which region holds which layer), never from
the code under test.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from disagg.worker.kv import rules
from disagg.worker.kv.decode_checks import (
    LocalRegion,
    PrefillRank,
    check_agent,
    check_decode_agent,
    check_decode_rank,
)
from disagg.worker.kv.errors import DisaggError
from disagg.worker.kv.layout import AttentionKind, ModelGeometry, StageLayout, build_stage_layout
from disagg.worker.kv.routing import RegionGeometry, TransferLayers
from disagg.worker.kv.wire import NixlAgentMetadata

GEMMA_30 = ModelGeometry.with_full_every(30, 6, num_kv_heads=8, head_size=128, dtype_bytes=2)
DENSE_8 = ModelGeometry.with_full_every(8, 1, num_kv_heads=8, head_size=128, dtype_bytes=2)
MLA_4 = ModelGeometry((AttentionKind.MLA,) * 4, num_kv_heads=8, head_size=576, dtype_bytes=2)


def prefill(
    model: ModelGeometry,
    *,
    pp_rank: int = 0,
    pp_size: int = 1,
    tp_rank: int = 0,
    tp_size: int = 1,
    block_size: int = 16,
    mem_types: frozenset[str] | None = frozenset({"DRAM"}),
) -> tuple[StageLayout, PrefillRank]:
    layout = build_stage_layout(
        model, pp_rank=pp_rank, pp_size=pp_size, tp_size=tp_size, block_size=block_size, num_blocks=64
    )
    routing = rules.requires_layer_name_routing(
        rules.PUSH, model.hma_required, False, model.has_mamba, pp_size, connector_version=15
    )
    layers = TransferLayers.from_layout(layout)
    rank = PrefillRank(
        block_size=layout.block_size,
        routed_layers=tuple(zip(layers.names, layers.region_indices, strict=True)) if routing else None,
        pp_size=pp_size,
        stage_layers=layout.layers,
        regions=tuple(LocalRegion(r.name, r.block_len, r.replicated) for r in layout.regions),
        mem_types=mem_types,
        tp_rank=tp_rank,
        tp_size=tp_size,
        num_kv_heads=model.num_kv_heads,
        is_mla=model.is_mla,
    )
    return layout, rank


def decoder(
    model: ModelGeometry, *, tp_size: int = 1, block_size: int = 16, mem_type: str = "DRAM"
) -> tuple[StageLayout, RegionGeometry]:
    layout = build_stage_layout(
        model, pp_rank=0, pp_size=1, tp_size=tp_size, block_size=block_size, num_blocks=32
    )
    meta = RegionGeometry.from_layout(
        layout,
        base_addr=0x7F00_0000_0000,
        device_id=0,
        mem_type=mem_type,
        advertise_members=model.hma_required,
    )
    return layout, meta


def refusal(rank: PrefillRank, remote: RegionGeometry, remote_tp: int = 1) -> DisaggError:
    with pytest.raises(DisaggError) as caught:
        check_decode_rank(rank, remote, remote_tp)
    return caught.value


# ---- acceptance ------------------------------------------------------------------------------------------


def test_a_pp2_hma_stage_pairs_each_of_its_layers_with_the_decoder_region_that_holds_it() -> None:
    layout, rank = prefill(GEMMA_30, pp_rank=1, pp_size=2)
    d_layout, remote = decoder(GEMMA_30)
    assert rank.routed_layers is not None
    aligned, local_regions = check_decode_rank(rank, remote, 1)

    region_of = {name: r for r, region in enumerate(d_layout.regions) for name in region.members}
    names = [name for name, _ in rank.routed_layers]
    assert sorted(names) == sorted(layout.layer_names)  # every layer of the stage, none of stage 0's
    assert aligned.region_names == names
    assert aligned.kv_caches_base_addr == [remote.kv_caches_base_addr[region_of[n]] for n in names]
    owner = {name: r for r, region in enumerate(layout.regions) for name in region.members}
    assert local_regions == [owner[n] for n in names]


def test_pp1_accepts_the_decoder_as_is_with_its_share_of_the_heads() -> None:
    _, rank = prefill(DENSE_8, tp_rank=1, tp_size=2)
    _, remote = decoder(DENSE_8, tp_size=1)
    aligned, local_regions = check_decode_rank(rank, remote, 1)
    assert aligned == remote
    assert local_regions == list(range(8))
    # One decode rank holds both prefill ranks' heads: twice this rank's block length.
    assert aligned.block_lens == [2 * region.block_len for region in rank.regions]


def test_pp1_without_routing_may_write_to_more_decode_ranks_than_it_has() -> None:
    _, rank = prefill(DENSE_8, tp_size=2)
    _, remote = decoder(DENSE_8, tp_size=4)
    aligned, _ = check_decode_rank(rank, remote, 4)
    assert aligned.block_lens == [region.block_len // 2 for region in rank.regions]


def test_the_pp_slice_path_takes_the_stages_run_of_decoder_regions() -> None:
    _, rank = prefill(DENSE_8, pp_rank=1, pp_size=2)
    assert rank.routed_layers is None  # no HMA: regions, not layer names
    _, remote = decoder(DENSE_8)
    aligned, local_regions = check_decode_rank(rank, remote, 1)
    assert local_regions == [0, 1, 2, 3]
    assert aligned.kv_caches_base_addr == remote.kv_caches_base_addr[4:8]
    assert aligned.region_names == [f"model.layers.{i}.self_attn.attn" for i in range(4, 8)]


def test_mla_regions_are_replicated_so_routing_may_fan_out_to_more_decode_ranks() -> None:
    _, rank = prefill(MLA_4, pp_rank=1, pp_size=2, tp_size=1)
    assert rank.routed_layers is not None and all(region.replicated for region in rank.regions)
    _, remote = decoder(MLA_4, tp_size=2)
    aligned, _ = check_decode_rank(rank, remote, 2)
    assert aligned.block_lens == [region.block_len for region in rank.regions]


def test_unknown_own_memory_types_are_not_compared() -> None:
    _, rank = prefill(DENSE_8, mem_types=None)
    _, remote = decoder(DENSE_8, mem_type="VRAM")
    check_decode_rank(rank, remote, 1)


# ---- refusals --------------------------------------------------------------------------------------------


def test_routing_refuses_unequal_block_sizes() -> None:
    _, rank = prefill(GEMMA_30, pp_rank=1, pp_size=2)
    _, remote = decoder(GEMMA_30, block_size=32)
    error = refusal(rank, remote)
    assert error.reason == "BlockSizeMismatch"
    assert "layer-name routing" in error.message and "prefill uses 16 and decode 32" in error.message


def test_the_region_path_refuses_unequal_block_sizes() -> None:
    _, rank = prefill(DENSE_8)
    _, remote = decoder(DENSE_8, block_size=32)
    error = refusal(rank, remote)
    assert error.reason == "BlockSizeMismatch"
    assert "prefill block size 16 and decode block size 32 differ" in error.message


def test_routing_refuses_more_decode_ranks_than_prefill_ranks_for_a_head_split_model() -> None:
    _, rank = prefill(GEMMA_30, pp_rank=0, pp_size=2, tp_size=1)
    _, remote = decoder(GEMMA_30, tp_size=2)
    error = refusal(rank, remote, 2)
    assert error.reason == "DecodeTPExceedsPrefillTP"
    assert "decode tensorParallelSize 2 exceeds prefill tensorParallelSize 1" in error.message


def test_routing_refuses_a_decoder_that_lacks_a_layer_of_the_stage() -> None:
    _, rank = prefill(GEMMA_30, pp_rank=1, pp_size=2)
    other = dataclasses.replace(
        GEMMA_30, layer_name_template="model.language_model.layers.{i}.self_attn.attn"
    )
    _, remote = decoder(other)
    error = refusal(rank, remote)
    assert error.reason == "MissingLayers"
    assert "does not advertise local transfer layers ['model.layers.15.self_attn.attn'" in error.message


def test_the_pp_slice_refuses_a_decoder_with_too_few_regions() -> None:
    _, rank = prefill(DENSE_8, pp_rank=1, pp_size=2)
    _, remote = decoder(ModelGeometry.with_full_every(6, 1, num_kv_heads=8, head_size=128, dtype_bytes=2))
    error = refusal(rank, remote)
    assert error.reason == "RegionGeometryMismatch"
    assert "the remote has 6 regions, fewer than the 8 this stage addresses" in error.message


def test_pp1_refuses_a_decoder_with_another_region_count() -> None:
    _, rank = prefill(DENSE_8)
    _, remote = decoder(ModelGeometry.with_full_every(6, 1, num_kv_heads=8, head_size=128, dtype_bytes=2))
    error = refusal(rank, remote)
    assert error.reason == "RegionGeometryMismatch"
    assert "the decoder has 6 regions for this stage's 8" in error.message


def test_refuses_decode_regions_in_another_memory_type() -> None:
    _, rank = prefill(DENSE_8, tp_rank=0)
    _, remote = decoder(DENSE_8, mem_type="VRAM")
    error = refusal(rank, remote)
    assert error.reason == "RegionGeometryMismatch"
    assert "decode regions are ['VRAM'], TP rank 0 of this stage moves ['DRAM']" in error.message


def test_refuses_a_block_length_that_is_not_this_ranks_share_of_the_decoders_heads() -> None:
    _, rank = prefill(DENSE_8, tp_rank=1, tp_size=2)
    _, remote = decoder(dataclasses.replace(DENSE_8, head_size=64))
    error = refusal(rank, remote)
    assert error.reason == "RegionGeometryMismatch"
    local_len = rank.regions[0].block_len
    assert (
        f"decode region for model.layers.0.self_attn.attn has block length {local_len} (stride {local_len}); "
        f"TP rank 1 of this stage (4 of 8 KV heads, block length {local_len}) needs {2 * local_len}"
    ) in error.message


def test_refuses_a_stride_shorter_than_the_block() -> None:
    _, rank = prefill(DENSE_8)
    _, remote = decoder(DENSE_8)
    short = dataclasses.replace(remote, block_strides=[length - 1 for length in remote.block_lens])
    error = refusal(rank, short)
    assert error.reason == "RegionGeometryMismatch"
    assert (
        "with stride >= length" in error.message and f"(stride {remote.block_lens[0] - 1})" in error.message
    )


def test_a_replicated_region_refuses_a_head_split_length() -> None:
    _, rank = prefill(MLA_4, pp_rank=1, pp_size=2, tp_size=1)
    _, remote = decoder(MLA_4, tp_size=2)
    halved = dataclasses.replace(
        remote,
        block_lens=[length // 2 for length in remote.block_lens],
        block_strides=[length // 2 for length in remote.block_lens],
    )
    error = refusal(rank, halved, 2)
    assert error.reason == "RegionGeometryMismatch"
    assert f"needs {rank.regions[0].block_len} with stride >= length" in error.message


# ---- what the peer's metadata says beyond its regions (check_decode_agent) -------------------------------


def agent(meta: RegionGeometry, **changes: object) -> NixlAgentMetadata:
    """`meta` as a worker advertises it on the wire, with `changes` to the non-region fields."""
    fields: dict[str, object] = {
        "engine_id": "decode",
        "agent_metadata": b"agent",
        "kv_caches_base_addr": meta.kv_caches_base_addr,
        "device_id": meta.device_id,
        "num_blocks": meta.num_blocks,
        "block_lens": meta.block_lens,
        "block_strides": meta.block_strides,
        "kv_cache_layout": "LBHNC",
        "block_size": meta.block_size,
        "ssm_sizes": (0, 0),
        "attn_backend_name": "FLASH_ATTN",
        "physical_blocks_per_logical_kv_block": meta.physical_blocks_per_logical_kv_block,
        "region_num_blocks": meta.region_num_blocks,
        "region_group_ids": meta.region_group_ids,
        "region_names": meta.region_names,
        "region_mem_types": meta.region_mem_types,
        "region_members": meta.region_members,
        **changes,
    }
    return NixlAgentMetadata(**fields)  # type: ignore[arg-type]


def agent_refusal(rank: PrefillRank, remote: NixlAgentMetadata, remote_tp: int = 1) -> DisaggError:
    with pytest.raises(DisaggError) as caught:
        check_decode_agent(rank, remote, remote_tp)
    return caught.value


def test_the_same_layout_under_its_old_name_is_accepted() -> None:
    _, rank = prefill(DENSE_8)
    _, remote = decoder(DENSE_8)
    aligned, _ = check_decode_agent(rank, agent(remote, kv_cache_layout="HND"), 1)
    assert aligned.block_lens == remote.block_lens


@pytest.mark.parametrize("layout", ["NHD", "LBNHC"])
def test_a_decoder_with_tokens_outside_heads_is_refused(layout: str) -> None:
    _, rank = prefill(DENSE_8)
    _, remote = decoder(DENSE_8)
    error = agent_refusal(rank, agent(remote, kv_cache_layout=layout))
    assert error.reason == "KVCacheLayoutMismatch"
    assert f"decode layout is {layout}" in error.message and "does not permute" in error.message


def test_an_mla_decoder_may_name_another_layout() -> None:
    _, rank = prefill(MLA_4)
    _, remote = decoder(MLA_4)
    check_decode_agent(rank, agent(remote, kv_cache_layout="NHD"), 1)


def test_a_decoder_with_mamba_state_is_refused() -> None:
    _, rank = prefill(DENSE_8)
    _, remote = decoder(DENSE_8)
    error = agent_refusal(rank, agent(remote, ssm_sizes=(4096, 65536)))
    assert error.reason == "MambaStateNotSupported"
    assert "Mamba" in error.message


def test_a_peer_with_prefill_context_parallelism_is_refused_by_either_side() -> None:
    _, rank = prefill(DENSE_8)
    _, remote = decoder(DENSE_8)
    assert agent_refusal(rank, agent(remote, pcp_size=2)).reason == "PrefillContextParallel"
    with pytest.raises(DisaggError) as caught:
        check_agent("LBHNC", False, agent(remote, pcp_size=4))
    assert caught.value.reason == "PrefillContextParallel"
    assert "prefill context parallel size is 4" in caught.value.message


def test_a_peer_with_decode_context_parallelism_is_refused_by_either_side() -> None:
    _, rank = prefill(DENSE_8)
    _, remote = decoder(DENSE_8)
    assert agent_refusal(rank, agent(remote, dcp_size=2)).reason == "DecodeContextParallel"
    with pytest.raises(DisaggError) as caught:
        check_agent("LBHNC", False, agent(remote, dcp_size=4))
    assert caught.value.reason == "DecodeContextParallel"
    assert "decode context parallel size is 4" in caught.value.message


def test_a_packed_vllm_decoder_row_is_refused_with_its_own_reason() -> None:
    _, remote = decoder(DENSE_8)
    # vLLM's packed layout: one region per row, holding every layer's page of the block.
    row = sum(remote.block_lens)
    packed = agent(
        dataclasses.replace(
            remote,
            kv_caches_base_addr=remote.kv_caches_base_addr[:1],
            block_lens=[row],
            block_strides=[row],
            region_num_blocks=remote.region_num_blocks[:1] if remote.region_num_blocks else None,
            region_group_ids=remote.region_group_ids[:1] if remote.region_group_ids else None,
            region_names=remote.region_names[:1] if remote.region_names else None,
            region_mem_types=remote.region_mem_types[:1] if remote.region_mem_types else None,
            region_members=[],
        ),
        kv_cache_layout="BLHNC",
    )
    _, own_packed = prefill(DENSE_8)
    own_packed = dataclasses.replace(own_packed, regions=own_packed.regions[:1], kv_cache_layout="BLHNC")
    error = agent_refusal(own_packed, packed)
    assert error.reason == "PackedRowsNotSupported"
    assert f"packed row of {row} bytes" in error.message


def test_a_decoder_with_other_cache_groups_is_refused_when_regions_pair_by_index() -> None:
    _, rank = prefill(GEMMA_30)
    assert rank.routed_layers is None  # PP 1: regions pair by index
    layout, remote = decoder(GEMMA_30)
    rank = dataclasses.replace(rank, region_group_ids=tuple(layout.region_group_ids))
    check_decode_agent(rank, agent(remote), 1)
    regrouped = dataclasses.replace(remote, region_group_ids=list(range(len(remote.block_lens))))
    error = agent_refusal(rank, agent(regrouped))
    assert error.reason == "RegionGeometryMismatch"
    assert "region group ids differ" in error.message and "cache-group layout" in error.message


@pytest.mark.parametrize("pp_size", [1, 2])
def test_vllm_s_own_packed_mla_decoder_is_refused_as_packed_rows(pp_size: int) -> None:
    """vLLM 0.33's encoding of a packed (BLHNC) DeepSeek-V2-Lite decoder: one region, one row of 27 pages."""
    golden = (
        Path(__file__).resolve().parents[1] / "golden" / "vllm" / "0.33.0" / "agent_metadata_packed_mla.json"
    )
    decoded = json.loads(golden.read_text())["decoded"]
    v12 = {name: decoded[name] for name in NixlAgentMetadata.__struct_fields__ if name in decoded}
    v12["agent_metadata"] = bytes.fromhex(decoded["agent_metadata"]["$bytes_hex"])
    v12["ssm_sizes"] = tuple(decoded["ssm_sizes"])
    remote = NixlAgentMetadata(**v12)
    dsv2 = ModelGeometry((AttentionKind.MLA,) * 27, num_kv_heads=1, head_size=576, dtype_bytes=2)
    layout, rank = prefill(dsv2, pp_rank=pp_size - 1, pp_size=pp_size)
    rank = dataclasses.replace(rank, kv_cache_layout="BLHNC")
    assert remote.block_lens == [27 * layout.regions[0].block_len]
    error = agent_refusal(rank, remote)
    assert error.reason == "PackedRowsNotSupported"
    assert f"packed row of {remote.block_lens[0]} bytes (27 layers)" in error.message
