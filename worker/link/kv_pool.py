"""The worker's KV pool: one flat byte buffer over a file in /dev/shm, shareable between processes.

The engine container and the sidecar map the same file, so the sidecar can register the engine's KV cache with
NIXL without copying it; tests map a decoder's pool from outside to check what arrived, byte for byte.

Page backing decides push throughput (measured in `bench_push`): on one host NIXL writes with CMA
(`process_vm_writev`), which pins the *target's* pages one page-table entry at a time. Into 4 KiB pages that
runs at about 0.4 of memcpy; into 2 MiB pages (a tmpfs mounted with `huge=always|within_size|advise`, or
hugetlbfs) it runs at memcpy speed. So every mapping asks for huge pages and is populated up front: huge pages
are only chosen at allocation, and a page first touched by a transfer would cost a fault inside it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

import numpy as np
import numpy.typing as npt

# Linux 5.14+; Python's mmap module does not name it.
MADV_POPULATE_WRITE = 23
PAGE_BYTES = mmap.PAGESIZE
# /proc/self/smaps fields that count pages mapped by huge (PMD) entries, all inside Rss: tmpfs and file THP.
_THP_FIELDS = ("ShmemPmdMapped:", "FilePmdMapped:")
# hugetlbfs pages, which smaps leaves out of Rss.
_HUGETLB_FIELDS = ("Shared_Hugetlb:", "Private_Hugetlb:")


def _file_bytes(nbytes: int, unit: int) -> int:
    return nbytes if unit <= PAGE_BYTES else -(-nbytes // unit) * unit


class ShmPool:
    """A uint8 numpy view over a shared mapping of `path`; `addr` is what NIXL registers.

    `path` may be on tmpfs (/dev/shm) or hugetlbfs (a Kubernetes `emptyDir: {medium: HugePages}`); there the
    file is rounded up to whole huge pages. `prefault` (default) populates every page of the mapping before it
    is used; `False` leaves them to be faulted in on first touch.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        nbytes: int | None = None,
        *,
        create: bool = False,
        prefault: bool = True,
    ) -> None:
        self.path = Path(path)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            # hugetlbfs sizes files in whole huge pages; the pool is the first `nbytes` of the file.
            unit = os.fstatvfs(fd).f_bsize
            if create:
                if nbytes is None or nbytes <= 0:
                    raise ValueError(f"a new pool needs a positive size, got {nbytes}")
                os.ftruncate(fd, _file_bytes(nbytes, unit))
            size = os.fstat(fd).st_size
            if nbytes is not None and size != _file_bytes(nbytes, unit):
                raise ValueError(f"{self.path} holds {size} bytes, expected {nbytes}")
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.array: npt.NDArray[np.uint8] = np.frombuffer(
            self._mmap, dtype=np.uint8, count=size if nbytes is None else nbytes
        )
        if prefault:
            self._prefault()

    @classmethod
    def create(cls, path: str | os.PathLike[str], nbytes: int, *, prefault: bool = True) -> ShmPool:
        return cls(path, nbytes, create=True, prefault=prefault)

    def _prefault(self) -> None:
        # Refused where the filesystem cannot give huge pages to this mapping; 4 KiB pages still work.
        with contextlib.suppress(OSError):
            self._mmap.madvise(mmap.MADV_HUGEPAGE)
        try:
            self._mmap.madvise(MADV_POPULATE_WRITE)
        except OSError:
            # Kernels before 5.14: a read of every page maps it (and allocates it, for a new file).
            int(self.array[::PAGE_BYTES].sum())

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    @property
    def addr(self) -> int:
        return int(self.array.ctypes.data)

    def resident_bytes(self) -> tuple[int, int]:
        """(bytes mapped into this process's page tables, of which by huge pages), from /proc/self/smaps."""
        start = self.addr
        rss = huge = 0
        inside = False
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head, _, rest = line.partition(" ")
                if not head.endswith(":"):
                    low, _, high = head.partition("-")
                    inside = int(low, 16) <= start < int(high, 16)
                elif inside and head == "Rss:":
                    rss += int(rest.split()[0]) * 1024
                elif inside and head in _THP_FIELDS:
                    huge += int(rest.split()[0]) * 1024
                elif inside and head in _HUGETLB_FIELDS:
                    rss += int(rest.split()[0]) * 1024
                    huge += int(rest.split()[0]) * 1024
        return rss, huge

    def close(self) -> None:
        # The numpy view must go before the mapping, or mmap.close() refuses (exported buffer).
        self.array = np.empty(0, dtype=np.uint8)
        self._mmap.close()

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)
