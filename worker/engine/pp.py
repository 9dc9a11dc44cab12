"""Disaggregated runs of the reference engine: pipeline-parallel prefill stages and a decoder, each a process.

Each prefill stage owns a contiguous slice of the layers (vLLM's even split) and its own KV buffer laid out
for those layers only, so its HMA pooling differs from the decoder's. Activations go stage to stage with
`torch.distributed` point-to-point over gloo on loopback. A request has one set of per-group block ids on
each side (P's single scheduler serves every stage), and KV moves between the sides by layer name. A
stage's step is the engine's own (`stages.prefill_step`).

The stage and decoder entry points map their KV buffer from a /dev/shm file, the same file a sidecar maps to
register the buffer with NIXL.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from disagg.worker.engine import stages
from disagg.worker.engine.config import TinyConfig
from disagg.worker.engine.kv_cache import BlockTables, PagedKVCache
from disagg.worker.engine.model import TinyModel
from disagg.worker.link.kv_pool import ShmPool


def map_kv_cache(
    model: TinyModel,
    num_blocks: int,
    path: str | os.PathLike[str],
    *,
    pp_rank: int = 0,
    pp_size: int = 1,
    create: bool = False,
) -> PagedKVCache:
    """The KV cache of stage `pp_rank` over the /dev/shm file `path` (created at the layout's size if asked).

    The mapping lives as long as the cache's buffer does.
    """
    layout = model.kv_layout(num_blocks, pp_rank=pp_rank, pp_size=pp_size)
    pool = ShmPool(path, layout.total_bytes, create=create)
    return PagedKVCache(layout, torch.from_numpy(pool.array))


@dataclass(frozen=True)
class PrefillJob:
    """What every prefill stage of one request is given (P's scheduler decides the block ids once)."""

    config: TinyConfig
    token_ids: Sequence[int]
    num_blocks: int
    block_tables: BlockTables


def prefill_stage_main(rank: int, world: int, master_port: int, job: PrefillJob, kv_path: str) -> int | None:
    """Process entry point of one prefill stage, its KV buffer mapped from the existing file `kv_path`: one
    `stages.prefill_step` in a gloo group of its own on loopback. The first token on the last stage, None on
    the others."""
    torch.set_num_threads(1)
    model = TinyModel(job.config)
    kv = map_kv_cache(model, job.num_blocks, kv_path, pp_rank=rank, pp_size=world)
    stages.join("127.0.0.1", master_port, rank, world)
    try:
        return stages.prefill_step(model, kv, rank, world, job.token_ids, job.block_tables)
    finally:
        stages.leave()


@dataclass(frozen=True)
class DecodeJob:
    """A decoder's continuation of one request whose prompt KV already sits in its cache."""

    config: TinyConfig
    num_blocks: int
    block_tables: BlockTables
    first_token: int
    num_prompt_tokens: int
    max_new_tokens: int


def decoder_main(job: DecodeJob, kv_path: str) -> list[int]:
    """Process entry point of the decoder: greedy decode from the KV in the buffer mapped from `kv_path`."""
    torch.set_num_threads(1)
    model = TinyModel(job.config)
    kv = map_kv_cache(model, job.num_blocks, kv_path)
    return model.decode_greedy(
        job.first_token, job.num_prompt_tokens, kv, job.block_tables, job.max_new_tokens
    )
