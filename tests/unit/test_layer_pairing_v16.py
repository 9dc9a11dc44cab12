"""Connector version 16 (vLLM 0.34): every worker advertises the layers of its regions and regions always pair
by layer name, PP1 and dense models included; each of 0.34's new handshake refusals is made by the pure
checks a prefill rank runs before any NIXL agent is added (`decode_checks`).

Both sides are built from `build_stage_layout` and `RegionGeometry.from_layout`, as the workers advertise
them; expected pairings come from the decoder's own layout, never from the code under test. vLLM 0.34's own
`_pair_regions` on the project's metadata is in tests/interop/test_pairing_interop.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from disagg.worker.kv import rules
from disagg.worker.kv.decode_checks import (
    LocalRegion,
    PrefillRank,
    check_decode_rank,
    check_same_layout,
    plan_decode_write,
)
from disagg.worker.kv.errors import DisaggError, MissingLayers, RegionGeometryMismatch
from disagg.worker.kv.layout import ModelGeometry, StageLayout, build_stage_layout
from disagg.worker.kv.routing import RegionGeometry, TransferLayers, select_regions
from disagg.worker.kv.wire import NixlAgentMetadata

V16 = 16
DENSE_8 = ModelGeometry.with_full_every(8, 1, num_kv_heads=8, head_size=128, dtype_bytes=2)
GEMMA_30 = ModelGeometry.with_full_every(30, 6, num_kv_heads=8, head_size=128, dtype_bytes=2)


def stage(
    model: ModelGeometry, *, pp_rank: int = 0, pp_size: int = 1, tp_rank: int = 0, tp_size: int = 1
) -> tuple[StageLayout, PrefillRank, RegionGeometry]:
    """A prefill rank speaking v16, as the producer builds it (`producer._prefill_rank`)."""
    layout = build_stage_layout(
        model, pp_rank=pp_rank, pp_size=pp_size, tp_size=tp_size, block_size=16, num_blocks=64
    )
    assert rules.requires_layer_name_routing(
        rules.PUSH, model.hma_required, False, model.has_mamba, pp_size, connector_version=V16
    )
    layers = TransferLayers.from_layout(layout)
    rank = PrefillRank(
        block_size=16,
        routed_layers=tuple(zip(layers.names, layers.region_indices, strict=True)),
        pp_size=pp_size,
        stage_layers=layout.layers,
        regions=tuple(LocalRegion(r.name, r.block_len, r.replicated) for r in layout.regions),
        mem_types=frozenset({"DRAM"}),
        tp_rank=tp_rank,
        tp_size=tp_size,
        num_kv_heads=model.num_kv_heads,
        is_mla=model.is_mla,
        region_group_ids=tuple(layout.region_group_ids),
        whole_model=pp_size == 1,
    )
    meta = RegionGeometry.from_layout(
        layout, base_addr=1 << 40, device_id=0, mem_type="DRAM", advertise_members=True
    )
    return layout, rank, meta


def decoder(
    model: ModelGeometry, *, tp_size: int = 1, advertise: bool = True
) -> tuple[StageLayout, RegionGeometry]:
    layout = build_stage_layout(model, pp_rank=0, pp_size=1, tp_size=tp_size, block_size=16, num_blocks=32)
    meta = RegionGeometry.from_layout(
        layout, base_addr=1 << 44, device_id=0, mem_type="DRAM", advertise_members=advertise
    )
    return layout, meta


def refused(rank: PrefillRank, remote: RegionGeometry, remote_tp: int = 1) -> DisaggError:
    with pytest.raises(DisaggError) as caught:
        check_decode_rank(rank, remote, remote_tp)
    return caught.value


def wire_of(meta: RegionGeometry) -> NixlAgentMetadata:
    return NixlAgentMetadata(
        engine_id="decode",
        agent_metadata=b"agent",
        kv_caches_base_addr=meta.kv_caches_base_addr,
        device_id=meta.device_id,
        num_blocks=meta.num_blocks,
        block_lens=meta.block_lens,
        block_strides=meta.block_strides,
        kv_cache_layout="LBHNC",
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


def test_a_pp1_dense_stage_pairs_every_decoder_region_by_the_layer_it_holds() -> None:
    _, rank, _ = stage(DENSE_8)
    d_layout, remote = decoder(DENSE_8)
    # The decoder lists its regions in another order: pairing follows the names, not the indices.
    order = list(reversed(range(len(remote.kv_caches_base_addr))))
    shuffled = select_regions(remote, order)
    aligned, local_regions = check_decode_rank(rank, shuffled, 1)
    holder = {name: r for r, region in enumerate(d_layout.regions) for name in region.members}
    names = [name for name, _ in rank.routed_layers or ()]
    assert aligned.kv_caches_base_addr == [remote.kv_caches_base_addr[holder[n]] for n in names]
    assert local_regions == list(range(8))


def test_a_pp1_stage_writes_to_more_decode_ranks_than_it_has_as_before() -> None:
    """vLLM 0.34 refuses decode TP above prefill TP only for a PP stage (`_supports_pp_hma`, PP > 1)."""
    _, rank, local = stage(DENSE_8, tp_size=1)
    _, remote = decoder(DENSE_8, tp_size=2)
    layers = TransferLayers(
        tuple(n for n, _ in rank.routed_layers or ()),
        tuple(r for _, r in rank.routed_layers or ()),
        (0,) * 8,
    )
    writes = [plan_decode_write(rank, local, layers, wire_of(remote), 2, d) for d in range(2)]
    assert [write.head_slice for write in writes] == [(0, 2), (1, 2)]
    check_same_layout("decode", writes)


def test_a_decoder_that_lists_its_layers_only_under_hma_is_refused() -> None:
    """What 0.31-0.33 (and this project's sidecar before v16) advertise for a dense model: no
    region_members. 0.34: "Engine X did not advertise the layers of its KV regions"."""
    _, rank, _ = stage(DENSE_8)
    _, remote = decoder(DENSE_8, advertise=False)
    error = refused(rank, remote)
    assert isinstance(error, MissingLayers)
    assert "did not advertise the layers of its KV regions" in error.message
    short = dataclasses.replace(decoder(DENSE_8)[1], region_members=[["model.layers.0.self_attn.attn"]])
    error = refused(rank, short)
    assert isinstance(error, MissingLayers) and "lists 1 regions of its 8" in error.message


def test_a_decoder_without_a_local_layer_is_refused() -> None:
    _, rank, _ = stage(DENSE_8)
    _, remote = decoder(DENSE_8)
    members = [list(m) for m in remote.region_members]
    members[3] = ["model.layers.99.self_attn.attn"]
    error = refused(rank, dataclasses.replace(remote, region_members=members))
    assert isinstance(error, MissingLayers)
    assert "does not advertise local transfer layers ['model.layers.3.self_attn.attn']" in error.message


def test_a_decoder_layer_with_no_counterpart_is_refused_at_pp1_and_skipped_by_a_pp_stage() -> None:
    _, remote = decoder(DENSE_8)
    extra = dataclasses.replace(
        remote,
        **{
            name: [*getattr(remote, name), getattr(remote, name)[0]]
            for name in (
                "kv_caches_base_addr",
                "block_lens",
                "block_strides",
                "region_num_blocks",
                "region_group_ids",
                "region_mem_types",
            )
        },
        region_names=[*(remote.region_names or []), "model.layers.8.self_attn.attn"],
        region_members=[*remote.region_members, ["model.layers.8.self_attn.attn"]],
    )
    _, rank, _ = stage(DENSE_8)
    error = refused(rank, extra)
    assert isinstance(error, MissingLayers)
    assert (
        "holds KV layers ['model.layers.8.self_attn.attn'], which have no counterpart here" in error.message
    )
    # A PP stage holds a slice of the model: the decoder's other layers are skipped.
    _, rank1, _ = stage(DENSE_8, pp_rank=1, pp_size=2)
    aligned, _ = check_decode_rank(rank1, extra, 1)
    assert aligned.region_names == [f"model.layers.{i}.self_attn.attn" for i in range(4, 8)]


def test_a_layer_spanning_more_regions_there_than_here_is_refused() -> None:
    _, rank, _ = stage(DENSE_8)
    _, remote = decoder(DENSE_8)
    members = [list(m) for m in remote.region_members]
    members[1] = [*members[1], members[0][0]]
    error = refused(rank, dataclasses.replace(remote, region_members=members))
    assert isinstance(error, MissingLayers)
    assert "KV layer 'model.layers.0.self_attn.attn' spans 2 NIXL regions there and 1 here" in error.message


def test_one_decoder_region_pairing_local_regions_of_different_block_lengths_is_refused() -> None:
    a, b = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"
    rank = PrefillRank(
        block_size=16,
        routed_layers=((a, 0), (b, 1)),
        pp_size=1,
        stage_layers=range(2),
        regions=(LocalRegion(a, 4096, False), LocalRegion(b, 8192, False)),
        mem_types=None,
        tp_rank=0,
        tp_size=1,
        num_kv_heads=8,
        is_mla=False,
        whole_model=True,
    )
    remote = RegionGeometry(
        kv_caches_base_addr=[1 << 44],
        device_id=0,
        num_blocks=32,
        block_lens=[4096],
        block_strides=[8192],
        block_size=16,
        region_names=[a],
        region_members=[[a, b]],
    )
    error = refused(rank, remote)
    assert isinstance(error, RegionGeometryMismatch)
    assert "decode region 0 pairs with local regions of different block lengths" in error.message


def test_decode_tp_ranks_laid_out_differently_are_refused_before_any_agent_is_added() -> None:
    _, rank, local = stage(GEMMA_30, pp_rank=1, pp_size=2)
    _, remote = decoder(GEMMA_30, tp_size=1)
    layers = TransferLayers(
        tuple(n for n, _ in rank.routed_layers or ()),
        tuple(r for _, r in rank.routed_layers or ()),
        tuple(0 for _ in rank.routed_layers or ()),
    )
    same = plan_decode_write(rank, local, layers, wire_of(remote), 1, 0)
    check_same_layout("decode", [same, same])
    # Another rank of the same engine registers its regions in another order.
    order = list(reversed(range(len(remote.kv_caches_base_addr))))
    other = plan_decode_write(rank, local, layers, wire_of(select_regions(remote, order)), 1, 0)
    assert other.pairing != same.pairing
    with pytest.raises(RegionGeometryMismatch, match="TP ranks of decode engine 'decode' lay out their KV"):
        check_same_layout("decode", [same, other])
