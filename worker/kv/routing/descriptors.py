"""Descriptor geometry: the (addr, len, dev) arrays the transport prepares as NIXL dlists, and which head
slice of a prefill block a decode rank with fewer heads takes (`rank_offset_factor`, `head_split`).

Each list is one run of equally spaced blocks per region, so it is also kept as NIXL's strided form
(`StridedArray`, one row per region): what the producer prepares and computes merged runs from, without a
row per block (`local_strided`, `remote_strided`; `expand_strided` gives the row-per-block list back).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from disagg.worker.kv.errors import RegionGeometryMismatch
from disagg.worker.kv.routing.regions import DescArray, IdArray, RegionMetadata, region_capacities

StridedArray = npt.NDArray[np.uint64]
"""Nx5 `(addr, len, dev, stride, count)`: `count` descriptors of `len` bytes `stride` apart from `addr`
(NIXL 1.5's strided dlist, which `prep_xfer_dlist` takes as is and indexes descriptor by descriptor)."""


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


def remote_strided(
    remote: RegionMetadata,
    local: RegionMetadata,
    *,
    local_regions: Sequence[int] | None = None,
    replicated: Sequence[bool] | None = None,
    block_size_ratio: int = 1,
    num_reads: int = 1,
    rank_offset_factor: int = 0,
) -> StridedArray:
    """`remote_descs` in the strided form: one row per remote region, the same descriptors in order."""
    pairs = range(len(remote.kv_caches_base_addr)) if local_regions is None else local_regions
    if len(pairs) != len(remote.kv_caches_base_addr):
        raise RegionGeometryMismatch(
            f"{len(remote.kv_caches_base_addr)} remote regions for {len(pairs)} local transfer regions"
        )
    caps = region_capacities(remote)
    out = np.empty((len(pairs), 5), dtype=np.uint64)
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
        out[i] = (
            remote.kv_caches_base_addr[i] + offset,
            local_len // reads,
            remote.device_id,
            remote.block_strides[i],
            caps[i],
        )
    return out


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
    return expand_strided(
        remote_strided(
            remote,
            local,
            local_regions=local_regions,
            replicated=replicated,
            block_size_ratio=block_size_ratio,
            num_reads=num_reads,
            rank_offset_factor=rank_offset_factor,
        )
    )


def local_strided(
    meta: RegionMetadata,
    *,
    regions: Sequence[int] | None = None,
    head_slice: tuple[int, int] = (0, 1),
    replicated: Sequence[bool] | None = None,
) -> StridedArray:
    """`local_descs` with whole kernel blocks (no block-size ratio) in the strided form: one row per entry
    of `regions`, the same descriptors in order."""
    slot, count = head_slice
    order = range(len(meta.kv_caches_base_addr)) if regions is None else regions
    caps = region_capacities(meta)
    out = np.empty((len(order), 5), dtype=np.uint64)
    for i, r in enumerate(order):
        split = 1 if replicated is not None and replicated[r] else count
        sub_len = meta.block_lens[r] // split
        start = meta.kv_caches_base_addr[r] + (slot if split > 1 else 0) * sub_len
        out[i] = (start, sub_len, meta.device_id, meta.block_strides[r], caps[r])
    return out


def expand_strided(strided: StridedArray) -> DescArray:
    """The Nx3 list a strided one stands for: row by row, `count` descriptors `stride` apart."""
    counts = strided[:, 4].astype(np.int64)
    total = int(counts.sum())
    out = np.empty((total, 3), dtype=np.uint64)
    start = 0
    for (addr, length, device, stride, _), count in zip(strided.tolist(), counts.tolist(), strict=True):
        end = start + count
        np.multiply(np.arange(count, dtype=np.uint64), np.uint64(stride), out=out[start:end, 0])
        out[start:end, 0] += np.uint64(addr)
        out[start:end, 1] = length
        out[start:end, 2] = device
        start = end
    return out


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
