"""A deduplicating work queue keyed by deployment, as controller-runtime's workqueue is (`WorkQueue`).

The operator runs two: spec reconciles (what a DisaggDeployment's spec handler asks for) and status refreshes
(what its children's events ask for). An event only says "look at this deployment again"; the queue turns any
number of them into one run per key, never two at a time, and retries a failed one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Key = tuple[str, str]
# The first retry of a failed key, doubled per failure in a row up to `MAX_RETRY_S` (kopf retried a failed
# handler after 60 s): a transient error costs a second, an API server away for minutes a request a minute.
RETRY_S = 1.0
MAX_RETRY_S = 60.0


class WorkQueue:
    """A deduplicating work queue: `run(key)` in `workers` threads for each key `request`ed.

    `request` returns at once; a key waits in the queue at most once however many requests name it, and one
    key is never run by two workers at a time (a request during its run queues it again, to be read afresh).
    A key is run `settle` seconds after the request that queued it (what controller-runtime's `AddAfter`
    does), so the requests of one burst of events share one run. Another step that must not overlap a run of
    the key holds it (`holding`), and requests meanwhile cost one run after it. A failed run is logged with
    its traceback (as `what` of the key, under `logger`) and run again after `retry`, doubled per failure of
    the key in a row up to `max_retry`, so a transient API error cannot leave a key unreconciled.
    """

    def __init__(
        self,
        run: Callable[[Key], object],
        *,
        what: str,
        logger: logging.Logger,
        workers: int = 4,
        settle: float = 0.0,
        retry: float = RETRY_S,
        max_retry: float = MAX_RETRY_S,
    ) -> None:
        self._run = run
        self._what = what
        self._log = logger
        self._retry = retry
        self._max_retry = max_retry
        self._settle = settle
        self._ready = threading.Condition()
        # Keys with the monotonic time each is due (all wait the same `settle`, so they stay in due order).
        self._order: deque[tuple[Key, float]] = deque()
        self._queued: set[Key] = set()
        self._busy: set[Key] = set()
        self._again: set[Key] = set()
        self._failures: dict[Key, int] = {}
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._work, name=f"disagg-{what.replace(' ', '-')}-{index}", daemon=True)
            for index in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def request(self, key: Key) -> None:
        with self._ready:
            if key in self._busy:
                self._again.add(key)
            elif key not in self._queued:
                self._queued.add(key)
                self._order.append((key, time.monotonic() + self._settle))
                # All: a step waiting in `holding` shares the condition, and a single wake-up that reached it
                # instead of an idle worker would leave this key queued until some run ends.
                self._ready.notify_all()

    @contextmanager
    def holding(self, key: Key) -> Iterator[None]:
        """Run the body with no run of `key` under way (it waits for one that is); requests meanwhile are
        run once afterwards."""
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

    def _release(self, key: Key) -> None:
        with self._ready:
            self._busy.discard(key)
            again = key in self._again
            self._again.discard(key)
            self._ready.notify_all()
        if again:
            self.request(key)

    def stop(self, timeout: float = 10.0) -> None:
        """Take no more keys, and wait up to `timeout` seconds for the runs under way to end (a reconcile
        cut off by the process's exit would be done again by the next operator, but its writes would be
        half)."""
        with self._ready:
            self._stopping = True
            self._ready.notify_all()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def _take(self) -> Key | None:
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
            delay = None
            try:
                self._run(key)
            except Exception:
                with self._ready:
                    failures = self._failures[key] = self._failures.get(key, 0) + 1
                    # The retry reads everything afresh: a request made meanwhile needs no run of its own.
                    self._again.discard(key)
                delay = min(self._retry * 2 ** (failures - 1), self._max_retry)
                self._log.exception("%s of %s/%s failed; retrying in %.1f s", self._what, *key, delay)
            else:
                with self._ready:
                    self._failures.pop(key, None)
            self._release(key)
            if delay is not None:
                timer = threading.Timer(delay, self.request, args=(key,))
                timer.daemon = True
                timer.start()
