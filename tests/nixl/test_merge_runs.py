"""Run merging of paired descriptors (pure numpy; lives with the transport it feeds)."""

from __future__ import annotations

import numpy as np
import pytest

from disagg.worker.connector.transport import descriptor_array, merge_runs


def test_merges_only_runs_contiguous_on_both_sides() -> None:
    local = descriptor_array([0, 100, 200, 300, 500], 100)
    remote = descriptor_array([1000, 1100, 5000, 5100, 5200], 100)
    merged_local, merged_remote = merge_runs(local, remote)
    assert merged_local.tolist() == [[0, 200, 0], [200, 200, 0], [500, 100, 0]]
    assert merged_remote.tolist() == [[1000, 200, 0], [5000, 200, 0], [5200, 100, 0]]


def test_total_bytes_and_pairing_are_preserved() -> None:
    rng = np.random.default_rng(3)
    blocks = rng.permutation(64)[:40]
    local = descriptor_array(np.sort(blocks) * 4096, 4096)
    remote = descriptor_array(np.arange(40) * 4096 + 10**6, 4096)
    merged_local, merged_remote = merge_runs(local, remote)
    assert merged_local[:, 1].sum() == merged_remote[:, 1].sum() == 40 * 4096
    assert len(merged_local) < 40


def test_refuses_unpaired_lengths() -> None:
    with pytest.raises(ValueError, match="equal lengths"):
        merge_runs(descriptor_array([0], 8), descriptor_array([0], 16))
