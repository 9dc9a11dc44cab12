"""A worker's KV pool and its registration with the sidecar, alike on the head and on a headless stage.

The pool is a new /dev/shm file the sidecar maps too; `layout_message` is what the worker tells its sidecar
about it, which `link_events.connect_and_register` sends.
"""

from __future__ import annotations

from pathlib import Path

from disagg.worker.engine.config import TinyConfig
from disagg.worker.engine.kv_cache import PagedKVCache
from disagg.worker.engine.model import TinyModel
from disagg.worker.engine.pp import map_kv_cache
from disagg.worker.engine.settings import ServeSettings
from disagg.worker.link.engine_link import RegisterLayout, register_layout_message

LINK_REPLY_TIMEOUT_S = 60.0


def new_pool(model: TinyModel, s: ServeSettings) -> PagedKVCache:
    """This worker's KV cache over its pool file, zeroed.

    The pool's emptyDir outlives a restart of the engine container, and so does the sidecar, with its NIXL
    registration of the file's pages: a restarted engine registers the same layout again, which the sidecar
    keeps as it is (`sidecar.transfer`). So a restart maps the file that is there when it has this layout's
    size; only a missing file or one of another size is replaced. (Unlinking it and creating a new one, as
    this did before, left the sidecar moving the dead file's pages: on a real kubelet, which restarts one
    container of a pod, every PP2 request after a stage's restart came back as another text than the
    monolithic run.)
    """
    try:
        kv = map_kv_cache(model, s.num_blocks, s.kv_pool, pp_rank=s.pp_rank, pp_size=s.pp_size)
    except (FileNotFoundError, ValueError):
        Path(s.kv_pool).unlink(missing_ok=True)
        return map_kv_cache(model, s.num_blocks, s.kv_pool, pp_rank=s.pp_rank, pp_size=s.pp_size, create=True)
    # What the last run left is nobody's KV now: the restart starts from the state a new pool has.
    kv.buffer.zero_()
    return kv


def layout_message(config: TinyConfig, s: ServeSettings, kv: PagedKVCache) -> RegisterLayout:
    """What the head and a headless stage alike tell their sidecar about their KV pool."""
    return register_layout_message(
        engine_id=s.engine_id,
        role=s.role,
        geometry=config.geometry,
        stage=config.stage_layout(s.num_blocks, pp_rank=s.pp_rank, pp_size=s.pp_size),
        tp_rank=0,
        num_blocks=s.num_blocks,
        pool_path=s.kv_pool,
        pool_bytes=int(kv.buffer.numel()),
    )
