"""The engine's registration and requests, checked against the sidecar's configuration (no I/O)."""

from __future__ import annotations

from collections.abc import Sequence

from disagg.worker.kv.errors import BlockIdOutOfRange, DisaggError, EngineLayoutMismatch, EngineProtocolError
from disagg.worker.kv.layout import StageLayout, build_stage_layout
from disagg.worker.link.engine_link import RegisterLayout
from disagg.worker.sidecar.config import SidecarConfig


def expected_layout(config: SidecarConfig, message: RegisterLayout) -> StageLayout:
    """The layout this worker must have, from the configuration and the engine's capacity; or a typed error
    naming the first field where the engine's registration contradicts the configuration."""
    topo = config.topology

    def differ(what: str, engine: object, configured: object) -> None:
        if engine != configured:
            raise EngineLayoutMismatch(
                f"{what}: the engine registers {engine!r}, the sidecar's configuration says {configured!r}"
            )

    differ("engine_id", message.engine_id, config.engine_id)
    differ("role", message.role, config.role)
    model = message.model
    configured = topo.model
    differ("model.layer_kinds", model.layer_kinds, [kind.value for kind in configured.kinds])
    differ("model.num_kv_heads", model.num_kv_heads, configured.num_kv_heads)
    differ("model.head_size", model.head_size, configured.head_size)
    differ("model.dtype_bytes", model.dtype_bytes, configured.dtype_bytes)
    differ("model.layer_name_template", model.layer_name_template, configured.layer_name_template)
    differ("model.hma", model.hma, configured.hma)
    differ("pp_size", message.pp_size, config.pp_size)
    differ("pp_rank", message.pp_rank, config.pp_rank)
    differ("tp_size", message.tp_size, config.tp_size)
    differ("tp_rank", message.tp_rank, config.tp_rank)
    differ("block_size", message.block_size, topo.block_size)
    differ("packed", message.packed, topo.packed)
    layers = topo.stage_layers[config.pp_rank] if config.role == "prefill" else range(configured.num_layers)
    differ("layers", (message.layer_start, message.layer_stop), (layers.start, layers.stop))
    if config.kv_pool is not None:
        differ("pool.path", message.pool.path, config.kv_pool)
    if message.num_blocks < 1 or message.kernel_block_size < 1:
        raise EngineLayoutMismatch(
            f"num_blocks {message.num_blocks} and kernel_block_size {message.kernel_block_size} "
            "must be positive"
        )
    try:
        layout = build_stage_layout(
            configured,
            pp_rank=config.pp_rank,
            pp_size=config.pp_size,
            tp_size=config.tp_size,
            block_size=topo.block_size,
            num_blocks=message.num_blocks,
            partition=topo.layer_partition if config.role == "prefill" else None,
            packed=topo.packed,
            kernel_block_size=message.kernel_block_size,
        )
    except DisaggError as exc:
        raise EngineLayoutMismatch(f"the registered geometry cannot be laid out: {exc.message}") from None
    differ("number of regions", len(message.regions), len(layout.regions))
    for index, (got, want) in enumerate(zip(message.regions, layout.regions, strict=True)):
        differ(f"regions[{index}].members", got.members, list(want.members))
        differ(f"regions[{index}].offset", got.offset, want.offset)
        differ(f"regions[{index}].block_len", got.block_len, want.block_len)
        differ(f"regions[{index}].block_stride", got.block_stride, want.block_stride)
        differ(f"regions[{index}].num_blocks", got.num_blocks, want.num_blocks)
    if message.pool.nbytes < layout.total_bytes:
        raise EngineLayoutMismatch(
            f"pool.nbytes: the engine's pool has {message.pool.nbytes} bytes, the layout needs "
            f"{layout.total_bytes}"
        )
    return layout


def check_block_ids(layout: StageLayout, block_ids: Sequence[Sequence[int]]) -> None:
    """One list per KV cache group, every id a logical block inside the pool."""
    if len(block_ids) != len(layout.groups):
        raise EngineProtocolError(
            f"block ids name {len(block_ids)} KV cache groups, the layout has {len(layout.groups)}"
        )
    capacity = layout.num_blocks // layout.physical_blocks_per_logical
    for group, ids in enumerate(block_ids):
        if len(ids) > capacity:
            raise BlockIdOutOfRange(
                f"group {group}: {len(ids)} block ids, the pool holds {capacity} blocks per group"
            )
        bad = [b for b in ids if not 0 <= b < capacity]
        if bad:
            raise BlockIdOutOfRange(
                f"group {group}: block ids {bad[:8]} are outside 0..{capacity - 1} "
                f"(the pool holds {capacity} blocks)"
            )
    if not any(block_ids):
        raise EngineProtocolError("a request needs at least one block")
