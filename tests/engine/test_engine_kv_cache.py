"""The paged KV cache: pooled regions, one shared block pool, the documented byte layout in a mapped file."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
import torch

from disagg.worker.engine.config import TinyConfig, layer_name
from disagg.worker.engine.kv_cache import (
    NULL_BLOCK,
    BlockPool,
    KVCacheLayout,
    OutOfBlocks,
    PagedKVCache,
    allocate_block_tables,
)
from disagg.worker.engine.model import TinyModel
from disagg.worker.kv.errors import CompatibilityError

CONFIG = TinyConfig()


@pytest.fixture(scope="module")
def model() -> TinyModel:
    return TinyModel(CONFIG)


def test_layout_pools_layers_of_different_groups_into_shared_regions(model: TinyModel) -> None:
    layout = model.kv_layout(16)
    # 9 layers, every 3rd full: groups {0,3,6} {1,4,7} sliding, {2,5,8} full; slot l holds the l-th of each.
    assert layout.num_groups == 3
    assert [layout.layer_group[layer_name(i)] for i in range(9)] == [0, 1, 2] * 3
    assert [layout.layer_region[layer_name(i)] for i in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert layout.block_len == layout.block_stride == 2 * 2 * 16 * 16 * 4
    assert layout.total_bytes == 3 * 16 * layout.block_len

    stage1 = model.kv_layout(16, pp_rank=1, pp_size=2)
    # Stage 1 owns layers 5..8: its first slot mixes layers the decoder keeps in two different slots.
    assert sorted(stage1.layer_region) == [layer_name(i) for i in range(5, 9)]
    assert {n for n, r in stage1.layer_region.items() if r == 0} == {layer_name(i) for i in (5, 6, 7)}
    assert all(stage1.layer_group[n] == layout.layer_group[n] for n in stage1.layer_group)


def test_layers_sharing_a_region_never_touch_the_same_bytes(model: TinyModel) -> None:
    kv = PagedKVCache(model.kv_layout(10))
    tables = kv.allocate(40)
    assert len({b for ids in tables.values() for b in ids}) == sum(len(ids) for ids in tables.values())
    positions = torch.arange(40)
    written = {}
    for i in range(CONFIG.num_layers):
        k = torch.full((2, 40, 16), float(i))
        v = torch.full((2, 40, 16), float(-i - 1))
        name = layer_name(i)
        kv.write(name, tables[kv.layout.group_of(name)], positions, k, v)
        written[name] = (k, v)
    for name, (k, v) in written.items():
        got_k, got_v = kv.gather(name, tables[kv.layout.group_of(name)], 40)
        assert torch.equal(got_k, k) and torch.equal(got_v, v), name


def test_external_mmap_buffer_holds_the_documented_byte_layout(model: TinyModel, tmp_path: Path) -> None:
    layout = model.kv_layout(6)
    stage = CONFIG.stage_layout(6)  # what the sidecar registers with NIXL
    assert layout.region_offsets == tuple(stage.base_offsets) and stage.total_bytes == layout.total_bytes
    assert [sorted(n for n, r in layout.layer_region.items() if r == i) for i in range(3)] == [
        sorted(members) for members in stage.region_members
    ]
    path = tmp_path / "kv"
    path.write_bytes(b"\0" * layout.total_bytes)
    with path.open("r+b") as file:
        mapping = mmap.mmap(file.fileno(), layout.total_bytes)
    kv = PagedKVCache(layout, torch.frombuffer(mapping, dtype=torch.uint8))
    name = layer_name(4)
    table = [3, 5]  # out of order on purpose: token t lives in table[t // 16]
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 20, 16, generator=gen)
    v = torch.randn(2, 20, 16, generator=gen)
    kv.write(name, table, torch.arange(20), k, v)

    raw = np.frombuffer(path.read_bytes(), dtype=np.uint8)  # what another process mapping the file sees
    for token in (0, 15, 16, 19):
        block, slot = table[token // 16], token % 16
        start = layout.region_offsets[1] + block * layout.block_stride
        page = raw[start : start + layout.block_len].view(np.float32).reshape(2, 16, 32)  # [head][token][K‖V]
        assert np.array_equal(page[:, slot, :16], k[:, token].numpy())
        assert np.array_equal(page[:, slot, 16:], v[:, token].numpy())


def test_layer_block_view_shares_the_buffer(model: TinyModel) -> None:
    kv = PagedKVCache(model.kv_layout(4))
    view = kv.layer_block_view(layer_name(7), 2)
    assert view.dtype == np.uint8 and view.nbytes == kv.layout.block_len
    view[:] = np.arange(kv.layout.block_len // 4, dtype=np.float32).view(np.uint8)
    keys, _ = kv.gather(layer_name(7), [2], 16)
    assert keys[0, 0, 1].item() == 1.0 and keys[1, 0, 0].item() == 16 * 32
    # Layers 6 and 7 share a region: one block id is the same bytes for both, hence one owner group per id.
    assert kv.layout.layer_offset(layer_name(6), 2) == kv.layout.layer_offset(layer_name(7), 2)
    with pytest.raises(KeyError, match="no KV cache in this process"):
        kv.layer_block_view("model.layers.99.self_attn.attn", 0)


def test_one_pool_serves_every_group_and_never_hands_out_the_null_block() -> None:
    pool = BlockPool(8)
    tables = allocate_block_tables(pool, num_groups=3, block_size=16, num_tokens=32)
    ids = [b for table in tables.values() for b in table]
    assert len(ids) == 6 and NULL_BLOCK not in ids and pool.num_free == 1
    assert all(pool.owner(b) == g for g, table in tables.items() for b in table)
    with pytest.raises(OutOfBlocks, match="33 tokens need 3 more blocks over 3 groups, only 1 are free"):
        allocate_block_tables(pool, 3, 16, 33, tables)
    assert pool.num_free == 1  # a refused allocation takes nothing
    freed = tables.pop(1)
    pool.give_back(freed)
    assert pool.num_free == 3 and all(pool.owner(b) is None for b in freed)
    regrown = allocate_block_tables(pool, 3, 16, 32, tables)
    assert pool.num_free == 1 and [len(t) for t in regrown.values()] == [2, 2, 2]
    assert regrown[0] == tables[0] and regrown[2] == tables[2]
    assert set(regrown[1]).isdisjoint(regrown[0] + regrown[2]) and {pool.owner(b) for b in regrown[1]} == {1}


def test_bad_buffers_and_layouts_are_refused(model: TinyModel) -> None:
    layout = model.kv_layout(4)
    with pytest.raises(CompatibilityError, match="has 100 bytes, the layout needs"):
        PagedKVCache(layout, torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(CompatibilityError, match="contiguous 1-D uint8"):
        PagedKVCache(layout, torch.zeros(layout.total_bytes, dtype=torch.float32))
    with pytest.raises(CompatibilityError, match="two layers of the same group share a region"):
        KVCacheLayout(
            block_size=16,
            num_kv_heads=2,
            head_size=16,
            num_blocks=4,
            block_len=4096,
            block_stride=4096,
            region_offsets=(0,),
            layer_region={"a": 0, "b": 0},
            layer_group={"a": 0, "b": 0},
            num_groups=1,
        )
