"""Backpressure: how many decode legs a decoder may hold at once, and a bounded wait for room.

A decoder's room is the least of the fixed cap (`max_per_decoder`) and what it can really take now, from its
own metrics (`window`, see `decoder_load`).

A decoder past its capacity queues a request inside vLLM while the prefill, which answered at once, holds the
KV only for its lease: a decode that starts after the lease has nothing to read, and fails only at its
registration timeout. So the router sends neither leg of a request until the decoder it goes to has room
(fewer decode legs in flight, the balancer's count, than its room). A request that finds no room
waits, first in first out, for at most `queue_timeout_s`, in a queue of at most `max_queued`; past either it
is shed with 503 and a Retry-After, having cost no engine anything. A request that is admitted takes the
least loaded pair with room, by the balancer's policy.

Room appears when a decode leg ends (`release`) or the routing changes (`wake_all`); each wakes the waiter at
the head of the queue, which re-checks. A request arriving while others wait queues behind them, so a
stream of arrivals cannot starve a waiter.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Sequence

from disagg.worker.contracts.pairing import DecodeTarget, Pair
from disagg.worker.router.balance import Balancer
from disagg.worker.router.protocol import Fault, RouterError


class Admission:
    def __init__(
        self,
        balancer: Balancer,
        *,
        max_per_decoder: int,
        max_queued: int,
        queue_timeout_s: float,
        retry_after_s: int,
        window: Callable[[DecodeTarget], int | None] = lambda decode: None,
    ) -> None:
        self.balancer = balancer
        self.window = window
        self.max_per_decoder = max_per_decoder
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self._waiters: deque[asyncio.Event] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def with_room(self, pairs: Sequence[Pair]) -> list[Pair]:
        """The pairs whose decoder can take one more decode leg (every pair without a bound)."""
        return [p for p in pairs if self.balancer.decode_legs[p.decode.pod] < self.room(p.decode)]

    def room(self, decode: DecodeTarget) -> float:
        """The decode legs `decode` may hold: the fixed cap, lowered to what it can take now."""
        room = float(self.max_per_decoder) if self.max_per_decoder > 0 else math.inf
        window = self.window(decode)
        return room if window is None else min(room, window)

    async def choose(
        self,
        pairs: Callable[[], Sequence[Pair]],
        timeout_s: float | None = None,
        coming: Callable[[], bool] = lambda: False,
    ) -> Pair:
        """A pair with room, waiting for one when there is none. The caller starts its ticket before it next
        awaits, so the room it was given is not given twice. `timeout_s` (the request's own deadline) may
        shorten the wait; when it is what ends the wait, the caller's deadline error is raised
        (TimeoutError), else 503 QueueTimeout. With no pair at all it fails at once (503 NoRoutablePair),
        unless `coming()` says a pair is on its way (its KV canary is in flight): then it waits."""
        if not self._waiters:
            pair = self._pick(pairs())
            if pair is not None:
                return pair
        if not pairs() and not coming():
            raise _no_pair()
        if len(self._waiters) >= self.max_queued:
            raise RouterError(
                Fault.UNAVAILABLE,
                "QueueFull",
                f"no decoder has room for another request and {self.max_queued} wait for room",
                retry_after_s=self.retry_after_s,
            )
        wait_s = self.queue_timeout_s if timeout_s is None else min(self.queue_timeout_s, timeout_s)
        woken = asyncio.Event()
        self._waiters.append(woken)
        try:
            async with asyncio.timeout(max(0.0, wait_s)):
                while True:
                    await woken.wait()
                    woken.clear()
                    if not pairs() and not coming():
                        raise _no_pair()
                    pair = self._pick(pairs())
                    if pair is not None:
                        return pair
        except TimeoutError:
            if timeout_s is not None and timeout_s < self.queue_timeout_s:
                raise
            raise RouterError(
                Fault.UNAVAILABLE,
                "QueueTimeout",
                f"no decoder had room for {self.queue_timeout_s:g} s",
                retry_after_s=self.retry_after_s,
            ) from None
        finally:
            self._waiters.remove(woken)
            # This waiter may have been woken for room it did not take (it timed out, or left): pass it on.
            self.release()

    def release(self) -> None:
        """A decode leg ended: the first waiter not yet woken re-checks."""
        for waiter in self._waiters:
            if not waiter.is_set():
                waiter.set()
                return

    def wake_all(self) -> None:
        """The routing changed: every waiter re-checks (new pairs may have room, or none may be left)."""
        for waiter in self._waiters:
            waiter.set()

    def _pick(self, pairs: Sequence[Pair]) -> Pair | None:
        return self.balancer.choose(self.with_room(pairs))


def _no_pair() -> RouterError:
    return RouterError(Fault.UNAVAILABLE, "NoRoutablePair", "no routable pair")
