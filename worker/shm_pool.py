"""The worker's KV pool: one flat byte buffer over a file in /dev/shm, shareable between processes.

The engine container and the sidecar map the same file, so the sidecar can register the engine's KV cache with
NIXL without copying it; tests map a decoder's pool from outside to check what arrived, byte for byte.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import numpy.typing as npt


class ShmPool:
    """A uint8 numpy view over a shared mapping of `path`; `addr` is what NIXL registers."""

    def __init__(
        self, path: str | os.PathLike[str], nbytes: int | None = None, *, create: bool = False
    ) -> None:
        self.path = Path(path)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                if nbytes is None or nbytes <= 0:
                    raise ValueError(f"a new pool needs a positive size, got {nbytes}")
                os.ftruncate(fd, nbytes)
            size = os.fstat(fd).st_size
            if nbytes is not None and size != nbytes:
                raise ValueError(f"{self.path} holds {size} bytes, expected {nbytes}")
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.array: npt.NDArray[np.uint8] = np.frombuffer(self._mmap, dtype=np.uint8)

    @classmethod
    def create(cls, path: str | os.PathLike[str], nbytes: int) -> ShmPool:
        return cls(path, nbytes, create=True)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    @property
    def addr(self) -> int:
        return int(self.array.ctypes.data)

    def close(self) -> None:
        # The numpy view must go before the mapping, or mmap.close() refuses (exported buffer).
        self.array = np.empty(0, dtype=np.uint8)
        self._mmap.close()

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)
