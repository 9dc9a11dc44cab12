"""The status refresh queue: a deduplicating work queue, as controller-runtime's workqueue is.

Pod and workload events only say "look at this deployment again"; the queue turns any number of them into one
refresh per key, never two at a time, and retries a failed one (`RefreshQueue`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# The logger the status refresh has always logged its failures under.
_LOG = logging.getLogger("disagg.operator.status")
# How long a requested key waits before its refresh: a new child's events (its pods created, its status
# updated two or three times by its controller) come within about a second when the API server keeps up,
# and one refresh after them writes the status once, not once per event (measured: a lone deployment's
# status is written twice, by its reconcile and one refresh). Under a loaded API server the pods come
# seconds apart and each still changes, and is written to, the status.
SETTLE_S = 1.0


class RefreshQueue:
    """A deduplicating work queue for status refreshes, as controller-runtime's workqueue does it.

    A pod's or workload's event only says "look at this deployment again". `request` returns at once; a key
    waits in the queue at most once however many events name it, and one key is never refreshed by two
    workers at a time (a request during its refresh queues it again, to be read afresh). A reconcile holds
    its key (`holding`): it writes the status itself, so no refresh runs meanwhile and the events of the
    children it applies cost one refresh after it, not one each during it. A failed refresh is logged with
    its traceback and retried after `retry_delay`, so a transient API error cannot leave a stale status
    behind. A key is refreshed `settle` seconds after the request that queued it (what controller-runtime's
    `AddAfter` does), so the requests of one burst of events share its refresh.
    """

    def __init__(
        self,
        refresh: Callable[[tuple[str, str]], object],
        *,
        workers: int = 4,
        retry_delay: float = 1.0,
        settle: float = SETTLE_S,
    ) -> None:
        self._refresh = refresh
        self._retry_delay = retry_delay
        self._settle = settle
        self._ready = threading.Condition()
        # Keys with the monotonic time each is due (all wait the same `settle`, so they stay in due order).
        self._order: deque[tuple[tuple[str, str], float]] = deque()
        self._queued: set[tuple[str, str]] = set()
        self._busy: set[tuple[str, str]] = set()
        self._again: set[tuple[str, str]] = set()
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._work, name=f"disagg-status-{index}", daemon=True)
            for index in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def request(self, key: tuple[str, str]) -> None:
        with self._ready:
            if key in self._busy:
                self._again.add(key)
            elif key not in self._queued:
                self._queued.add(key)
                self._order.append((key, time.monotonic() + self._settle))
                # All: a reconcile waiting in `holding` shares the condition, and a single wake-up that
                # reached it instead of an idle worker would leave this key queued until some refresh ends.
                self._ready.notify_all()

    @contextmanager
    def holding(self, key: tuple[str, str]) -> Iterator[None]:
        """Run the body with no refresh of `key` running (it waits for one that is); requests meanwhile
        are refreshed once afterwards."""
        with self._ready:
            while key in self._busy:
                self._ready.wait()
            self._busy.add(key)
            if key in self._queued:
                self._queued.discard(key)
                self._order = deque(item for item in self._order if item[0] != key)
                self._again.add(key)
        try:
            yield
        finally:
            self._release(key)

    def _release(self, key: tuple[str, str]) -> None:
        with self._ready:
            self._busy.discard(key)
            again = key in self._again
            self._again.discard(key)
            self._ready.notify_all()
        if again:
            self.request(key)

    def stop(self) -> None:
        with self._ready:
            self._stopping = True
            self._ready.notify_all()

    def _take(self) -> tuple[str, str] | None:
        with self._ready:
            while not self._stopping:
                wait = self._order[0][1] - time.monotonic() if self._order else None
                if wait is not None and wait <= 0:
                    break
                self._ready.wait(wait)
            if self._stopping:
                return None
            key, _ = self._order.popleft()
            self._queued.discard(key)
            self._busy.add(key)
            return key

    def _work(self) -> None:
        while (key := self._take()) is not None:
            failed = False
            try:
                self._refresh(key)
            except Exception:
                failed = True
                _LOG.exception("Status refresh of %s/%s failed; retrying in %.1f s", *key, self._retry_delay)
            if failed:
                # The retry reads everything afresh: a request made meanwhile needs no refresh of its own.
                with self._ready:
                    self._again.discard(key)
            self._release(key)
            if failed:
                timer = threading.Timer(self._retry_delay, self.request, args=(key,))
                timer.daemon = True
                timer.start()
