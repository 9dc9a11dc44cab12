"""The router's Prometheus metrics (its own registry, served at `/metrics`) and the clock of one request.

Every label is bounded: `endpoint` is the request path (two completion routes), `outcome` and `reason` come
from fixed sets (`ok`, a `Fault`'s name, the CamelCase reasons of `RouterError`), `role` is prefill or decode,
and the per-engine gauges name engines and pods, which the deployment's size bounds. No request id, prompt or
model text is ever a label.

The latency histograms, each measured by the router's monotonic clock from what it forwards, streamed
requests only where a first token must be seen (a non-streamed answer arrives whole, so its first token is
not observable; `request_duration_seconds` is its latency):

- `time_to_first_token_seconds`: the request's arrival (its handler starts) to the first SSE data event that
  carries a choice, as the router forwards it to the client.
- `inter_token_latency_seconds`: between two consecutive such events (one event is one token for vLLM and
  the reference engine; the final usage-only event and `[DONE]` are not counted).
- `request_duration_seconds{outcome}`: arrival to the response's end, every request, failed ones too.
- `dispatch_seconds`: arrival to both legs sent: the body read and parsed, a pair chosen (a wait for a decoder
  with room included), the legs built. The router's own share of the time to first token.
- `prefill_leg_seconds`: the prefill leg sent to its answer read and checked (the engine holds the KV).
- `kv_wait_seconds`: the prefill's answer to the decoder's first data event, i.e. the rest of the KV push
  after the prefill answered plus the decoder's first step (0 when the first event comes before the answer,
  which the push protocol makes a matter of a few milliseconds).
- `decode_leg_seconds`: the decode leg sent to its answer complete (`[DONE]`, or the whole JSON body).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from disagg.worker.contracts.pairing import Routing
from disagg.worker.router.admission import Admission
from disagg.worker.router.balance import Balancer
from disagg.worker.router.protocol import Fault
from disagg.worker.router.server import ConnectionGate

LEG_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# The router's own work per request is sub-millisecond unless it queues for a decoder.
DISPATCH_BUCKETS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0, 10.0)
# vLLM's own TTFT and inter-token buckets (vllm/v1/metrics/loggers.py), so the two compare bucket by bucket.
TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# vLLM's e2e request-latency buckets, with finer ones below 0.3 s for short and failed requests.
DURATION_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
OK: Final = "ok"
DISCONNECTED: Final = "disconnected"
"""The `outcome` of a request whose client went away (its reason is `ClientDisconnected`)."""


def fault_outcome(fault: Fault) -> str:
    """A failed request's `outcome` label: whose fault it was (client, upstream, unavailable, timeout)."""
    return fault.name.lower()


@dataclass
class RequestClock:
    """When one client request arrived, and what of it the metrics have seen so far (monotonic seconds)."""

    endpoint: str
    arrived: float
    prefill_answered: float | None = None
    last_token: float | None = None


@dataclass(frozen=True)
class RouterState:
    """What the scrape-time gauges read: the router's live objects, the routing through a getter."""

    balancer: Balancer
    admission: Admission
    gate: ConnectionGate
    routing: Callable[[], Routing | None]


