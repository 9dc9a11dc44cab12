"""The engine head's one model thread: every model step, gloo exchange and block-id change, in order.

None of them runs on the event loop, and none runs beside another: requests interleave step by step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class ModelThread:
    """The one thread that runs model steps, gloo exchanges and block bookkeeping, in submission order."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-model")

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self._executor.submit(fn))

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future = self._executor.submit(fn)
        future.add_done_callback(_log_failure)
        return future

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def _log_failure(future: Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("a model-thread job failed", exc_info=future.exception())
