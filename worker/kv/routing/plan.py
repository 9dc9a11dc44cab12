"""`TransferPlan` / `plan_transfer`: how this worker's regions pair with one peer's, what the producer
writes by.

Alignment, descriptor ids and descriptor geometry are one computation in vLLM (`_compute_desc_ids`,
`_build_fa_local`, `_build_fa_remote`) whose two sides must agree id for id; the plan ties them together,
and the property tests pin them through it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from disagg.worker.kv.errors import RegionGeometryMismatch
from disagg.worker.kv.routing.desc_ids import IdBuffer, IdRows, desc_id_rows, group_arrays, layer_routed_rows
from disagg.worker.kv.routing.descriptors import StridedArray
from disagg.worker.kv.routing.regions import (
    BlockIds,
    IdArray,
    M,
    RegionMetadata,
    TransferLayers,
    align_remote_regions,
    region_capacities,
)
from disagg.worker.kv.routing.runs import Runs, merged_runs


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
        local_rows, remote_rows, local_groups, remote_groups = self.checked(local_blocks, remote_blocks)
        if buffer is None:
            return local_rows.fill(local_groups), remote_rows.fill(remote_groups)
        local_size = local_rows.size(local_groups)
        out = buffer.take(local_size + remote_rows.size(remote_groups))
        return (
            local_rows.fill(local_groups, out[:local_size]),
            remote_rows.fill(remote_groups, out[local_size:]),
        )

    def checked(
        self, local_blocks: BlockIds, remote_blocks: BlockIds
    ) -> tuple[IdRows, IdRows, list[IdArray], list[IdArray]]:
        """Both sides' id rows and block ids as arrays, after every refusal `desc_ids` makes (group counts,
        unequal lists, ids beyond a region's capacity); nothing is allocated for the ids yet."""
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
        local_groups, remote_groups = group_arrays(local_blocks), group_arrays(remote_blocks)
        local_rows.check(local_groups)
        remote_rows.check(remote_groups)
        return local_rows, remote_rows, local_groups, remote_groups

    def runs(
        self, local_blocks: BlockIds, remote_blocks: BlockIds, local: StridedArray, remote: StridedArray
    ) -> Runs | None:
        """The request's WRITE as merged runs (`runs.merged_runs`) over the strided lists the plan's ids
        index, after `checked`'s refusals; None when the sides' rows do not pair row for row."""
        local_rows, remote_rows, local_groups, remote_groups = self.checked(local_blocks, remote_blocks)
        return merged_runs(local_rows, local, local_groups, remote_rows, remote, remote_groups)

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
