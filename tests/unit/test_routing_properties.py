"""Properties of layer-name routing over random hybrid models, poolings and PP partitions."""

from __future__ import annotations

import itertools
import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.worker.kv.layout import (
    AttentionKind,
    ModelGeometry,
    build_stage_layout,
    transfer_group_index_by_layer,
)
from disagg.worker.kv.routing import (
    RegionGeometry,
    TransferLayers,
    align_remote_regions,
    cumulative_offsets,
    local_descs,
    plan_transfer,
    remote_descs,
    select_regions,
)

KINDS = st.sampled_from([AttentionKind.FULL, AttentionKind.SLIDING_WINDOW, AttentionKind.MLA])


@st.composite
def topologies(draw: st.DrawFn) -> tuple[ModelGeometry, int, tuple[int, ...] | None]:
    num_layers = draw(st.integers(1, 28))
    if draw(st.booleans()):
        period = draw(st.integers(1, 7))
        geometry = ModelGeometry.with_full_every(
            num_layers, period, num_kv_heads=4, head_size=8, dtype_bytes=2
        )
    else:
        kinds = tuple(draw(st.lists(KINDS, min_size=num_layers, max_size=num_layers)))
        geometry = ModelGeometry(kinds, num_kv_heads=4, head_size=8, dtype_bytes=2)
    pp = draw(st.integers(1, min(4, num_layers)))
    partition: tuple[int, ...] | None = None
    if pp > 1 and draw(st.booleans()):
        cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=pp - 1, max_size=pp - 1)))
        bounds = [0, *cuts, num_layers]
        partition = tuple(b - a for a, b in itertools.pairwise(bounds))
    return geometry, pp, partition


@settings(max_examples=60, deadline=None)
@given(
    topology=topologies(),
    p_blocks=st.integers(1, 40),
    d_blocks=st.integers(1, 40),
    request=st.data(),
)
def test_layer_routing_pairs_blocks_of_the_same_layer(
    topology: tuple[ModelGeometry, int, tuple[int, ...] | None],
    p_blocks: int,
    d_blocks: int,
    request: st.DataObject,
) -> None:
    geometry, pp, partition = topology
    d_layout = build_stage_layout(
        geometry, pp_rank=0, pp_size=1, tp_size=1, block_size=16, num_blocks=d_blocks
    )
    decoder = RegionGeometry.from_layout(
        d_layout, base_addr=1 << 40, device_id=0, mem_type="DRAM", advertise_members=True
    )
    groups = transfer_group_index_by_layer(geometry)
    num_groups = max(groups.values()) + 1
    capacity = min(p_blocks, d_blocks)
    length = request.draw(st.integers(0, capacity), label="blocks per group")
    ids = st.lists(st.integers(0, capacity - 1), min_size=length, max_size=length)
    local_blocks = [request.draw(ids, label=f"P group {g}") for g in range(num_groups)]
    remote_blocks = [request.draw(ids, label=f"D group {g}") for g in range(num_groups)]

    seen: list[str] = []
    for rank in range(pp):
        layout = build_stage_layout(
            geometry,
            pp_rank=rank,
            pp_size=pp,
            tp_size=1,
            block_size=16,
            num_blocks=p_blocks,
            partition=partition,
        )
        local = RegionGeometry.from_layout(
            layout, base_addr=1 << 32, device_id=0, mem_type="DRAM", advertise_members=True
        )
        layers = TransferLayers.from_layout(layout)
        seen.extend(layers.names)
        assert all(groups[name] == g for name, g in zip(layers.names, layers.group_ids, strict=True))

        plan, aligned = plan_transfer(local, decoder, transfer_layers=layers)
        assert align_remote_regions(aligned, layers.names) == aligned
        local_ids, remote_ids = plan.desc_ids(local_blocks, remote_blocks)
        assert len(local_ids) == len(remote_ids) == len(layers.names) * length

        src = local_descs(local, regions=layers.region_indices)
        dst = remote_descs(aligned, local, local_regions=layers.region_indices)
        assert ((local_ids >= 0) & (local_ids < len(src))).all()
        assert ((remote_ids >= 0) & (remote_ids < len(dst))).all()

        # Which transfer layer each id falls in, on each side, from that side's own capacities.
        off_l = cumulative_offsets(plan.local_capacities())
        off_r = cumulative_offsets(aligned.region_num_blocks or [])
        k_local = np.searchsorted(off_l, local_ids, side="right") - 1
        k_remote = np.searchsorted(off_r, remote_ids, side="right") - 1
        assert (k_local == k_remote).all()
        expected = [
            (local_blocks[g][j], remote_blocks[g][j]) for g in layers.group_ids for j in range(length)
        ]
        got = list(
            zip((local_ids - off_l[k_local]).tolist(), (remote_ids - off_r[k_remote]).tolist(), strict=True)
        )
        assert got == expected
        # Transfer layer k really is the same layer on both sides: the remote region it points into is the
        # decoder region that holds that layer.
        for k, name in enumerate(layers.names):
            (d_region,) = [r for r, members in enumerate(d_layout.region_members) if name in members]
            assert aligned.kv_caches_base_addr[k] == decoder.kv_caches_base_addr[d_region]
            assert name in local.region_members[layers.region_indices[k]]

    assert sorted(seen) == sorted(geometry.layer_names)


@settings(max_examples=40, deadline=None)
@given(topology=topologies(), order=st.randoms(use_true_random=False))
def test_alignment_does_not_depend_on_the_remote_region_order(
    topology: tuple[ModelGeometry, int, tuple[int, ...] | None], order: random.Random
) -> None:
    geometry, pp, partition = topology
    d_layout = build_stage_layout(geometry, pp_rank=0, pp_size=1, tp_size=1, block_size=16, num_blocks=8)
    decoder = RegionGeometry.from_layout(
        d_layout, base_addr=0, device_id=0, mem_type="DRAM", advertise_members=True
    )
    permutation = list(range(len(d_layout.regions)))
    order.shuffle(permutation)
    shuffled = select_regions(decoder, permutation)
    stage = build_stage_layout(
        geometry, pp_rank=pp - 1, pp_size=pp, tp_size=1, block_size=16, num_blocks=8, partition=partition
    )
    names = TransferLayers.from_layout(stage).names
    assert align_remote_regions(shuffled, names) == align_remote_regions(decoder, names)
