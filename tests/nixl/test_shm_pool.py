"""KV pool mappings are populated up front, so a NIXL (CMA) write into them never pays a page fault.

Residency is read from this process's own page tables (/proc/self/smaps), not inferred from the API.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from disagg.worker.shm_pool import PAGE_BYTES, ShmPool

NBYTES = 64 * 2**20 + 3 * PAGE_BYTES  # not a multiple of a huge page


@pytest.fixture
def path(tmp_path: Path) -> Iterator[Path]:
    p = Path("/dev/shm") / f"disagg-pool-{tmp_path.name}"
    yield p
    p.unlink(missing_ok=True)


def test_a_new_pool_is_resident_and_zeroed(path: Path) -> None:
    pool = ShmPool.create(path, NBYTES)
    try:
        rss, huge = pool.resident_bytes()
        assert rss == NBYTES
        assert 0 <= huge <= rss
        assert not pool.array.any()
    finally:
        pool.close()


def test_without_prefault_pages_arrive_on_first_touch(path: Path) -> None:
    pool = ShmPool.create(path, NBYTES, prefault=False)
    try:
        assert pool.resident_bytes()[0] == 0
        pool.array[::PAGE_BYTES] = 1
        assert pool.resident_bytes()[0] == NBYTES
    finally:
        pool.close()


def test_opening_a_pool_maps_every_page_and_keeps_its_bytes(path: Path) -> None:
    owner = ShmPool.create(path, NBYTES)
    data = np.random.default_rng(3).integers(0, 256, size=NBYTES, dtype=np.uint8)
    owner.array[:] = data
    other = ShmPool(path, NBYTES)
    try:
        assert other.resident_bytes()[0] == NBYTES
        assert np.array_equal(other.array, data)
        other.array[:PAGE_BYTES] = 7
        assert (owner.array[:PAGE_BYTES] == 7).all()
    finally:
        other.close()
        owner.close()
