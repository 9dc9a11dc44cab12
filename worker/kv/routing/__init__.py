"""Layer-name routing of KV blocks between a PP prefill stage and a decoder (vLLM PR #50494), vectorised.

Pure: numpy only, no torch, nixl, I/O or clock. `vllm-nixl-push-connector.md` §2.1, §2.2 and §2.4. This
package's face: every routing name is importable from here.

- `regions`: per-region metadata, `TransferLayers`, and aligning a peer's regions to local transfer layers.
- `desc_ids`: descriptor ids from cumulative per-region capacities, as `IdRows` a plan builds once.
- `descriptors`: descriptor geometry (the (addr, len, dev) lists NIXL prepares) and head slices.
- `runs`: a request's WRITE as runs merged from its block ids, without a descriptor row per block.
- `plan`: `TransferPlan` / `plan_transfer`, one peer's pairing, what the producer writes by.
"""

from disagg.worker.kv.routing.desc_ids import (
    IdBuffer,
    IdRows,
    compute_desc_ids,
    cumulative_offsets,
    desc_id_rows,
    expand_logical_blocks,
    group_arrays,
    group_mapped_desc_ids,
    group_mapped_rows,
    layer_routed_desc_ids,
    layer_routed_rows,
    region_desc_ids,
    region_rows,
    uses_region_group_mapping,
)
from disagg.worker.kv.routing.descriptors import (
    StridedArray,
    expand_strided,
    first_kv_head,
    head_split,
    local_descs,
    local_strided,
    rank_offset_factor,
    remote_descs,
    remote_strided,
)
from disagg.worker.kv.routing.plan import (
    TransferPlan,
    check_group_layouts,
    plan_transfer,
)
from disagg.worker.kv.routing.regions import (
    BlockIds,
    DescArray,
    IdArray,
    RegionGeometry,
    RegionMetadata,
    TransferLayers,
    align_remote_regions,
    pair_layers,
    region_capacities,
    select_regions,
    slice_pp_regions,
)
from disagg.worker.kv.routing.runs import Runs, merged_runs

__all__ = [
    "BlockIds",
    "DescArray",
    "IdArray",
    "IdBuffer",
    "IdRows",
    "RegionGeometry",
    "RegionMetadata",
    "Runs",
    "StridedArray",
    "TransferLayers",
    "TransferPlan",
    "align_remote_regions",
    "check_group_layouts",
    "compute_desc_ids",
    "cumulative_offsets",
    "desc_id_rows",
    "expand_logical_blocks",
    "expand_strided",
    "first_kv_head",
    "group_arrays",
    "group_mapped_desc_ids",
    "group_mapped_rows",
    "head_split",
    "layer_routed_desc_ids",
    "layer_routed_rows",
    "local_descs",
    "local_strided",
    "merged_runs",
    "pair_layers",
    "plan_transfer",
    "rank_offset_factor",
    "region_capacities",
    "region_desc_ids",
    "region_rows",
    "remote_descs",
    "remote_strided",
    "select_regions",
    "slice_pp_regions",
    "uses_region_group_mapping",
]
