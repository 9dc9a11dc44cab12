"""What the planner reads of the router's and the engines' Prometheus metrics: one `Sample` per scrape, and
the figures over a window of samples (a histogram's quantile from its bucket increases, a gauge's mean, a
counter's rate). Pure: the text comes from `control/`. A page that is not Prometheus text raises `ValueError`
(the caller counts that pod as not answering); a NaN or infinite value is no reading and is skipped.

What a page may hold is bounded before it is kept: only the roles' legs in flight, the legs of the
deployment's own engines, and at most `MAX_BUCKETS` bucket bounds per histogram (a page with more is not the
router's, and raises `ValueError`); a sample stored for the window (`Sample.kept`) keeps only the
histograms a target reads and no legs, so the planner's memory per deployment is bounded by its pods and
windows, not by what a pod's page holds.

Counters and histograms are cumulative and per process: a window's figure is the difference between its
last and first sample, bucket by bucket; a value that went down is a restarted process, whose new count is
the whole increase (as Prometheus's `increase` reads a reset).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from prometheus_client.parser import text_string_to_metric_families

TTFT: Final = "disagg_router_time_to_first_token_seconds"
ITL: Final = "disagg_router_inter_token_latency_seconds"
IN_FLIGHT: Final = "disagg_router_in_flight_requests"
OUTSTANDING: Final = "disagg_router_outstanding_legs"
QUEUED: Final = "disagg_router_queued_requests"
KV_USAGE: Final = "vllm:kv_cache_usage_perc"
PROMPT_TOKENS: Final = "vllm:prompt_tokens"

# The router's histograms have about twenty; a page past this bound is not one of its pages.
MAX_BUCKETS: Final = 64
ROLE_NAMES: Final = ("prefill", "decode")
Histogram = Literal["ttft", "itl"]

Buckets = tuple[tuple[float, float], ...]
"""A histogram's cumulative counts by upper bound (`le`), ascending, +Inf last."""


@dataclass(frozen=True)
class RouterSample:
    """One router's metrics at one scrape."""

    ttft: Buckets = ()
    itl: Buckets = ()
    in_flight: Mapping[str, float] = field(default_factory=dict)
    """Legs in flight per role."""
    legs: Mapping[tuple[str, str], float] = field(default_factory=dict)
    """Legs in flight per (role, engine): a prefill engine id or a decode pod."""
    queued: float = 0.0
    """Requests waiting for a decoder with room: demand the decoders do not hold yet."""


@dataclass(frozen=True)
class EngineSample:
    """One engine pod's `vllm:*` metrics at one scrape."""

    kv_usage: float | None = None
    prompt_tokens: float | None = None


@dataclass(frozen=True)
class Sample:
    """Everything scraped for one deployment at `at` (seconds on the operator's clock): per router pod and
    per engine (a prefill engine id or a decode pod), what answered."""

    at: float
    routers: Mapping[str, RouterSample] = field(default_factory=dict)
    engines: Mapping[tuple[str, str], EngineSample] = field(default_factory=dict)
    """Per (role, engine): a prefill engine's head pod's metrics, a decode pod's."""

    def busy(self) -> frozenset[str]:
        """Engines (prefill engine ids, decode pods) some router has a leg in flight on."""
        return frozenset(engine for r in self.routers.values() for (_, engine), n in r.legs.items() if n > 0)

    def kept(self, histograms: Collection[Histogram]) -> Sample:
        """What the window needs of this sample: the named histograms, and no legs (only the newest
        sample's busy engines are read, before it is stored)."""
        routers = {
            address: dataclasses.replace(
                router,
                ttft=router.ttft if "ttft" in histograms else (),
                itl=router.itl if "itl" in histograms else (),
                legs={},
            )
            for address, router in self.routers.items()
        }
        return Sample(self.at, routers, self.engines)


def _buckets(samples: Iterable[tuple[str, Mapping[str, str], float]], name: str) -> Buckets:
    """Cumulative bucket counts summed over every label set (endpoints) of one histogram."""
    summed: dict[float, float] = {}
    for sample_name, labels, value in samples:
        if sample_name == f"{name}_bucket" and "le" in labels:
            try:
                bound = float(labels["le"])
            except ValueError:
                raise ValueError(f"{name}: bucket bound {labels['le']!r} is not a number") from None
            summed[bound] = summed.get(bound, 0.0) + value
            if len(summed) > MAX_BUCKETS:
                raise ValueError(f"{name}: more than {MAX_BUCKETS} bucket bounds")
    return tuple(sorted(summed.items()))


