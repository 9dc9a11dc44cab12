"""Disaggregated reference run: 2 PP prefill stage processes, KV moved by layer name, a decoder process.

The copy between the stages' buffers and the decoder's buffer stands in for the sidecar's NIXL push: it goes
by layer name and per-group block ids, from each stage's pooling into the decoder's different pooling.
"""

from __future__ import annotations

import math
import multiprocessing
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from disagg.rig.local import free_port
from disagg.worker.engine.config import TinyConfig, encode, layer_name
from disagg.worker.engine.kv_cache import BlockPool, PagedKVCache, allocate_block_tables
from disagg.worker.engine.model import TinyModel
from disagg.worker.engine.pp import (
    DecodeJob,
    PrefillJob,
    decoder_main,
    map_kv_cache,
    prefill_stage_main,
)

CONFIG = TinyConfig()
PROMPT = encode("Pipeline-parallel prefill, then decode elsewhere; the sliding window is 32 tokens wide.")
MAX_NEW_TOKENS = 16
P_BLOCKS, D_BLOCKS = 40, 48
WORLD = 2


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    shm = Path("/dev/shm")
    path = Path(tempfile.mkdtemp(prefix="disagg-engine-", dir=shm if shm.is_dir() else None))
    yield path
    shutil.rmtree(path)


def spawn_pool() -> ProcessPoolExecutor:
    # A fresh spawned process per task: every stage and decoder is its own interpreter, as in the pods.
    return ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1)


def test_pp_prefill_then_decode_from_moved_kv_equals_monolithic_run(shm_dir: Path) -> None:
    model = TinyModel(CONFIG)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the worker processes' kernels
    try:
        reference = model.generate(PROMPT, MAX_NEW_TOKENS)
    finally:
        torch.set_num_threads(threads)

    # P's scheduler: one pool, one set of per-group block ids for every stage (another request came first).
    num_groups = len(CONFIG.stage_layout(P_BLOCKS).groups)
    p_pool = BlockPool(P_BLOCKS)
    allocate_block_tables(p_pool, num_groups, CONFIG.block_size, 37)
    p_tables = allocate_block_tables(p_pool, num_groups, CONFIG.block_size, len(PROMPT))
    stage_paths = [shm_dir / f"prefill-{rank}.kv" for rank in range(WORLD)]
    for rank, path in enumerate(stage_paths):
        map_kv_cache(model, P_BLOCKS, path, pp_rank=rank, pp_size=WORLD, create=True)
    job = PrefillJob(CONFIG, PROMPT, P_BLOCKS, p_tables)
    port = free_port()
    with spawn_pool() as pool:
        stages = [
            pool.submit(prefill_stage_main, r, WORLD, port, job, str(stage_paths[r])) for r in range(WORLD)
        ]
        results = [stage.result(timeout=120) for stage in stages]
    assert results[0] is None and results[1] == reference[0]

    # D: its own pooling (3 regions for 9 layers vs 2 per stage) and its own block ids.
    d_path = shm_dir / "decode.kv"
    decoder = map_kv_cache(model, D_BLOCKS, d_path, create=True)
    decoder.allocate(70)
    d_tables = decoder.allocate(len(PROMPT) + MAX_NEW_TOKENS - 1)
    # Stage 1 pools layers 5, 6 and 7 in one region; the decoder keeps them in two (HMA note, §5).
    stage1 = CONFIG.stage_layout(P_BLOCKS, pp_rank=1, pp_size=WORLD)
    assert stage1.region_members[0] == [layer_name(i) for i in (5, 6, 7)]
    assert {decoder.layout.layer_region[layer_name(i)] for i in (5, 6, 7)} == {1, 2}
    prompt_blocks = math.ceil(len(PROMPT) / CONFIG.block_size)
    moved = []
    for rank, path in enumerate(stage_paths):
        stage = map_kv_cache(model, P_BLOCKS, path, pp_rank=rank, pp_size=WORLD)
        for name in stage.layout.layer_region:
            group = stage.layout.group_of(name)
            assert decoder.layout.group_of(name) == group
            copy_layer_blocks(
                stage, decoder, name, p_tables[group][:prompt_blocks], d_tables[group][:prompt_blocks]
            )
            moved.append(name)
    assert sorted(moved) == sorted(CONFIG.layer_names)

    # A second decoder buffer, identical except for one block of one full-attention layer.
    bad_path = shm_dir / "decode-corrupted.kv"
    shutil.copyfile(d_path, bad_path)
    bad = map_kv_cache(model, D_BLOCKS, bad_path)
    victim = layer_name(8)
    noise = 50 * torch.randn(bad.layout.block_len // 4, generator=torch.Generator().manual_seed(3))
    bad.layer_block_view(victim, d_tables[bad.layout.group_of(victim)][1])[:] = noise.numpy().view(np.uint8)

    decode = DecodeJob(CONFIG, D_BLOCKS, d_tables, results[1], len(PROMPT), MAX_NEW_TOKENS)
    with spawn_pool() as pool:
        clean, corrupted = (pool.submit(decoder_main, decode, str(p)) for p in (d_path, bad_path))
        assert clean.result(timeout=120) == reference
        assert corrupted.result(timeout=120) != reference


def copy_layer_blocks(
    src: PagedKVCache, dst: PagedKVCache, name: str, src_blocks: list[int], dst_blocks: list[int]
) -> None:
    """Copy layer `name`'s blocks between two caches by layer name, pairing block ids positionally."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(
            f"{len(src_blocks)} source blocks vs {len(dst_blocks)} destination blocks for {name}"
        )
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        dst.layer_block_view(name, d)[:] = src.layer_block_view(name, s)
