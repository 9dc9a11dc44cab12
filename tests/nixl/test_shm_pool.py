"""KV pool mappings are populated up front, so a NIXL (CMA) write into them never pays a page fault.

Residency is read from this process's own page tables (/proc/self/smaps), not inferred from the API.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from disagg.worker.link.kv_pool import PAGE_BYTES, ShmPool

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


def _hugetlbfs_mount() -> Path | None:
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, where, fstype, *_ = line.split()
            if fstype == "hugetlbfs" and os.access(where, os.W_OK):
                return Path(where)
    return None


@pytest.mark.skipif(_hugetlbfs_mount() is None, reason="no writable hugetlbfs mount on this host")
def test_a_pool_on_hugetlbfs_is_rounded_to_huge_pages_and_mapped_by_them(tmp_path: Path) -> None:
    mount = _hugetlbfs_mount()
    assert mount is not None
    path = mount / f"disagg-pool-{tmp_path.name}"
    try:
        pool = ShmPool.create(path, NBYTES)
    except OSError as exc:  # ENOMEM: the mount exists but its huge pages are taken
        pytest.skip(f"no free huge pages: {exc}")
    try:
        unit = os.statvfs(mount).f_bsize
        assert pool.nbytes == NBYTES
        assert path.stat().st_size == -(-NBYTES // unit) * unit
        assert pool.resident_bytes() == (path.stat().st_size, path.stat().st_size)
        pool.array[-1] = 5
        other = ShmPool(path, NBYTES)
        assert other.nbytes == NBYTES and other.array[-1] == 5
        other.close()
    finally:
        pool.close()
        path.unlink(missing_ok=True)
