"""The operator's clock: reconciles that no watch event brings, run on a schedule per deployment.

Nothing in a deployment's spec changes when a rollout's new revision becomes routable or a drain ends, nor
when the routers' load moves the planner's targets; those steps run every `interval` seconds for each
deployment a `Tick` applies to. kopf's timers did this, but kopf keeps, for every object of a kind with any
timer, a live copy of its whole body (its daemons' `live_fresh_body`), whatever the timer's `when=` says:
about 1.6 MiB per 100 deployments that never roll out nor autoscale. This clock reads the operator's
`owners` store instead.

One step runs at a time per deployment and tick (a slow one is not started again until it ends); a failed step
is logged with its traceback and runs again at its next time, as kopf's timers retried.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

_LOG = logging.getLogger("disagg.operator.ticker")
Key = tuple[str, str]


@dataclass(frozen=True)
class Tick:
    """`run(body)` every `interval` seconds for each deployment whose body `applies`; the first run comes
    one interval after the deployment first applies."""

    name: str
    interval: float
    applies: Callable[[Mapping[str, Any]], bool]
    run: Callable[[Mapping[str, Any]], None]


class Ticker:
    """Runs each `Tick` on the deployments `bodies()` returns (read afresh every `resolution` seconds) in
    `workers` threads. `forget(key)` is called once for each deployment that is gone from `bodies()`."""

    def __init__(
        self,
        bodies: Callable[[], Iterable[Mapping[str, Any]]],
        ticks: Iterable[Tick],
        *,
        workers: int = 2,
        resolution: float = 0.5,
        forget: Callable[[Key], object] = lambda key: None,
    ) -> None:
        self._bodies = bodies
        self._ticks = tuple(ticks)
        self._resolution = resolution
        self._forget = forget
        self._due: dict[tuple[str, Key], float] = {}
        self._running: dict[tuple[str, Key], Future[None]] = {}
        self._seen: set[Key] = set()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # Its threads start with the first step.
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="disagg-tick")

    def start(self) -> None:
        """Start the clock (again a no-op): call it once the stores `bodies` reads are whole."""
        with self._lock:
            if self._thread is not None or self._stopping.is_set():
                return
            self._thread = threading.Thread(target=self._loop, name="disagg-ticker", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop scheduling, and wait up to `timeout` seconds for the steps under way to end (a reconcile cut
        off by the process's exit would be done again by the next operator, but its writes would be half)."""
        with self._lock:
            self._stopping.set()
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the steps started so far to end."""
        futures.wait(list(self._running.values()), timeout)

    def _loop(self) -> None:
        while not self._stopping.wait(self._resolution):
            try:
                self.schedule(time.monotonic())
            except Exception:
                # The next pass reads everything afresh; a broken one must not end the clock.
                _LOG.exception("The operator's clock failed a pass; trying again")

    def schedule(self, now: float) -> None:
        """One pass: start every step that is due at `now` and not still running."""
        seen: set[Key] = set()
        for body in self._bodies():
            metadata = body["metadata"]
            if metadata.get("deletionTimestamp"):
                continue
            key = (metadata["namespace"], metadata["name"])
            seen.add(key)
            for tick in self._ticks:
                self._consider(tick, key, body, now)
        for slot in [slot for slot in self._due if slot[1] not in seen]:
            del self._due[slot]
        for slot in [slot for slot, step in self._running.items() if step.done()]:
            del self._running[slot]
        for key in self._seen - seen:
            self._forget(key)
        self._seen = seen

    def _consider(self, tick: Tick, key: Key, body: Mapping[str, Any], now: float) -> None:
        slot = (tick.name, key)
        if not tick.applies(body):
            self._due.pop(slot, None)
            return
        due = self._due.setdefault(slot, now + tick.interval)
        running = self._running.get(slot)
        if due > now or (running is not None and not running.done()):
            return
        self._due[slot] = now + tick.interval
        try:
            self._running[slot] = self._pool.submit(self._run, tick, key, body)
        except RuntimeError:
            # The pool shut down (`stop`) between this pass's start and now.
            return

    def _run(self, tick: Tick, key: Key, body: Mapping[str, Any]) -> None:
        try:
            tick.run(body)
        except Exception:
            _LOG.exception("%s of %s/%s failed; it runs again in %g s", tick.name, *key, tick.interval)