def parse_router(text: str, engines: Collection[str] | None = None) -> RouterSample:
    """The router's `/metrics` (Prometheus text) as what the planner reads of it: the legs of `engines`
    only (every engine's when None)."""
    flat = [(name, labels, value) for name, labels, value in _samples(text) if math.isfinite(value)]
    in_flight = {
        labels["role"]: v
        for name, labels, v in flat
        if name == IN_FLIGHT and labels.get("role") in ROLE_NAMES
    }
    legs = {
        (labels["role"], labels["engine"]): v
        for name, labels, v in flat
        if name == OUTSTANDING
        and labels.get("role") in ROLE_NAMES
        and "engine" in labels
        and (engines is None or labels["engine"] in engines)
    }
    queued = sum(v for name, _, v in flat if name == QUEUED)
    return RouterSample(_buckets(flat, TTFT), _buckets(flat, ITL), in_flight, legs, queued)


def parse_engine(text: str) -> EngineSample:
    """An engine's `/metrics` (the reference engine's or vLLM's `vllm:*` names)."""
    usage: float | None = None
    prompt: float | None = None
    for name, _, value in _samples(text):
        if not math.isfinite(value):
            continue  # NaN or Inf is no reading; the window's other samples speak
        if name == KV_USAGE:
            usage = max(usage or 0.0, value)
        elif name == f"{PROMPT_TOKENS}_total":
            prompt = (prompt or 0.0) + value
    return EngineSample(usage, prompt)


def _samples(text: str) -> list[tuple[str, Mapping[str, str], float]]:
    """Every sample of a Prometheus text page; a page that is not one raises `ValueError`."""
    return [
        (s.name, s.labels, float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def within(samples: Sequence[Sample], window_s: float, now: float) -> list[Sample]:
    """The samples of the last `window_s` seconds, oldest first."""
    return [s for s in samples if now - window_s <= s.at <= now]


def _increase(first: float, last: float) -> float:
    return last - first if last >= first else last


def histogram_increase(first: Buckets, last: Buckets) -> Buckets:
    """The bucket counts observed between two scrapes of one process's histogram."""
    before = dict(first)
    return tuple((bound, _increase(before.get(bound, 0.0), count)) for bound, count in last)


def quantile(q: float, buckets: Buckets) -> float | None:
    """`histogram_quantile`: linear within the bucket the rank falls in; None without observations. A rank
    in the +Inf bucket reads as the highest finite bound (Prometheus does the same)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def window_quantile(q: float, samples: Sequence[Sample], histogram: Histogram) -> tuple[float | None, float]:
    """The q-quantile of a router histogram (`"ttft"` or `"itl"`) over the samples, summed over the routers
    present at both ends, and how many observations it is from; (None, 0) without two samples."""
    if len(samples) < 2:
        return None, 0.0
    first, last = samples[0], samples[-1]
    total: dict[float, float] = {}
    for router, sample in last.routers.items():
        before = first.routers.get(router)
        if before is None:
            continue
        increase = histogram_increase(getattr(before, histogram), getattr(sample, histogram))
        for bound, count in increase:
            total[bound] = total.get(bound, 0.0) + count
    buckets = tuple(sorted(total.items()))
    observed = buckets[-1][1] if buckets else 0.0
    return quantile(q, buckets), observed


def mean_in_flight(samples: Sequence[Sample], role: str) -> float | None:
    """Legs in flight on `role`, summed over the routers, averaged over the samples; for decode, with the
    requests queued for a decoder with room (the router holds them back at a decoder's capacity)."""
    values = [
        sum(r.in_flight.get(role, 0.0) + (r.queued if role == "decode" else 0.0) for r in s.routers.values())
        for s in samples
        if s.routers
    ]
    return sum(values) / len(values) if values else None


def mean_kv_usage(samples: Sequence[Sample], role: str = "decode") -> float | None:
    """The role's KV-cache usage, averaged over its engines and the samples."""
    values = [
        e.kv_usage for s in samples for (r, _), e in s.engines.items() if r == role and e.kv_usage is not None
    ]
    return sum(values) / len(values) if values else None


def prompt_token_rate(samples: Sequence[Sample], role: str = "prefill") -> float | None:
    """The role's prompt tokens per second over the window, summed over its engines present at both ends."""
    if len(samples) < 2 or samples[-1].at <= samples[0].at:
        return None
    first, last = samples[0], samples[-1]
    increase = 0.0
    counted = False
    for engine, sample in last.engines.items():
        before = first.engines.get(engine)
        if engine[0] != role:
            continue
        if before is None or before.prompt_tokens is None or sample.prompt_tokens is None:
            continue
        increase += _increase(before.prompt_tokens, sample.prompt_tokens)
        counted = True
    return increase / (last.at - first.at) if counted else None
