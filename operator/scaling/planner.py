"""The planner: from a role's recorded metric samples, its replica count in effect and its autoscaling
spec, the count it should have and why. Pure.

The rule is a HorizontalPodAutoscaler's: each tick recommends `ceil(current * metric / target)` (for the
per-deployment totals, running requests and prompt tokens per second, `ceil(total / target)`), or keeps
`current` while the metric is within `tolerance` of its target (hysteresis: no flapping around it). The
recommendations are stabilized over the spec's windows, as the HPA's `behavior` does: the count goes up to
the lowest recommendation of the scale-up window (0 s by default: at once) and down only to the highest of
the scale-down window (300 s by default), so a dip does not remove a replica and a spike adds it at once.
Then the bounds. A role whose metrics are missing (no router answered, too few samples) holds its count
and says so.

A histogram target (TTFT, inter-token latency) is the p90 of the bucket increases over the metric window,
not of the cumulative counts (which would remember every request since the router started). A window with
no request in it reads as no load: its p90 is 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from disagg.operator.api import MAX_REPLICAS, DecodeAutoscaling, PrefillAutoscaling, Role
from disagg.operator.scaling import signals
from disagg.operator.scaling.signals import Sample

SCALED_UP: Final = "ScaledUp"
SCALED_DOWN: Final = "ScaledDown"
AT_MAX: Final = "AtMaxReplicas"
METRICS_MISSING: Final = "MetricsMissing"
STABLE: Final = "Stable"
QUANTILE: Final = 0.9
# More than any role may have: what a recommendation past every bound (an infinite ratio) reads as.
_BEYOND: Final = MAX_REPLICAS + 1

Recommendations = tuple[tuple[float, int, bool], ...]
"""(when, count, seeded) of the planner's past recommendations, oldest first; a seeded one is the count in
effect when the planner began, which holds a scale-down back but not a scale-up."""


@dataclass(frozen=True)
class Measure:
    """What the metric reads against its target: `value` is per replica unless `total`."""

    name: str
    value: float | None
    target: float
    total: bool = False
    unit: str = ""

    def describe(self) -> str:
        shown = "missing" if self.value is None else f"{self.value:.3g}{self.unit}"
        return f"{self.name} {shown} (target {self.target:g}{self.unit})"


@dataclass(frozen=True)
class Decision:
    role: Role
    current: int
    desired: int
    reason: str
    message: str

    @property
    def changed(self) -> bool:
        return self.desired != self.current


def measure(
    role: Role, scaling: PrefillAutoscaling | DecodeAutoscaling, samples: Sequence[Sample], now: float
) -> Measure:
    """The role's target metric over the spec's metric window; a NaN (what sums and differences of a
    hostile page's huge values can make) reads as missing."""
    m = _measure(role, scaling, signals.within(samples, scaling.metric_window_seconds, now))
    if m.value is not None and math.isnan(m.value):
        return Measure(m.name, None, m.target, m.total, m.unit)
    return m


def _measure(
    role: Role, scaling: PrefillAutoscaling | DecodeAutoscaling, window: Sequence[Sample]
) -> Measure:
    over = f" p90 over {scaling.metric_window_seconds}s"
    if isinstance(scaling, PrefillAutoscaling):
        assert scaling.target is not None
        if scaling.target.ttft_p90_seconds is not None:
            value, _ = signals.window_quantile(QUANTILE, window, "ttft")
            return Measure("TTFT" + over, _latency(value, window), scaling.target.ttft_p90_seconds, unit="s")
        assert scaling.target.prompt_tokens_per_second is not None
        rate = signals.prompt_token_rate(window, role)
        return Measure("prompt tokens/s", rate, scaling.target.prompt_tokens_per_second, total=True)
    assert scaling.target is not None
    target = scaling.target
    if target.inter_token_latency_p90_seconds is not None:
        value, _ = signals.window_quantile(QUANTILE, window, "itl")
        return Measure(
            "inter-token latency" + over,
            _latency(value, window),
            target.inter_token_latency_p90_seconds,
            unit="s",
        )
    if target.kv_cache_usage is not None:
        return Measure("KV-cache usage", signals.mean_kv_usage(window, role), target.kv_cache_usage)
    assert target.running_requests is not None
    return Measure(
        "running requests", signals.mean_in_flight(window, role), target.running_requests, total=True
    )


def _latency(value: float | None, window: Sequence[Sample]) -> float | None:
    # Two scrapes with a router at both ends and no request between them: no load, not missing metrics.
    if value is None and len(window) >= 2 and set(window[0].routers) & set(window[-1].routers):
        return 0.0
    return value


def recommend(m: Measure, current: int, tolerance: float) -> int:
    """This tick's count, before stabilization and bounds. A page's value or a target at the float edges
    (1e308 legs in flight, a target of 5e-324) makes an infinite ratio: it recommends more than any bound,
    never a count `ceil` cannot make."""
    assert m.value is not None
    per_replica = m.value / current if m.total and current > 0 else m.value
    ratio = per_replica / m.target
    if current > 0 and abs(ratio - 1.0) <= tolerance:
        return current
    wanted = m.value / m.target if m.total else max(current, 1) * ratio
    return math.ceil(min(max(wanted - 1e-9, 0.0), _BEYOND))


def plan(
    role: Role,
    scaling: PrefillAutoscaling | DecodeAutoscaling,
    samples: Sequence[Sample],
    current: int,
    history: Recommendations,
    now: float,
) -> tuple[Decision, Recommendations]:
    """The count the role should have, and the recommendations to remember for the next tick. `current` is
    the count in effect (the last decision, or the spec's replicas at first)."""
    low, high = scaling.bounds
    m = measure(role, scaling, samples, now)
    if m.value is None:
        desired = min(max(current, low), high)
        reason = METRICS_MISSING if desired == current else _direction(current, desired)
        return Decision(role, current, desired, reason, f"{role}: holds {desired}: {m.describe()}"), history
    raw = recommend(m, current, scaling.tolerance)
    # The first tick remembers the count in effect too, so a scale-down waits a whole window after a
    # (re)start of the operator, which forgot what it recommended before.
    seed: Recommendations = ((now, current, True),) if not history else ()
    keep = max(scaling.scale_up_stabilization_window_seconds, scaling.scale_down_stabilization_window_seconds)
    remembered = (*(r for r in (*history, *seed) if now - r[0] <= keep), (now, raw, False))
    up_window = scaling.scale_up_stabilization_window_seconds
    down_window = scaling.scale_down_stabilization_window_seconds
    up = min(n for t, n, seeded in remembered if now - t <= up_window and not seeded)
    down = max(n for t, n, _ in remembered if now - t <= down_window)
    stabilized = up if up > current else down if down < current else current
    desired = min(max(stabilized, low), high)
    reason = AT_MAX if raw > high and desired == high else _direction(current, desired)
    said = f"{role}: {current} -> {desired}" if desired != current else f"{role}: {desired}"
    detail = f"{said}: {m.describe()}, recommends {raw}"
    if stabilized != raw:
        window = (
            scaling.scale_down_stabilization_window_seconds
            if raw < current
            else scaling.scale_up_stabilization_window_seconds
        )
        detail += f", {stabilized} over the {window}s stabilization window"
    detail += f" (bounds {low}-{high})"
    return Decision(role, current, desired, reason, detail), remembered


def _direction(current: int, desired: int) -> str:
    return SCALED_UP if desired > current else SCALED_DOWN if desired < current else STABLE
