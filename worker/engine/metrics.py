"""The reference engine server's Prometheus metrics (its own registry, served at `/metrics`).

The block gauges read the scheduler when scraped, so a test or an operator sees what is held right now:
`disagg_engine_kv_blocks_free` back at `disagg_engine_kv_blocks_usable` means no request holds any block.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from disagg.worker.engine.scheduler import STATES, BlockScheduler


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ready = Gauge("disagg_engine_ready", "1 when the engine serves requests", registry=r)
        self.blocks_usable = Gauge(
            "disagg_engine_kv_blocks_usable", "KV block ids the scheduler can hand out", registry=r
        )
        self.blocks_free = Gauge("disagg_engine_kv_blocks_free", "KV block ids free now", registry=r)
        self.requests_holding = Gauge(
            "disagg_engine_requests_holding_blocks",
            "Requests holding KV blocks, by what they wait for",
            ["state"],
            registry=r,
        )
        self.requests = Counter(
            "disagg_engine_requests",
            "Requests answered, by endpoint, leg and outcome",
            ["endpoint", "leg", "outcome"],
            registry=r,
        )
        self.kv_events = Counter(
            "disagg_engine_kv_events",
            "Sidecar events received, by kind and reason",
            ["event", "reason"],
            registry=r,
        )
        self.tokens = Counter("disagg_engine_generated_tokens", "Tokens generated", registry=r)

    def watch(self, scheduler: Callable[[], BlockScheduler | None]) -> None:
        """Read the block gauges from the scheduler at each scrape (0 until there is one)."""

        def read(attr: str) -> Callable[[], float]:
            def value() -> float:
                s = scheduler()
                return 0.0 if s is None else float(getattr(s, attr))

            return value

        self.blocks_usable.set_function(read("usable_blocks"))
        self.blocks_free.set_function(read("free_blocks"))
        for state in STATES:

            def count(state: str = state) -> float:
                s = scheduler()
                return 0.0 if s is None else float(s.counts().get(state, 0))  # type: ignore[call-overload]

            self.requests_holding.labels(state).set_function(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
