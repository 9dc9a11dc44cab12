"""The reference engine's paged KV cache: one flat byte buffer per process, pooled as vLLM's HMA pools it.

Buffer layout (fixed; the sidecar registers the buffer once with NIXL and moves the same bytes). It is the
era-C layout that `disagg.worker.kv.layout.build_stage_layout` describes, and is taken from it:

- The buffer is split into regions ("slots"). Region `r` starts at byte `region_offsets[r]` and holds
  `num_blocks` blocks, block `b` at `region_offsets[r] + b * block_stride` (layer-outer `LBHNC`:
  `block_stride == block_len`; block-outer `BLHNC` strides over every region's page).
- One block of one layer is `block_len` bytes of float32 laid out `[num_kv_heads][block_size][K ‖ V]`:
  heads outermost (vLLM's HND), then tokens, then the token's K (`head_size` floats) followed by its V
  (`head_size` floats). So `block_len = num_kv_heads * block_size * 2 * head_size * 4`.
- Layers are grouped into KV cache groups (vLLM era C: the sliding bucket first, strided assignment). Region
  `l` is shared by the `l`-th layer of every group. A block id belongs to exactly one group at a time, so two
  layers sharing a region never touch the same bytes. Each group has its own block table; all groups draw
  ids from ONE pool of `num_blocks` ids, and id 0 is the permanently reserved null block.

A `KVCacheLayout` maps each local layer name to its (region, group). The buffer may be provided from
outside (e.g. a uint8 tensor over an mmap of a /dev/shm file shared with the sidecar): the cache only
views into it and never copies it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from disagg.worker.kv.errors import CompatibilityError
from disagg.worker.kv.layout import StageLayout

NULL_BLOCK = 0

BlockTables = dict[int, list[int]]


class OutOfBlocks(CompatibilityError):
    """The shared pool has fewer free block ids than a request needs."""

    reason = "OutOfKVBlocks"


@dataclass(frozen=True)
class KVCacheLayout:
    """Where every local attention layer lives in the process's KV buffer."""

    block_size: int
    num_kv_heads: int
    head_size: int
    num_blocks: int
    block_len: int
    block_stride: int
    region_offsets: tuple[int, ...]
    layer_region: Mapping[str, int]
    layer_group: Mapping[str, int]
    num_groups: int

    def __post_init__(self) -> None:
        expected = 2 * self.num_kv_heads * self.block_size * self.head_size * 4
        if self.block_len != expected:
            raise CompatibilityError(
                f"block_len {self.block_len} != 2 * {self.num_kv_heads} kv heads * {self.block_size} tokens "
                f"* {self.head_size} * 4 bytes = {expected}",
                reason="RegionGeometryMismatch",
            )
        if self.block_stride < self.block_len or self.block_stride % 4:
            raise CompatibilityError(
                f"block_stride {self.block_stride} must be a multiple of 4 and at least block_len "
                f"{self.block_len}",
                reason="RegionGeometryMismatch",
            )
        if self.layer_region.keys() != self.layer_group.keys():
            raise CompatibilityError(
                "layer_region and layer_group name different layers", reason="RegionGeometryMismatch"
            )
        for name, region in self.layer_region.items():
            if not 0 <= region < len(self.region_offsets):
                raise CompatibilityError(
                    f"layer {name} is in region {region}, but there are {len(self.region_offsets)} regions",
                    reason="RegionGeometryMismatch",
                )
            if not 0 <= self.layer_group[name] < self.num_groups:
                raise CompatibilityError(
                    f"layer {name} is in group {self.layer_group[name]} of {self.num_groups}",
                    reason="RegionGeometryMismatch",
                )
        cells = [(self.layer_region[n], self.layer_group[n]) for n in self.layer_region]
        if len(set(cells)) != len(cells):
            raise CompatibilityError(
                "two layers of the same group share a region: they would overwrite each other's blocks",
                reason="RegionGeometryMismatch",
            )
        if any(offset % 4 for offset in self.region_offsets):
            raise CompatibilityError(
                "region offsets must be float32-aligned", reason="RegionGeometryMismatch"
            )

    @property
    def region_bytes(self) -> int:
        return (self.num_blocks - 1) * self.block_stride + self.block_len

    @property
    def total_bytes(self) -> int:
        """The smallest buffer that holds every region."""
        return max(offset + self.region_bytes for offset in self.region_offsets)

    @classmethod
    def from_stage_layout(cls, stage: StageLayout, *, num_kv_heads: int, head_size: int) -> KVCacheLayout:
        """The engine's view of one worker's `StageLayout` (its TP rank's heads; TP 1 here)."""
        if stage.physical_blocks_per_logical != 1:
            raise CompatibilityError(
                f"the engine pages by the scheduler's block size; the stage splits each block into "
                f"{stage.physical_blocks_per_logical} kernel blocks",
                reason="BlockSizeMismatch",
            )
        strides = {(r.block_len, r.block_stride, r.num_blocks) for r in stage.regions}
        if len(strides) != 1:
            raise CompatibilityError(
                f"the engine needs one block geometry for every region, the stage has {sorted(strides)}",
                reason="RegionGeometryMismatch",
            )
        block_len, block_stride, num_blocks = strides.pop()
        return cls(
            block_size=stage.block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            num_blocks=num_blocks,
            block_len=block_len,
            block_stride=block_stride,
            region_offsets=tuple(stage.base_offsets),
            layer_region={name: r for r, region in enumerate(stage.regions) for name in region.members},
            layer_group=dict(stage.group_index_by_layer),
            num_groups=len(stage.groups),
        )

    def group_of(self, name: str) -> int:
        self._require_local(name)
        return self.layer_group[name]

    def layer_offset(self, name: str, block_id: int) -> int:
        """Byte offset of layer `name`'s block `block_id` (`block_len` bytes) in the buffer."""
        self._require_local(name)
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} outside 0..{self.num_blocks - 1}")
        return self.region_offsets[self.layer_region[name]] + block_id * self.block_stride

    def _require_local(self, name: str) -> None:
        if name not in self.layer_region:
            raise KeyError(
                f"layer {name} has no KV cache in this process; local layers: {sorted(self.layer_region)}"
            )


