"""Layer-name routing of KV blocks between a PP prefill stage and a decoder (vLLM PR #50494), vectorised.

Pure: numpy only, no torch, nixl, I/O or clock. `vllm-nixl-push-connector.md` §2.1, §2.2 and §2.4.

- `TransferLayers`: the flattened transfer layers of a stage (a pooled region repeats once per member),
  their region indices and KV cache group ids.
- `align_remote_regions`: reorder and subset every per-region field of a peer's metadata to the local
  transfer-layer order. Works on any object with the `NixlAgentMetadata` attribute names (`RegionMetadata`):
  the wire struct or `RegionGeometry`; it returns a new object of the same type.
- Descriptor ids from cumulative per-region capacities (layer routing, single-group regions, group-mapped
  regions, the legacy `r * num_blocks + b`), each side with its own capacities. Each scheme is an `IdRows`
  that a plan builds once; a request fills it, into an `IdBuffer` the producer reuses.
- Descriptor geometry: the (addr, len, dev) arrays the transport prepares as NIXL dlists, and which head
  slice of a prefill block a decode rank with fewer heads takes (`rank_offset_factor`, `head_split`).
- `TransferPlan` / `plan_transfer`: one peer's pairing, what the producer writes by.

One module of some 700 lines on purpose: alignment, descriptor ids and descriptor geometry are one
computation in vLLM (`_compute_desc_ids`, `_build_fa_local`, `_build_fa_remote`) whose two sides must agree id
for id, and the property tests pin them together through `TransferPlan`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt

from disagg.worker.kv.errors import BlockIdOutOfRange, LayoutError, MissingLayers, RegionGeometryMismatch
from disagg.worker.kv.layout import StageLayout

IdArray = npt.NDArray[np.int64]
DescArray = npt.NDArray[np.uint64]
BlockIds = Sequence[Sequence[int] | npt.NDArray[np.integer[Any]]]
"""One block-id list per KV cache group (vLLM's `BlockIds`)."""


class RegionMetadata(Protocol):
    """The per-region part of `NixlAgentMetadata` (v12) that routing reads. Satisfied by the wire struct."""

    @property
    def kv_caches_base_addr(self) -> Sequence[int]: ...
    @property
    def device_id(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_lens(self) -> Sequence[int]: ...
    @property
    def block_strides(self) -> Sequence[int]: ...
    @property
    def block_size(self) -> int: ...
    @property
    def physical_blocks_per_logical_kv_block(self) -> int: ...
    @property
    def region_num_blocks(self) -> Sequence[int] | None: ...
    @property
    def region_group_ids(self) -> Sequence[int] | None: ...
    @property
    def region_names(self) -> Sequence[str] | None: ...
    @property
    def region_mem_types(self) -> Sequence[str] | None: ...
    @property
    def region_members(self) -> Sequence[Sequence[str]]: ...


M = TypeVar("M", bound=RegionMetadata)

_REQUIRED_FIELDS = ("kv_caches_base_addr", "block_lens", "block_strides")
_OPTIONAL_FIELDS = ("region_num_blocks", "region_group_ids", "region_names", "region_mem_types")


@dataclass(frozen=True)
class RegionGeometry:
    """The routing-relevant fields of `NixlAgentMetadata`, with the same names, as a plain frozen value."""

    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    block_size: int
    physical_blocks_per_logical_kv_block: int = 1
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    region_members: list[list[str]] = dataclasses.field(default_factory=list)

    @classmethod
    def from_metadata(cls, meta: RegionMetadata) -> RegionGeometry:
        def opt(values: Sequence[Any] | None) -> list[Any] | None:
            return None if values is None else list(values)

        return cls(
            kv_caches_base_addr=list(meta.kv_caches_base_addr),
            device_id=meta.device_id,
            num_blocks=meta.num_blocks,
            block_lens=list(meta.block_lens),
            block_strides=list(meta.block_strides),
            block_size=meta.block_size,
            physical_blocks_per_logical_kv_block=meta.physical_blocks_per_logical_kv_block,
            region_num_blocks=opt(meta.region_num_blocks),
            region_group_ids=opt(meta.region_group_ids),
            region_names=opt(meta.region_names),
            region_mem_types=opt(meta.region_mem_types),
            region_members=[list(members) for members in meta.region_members],
        )

    @classmethod
    def from_layout(
        cls, layout: StageLayout, *, base_addr: int, device_id: int, mem_type: str, advertise_members: bool
    ) -> RegionGeometry:
        """What a worker with `layout`, registered at `base_addr`, advertises. vLLM fills `region_members`
        only when it tracks region layers (push, HMA or packed, no Mamba): `advertise_members`."""
        return cls(
            kv_caches_base_addr=[base_addr + offset for offset in layout.base_offsets],
            device_id=device_id,
            num_blocks=layout.num_blocks,
            block_lens=layout.block_lens,
            block_strides=layout.block_strides,
            block_size=layout.block_size,
            physical_blocks_per_logical_kv_block=layout.physical_blocks_per_logical,
            region_num_blocks=layout.region_num_blocks,
            region_group_ids=layout.region_group_ids,
            region_names=layout.region_names,
            region_mem_types=[mem_type] * len(layout.regions),
            region_members=layout.region_members if advertise_members else [],
        )


def _replace(meta: M, changes: dict[str, Any]) -> M:
    """A copy of `meta` with `changes`, for a msgspec Struct (the wire type) or a dataclass."""
    if isinstance(meta, msgspec.Struct):
        return msgspec.structs.replace(meta, **changes)
    if dataclasses.is_dataclass(meta) and not isinstance(meta, type):
        return dataclasses.replace(meta, **changes)
    raise TypeError(f"cannot copy region metadata of type {type(meta).__name__}")


def region_capacities(meta: RegionMetadata) -> list[int]:
    """Per-region capacity in kernel blocks; peers before v11 advertise one `num_blocks` for all regions."""
    if meta.region_num_blocks is not None:
        return list(meta.region_num_blocks)
    return [meta.num_blocks] * len(meta.kv_caches_base_addr)


@dataclass(frozen=True)
class TransferLayers:
    """The flattened transfer layers of a worker, in region order (vLLM's `_transfer_layer_*`)."""

    names: tuple[str, ...]
    region_indices: tuple[int, ...]
    """Local region of each layer; a pooled region repeats once per member layer."""
    group_ids: tuple[int, ...]
    """Transfer-group index of each layer (`transfer_group_index_by_layer`)."""

    @classmethod
    def from_regions(
        cls, region_members: Sequence[Sequence[str]], group_index_by_layer: Mapping[str, int]
    ) -> TransferLayers:
        seen: dict[str, int] = {}
        names: list[str] = []
        regions: list[int] = []
        for region, members in enumerate(region_members):
            for name in members:
                if name in seen:
                    raise LayoutError(f"layer {name} maps to regions {seen[name]} and {region}")
                seen[name] = region
                names.append(name)
                regions.append(region)
        ungrouped = [name for name in names if name not in group_index_by_layer]
        if ungrouped:
            raise LayoutError(f"layers {ungrouped} belong to no KV cache group")
        return cls(tuple(names), tuple(regions), tuple(group_index_by_layer[n] for n in names))

    @classmethod
    def from_layout(cls, layout: StageLayout) -> TransferLayers:
        return cls.from_regions(layout.region_members, layout.group_index_by_layer)

    def capacities(self, meta: RegionMetadata) -> list[int]:
        """The local per-transfer-layer capacities (`xfer_region_num_blocks`)."""
        per_region = region_capacities(meta)
        return [per_region[r] for r in self.region_indices]


def _check_region_lists(meta: RegionMetadata) -> int:
    lengths = {name: len(getattr(meta, name)) for name in (*_REQUIRED_FIELDS, "region_members")}
    lengths.update(
        {name: len(getattr(meta, name)) for name in _OPTIONAL_FIELDS if getattr(meta, name) is not None}
    )
    if len(set(lengths.values())) != 1:
        raise RegionGeometryMismatch(f"remote per-region lists differ in length: {lengths}")
    return lengths["kv_caches_base_addr"]


def select_regions(meta: M, regions: Sequence[int]) -> M:
    """`meta` with every per-region field reordered/subset to `regions` (which may repeat)."""
    changes: dict[str, Any] = {}
    for name in (*_REQUIRED_FIELDS, *_OPTIONAL_FIELDS):
        values = getattr(meta, name)
        if values is not None:
            changes[name] = [values[r] for r in regions]
    if meta.region_members:
        changes["region_members"] = [list(meta.region_members[r]) for r in regions]
    return _replace(meta, changes)


def align_remote_regions(meta: M, local_layers: Sequence[str]) -> M:
    """The remote metadata re-expressed as one region per local transfer layer, in local order.

    Layers the remote has but this stage does not own (other PP stages) are dropped; a local layer the remote
    lacks, a layer advertised twice or no `region_members` at all is refused (never falling back to index
    routing). The result advertises `region_members = [[name] ...]`, so aligning it again changes nothing.
    """
    if not meta.region_members:
        raise MissingLayers(
            "the remote advertised no region_members, so its regions cannot be routed by layer name; "
            "the peer must run the push connector with layer tracking (vLLM 0.31, connector version 13, "
            "or later)"
        )
    _check_region_lists(meta)
    region_by_layer: dict[str, int] = {}
    duplicates: list[str] = []
    for region, members in enumerate(meta.region_members):
        for name in members:
            if name in region_by_layer:
                duplicates.append(name)
            region_by_layer[name] = region
    if duplicates:
        raise MissingLayers(f"the remote advertises layers more than once: {sorted(set(duplicates))}")
    missing = [name for name in local_layers if name not in region_by_layer]
    if missing:
        raise MissingLayers(f"the remote does not advertise local transfer layers {missing}")
    aligned = select_regions(meta, [region_by_layer[name] for name in local_layers])
    return _replace(
        aligned,
        {"region_names": list(local_layers), "region_members": [[name] for name in local_layers]},
    )


def slice_pp_regions(meta: M, *, start_layer: int, num_local_layers: int, num_local_regions: int) -> M:
    """The non-HMA PP path (#45880): a stage's regions are a contiguous run of the decoder's, at
    `regions_per_layer * start_layer`. It assumes a uniform region count per layer."""
    if num_local_layers < 1 or num_local_regions % num_local_layers:
        raise RegionGeometryMismatch(
            f"{num_local_regions} local regions are not a whole number per layer "
            f"for {num_local_layers} layers"
        )
    total = _check_region_lists(meta) if meta.region_members else len(meta.kv_caches_base_addr)
    start = num_local_regions // num_local_layers * start_layer
    if start + num_local_regions > total:
        raise RegionGeometryMismatch(
            f"the remote has {total} regions, fewer than the {start + num_local_regions} this stage addresses"
        )
    return select_regions(meta, range(start, start + num_local_regions))


# ---- descriptor ids --------------------------------------------------------------------------------------


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
        return cls(tuple(starts[r] for r, _ in rows), tuple(g for _, g in rows), tuple(limits))

    def size(self, groups: Sequence[IdArray]) -> int:
        """How many ids `fill` makes from these per-group block ids."""
        if len(groups) < len(self.limits):
            raise RegionGeometryMismatch(
                f"descriptor ids name {len(self.limits)} KV cache groups, but {len(groups)} lists were given"
            )
        return sum(len(column) * groups[g].size for g, column in self.runs)

    def fill(self, block_ids: BlockIds, out: IdArray | None = None) -> IdArray:
        """The ids for one request, after checking every group's block ids against its limit; written into
        `out` (exactly `size` long) when given.

        One output and one broadcast `np.add(..., out=)` per run: no per-row temporaries and no
        concatenation, so each id is written once (at a million ids per request, allocating and passing
        over memory again cost more than the additions).
        """
        groups = group_arrays(block_ids)
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


# ---- descriptor geometry ---------------------------------------------------------------------------------


def _descs(addrs: IdArray, length: IdArray, device: int) -> DescArray:
    out = np.empty((len(addrs), 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = length
    out[:, 2] = device
    return out


def local_descs(
    meta: RegionMetadata,
    *,
    regions: Sequence[int] | None = None,
    block_size_ratio: int = 1,
    head_slice: tuple[int, int] = (0, 1),
    replicated: Sequence[bool] | None = None,
) -> DescArray:
    """Local source descriptors (vLLM `_build_fa_local`): Nx3 `(addr, len, dev)`.

    For each region in `regions` (default: every region; under layer routing `TransferLayers.region_indices`)
    and each kernel block b and sub-block s < `block_size_ratio`:
    `addr = base + b * stride + s * block_len / ratio`, `len = block_len / ratio`. Descriptor id order
    matches `compute_desc_ids` with capacities multiplied by the ratio.

    `head_slice = (slot, count)` is vLLM's local split handle (`_build_local_splits_from_plan`) for a decode
    rank holding fewer heads than this one: each block is cut into `count` equal head slices and the
    descriptor is slice `slot`, `addr + slot * block_len / count`. A `replicated` (MLA) region keeps the
    whole block.
    """
    slot, count = head_slice
    if count > 1 and block_size_ratio > 1:
        raise RegionGeometryMismatch("a head split and a block-size ratio cannot be combined")
    order = range(len(meta.kv_caches_base_addr)) if regions is None else regions
    caps = region_capacities(meta)
    parts: list[DescArray] = []
    for r in order:
        split = 1 if replicated is not None and replicated[r] else count
        sub_len = meta.block_lens[r] // (block_size_ratio * split)
        start = meta.kv_caches_base_addr[r] + (slot if split > 1 else 0) * sub_len
        blocks = np.arange(caps[r], dtype=np.int64)[:, None] * meta.block_strides[r]
        subs = np.arange(block_size_ratio, dtype=np.int64)[None, :] * sub_len
        addrs = (start + blocks + subs).reshape(-1)
        parts.append(_descs(addrs, np.full(len(addrs), sub_len, dtype=np.int64), meta.device_id))
    return np.concatenate(parts) if parts else np.zeros((0, 3), dtype=np.uint64)


def remote_descs(
    remote: RegionMetadata,
    local: RegionMetadata,
    *,
    local_regions: Sequence[int] | None = None,
    replicated: Sequence[bool] | None = None,
    block_size_ratio: int = 1,
    num_reads: int = 1,
    rank_offset_factor: int = 0,
) -> DescArray:
    """Remote destination descriptors (vLLM `_build_fa_remote`): Nx3 `(addr, len, dev)`.

    Remote region i pairs with local region `local_regions[i]` (the transfer-layer region under layer
    routing, else i). A replicated (MLA) local region takes the whole block; otherwise this rank takes
    `len = local_len / num_reads` at `rank_offset_factor * local_len / ratio` inside the remote block, which
    is a contiguous head slice because heads are outermost in a block (LBHNC). `replicated` is per local
    region (`StageLayout.region_replicated`); None means no MLA region.
    """
    pairs = range(len(remote.kv_caches_base_addr)) if local_regions is None else local_regions
    if len(pairs) != len(remote.kv_caches_base_addr):
        raise RegionGeometryMismatch(
            f"{len(remote.kv_caches_base_addr)} remote regions for {len(pairs)} local transfer regions"
        )
    caps = region_capacities(remote)
    parts: list[DescArray] = []
    for i, r in enumerate(pairs):
        local_len = local.block_lens[r]
        kv_block_len = local_len // block_size_ratio
        if block_size_ratio > 1:
            local_len = kv_block_len
        reads, offset = (
            (1, 0)
            if replicated is not None and replicated[r]
            else (num_reads, rank_offset_factor * kv_block_len)
        )
        addrs = (
            remote.kv_caches_base_addr[i]
            + offset
            + np.arange(caps[i], dtype=np.int64) * remote.block_strides[i]
        )
        parts.append(_descs(addrs, np.full(len(addrs), local_len // reads, dtype=np.int64), remote.device_id))
    return np.concatenate(parts) if parts else np.zeros((0, 3), dtype=np.uint64)


def rank_offset_factor(tp_rank: int, local_tp: int, remote_tp: int, total_kv_heads: int, is_mla: bool) -> int:
    """Which head slice of the remote block this rank's block is, in units of its own block length."""
    if is_mla or local_tp <= remote_tp:
        return 0
    if local_tp > total_kv_heads:
        local_head = tp_rank * total_kv_heads // local_tp
        remote_rank = tp_rank * remote_tp // local_tp
        return local_head - remote_rank * total_kv_heads // remote_tp
    return tp_rank % (local_tp // remote_tp)


def first_kv_head(tp_rank: int, tp_size: int, total_kv_heads: int) -> int:
    """The first KV head a TP rank holds; above `total_kv_heads` ranks each hold one (replicated) head."""
    return tp_rank * total_kv_heads // tp_size


def head_split(
    tp_rank: int, local_tp: int, remote_rank: int, remote_tp: int, total_kv_heads: int, is_mla: bool
) -> tuple[int, int]:
    """`(slot, count)`: the slice of this rank's block that decode rank `remote_rank` holds, when it holds
    fewer heads (vLLM `compute_tp_mapping` with `local_tp < remote_tp`, non-MLA).

    Heads are outermost in a block (LBHNC), so this rank's block is `count` equal runs of the remote rank's
    head count, and `remote_rank`'s heads are run `slot`. vLLM's split is `slot = remote_rank % k` over
    `k = remote_tp / local_tp` ranks; when the decoder replicates heads (`remote_tp > total_kv_heads`) the
    runs are its distinct heads and every replica gets its head's run (vLLM writes only the first replica).
    `(0, 1)` when the remote rank holds this rank's whole block (MLA, or `local_tp >= remote_tp`).
    """
    if is_mla or local_tp >= remote_tp:
        return 0, 1
    local_heads = max(1, total_kv_heads // local_tp)
    remote_heads = max(1, total_kv_heads // remote_tp)
    offset = first_kv_head(remote_rank, remote_tp, total_kv_heads) - first_kv_head(
        tp_rank, local_tp, total_kv_heads
    )
    count = local_heads // remote_heads
    if not 0 <= offset < local_heads or count < 1:
        raise RegionGeometryMismatch(
            f"decode TP rank {remote_rank} of {remote_tp} holds none of the {local_heads} KV heads of "
            f"prefill TP rank {tp_rank} of {local_tp}"
        )
    return offset // remote_heads, count


# ---- one peer's transfer plan ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TransferPlan:
    """How this worker's regions pair with one remote worker's, after alignment.

    `local_regions[i]` is the local region paired with remote region i of `remote` (aligned metadata under
    layer routing, where i is a transfer layer; otherwise i itself). `group_ids` is set only under layer
    routing.
    """

    local: RegionMetadata
    remote: RegionMetadata
    local_regions: tuple[int, ...]
    group_ids: tuple[int, ...] | None
    _id_rows: dict[int, tuple[IdRows, IdRows]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def layer_routing(self) -> bool:
        return self.group_ids is not None

    def local_capacities(self) -> list[int]:
        per_region = region_capacities(self.local)
        return [per_region[r] for r in self.local_regions]

    def desc_ids(
        self, local_blocks: BlockIds, remote_blocks: BlockIds, buffer: IdBuffer | None = None
    ) -> tuple[IdArray, IdArray]:
        """Paired (local, remote) descriptor ids for one request, both as kernel block ids per group.

        Each side indexes its own prepared list (`local_descs(regions=local_regions)`, `remote_descs`), with
        its own capacities. Prefix-hit trimming must already have made each group's two lists equally long.
        With `buffer`, both arrays are views into it (valid until its next use).
        """
        if len(local_blocks) != len(remote_blocks):
            raise RegionGeometryMismatch(
                f"{len(local_blocks)} local block-id groups against {len(remote_blocks)} remote ones"
            )
        unequal = [
            g for g, (a, b) in enumerate(zip(local_blocks, remote_blocks, strict=True)) if len(a) != len(b)
        ]
        if unequal:
            raise RegionGeometryMismatch(f"groups {unequal} have different local and remote block counts")
        local_rows, remote_rows = self.id_rows(len(local_blocks))
        if buffer is None:
            return local_rows.fill(local_blocks), remote_rows.fill(remote_blocks)
        local_groups, remote_groups = group_arrays(local_blocks), group_arrays(remote_blocks)
        local_size = local_rows.size(local_groups)
        out = buffer.take(local_size + remote_rows.size(remote_groups))
        return (
            local_rows.fill(local_groups, out[:local_size]),
            remote_rows.fill(remote_groups, out[local_size:]),
        )

    def id_rows(self, num_groups: int) -> tuple[IdRows, IdRows]:
        """Both sides' descriptor-id rows for requests with `num_groups` block-id lists, built once per plan:
        they depend only on the capacities and group ids, which a plan's metadata fixes."""
        rows = self._id_rows.get(num_groups)
        if rows is None:
            local_caps, remote_caps = self.local_capacities(), region_capacities(self.remote)
            if self.group_ids is not None:
                rows = (
                    layer_routed_rows(local_caps, self.group_ids),
                    layer_routed_rows(remote_caps, self.group_ids),
                )
            else:
                rows = (
                    desc_id_rows(local_caps, num_groups, region_group_ids=self.local.region_group_ids),
                    desc_id_rows(remote_caps, num_groups, region_group_ids=self.remote.region_group_ids),
                )
            self._id_rows[num_groups] = rows
        return rows


def check_group_layouts(local: Sequence[int] | None, remote: Sequence[int] | None) -> None:
    """Regions paired by index must lay out the same KV cache groups (vLLM `_xfer_blocks_for_req` refuses
    other group layouts unless layer-name routing is on); None on either side is not compared."""
    if local is not None and remote is not None and list(local) != list(remote):
        raise RegionGeometryMismatch(
            f"region group ids differ (local {list(local)}, remote {list(remote)}) and layer-name routing "
            "is off: the decoder's cache-group layout differs from this stage's; run the same model, KV "
            "cache layout and hybrid KV cache manager setting on both sides"
        )


def plan_transfer(
    local: RegionMetadata, remote: M, *, transfer_layers: TransferLayers | None
) -> tuple[TransferPlan, M]:
    """Pair `local` with `remote`: by layer name when `transfer_layers` is given, else by region index.

    Returns the plan and the remote metadata as the plan uses it (aligned under layer routing).
    """
    if transfer_layers is not None:
        aligned = align_remote_regions(remote, transfer_layers.names)
        return TransferPlan(
            local, aligned, transfer_layers.region_indices, transfer_layers.group_ids
        ), aligned
    local_count, remote_count = len(local.kv_caches_base_addr), len(remote.kv_caches_base_addr)
    if local_count != remote_count:
        raise RegionGeometryMismatch(f"{local_count} local regions against {remote_count} remote regions")
    check_group_layouts(local.region_group_ids, remote.region_group_ids)
    return TransferPlan(local, remote, tuple(range(local_count)), None), remote
