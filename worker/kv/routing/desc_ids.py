"""Descriptor ids from cumulative per-region capacities, each side with its own capacities.

Layer routing, single-group regions, group-mapped regions and the legacy `r * num_blocks + b` are each an
`IdRows` that a plan builds once; a request fills it, into an `IdBuffer` the producer reuses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from disagg.worker.kv.errors import BlockIdOutOfRange, RegionGeometryMismatch
from disagg.worker.kv.routing.regions import BlockIds, IdArray


def cumulative_offsets(capacities: Sequence[int]) -> IdArray:
    """First descriptor id of each region: the running sum of the capacities before it."""
    caps = np.asarray(capacities, dtype=np.int64)
    offsets = np.zeros(len(caps), dtype=np.int64)
    np.cumsum(caps[:-1], out=offsets[1:])
    return offsets


def group_arrays(block_ids: BlockIds) -> list[IdArray]:
    """Block ids per KV cache group as int64 arrays, the form every descriptor-id function works on.

    Lists (what the engine reports and the decoder's registration decodes to) go through `np.fromiter`,
    which converts each int without `np.asarray`'s first pass to discover the type (10 to 25% faster for a
    long request's block lists, converted once when they arrive).
    """
    return [
        ids.astype(np.int64, copy=False)
        if isinstance(ids, np.ndarray)
        else np.fromiter(ids, dtype=np.int64, count=len(ids))
        for ids in block_ids
    ]


@dataclass(frozen=True)
class IdRows:
    """A descriptor-id scheme as rows: the ids are `offsets[i] + block_ids[groups[i]]` for each row i, in
    row order. Every scheme (layer routing, single-group regions, group-mapped regions) is such a list; it
    depends only on the capacities, so a `TransferPlan` builds its rows once and each request only fills.

    `limits[g]` is the smallest capacity among group g's rows (None: group g has no row), which bounds
    every block id of group g.
    """

    offsets: tuple[int, ...]
    groups: tuple[int, ...]
    limits: tuple[int | None, ...]
    regions: tuple[int, ...] = ()
    """The index into the capacities (the descriptor list's strided row) each row's ids fall in."""
    runs: tuple[tuple[int, IdArray], ...] = dataclasses.field(init=False, repr=False, compare=False)
    """Consecutive rows of one group as (group, offsets as a column): one broadcast add fills a run."""

    def __post_init__(self) -> None:
        runs: list[tuple[int, list[int]]] = []
        for offset, g in zip(self.offsets, self.groups, strict=True):
            if runs and runs[-1][0] == g:
                runs[-1][1].append(offset)
            else:
                runs.append((g, [offset]))
        columns = tuple((g, np.array(offsets, dtype=np.int64)[:, None]) for g, offsets in runs)
        object.__setattr__(self, "runs", columns)

    @classmethod
    def build(cls, capacities: Sequence[int], rows: Sequence[tuple[int, int]], num_groups: int) -> IdRows:
        """`rows` as (region index into `capacities`, group) pairs, with groups below `num_groups`."""
        caps = [int(c) for c in capacities]
        starts = cumulative_offsets(caps).tolist()
        limits: list[int | None] = [None] * num_groups
        for r, g in rows:
            limit = limits[g]
            limits[g] = caps[r] if limit is None else min(limit, caps[r])
        return cls(
            tuple(starts[r] for r, _ in rows),
            tuple(g for _, g in rows),
            tuple(limits),
            tuple(r for r, _ in rows),
        )

    def size(self, groups: Sequence[IdArray]) -> int:
        """How many ids `fill` makes from these per-group block ids."""
        if len(groups) < len(self.limits):
            raise RegionGeometryMismatch(
                f"descriptor ids name {len(self.limits)} KV cache groups, but {len(groups)} lists were given"
            )
        return sum(len(column) * groups[g].size for g, column in self.runs)

    def check(self, groups: Sequence[IdArray]) -> int:
        """`size`, after refusing any block id outside its group's limit: nothing is allocated before."""
        size = self.size(groups)
        for g, limit in enumerate(self.limits):
            ids = groups[g]
            if limit is None or ids.size == 0:
                continue
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= limit:
                raise BlockIdOutOfRange(
                    f"group {g} has block ids in [{low}, {high}] but its regions hold only {limit} blocks"
                )
        return size

    def fill(self, block_ids: BlockIds, out: IdArray | None = None) -> IdArray:
        """The ids for one request, after checking every group's block ids against its limit; written into
        `out` (exactly `size` long) when given.

        One output and one broadcast `np.add(..., out=)` per run: no per-row temporaries and no
        concatenation, so each id is written once (at a million ids per request, allocating and passing
        over memory again cost more than the additions).
        """
        groups = group_arrays(block_ids)
        size = self.check(groups)
        if out is None:
            out = np.empty(size, dtype=np.int64)
        elif out.shape != (size,) or out.dtype != np.int64:
            raise ValueError(f"{size} descriptor ids do not fit an output of {out.dtype}{out.shape}")
        start = 0
        for g, column in self.runs:
            ids = groups[g]
            end = start + len(column) * ids.size
            np.add(column, ids, out=out[start:end].reshape(len(column), ids.size))
            start = end
        return out


class IdBuffer:
    """Scratch space for descriptor ids, reused request after request by one producer.

    A fresh output of a million ids costs more than computing them: the allocator hands arrays this large
    back to the kernel when they are freed, so each request's output is faulted in again page by page.
    Ids from `take` are views that stay valid only until the next `take`; the producer hands them to NIXL
    (which copies the indices) before it computes the next decode rank's.
    """

    def __init__(self) -> None:
        self._array: IdArray = np.empty(0, dtype=np.int64)

    def take(self, size: int) -> IdArray:
        if size > self._array.size:
            self._array = np.empty(size, dtype=np.int64)
        return self._array[:size]


def expand_logical_blocks(block_ids: BlockIds, physical_per_logical: int) -> list[IdArray]:
    """Logical to kernel block ids, `b -> b * n + [0 .. n-1]` (vLLM `_logical_to_kernel_block_ids`)."""
    groups = group_arrays(block_ids)
    if physical_per_logical == 1:
        return groups
    step = np.arange(physical_per_logical, dtype=np.int64)
    return [(ids[:, None] * physical_per_logical + step).reshape(-1) for ids in groups]


def layer_routed_rows(capacities: Sequence[int], group_ids: Sequence[int]) -> IdRows:
    """Layer-name routing's rows: transfer layer k is `offset[k] + block_ids[group[k]]`."""
    if len(capacities) != len(group_ids):
        raise RegionGeometryMismatch(f"{len(capacities)} capacities for {len(group_ids)} transfer layers")
    for k, g in enumerate(group_ids):
        if g < 0:
            raise RegionGeometryMismatch(f"transfer layer {k} is in group {g}")
    return IdRows.build(capacities, list(enumerate(group_ids)), max(group_ids, default=-1) + 1)


def layer_routed_desc_ids(
    block_ids: BlockIds, capacities: Sequence[int], group_ids: Sequence[int]
) -> IdArray:
    """Layer-name routing: `concat_k (offset[k] + block_ids[group[k]])` over the transfer layers.

    `capacities` and `group_ids` are per transfer layer (local: `TransferLayers.capacities`; remote: the
    aligned metadata's `region_num_blocks`). Layer k's ids on both sides are the same group's list, so local
    and remote id arrays pair block by block as long as both sides' group lists have equal lengths.
    """
    if len(capacities) != len(group_ids):
        raise RegionGeometryMismatch(f"{len(capacities)} capacities for {len(group_ids)} transfer layers")
    for k, g in enumerate(group_ids):
        if not 0 <= g < len(block_ids):
            raise RegionGeometryMismatch(
                f"transfer layer {k} is in group {g}, but {len(block_ids)} lists were given"
            )
    return layer_routed_rows(capacities, group_ids).fill(block_ids)


def region_desc_ids(block_ids: BlockIds, capacities: Sequence[int]) -> IdArray:
    """Region-index routing without group mapping: every region gets every group's blocks.

    Right for one group, and for vLLM's legacy HMA assumption that every slot holds one layer of each group.
    """
    return region_rows(capacities, len(block_ids)).fill(block_ids)


def region_rows(capacities: Sequence[int], num_groups: int) -> IdRows:
    """Every region r, in order, holds every group's blocks in group order: `offset[r] + concat_g ids[g]`."""
    return IdRows.build(
        capacities, [(r, g) for r in range(len(capacities)) for g in range(num_groups)], num_groups
    )


def uses_region_group_mapping(region_group_ids: Sequence[int] | None) -> bool:
    """vLLM maps groups to regions when the regions name more than one distinct group id."""
    return region_group_ids is not None and len(set(region_group_ids)) > 1


def group_mapped_rows(capacities: Sequence[int], region_group_ids: Sequence[int], num_groups: int) -> IdRows:
    """For each group g in order, the regions of g or shared (-1), in region order."""
    if len(capacities) != len(region_group_ids):
        raise RegionGeometryMismatch(
            f"{len(capacities)} capacities for {len(region_group_ids)} region group ids"
        )
    rows = [
        (r, g)
        for g in range(num_groups)
        for r, region_group in enumerate(region_group_ids)
        if region_group == g or region_group < 0
    ]
    return IdRows.build(capacities, rows, num_groups)


def group_mapped_desc_ids(
    block_ids: BlockIds, capacities: Sequence[int], region_group_ids: Sequence[int]
) -> IdArray:
    """Group-mapped regions: for each group g, regions of g or shared (-1) get `offset[r] + block_ids[g]`."""
    return group_mapped_rows(capacities, region_group_ids, len(block_ids)).fill(block_ids)


def desc_id_rows(
    capacities: Sequence[int],
    num_groups: int,
    *,
    transfer_group_ids: Sequence[int] | None = None,
    region_group_ids: Sequence[int] | None = None,
) -> IdRows:
    """vLLM's `_compute_desc_ids` dispatch for attention caches, as rows (see `compute_desc_ids`)."""
    if transfer_group_ids is not None:
        return layer_routed_rows(capacities, transfer_group_ids)
    if region_group_ids is not None and uses_region_group_mapping(region_group_ids):
        return group_mapped_rows(capacities, region_group_ids, num_groups)
    return region_rows(capacities, num_groups)


def compute_desc_ids(
    block_ids: BlockIds,
    capacities: Sequence[int],
    *,
    transfer_group_ids: Sequence[int] | None = None,
    region_group_ids: Sequence[int] | None = None,
) -> IdArray:
    """vLLM's `_compute_desc_ids` dispatch for attention caches.

    With `transfer_group_ids` (layer-name routing) `capacities` are per transfer layer; otherwise per region,
    with group mapping when `region_group_ids` name more than one group.
    """
    if transfer_group_ids is not None:
        return layer_routed_desc_ids(block_ids, capacities, transfer_group_ids)
    return desc_id_rows(capacities, len(block_ids), region_group_ids=region_group_ids).fill(block_ids)
