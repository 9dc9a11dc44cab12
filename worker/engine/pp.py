"""Disaggregated runs of the reference engine: pipeline-parallel prefill stages and a decoder, each a process.

Each prefill stage owns a contiguous slice of the layers (vLLM's even split) and its own KV buffer laid out
for those layers only, so its HMA pooling differs from the decoder's. Activations go stage to stage with
`torch.distributed` point-to-point over gloo on loopback. A request has one set of per-group block ids on
each side (P's single scheduler serves every stage), and KV moves between the sides by layer name.

The stage and decoder entry points map their KV buffer from a /dev/shm file, the same file a sidecar maps to
register the buffer with NIXL.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

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


def run_prefill_stage(
    rank: int,
    world: int,
    master_port: int,
    model: TinyModel,
    kv: PagedKVCache,
    token_ids: Sequence[int],
    block_tables: BlockTables,
    *,
    timeout_s: float = 60.0,
) -> int | None:
    """Prefill stage `rank` of `world`: receive activations, run this stage's layers, pass them on.

    Writes only this stage's layers' KV into `kv` (a cache laid out for this stage). Returns the first
    generated token on the last stage, None on the others.
    """
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{master_port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        layers = model.config.stages(world)[rank]
        hidden_in = None
        if rank > 0:
            hidden_in = torch.empty(len(token_ids), model.config.hidden_size, dtype=torch.float32)
            dist.recv(hidden_in, src=rank - 1)
        out = model.prefill(token_ids, kv, block_tables, layers=layers, hidden_in=hidden_in)
        if rank < world - 1:
            dist.send(out.contiguous(), dst=rank + 1)
            return None
        return int(torch.argmax(out[-1]))
    finally:
        dist.destroy_process_group()


def prefill_stage_main(rank: int, world: int, master_port: int, job: PrefillJob, kv_path: str) -> int | None:
    """Process entry point of one prefill stage, its KV buffer mapped from the existing file `kv_path`."""
    torch.set_num_threads(1)
    model = TinyModel(job.config)
    kv = map_kv_cache(model, job.num_blocks, kv_path, pp_rank=rank, pp_size=world)
    return run_prefill_stage(rank, world, master_port, model, kv, job.token_ids, job.block_tables)


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