class RouterMetrics(Collector):
    """The router's metrics in its own registry; outstanding work and pairs are read at scrape time."""

    def __init__(self, state: RouterState) -> None:
        self.state = state
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "disagg_router_requests",
            "Client requests by endpoint and outcome (ok, or the CamelCase reason it failed).",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.failures = Counter(
            "disagg_router_request_failures",
            "Failed client requests by endpoint and CamelCase reason (ClientDisconnected included).",
            ["endpoint", "reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "disagg_router_time_to_first_token_seconds",
            "Streamed requests: arrival to the first SSE data event with a choice forwarded to the client.",
            ["endpoint"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "disagg_router_inter_token_latency_seconds",
            "Streamed requests: between consecutive SSE data events with a choice forwarded to the client.",
            ["endpoint"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "disagg_router_request_duration_seconds",
            "Arrival to the end of the response, by endpoint and outcome (ok, client, upstream, unavailable, "
            "timeout, disconnected).",
            ["endpoint", "outcome"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.dispatch = Histogram(
            "disagg_router_dispatch_seconds",
            "Client requests: arrival to both legs sent (body read and parsed, pair chosen, legs built).",
            ["endpoint"],
            buckets=DISPATCH_BUCKETS,
            registry=r,
        )
        self.prefill_leg = Histogram(
            "disagg_router_prefill_leg_seconds",
            "Client requests' prefill legs: sent to their answer read and checked (the engine holds the KV).",
            ["endpoint"],
            buckets=LEG_BUCKETS,
            registry=r,
        )
        self.kv_wait = Histogram(
            "disagg_router_kv_wait_seconds",
            "Streamed requests: the prefill leg's answer to the decoder's first data event (the rest of the "
            "KV push and the first decode step).",
            ["endpoint"],
            buckets=LEG_BUCKETS,
            registry=r,
        )
        self.decode_leg = Histogram(
            "disagg_router_decode_leg_seconds",
            "Client requests' decode legs that completed: sent to the answer's end.",
            ["endpoint"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.recomputed_requests = Counter(
            "disagg_router_recomputed_requests",
            "Client requests served again by the decoder alone because their transferred KV is known to be "
            "wrong, by endpoint and CamelCase reason (WindowEdge: the prompt's length loses a sliding "
            "window's first key on engines with that defect).",
            ["endpoint", "reason"],
            registry=r,
        )
        r.register(self)

    # --- one request's clock --------------------------------------------------------------------------------

    def clock(self, endpoint: str) -> RequestClock:
        return RequestClock(endpoint, time.monotonic())

    def dispatched(self, clock: RequestClock) -> None:
        """Both legs of the request are about to be sent."""
        self.dispatch.labels(clock.endpoint).observe(time.monotonic() - clock.arrived)

    def prefill_answered(self, clock: RequestClock, sent: float) -> None:
        clock.prefill_answered = now = time.monotonic()
        self.prefill_leg.labels(clock.endpoint).observe(now - sent)

    def token_event(self, clock: RequestClock) -> None:
        """The router forwarded a data event carrying a choice (a token) to a streaming client."""
        now = time.monotonic()
        if clock.last_token is None:
            self.ttft.labels(clock.endpoint).observe(now - clock.arrived)
            if clock.prefill_answered is not None:
                self.kv_wait.labels(clock.endpoint).observe(max(0.0, now - clock.prefill_answered))
        else:
            self.itl.labels(clock.endpoint).observe(now - clock.last_token)
        clock.last_token = now

    def recomputed(self, clock: RequestClock, reason: str) -> None:
        self.recomputed_requests.labels(clock.endpoint, reason).inc()

    def decode_complete(self, clock: RequestClock, sent: float) -> None:
        self.decode_leg.labels(clock.endpoint).observe(time.monotonic() - sent)

    def succeeded(self, clock: RequestClock) -> None:
        self._end(clock, OK, OK)

    def failed(self, clock: RequestClock, reason: str, outcome: str) -> None:
        """The request ended with `reason` (a RouterError's, or ClientDisconnected); `outcome` is
        `fault_outcome(fault)` or `DISCONNECTED`."""
        self.failures.labels(clock.endpoint, reason).inc()
        self._end(clock, reason, outcome)

    def _end(self, clock: RequestClock, reason: str, outcome: str) -> None:
        self.requests.labels(clock.endpoint, reason).inc()
        self.duration.labels(clock.endpoint, outcome).observe(time.monotonic() - clock.arrived)

    # --- read at scrape time --------------------------------------------------------------------------------

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        state = self.state
        balancer, routing = state.balancer, state.routing()
        in_flight = GaugeMetricFamily(
            "disagg_router_in_flight_requests",
            "Legs the router has sent and not yet seen end, per role (the sum of the per-engine legs).",
            labels=["role"],
        )
        in_flight.add_metric(["prefill"], sum(balancer.prefill_legs.values()))
        in_flight.add_metric(["decode"], sum(balancer.decode_legs.values()))
        yield in_flight
        legs = GaugeMetricFamily(
            "disagg_router_outstanding_legs", "Legs in flight per engine.", labels=["role", "engine"]
        )
        for engine, n in sorted(balancer.prefill_legs.items()):
            legs.add_metric(["prefill", engine], n)
        for pod, n in sorted(balancer.decode_legs.items()):
            legs.add_metric(["decode", pod], n)
        yield legs
        weight = GaugeMetricFamily(
            "disagg_router_outstanding_prefill_weight",
            "Summed prompt weight (characters or token ids) of the prefill legs in flight, per engine.",
            labels=["engine"],
        )
        for engine, n in sorted(balancer.prefill_weight.items()):
            weight.add_metric([engine], n)
        yield weight
        yield GaugeMetricFamily(
            "disagg_router_routable_pairs",
            "(prefill engine, decoder) pairs the router sends requests to.",
            value=0 if routing is None else len(routing.pairs),
        )
        excluded = GaugeMetricFamily(
            "disagg_router_excluded_pairs", "Pairs the router does not use, by reason.", labels=["reason"]
        )
        reasons: dict[str, int] = {}
        for exclusion in () if routing is None else routing.exclusions:
            reasons[exclusion.reason] = reasons.get(exclusion.reason, 0) + 1
        for reason, n in sorted(reasons.items()):
            excluded.add_metric([reason], n)
        yield excluded
        yield GaugeMetricFamily(
            "disagg_router_queued_requests",
            "Requests waiting for a decoder with room (none of their legs sent yet).",
            value=state.admission.queued,
        )
        yield GaugeMetricFamily(
            "disagg_router_client_connections",
            "Client connections open (each counts against --max-connections).",
            value=state.gate.open,
        )
        yield CounterMetricFamily(
            "disagg_router_refused_connections",
            "Client connections refused with 503 because --max-connections were open.",
            value=state.gate.refused,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
