"""Merged runs from block ids and strided lists (`routing.runs`) equal `transport.merge_runs` over the
gathered rows, and a handshake's destination list is one strided row per region."""

from __future__ import annotations

import numpy as np
import pytest

from disagg.worker.connector.transport import merge_runs
from disagg.worker.kv.errors import BlockIdOutOfRange
from disagg.worker.kv.routing import (
    IdArray,
    RegionGeometry,
    TransferPlan,
    expand_strided,
    group_arrays,
    layer_routed_rows,
    merged_runs,
    region_capacities,
    region_rows,
)

BLOCK = 64


def _strided(rng: np.random.Generator, caps: list[int], contiguous: bool) -> np.ndarray:
    rows = []
    addr = 1 << 40
    for cap in caps:
        stride = BLOCK if contiguous else BLOCK * int(rng.integers(1, 3))
        rows.append((addr, BLOCK, 0, stride, cap))
        addr += cap * stride + (0 if contiguous else BLOCK * int(rng.integers(0, 2)))
    return np.array(rows, dtype=np.uint64).reshape(-1, 5)


def _blocks(rng: np.random.Generator, groups: int, n: int, cap: int, runs: bool) -> list[IdArray]:
    out = []
    for _ in range(groups):
        if runs:
            start = int(rng.integers(0, max(1, cap - n)))
            ids = np.arange(start, start + n, dtype=np.int64)
            cut = int(rng.integers(0, n + 1))
            ids[cut:] = np.minimum(ids[cut:] + int(rng.integers(0, 3)), cap - 1)
        else:
            ids = rng.integers(0, cap, size=n).astype(np.int64)
        out.append(ids)
    return out


@pytest.mark.parametrize("seed", range(60))
def test_merged_runs_equal_merging_the_gathered_rows(seed: int) -> None:
    rng = np.random.default_rng(seed)
    groups = int(rng.integers(1, 4))
    layers = int(rng.integers(1, 7))
    group_ids = [int(rng.integers(0, groups)) for _ in range(layers)]
    group_ids[0] = groups - 1
    cap = int(rng.integers(1, 40))
    caps = [cap + int(rng.integers(0, 3)) for _ in range(layers)]
    layered = bool(rng.integers(0, 2))
    rows = layer_routed_rows(caps, group_ids) if layered else region_rows(caps, groups)
    n = int(rng.integers(0, cap + 1)) if seed % 7 else int(rng.integers(0, 2))
    contiguous = bool(rng.integers(0, 2))
    local, remote = _strided(rng, caps, contiguous), _strided(rng, caps, contiguous)
    local_ids = _blocks(rng, groups, n, cap, bool(rng.integers(0, 2)))
    remote_ids = _blocks(rng, groups, n, cap, bool(rng.integers(0, 2)))
    runs = merged_runs(rows, local, local_ids, rows, remote, remote_ids)
    assert runs is not None
    want_local, want_remote = merge_runs(
        expand_strided(local)[rows.fill(local_ids)], expand_strided(remote)[rows.fill(remote_ids)]
    )
    got_local, got_remote = runs.descriptors()
    assert runs.count == len(want_local)
    np.testing.assert_array_equal(got_local, want_local)
    np.testing.assert_array_equal(got_remote, want_remote)
    assert runs.num_descs == rows.size(group_arrays(local_ids))
    assert runs.nbytes == int(expand_strided(local)[rows.fill(local_ids)][:, 1].sum())


def test_runs_of_empty_one_block_and_unequal_lengths() -> None:
    rows = layer_routed_rows([4, 4], [0, 0])
    table = np.array([[1 << 20, BLOCK, 0, BLOCK, 4], [1 << 21, BLOCK, 0, BLOCK, 4]], dtype=np.uint64)
    empty = merged_runs(rows, table, [np.zeros(0, np.int64)], rows, table, [np.zeros(0, np.int64)])
    assert empty is not None and empty.count == 0 and empty.descriptors()[0].shape == (0, 3)
    one = merged_runs(rows, table, [np.array([2])], rows, table, [np.array([3])])
    assert one is not None and one.count == 2 and one.nbytes == 2 * BLOCK
    other = table.copy()
    other[:, 1] = BLOCK // 2
    with pytest.raises(ValueError, match="equal lengths"):
        merged_runs(rows, table, [np.array([1])], rows, other, [np.array([1])])


def test_out_of_range_ids_are_refused_before_any_run() -> None:
    meta = RegionGeometry([1 << 20], 0, 4, [BLOCK], [BLOCK], 16, region_num_blocks=[4])
    plan = TransferPlan(meta, meta, (0,), None)
    table = np.array([[1 << 20, BLOCK, 0, BLOCK, 4]], dtype=np.uint64)
    with pytest.raises(BlockIdOutOfRange):
        plan.runs([np.array([1, 4])], [np.array([0, 1])], table, table)


def test_a_handshake_builds_one_strided_row_per_transfer_layer_never_one_per_block() -> None:
    """The handshake's cost was a descriptor row per block and layer (hundreds of thousands for a
    64-layer PP2 -> PP1 decoder), built in numpy and again by NIXL; the producer prepares this list."""
    from test_write_bounds import prefill_rank, wire_of

    from disagg.worker.kv.decode_checks import plan_decode_write
    from disagg.worker.kv.layout import ModelGeometry, build_stage_layout
    from disagg.worker.kv.routing import TransferLayers, remote_descs

    geometry = ModelGeometry.with_full_every(64, 6, num_kv_heads=1, head_size=64, dtype_bytes=2)
    decode = build_stage_layout(geometry, pp_rank=0, pp_size=1, tp_size=1, block_size=16, num_blocks=4096)
    d_meta = RegionGeometry.from_layout(
        decode, base_addr=1 << 44, device_id=0, mem_type="DRAM", advertise_members=True
    )
    stage = build_stage_layout(geometry, pp_rank=1, pp_size=2, tp_size=1, block_size=16, num_blocks=4096)
    p_meta = RegionGeometry.from_layout(
        stage, base_addr=1 << 40, device_id=0, mem_type="DRAM", advertise_members=True
    )
    layers = TransferLayers.from_layout(stage)
    write = plan_decode_write(
        prefill_rank(stage, geometry, 0, True), p_meta, layers, wire_of(decode, d_meta), 1, 0
    )
    assert write.remote_strided.shape == (len(layers.names), 5)
    assert int(write.remote_strided[:, 4].sum()) == sum(region_capacities(write.plan.remote))
    np.testing.assert_array_equal(
        write.remote_descs,
        remote_descs(
            write.plan.remote, p_meta, local_regions=write.plan.local_regions, replicated=write.replicated
        ),
    )
    assert write.source_strided().shape == (len(layers.names), 5)
