"""Per-region metadata as routing reads it, and its alignment to this stage's transfer layers.

- `RegionMetadata`: the per-region part of `NixlAgentMetadata` (the wire struct satisfies it);
  `RegionGeometry`, the same fields as a plain frozen value.
- `TransferLayers`: the flattened transfer layers of a stage (a pooled region repeats once per member),
  their region indices and KV cache group ids.
- `pair_layers`: the remote region of each local transfer layer, with vLLM 0.34's refusals;
  `align_remote_regions`: reorder and subset every per-region field of a peer's metadata to the local
  transfer-layer order; `slice_pp_regions`, the non-HMA PP slice. Either returns a new object of the
  input's type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt

from disagg.worker.kv.errors import LayoutError, MissingLayers, RegionGeometryMismatch
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


def pair_layers(meta: RegionMetadata, local_layers: Sequence[str], *, whole_model: bool = False) -> list[int]:
    """The remote region of each local transfer layer, in local order: how regions pair by layer name.

    Refused, as vLLM 0.34's `_pair_regions` refuses them: no `region_members` for every region (the peer did
    not advertise the layers of its regions), a layer in several regions (it would span more NIXL regions
    there than the one it has here), a local layer the remote does not hold, and with `whole_model` (a PP1
    worker, which holds every layer) a remote layer with no counterpart here. A PP stage skips the remote's
    layers it does not hold. Never falls back to index routing.
    """
    if not meta.region_members:
        raise MissingLayers(
            "the remote did not advertise the layers of its KV regions (no region_members), so its regions "
            "cannot be routed by layer name; the peer must run the push connector with layer tracking "
            "(vLLM 0.31, connector version 13, or later; every worker from vLLM 0.34, connector version 16)"
        )
    regions = len(meta.kv_caches_base_addr)
    if len(meta.region_members) != regions:
        raise MissingLayers(
            f"the remote did not advertise the layers of its KV regions: region_members lists "
            f"{len(meta.region_members)} regions of its {regions}"
        )
    _check_region_lists(meta)
    regions_by_layer: dict[str, list[int]] = {}
    for region, members in enumerate(meta.region_members):
        for name in members:
            regions_by_layer.setdefault(name, []).append(region)
    spanning = {name: len(found) for name, found in regions_by_layer.items() if len(found) > 1}
    if spanning:
        name, count = next(iter(spanning.items()))
        raise MissingLayers(
            f"the remote advertises layers more than once: {sorted(spanning)} (KV layer {name!r} spans "
            f"{count} NIXL regions there and 1 here)"
        )
    missing = [name for name in local_layers if name not in regions_by_layer]
    if missing:
        raise MissingLayers(f"the remote does not advertise local transfer layers {missing}")
    if whole_model:
        local = set(local_layers)
        extra = [name for name in regions_by_layer if name not in local]
        if extra:
            raise MissingLayers(
                f"the remote holds KV layers {extra}, which have no counterpart here (this worker holds "
                "every layer of the model, so both sides must hold the same layers)"
            )
    return [regions_by_layer[name][0] for name in local_layers]


def align_remote_regions(meta: M, local_layers: Sequence[str], *, whole_model: bool = False) -> M:
    """The remote metadata re-expressed as one region per local transfer layer, in local order.

    Layers the remote has but this stage does not own (other PP stages) are dropped; every refusal is
    `pair_layers`'. The result advertises `region_members = [[name] ...]`, so aligning it again changes
    nothing.
    """
    aligned = select_regions(meta, pair_layers(meta, local_layers, whole_model=whole_model))
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
