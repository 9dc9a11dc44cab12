"""A request's WRITE as merged runs, computed from its block ids and both sides' strided lists.

What `transport.merge_runs(local[local_ids], remote[remote_ids])` gives, without gathering a descriptor
row per block: every id row of a plan (`IdRows`) is one group's block list laid over one strided row of each
side, so the addresses are `addr + b * stride`, and a pair continues a run exactly when both sides' next
block starts where the previous one ends. Within a row that depends only on the group's block-id steps and
the two rows' (stride, len), so rows of one group with the same spacing share the work; only the edges
between rows are compared one by one. The cost is a pass over the block ids of each group and the merged
runs themselves: for a contiguous block table that is a few dozen descriptors, never a row per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from disagg.worker.kv.routing.desc_ids import IdRows
from disagg.worker.kv.routing.descriptors import StridedArray
from disagg.worker.kv.routing.regions import DescArray, IdArray

_WRAP = 1 << 64
"""Addresses compare as the uint64 descriptor columns do."""


@dataclass(frozen=True)
class _Row:
    local_row: int
    remote_row: int
    ids: tuple[IdArray, IdArray]
    breaks: IdArray
    """Positions in the row where a run starts, other than 0 (shared by the rows of one group and spacing)."""
    continues: bool
    """The row's first block continues the previous row's last run."""
    length: int

    @property
    def count(self) -> int:
        return len(self.breaks) + (0 if self.continues else 1)

    def starts(self) -> IdArray:
        """Positions in the row where a run starts. Built only for `Runs.descriptors`: a random block table
        has a run per block, and a request whose runs do not merge never asks."""
        return self.breaks if self.continues else np.concatenate((np.zeros(1, dtype=np.int64), self.breaks))


@dataclass(frozen=True)
class Runs:
    """One request's paired descriptors as runs contiguous on both sides."""

    rows: tuple[_Row, ...]
    local: StridedArray
    remote: StridedArray
    num_descs: int
    """Descriptors before merging: one per block and row."""
    nbytes: int
    """Bytes the WRITE moves."""

    @property
    def count(self) -> int:
        """Descriptors after merging."""
        return sum(row.count for row in self.rows)

    def descriptors(self) -> tuple[DescArray, DescArray]:
        """The merged Nx3 lists, row i of one paired with row i of the other (equal lengths)."""
        count = self.count
        local, remote = np.empty((count, 3), dtype=np.uint64), np.empty((count, 3), dtype=np.uint64)
        # The bytes before each run's start: each run's length is the difference to the next one's.
        ends = np.empty(count, dtype=np.int64)
        done, position = 0, 0
        for row in self.rows:
            starts = row.starts()
            n = len(starts)
            for side, table, ids, strided_row in (
                (local, self.local, row.ids[0], row.local_row),
                (remote, self.remote, row.ids[1], row.remote_row),
            ):
                addr, _, device, stride, _ = table[strided_row].tolist()
                block = ids[starts].astype(np.uint64)
                np.multiply(block, np.uint64(stride), out=side[position : position + n, 0])
                side[position : position + n, 0] += np.uint64(addr)
                side[position : position + n, 2] = device
            ends[position : position + n] = done + starts * row.length
            done += len(row.ids[0]) * row.length
            position += n
        lengths = np.diff(ends, append=done).astype(np.uint64)
        local[:, 1] = lengths
        remote[:, 1] = lengths
        return local, remote


def merged_runs(
    local_rows: IdRows,
    local: StridedArray,
    local_groups: Sequence[IdArray],
    remote_rows: IdRows,
    remote: StridedArray,
    remote_groups: Sequence[IdArray],
) -> Runs | None:
    """The runs of one request whose block ids (kernel ids per group, already checked against the rows'
    limits) index `local` and `remote` through their id rows; None when the two sides' rows do not pair
    row for row (the caller gathers and merges the rows instead). Raises ValueError where paired
    descriptors differ in length, as `merge_runs` does."""
    if local_rows.groups != remote_rows.groups or not local_rows.regions or not remote_rows.regions:
        return None
    local_table, remote_table = local.tolist(), remote.tolist()
    rows: list[_Row] = []
    shared: dict[tuple[int, int, int, int], IdArray] = {}
    previous: tuple[int, int, int, int] | None = None
    """The last row's end address and device on each side, to see whether the next row continues it."""
    num_descs = nbytes = 0
    for g, lr, rr in zip(local_rows.groups, local_rows.regions, remote_rows.regions, strict=True):
        local_ids, remote_ids = local_groups[g], remote_groups[g]
        n = local_ids.size
        if n == 0:
            continue
        l_addr, length, l_dev, l_stride, _ = local_table[lr]
        r_addr, r_length, r_dev, r_stride, _ = remote_table[rr]
        if length != r_length:
            raise ValueError("paired descriptors must have equal lengths")
        key = (g, l_stride, r_stride, length)
        breaks = shared.get(key)
        if breaks is None:
            # int64 steps times the stride wrap as the uint64 addresses would.
            joins = (np.diff(local_ids) * np.int64(l_stride) == length) & (
                np.diff(remote_ids) * np.int64(r_stride) == length
            )
            breaks = np.flatnonzero(~joins) + 1
            shared[key] = breaks
        l_first = (l_addr + int(local_ids[0]) * l_stride) % _WRAP
        r_first = (r_addr + int(remote_ids[0]) * r_stride) % _WRAP
        continues = previous is not None and previous == (l_first, l_dev, r_first, r_dev)
        rows.append(_Row(lr, rr, (local_ids, remote_ids), breaks, continues, length))
        previous = (
            (l_addr + int(local_ids[-1]) * l_stride + length) % _WRAP,
            l_dev,
            (r_addr + int(remote_ids[-1]) * r_stride + length) % _WRAP,
            r_dev,
        )
        num_descs += n
        nbytes += n * length
    return Runs(tuple(rows), local, remote, num_descs, nbytes)