class BlockPool:
    """One pool of block ids shared by every KV cache group; id 0 is the null block and never handed out."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise CompatibilityError(f"need at least 2 blocks (one is the null block), got {num_blocks}")
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self._owner: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def owner(self, block_id: int) -> int | None:
        return self._owner.get(block_id)

    def take(self, group: int, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocks(f"group {group} needs {count} blocks, only {len(self._free)} are free")
        taken = [self._free.pop() for _ in range(count)]
        for block_id in taken:
            self._owner[block_id] = group
        return taken

    def give_back(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if block_id == NULL_BLOCK:
                continue
            if self._owner.pop(block_id, None) is None:
                raise ValueError(f"block {block_id} is not allocated")
            self._free.append(block_id)


def allocate_block_tables(
    pool: BlockPool,
    num_groups: int,
    block_size: int,
    num_tokens: int,
    block_tables: BlockTables | None = None,
) -> BlockTables:
    """Grow (or create) one block table per group, all from `pool`, so that each covers `num_tokens` tokens.

    Sliding-window groups keep their out-of-window blocks (vLLM would null and free them); the attention
    mask, not the allocation, applies the window.
    """
    tables = {g: list((block_tables or {}).get(g, [])) for g in range(num_groups)}
    needed = math.ceil(num_tokens / block_size)
    missing = {g: needed - len(table) for g, table in tables.items() if len(table) < needed}
    if sum(missing.values()) > pool.num_free:
        raise OutOfBlocks(
            f"{num_tokens} tokens need {sum(missing.values())} more blocks over {len(missing)} groups, "
            f"only {pool.num_free} are free"
        )
    for group, count in missing.items():
        tables[group].extend(pool.take(group, count))
    return tables


class PagedKVCache:
    """Per-layer paged views into one flat uint8 buffer, plus the shared block pool."""

    def __init__(self, layout: KVCacheLayout, buffer: torch.Tensor | None = None) -> None:
        if buffer is None:
            buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8)
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise CompatibilityError(
                f"the KV buffer must be a contiguous 1-D uint8 tensor, got {buffer.dtype} "
                f"{tuple(buffer.shape)}",
                reason="RegionGeometryMismatch",
            )
        if buffer.numel() < layout.total_bytes:
            raise CompatibilityError(
                f"the KV buffer has {buffer.numel()} bytes, the layout needs {layout.total_bytes}",
                reason="RegionGeometryMismatch",
            )
        self.layout = layout
        self.buffer = buffer
        self.pool = BlockPool(layout.num_blocks)
        words = buffer[: buffer.numel() // 4 * 4].view(torch.float32)
        shape = (layout.num_blocks, layout.num_kv_heads, layout.block_size, 2 * layout.head_size)
        contiguous = torch.empty(shape).stride()
        stride = (layout.block_stride // 4, *contiguous[1:])
        self._views = {
            name: words.as_strided(shape, stride, layout.region_offsets[region] // 4)
            for name, region in layout.layer_region.items()
        }

    def layer(self, name: str) -> torch.Tensor:
        """Layer `name`'s cache as float32 `[num_blocks, num_kv_heads, block_size, 2 * head_size]` (K ‖ V)."""
        try:
            return self._views[name]
        except KeyError:
            raise KeyError(
                f"layer {name} has no KV cache in this process; local layers: {sorted(self._views)}"
            ) from None

    def allocate(self, num_tokens: int, block_tables: BlockTables | None = None) -> BlockTables:
        """Grow (or create) one block table per group from this cache's own pool to cover `num_tokens`."""
        return allocate_block_tables(
            self.pool, self.layout.num_groups, self.layout.block_size, num_tokens, block_tables
        )

    def free(self, block_tables: BlockTables) -> None:
        for ids in block_tables.values():
            self.pool.give_back(ids)

    def write(
        self, name: str, block_table: list[int], positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store K and V (`[num_kv_heads, len(positions), head_size]`) of the tokens at `positions`."""
        bs = self.layout.block_size
        last = int(positions.max())
        if last // bs >= len(block_table):
            raise IndexError(
                f"block table of {len(block_table)} blocks cannot hold position {last} of {name}"
            )
        table = torch.tensor(block_table, dtype=torch.long)
        rows = torch.cat((k, v), dim=-1).transpose(0, 1)  # [tokens, heads, K ‖ V]
        self.layer(name)[table[positions // bs], :, positions % bs] = rows

    def gather(self, name: str, block_table: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first `num_tokens` tokens, read from the cache, each `[num_kv_heads, num_tokens,
        head_size]`."""
        needed = math.ceil(num_tokens / self.layout.block_size)
        if len(block_table) < needed:
            raise IndexError(f"block table of {len(block_table)} blocks cannot hold {num_tokens} tokens")
        pages = self.layer(name)[torch.tensor(block_table[:needed], dtype=torch.long)]
        heads, width = self.layout.num_kv_heads, 2 * self.layout.head_size
        rows = pages.transpose(0, 1).reshape(heads, needed * self.layout.block_size, width)[:, :num_tokens]
        return rows[..., : self.layout.head_size], rows[..., self.layout.head_size :]

    def layer_block_view(self, name: str, block_id: int) -> np.ndarray:
        """The raw bytes (uint8, `block_len` long) of layer `name`'s block `block_id`, sharing the buffer."""
        start = self.layout.layer_offset(name, block_id)
        array: np.ndarray = self.buffer.numpy()[start : start + self.layout.block_len]
        return array
