"""The reference engine server's Prometheus metrics (its own registry, served at `/metrics`).

The block gauges read the scheduler when scraped, so a test or an operator sees what is held right now:
`disagg_engine_kv_blocks_free` back at `disagg_engine_kv_blocks_usable` means no request holds any block.

What vLLM also measures is exported under vLLM's names, types and labels (`model_name`, the served model,
and `engine`, the engine core's index in its process: always "0" here, one core per process), as vLLM 0.33
defines them in `vllm/v1/metrics/loggers.py`, so one dashboard and one autoscaler serve both engines:

- `vllm:num_requests_running` (gauge): requests in model execution: prefilling, decoding, or a whole
  request running here.
- `vllm:num_requests_waiting` (gauge): requests admitted but not executing: decode legs waiting for their
  KV to arrive (vLLM's WAITING_FOR_REMOTE_KVS, which it counts as waiting) and requests waiting for free
  KV blocks. A prefill's blocks held for the push are neither (vLLM: a finished request's blocks).
- `vllm:kv_cache_usage_perc` (gauge, 0-1): 1 - free / usable blocks (vLLM's `BlockPool.get_usage`, which
  does not count the null block either).
- `vllm:prompt_tokens_total` (counter): every request's prompt length, counted at its first token (vLLM
  counts a prompt served from the cache or the KV transfer too: a decode leg's prompt is counted).
- `vllm:generation_tokens_total` (counter): tokens generated (a prefill leg's one token too).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from disagg.worker.engine.scheduler import STATES, BlockScheduler

VLLM_LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.labels = labels = (model_name, ENGINE_INDEX)
        # The scheduler's gauges have a sample only once `watch` gives them a scheduler: a PP engine's
        # other stages (headless) schedule nothing, and vLLM's engine exports them once, not per stage.
        self.running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            VLLM_LABELS,
            registry=r,
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            VLLM_LABELS,
            registry=r,
        )
        self.kv_cache_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            VLLM_LABELS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", VLLM_LABELS, registry=r
        ).labels(*labels)
        self.tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", VLLM_LABELS, registry=r
        ).labels(*labels)
        self.waiting_for_blocks = 0
        """Requests whose admission waits for free KV blocks (set on the event loop)."""
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

        def running() -> float:
            s = scheduler()
            if s is None:
                return 0.0
            counts = s.counts()
            return float(counts["prefilling"] + counts["decoding"] + counts["running"])

        def waiting() -> float:
            s = scheduler()
            return float(self.waiting_for_blocks + (0 if s is None else s.counts()["awaiting_kv"]))

        def usage() -> float:
            s = scheduler()
            return 0.0 if s is None or s.usable_blocks <= 0 else 1.0 - s.free_blocks / s.usable_blocks

        self.running.labels(*self.labels).set_function(running)
        self.waiting.labels(*self.labels).set_function(waiting)
        self.kv_cache_usage.labels(*self.labels).set_function(usage)

    def render(self) -> bytes:
        return generate_latest(self.registry)
