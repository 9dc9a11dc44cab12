"""Giving the C heap's freed memory back to the operating system after a large drop, at most so often.

glibc's malloc serves blocks under its mmap threshold (128 KiB, raised up to 32 MiB once a large block is
freed) from the process heap, and on `free` returns pages to the system only from the heap's top: one live
allocation above a freed region keeps all of it in the process's RSS. A flood of decoders' registrations
(each a few block-id arrays of tens of KiB, allocated between everything else the main loop allocates)
dropped at their deadline is such a region: measured on a prefill sidecar, some 400 MiB stayed resident
after every registration had expired. `malloc_trim(0)` hands back every whole free page wherever it lies
(`madvise(MADV_DONTNEED)`), in every arena. Where the C library has no `malloc_trim` (musl), trimming is a
no-op and the freed memory is reused by later allocations instead.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIM_AFTER_BYTES = 16 * 1024 * 1024
"""Bytes freed since the last trim that make the next one worth its cost (a walk of the heap)."""
TRIM_INTERVAL_S = 2.0
"""The least time between two trims, however much is freed: a steady stream of drops costs one walk of
the heap per interval, not one per drop."""


def libc_malloc_trim() -> Callable[[], object] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the C library the process runs on
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


class HeapTrimmer:
    """Counts bytes its owner freed; trims the heap once enough were freed and the interval has passed."""

    def __init__(
        self,
        *,
        after_bytes: int = TRIM_AFTER_BYTES,
        interval_s: float = TRIM_INTERVAL_S,
        trim: Callable[[], object] | None = None,
    ) -> None:
        self._after_bytes = after_bytes
        self._interval_s = interval_s
        self._trim = trim
        self._freed = 0
        self._last: float | None = None
        self.trims = 0
        """Trims done since the start."""

    def freed(self, nbytes: int) -> None:
        self._freed += nbytes

    def maybe_trim(self, now: float) -> bool:
        """Trim if enough was freed and the last trim is at least the interval ago; True when it did.
        Called on every poll, so that bytes freed within the interval are trimmed once it has passed."""
        if self._freed < self._after_bytes:
            return False
        if self._last is not None and now - self._last < self._interval_s:
            return False
        if self._trim is None:
            # Looked up on the first trim: a worker no flood reaches never touches the C library for it.
            self._trim = libc_malloc_trim() or (lambda: None)
        started = time.perf_counter()
        self._trim()
        log.info(
            "returned the heap's free pages to the system after %d MiB were freed (%.1f ms)",
            self._freed >> 20,
            (time.perf_counter() - started) * 1e3,
        )
        self._freed, self._last = 0, now
        self.trims += 1
        return True
