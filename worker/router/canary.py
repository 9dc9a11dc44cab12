"""The KV canary: a pair is routable only once KV has really crossed it.

Verified handshakes and equal live hashes say that a prefill engine and a decoder *can* exchange KV; they do
not say that the first request will. Against real vLLM engines, the first request to a fresh pair has lost
its KV (the decoder's first handshake with the prefill missed vLLM's fixed 5 s window while the engines'
cores were busy, and the prefill's lease expired with the blocks unread). So before a pair gets client
traffic the router sends one request of its own through it, both legs, as a client's request would go, with
a one-token answer; only its success makes the pair routable. A pair is known by both engines' live ids,
addresses and container restarts: a vLLM engine that restarts draws a new id (the operator's launcher), but a
reference engine's container restarted by the kubelet keeps its pod, address and sidecar, and only its
restart count says that its pairs must be probed again.
A failed canary is retried every `retry_s`, and the pair is excluded with the reason meanwhile.

A verified pair that leaves the routing for a moment (a peer report rewritten while a decoder joins, a
readiness flap on a loaded node) and comes back with the same live ids is the same engines' proven path: it
is admitted again without a new canary if it returns within `remember_s`. Forgetting it at once had left a
deployment with no routable pair while its only serving pair was canaried again (503 `NoRoutablePair` for
the requests of those seconds, seen during a scale-up).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from disagg.worker.contracts.pairing import Exclusion, Pair, Routing

log = logging.getLogger("disagg.worker.router.canary")

PENDING_REASON = "KVCanaryPending"
FAILED_REASON = "KVCanaryFailed"

PairKey = tuple[str, str, int, str, str, int]


def pair_key(pair: Pair) -> PairKey:
    prefill, decode = pair.prefill, pair.decode
    return (prefill.engine_id, prefill.host, prefill.restarts, decode.engine_id, decode.host, decode.restarts)


def _has_engine(key: PairKey, engine_id: str) -> bool:
    prefill_engine, _, _, decode_engine, _, _ = key
    return engine_id in (prefill_engine, decode_engine)


@dataclass
class _State:
    task: asyncio.Task[None] | None
    verified: bool = False
    failure: str = ""


class KvCanary:
    """Which of a routing's pairs have carried KV; `admit` keeps only those. Runs on the router's loop."""

    def __init__(
        self,
        probe: Callable[[Pair], Awaitable[None]],
        on_change: Callable[[], None],
        *,
        retry_s: float = 5.0,
        remember_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._probe = probe
        self._on_change = on_change
        self._retry_s = retry_s
        self._remember_s = remember_s
        self._clock = clock
        self._pairs: dict[PairKey, _State] = {}
        # Verified pairs that left the routing, and when: admitted again without a canary within remember_s.
        self._left: dict[PairKey, float] = {}

    def admit(self, routing: Routing) -> Routing:
        """`routing` with only its canaried pairs; the others become exclusions saying why, and get a canary
        if they have none running. Pairs no longer in `routing` are forgotten (and their canary stopped)."""
        wanted = {pair_key(pair): pair for pair in routing.pairs}
        now = self._clock()
        for key in [key for key in self._pairs if key not in wanted]:
            gone = self._pairs.pop(key)
            if gone.task is not None:
                gone.task.cancel()
            if gone.verified:
                self._left[key] = now
        for key in [key for key, left in self._left.items() if now - left > self._remember_s]:
            del self._left[key]
        admitted: list[Pair] = []
        waiting: list[Exclusion] = []
        for key, pair in wanted.items():
            state = self._pairs.get(key)
            if state is None and self._left.pop(key, None) is not None:
                state = self._pairs[key] = _State(None, verified=True)
            if state is None:
                state = self._pairs[key] = _State(
                    asyncio.get_running_loop().create_task(self._run(key, pair))
                )
            if state.verified:
                admitted.append(pair)
                continue
            reason, why = (
                (
                    FAILED_REASON,
                    f"the last canary request failed: {state.failure}; retried every {self._retry_s:g} s",
                )
                if state.failure
                else (PENDING_REASON, "a canary request has not yet carried KV through this pair")
            )
            waiting.append(
                Exclusion(
                    prefill=pair.prefill.head_pod,
                    decode=pair.decode.pod,
                    reason=reason,
                    message=f"{pair.prefill.head_pod} ↔ {pair.decode.pod}: {why}",
                )
            )
        return replace(routing, pairs=tuple(admitted), exclusions=(*routing.exclusions, *waiting))

    def forget(self, engine_id: str) -> None:
        """Every pair with the engine `engine_id` must pass a canary again before it is admitted (the engine
        was ejected for its failures)."""
        for key in [key for key in self._pairs if _has_engine(key, engine_id)]:
            state = self._pairs.pop(key)
            if state.task is not None:
                state.task.cancel()
        for key in [key for key in self._left if _has_engine(key, engine_id)]:
            del self._left[key]

    def in_flight(self) -> bool:
        """A pair's canary is running: its first request, or the retries after a failed one (against real
        vLLM, the first request to a restarted engine often loses its handshake's 5 s window). A request
        may wait for it, within its queue bound, rather than fail at once for want of a pair."""
        return any(not state.verified for state in self._pairs.values())

    def verified(self, pair: Pair) -> bool:
        state = self._pairs.get(pair_key(pair))
        return state is not None and state.verified

    async def _run(self, key: PairKey, pair: Pair) -> None:
        while True:
            try:
                await self._probe(pair)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                state = self._pairs.get(key)
                if state is None:
                    return
                state.failure = str(exc) or type(exc).__name__
                log.warning(
                    "KV canary %s ↔ %s failed: %s", pair.prefill.head_pod, pair.decode.pod, state.failure
                )
                self._on_change()
                await asyncio.sleep(self._retry_s)
                continue
            state = self._pairs.get(key)
            if state is not None:
                state.verified, state.failure = True, ""
                log.info("KV canary %s ↔ %s: KV crossed the pair", pair.prefill.head_pod, pair.decode.pod)
                self._on_change()
            return

    async def close(self) -> None:
        tasks = [state.task for state in self._pairs.values() if state.task is not None]
        self._pairs.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
