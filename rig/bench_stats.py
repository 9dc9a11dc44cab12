"""The arithmetic of `disagg bench vllm`, apart from any engine: percentiles, one router's run at one
concurrency summed up, ratios between routers, and one request's time split hop by hop from Prometheus
histograms scraped before and after a run (the router's own and the engines').

Pure: every function takes what was measured or scraped and returns numbers; nothing here does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0..100) of `values` by linear interpolation between closest ranks; NaN when
    there are none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class Outcome:
    """One request as the client saw it: seconds to the first token, gaps between tokens, whether it failed
    (and why) and whether its text equals the monolithic answer."""

    ttft: float = math.nan
    gaps: list[float] = field(default_factory=list)
    error: str = ""
    matches: bool = False


@dataclass(frozen=True)
class LevelResult:
    """One way of serving (a router, or the legs sent directly) at one concurrency."""

    name: str
    concurrency: int
    requests: int
    failed: int
    wrong: int
    seconds: float
    ttft_p50: float
    ttft_p90: float
    itl_mean: float
    rss_mib: float = math.nan
    cpu_s: float = math.nan
    first_error: str = ""

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else math.nan


def summarize(
    name: str,
    concurrency: int,
    outcomes: Sequence[Outcome],
    seconds: float,
    *,
    rss_mib: float = math.nan,
    cpu_s: float = math.nan,
) -> LevelResult:
    """A level's numbers: TTFT percentiles and the mean inter-token gap over the requests that succeeded."""
    good = [o for o in outcomes if not o.error]
    gaps = [g for o in good for g in o.gaps]
    errors = [o.error for o in outcomes if o.error]
    return LevelResult(
        name=name,
        concurrency=concurrency,
        requests=len(outcomes),
        failed=len(errors),
        wrong=sum(1 for o in good if not o.matches),
        seconds=seconds,
        ttft_p50=percentile([o.ttft for o in good], 50),
        ttft_p90=percentile([o.ttft for o in good], 90),
        itl_mean=sum(gaps) / len(gaps) if gaps else math.nan,
        rss_mib=rss_mib,
        cpu_s=cpu_s,
        first_error=errors[0] if errors else "",
    )


def ratio(ours: float, theirs: float) -> float:
    """ours / theirs, NaN where either is unknown or theirs is 0."""
    if math.isnan(ours) or math.isnan(theirs) or theirs == 0:
        return math.nan
    return ours / theirs


def histogram(text: str, name: str, labels: Mapping[str, str] | None = None) -> tuple[float, float]:
    """(sum, count) of Prometheus histogram `name` in exposition `text`, over every sample whose labels
    include `labels` (vLLM labels each with its model and engine as well)."""
    totals = [0.0, 0.0]
    for index, suffix in enumerate(("_sum", "_count")):
        metric = name + suffix
        for line in text.splitlines():
            if not (line.startswith(metric + "{") or line.startswith(metric + " ")):
                continue
            head, _, value = line.rpartition(" ")
            if all(f'{key}="{val}"' in head for key, val in (labels or {}).items()):
                totals[index] += float(value)
    return totals[0], totals[1]


def mean_between(before: str, after: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """The mean of histogram `name` over the observations made between two scrapes; NaN if there were none."""
    sum0, count0 = histogram(before, name, labels)
    sum1, count1 = histogram(after, name, labels)
    return (sum1 - sum0) / (count1 - count0) if count1 > count0 else math.nan


# (label, source, histogram) of the hops, in the order a streamed request passes them. `router` is disagg's
# router's /metrics, `prefill` and `decode` the two engines' (vLLM's names).
ROUTER_HOPS: tuple[tuple[str, str, str], ...] = (
    ("router: arrival to both legs sent (parse, pick a pair)", "router", "disagg_router_dispatch_seconds"),
    ("prefill leg (sent to its answer checked)", "router", "disagg_router_prefill_leg_seconds"),
    ("  of which the prefill engine queued", "prefill", "vllm:request_queue_time_seconds"),
    ("  of which the prefill engine computed", "prefill", "vllm:request_prefill_time_seconds"),
    ("KV handoff and the decoder's first token", "router", "disagg_router_kv_wait_seconds"),
    # The decode leg is sent with the prefill leg: its wait for the KV overlaps the prefill leg.
    ("  decoder waited for the KV (from its leg's arrival)", "decode", "vllm:request_queue_time_seconds"),
    ("  of which the decoder's first step", "decode", "vllm:request_prefill_time_seconds"),
    ("time to first token at the router", "router", "disagg_router_time_to_first_token_seconds"),
    ("stream: each next token", "router", "disagg_router_inter_token_latency_seconds"),
    ("stream: the decode leg whole", "router", "disagg_router_decode_leg_seconds"),
)


def hop_split(
    before: Mapping[str, str], after: Mapping[str, str], hops: Sequence[tuple[str, str, str]] = ROUTER_HOPS
) -> list[tuple[str, float]]:
    """(label, mean seconds) of each hop over the requests between two scrapes of every source."""
    return [(label, mean_between(before[src], after[src], metric)) for label, src, metric in hops]


FIRST_TOKEN_HOPS: tuple[str, ...] = (
    "disagg_router_dispatch_seconds",
    "disagg_router_prefill_leg_seconds",
    "disagg_router_kv_wait_seconds",
)


def first_token_rest(before: str, after: str) -> float:
    """The router's mean time to first token less the mean hops that make it up one after another (dispatch,
    prefill leg, KV handoff): the router's forwarding of the first token, for streamed requests alone."""
    ttft = mean_between(before, after, "disagg_router_time_to_first_token_seconds")
    return ttft - sum(mean_between(before, after, name) for name in FIRST_TOKEN_HOPS)
