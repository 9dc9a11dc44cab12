"""The planner's decisions over recorded metric series: the HPA rule and its tolerance (hysteresis), the
stabilization windows, the bounds, a role whose metrics are missing, and a p90 from bucket increases."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from pydantic import ValidationError

from disagg.operator.api import (
    DecodeAutoscaling,
    PrefillAutoscaling,
    ScalingMode,
    old_spellings,
    scaling_mode,
)
from disagg.operator.control.ticks import planned
from disagg.operator.crd import build_crd
from disagg.operator.scaling import planner, signals
from disagg.operator.scaling.planner import Decision, Recommendations
from disagg.operator.scaling.signals import Buckets, EngineSample, RouterSample, Sample

ROUTER = "10.0.0.1:8000"


def decode_scaling(**fields: object) -> DecodeAutoscaling:
    base: dict[str, object] = {
        "maxReplicas": 4,
        "target": {"runningRequests": 4},
        "scaleDownStabilizationWindowSeconds": 30,
        "metricWindowSeconds": 10,
    }
    return DecodeAutoscaling.model_validate({**base, **fields})


def in_flight(series: Sequence[float], step: float = 5.0) -> list[Sample]:
    """A router reporting `series[k]` decode legs in flight at k * step seconds."""
    return [
        Sample(k * step, {ROUTER: RouterSample(in_flight={"decode": v, "prefill": 0.0})})
        for k, v in enumerate(series)
    ]


def run(
    scaling: DecodeAutoscaling | PrefillAutoscaling,
    samples: Sequence[Sample],
    start: int,
    role: str = "decode",
) -> list[Decision]:
    """The planner ticking once per sample, each decision the next tick's count."""
    current, history = start, Recommendations()
    decisions = []
    for k in range(len(samples)):
        decision, history = planner.plan(
            "decode" if role == "decode" else "prefill",
            scaling,
            samples[: k + 1],
            current,
            history,
            samples[k].at,
        )
        decisions.append(decision)
        current = decision.desired
    return decisions


def test_a_load_step_scales_up_at_once_and_down_only_after_the_window() -> None:
    series = [1] * 3 + [24] * 6 + [1] * 12
    decisions = run(decode_scaling(), in_flight(series), 1)
    counts = [d.desired for d in decisions]
    # Up on the first tick whose window mean asks for more, capped at maxReplicas.
    first_up = next(k for k, n in enumerate(counts) if n > 1)
    assert first_up == 3 and max(counts) == 4
    assert decisions[first_up].reason == planner.SCALED_UP
    assert "AtMaxReplicas" in {d.reason for d in decisions}
    # Load falls at t=45 s; with a 30 s scale-down window the count holds at least that long.
    down = next(k for k, n in enumerate(counts) if k > first_up and n < 4)
    assert down * 5.0 - 45.0 >= 30.0
    assert decisions[down].reason == planner.SCALED_DOWN
    assert counts[-1] == 1


def test_the_tolerance_keeps_the_count_near_the_target() -> None:
    # 2 decoders at 4.3 and 3.7 requests each: within 10% of 4, nothing moves (hysteresis).
    for total in (8.6, 7.4):
        decision, _ = planner.plan("decode", decode_scaling(), in_flight([total, total]), 2, (), 5.0)
        assert (decision.desired, decision.reason) == (2, planner.STABLE)
    decision, _ = planner.plan("decode", decode_scaling(), in_flight([9.2, 9.2]), 2, (), 5.0)
    assert (decision.desired, decision.reason) == (3, planner.SCALED_UP)


def test_an_oscillating_load_does_not_flap() -> None:
    series = [14, 2] * 12
    counts = [1] + [d.desired for d in run(decode_scaling(metricWindowSeconds=1), in_flight(series), 1)]
    # Up once, then held by the scale-down window: never back and forth.
    changes = sum(1 for a, b in itertools.pairwise(counts) if a != b)
    assert changes == 1 and counts[-1] == 4


def test_bounds_hold_both_ways() -> None:
    scaling = decode_scaling(minReplicas=2, maxReplicas=3, scaleDownStabilizationWindowSeconds=0)
    up = run(scaling, in_flight([40, 40]), 2)
    assert [d.desired for d in up] == [3, 3] and up[-1].reason == planner.AT_MAX
    down = run(scaling, in_flight([0, 0, 0]), 3)
    assert down[-1].desired == 2
    # A count outside the bounds (the spec's bounds changed) is brought inside them.
    decision, _ = planner.plan("decode", scaling, in_flight([8, 8]), 6, (), 5.0)
    assert decision.desired == 3


def test_missing_metrics_hold_the_count_and_say_so() -> None:
    no_router = [Sample(0.0), Sample(5.0)]
    decision, history = planner.plan("decode", decode_scaling(), no_router, 3, (), 5.0)
    assert (decision.desired, decision.reason) == (3, planner.METRICS_MISSING)
    assert "missing" in decision.message and history == ()
    # An engine target with no engine answering: the same.
    kv = decode_scaling(target={"kvCacheUsage": 0.7})
    decision, _ = planner.plan("decode", kv, in_flight([3, 3]), 2, (), 5.0)
    assert decision.reason == planner.METRICS_MISSING


def test_the_first_tick_after_a_restart_waits_a_window_to_scale_down() -> None:
    scaling = decode_scaling(scaleDownStabilizationWindowSeconds=20)
    decisions = run(scaling, in_flight([0] * 8), 4)
    counts = [d.desired for d in decisions]
    assert counts[:5] == [4] * 5 and counts[5] == 1


def _hist(bounds: Sequence[float], counts: Sequence[float]) -> Buckets:
    return tuple(zip([*bounds, float("inf")], counts, strict=True))


def ttft(at: float, counts: Sequence[float]) -> Sample:
    return Sample(at, {ROUTER: RouterSample(ttft=_hist((0.1, 0.5, 1.0), counts))})


def test_the_p90_comes_from_bucket_increases_over_the_window_not_the_cumulative_counts() -> None:
    # 1,000 fast requests long ago, then 10 slow ones inside the window.
    old = ttft(0.0, (1000, 1000, 1000, 1000))
    start = ttft(100.0, (1000, 1000, 1000, 1000))
    end = ttft(110.0, (1000, 1000, 1010, 1010))
    value, observed = signals.window_quantile(0.9, [start, end], "ttft")
    assert observed == 10 and value == pytest.approx(0.95)
    cumulative = signals.quantile(0.9, end.routers[ROUTER].ttft)
    assert cumulative is not None and cumulative < 0.1
    scaling = PrefillAutoscaling.model_validate(
        {"maxReplicas": 4, "target": {"ttftP90Seconds": 0.5}, "metricWindowSeconds": 15}
    )
    decision, _ = planner.plan("prefill", scaling, [old, start, end], 1, (), 110.0)
    assert (decision.desired, decision.reason) == (2, planner.SCALED_UP)
    assert "TTFT" in decision.message


def test_a_router_restart_reads_as_a_reset_and_no_requests_as_no_load() -> None:
    before = ttft(0.0, (50, 50, 50, 50))
    after = ttft(5.0, (0, 2, 2, 2))
    value, observed = signals.window_quantile(0.9, [before, after], "ttft")
    assert observed == 2 and value is not None and 0.1 < value <= 0.5
    quiet = [ttft(0.0, (5, 5, 5, 5)), ttft(5.0, (5, 5, 5, 5))]
    scaling = PrefillAutoscaling.model_validate(
        {"maxReplicas": 4, "target": {"ttftP90Seconds": 0.5}, "scaleDownStabilizationWindowSeconds": 0}
    )
    decision, _ = planner.plan("prefill", scaling, quiet, 3, ((0.0, 3, False),), 5.0)
    assert decision.desired == 1 and decision.reason == planner.SCALED_DOWN


def test_engine_targets_read_the_engines() -> None:
    samples = [
        Sample(0.0, engines={("prefill", "x-prefill-0"): EngineSample(prompt_tokens=1000.0)}),
        Sample(10.0, engines={("prefill", "x-prefill-0"): EngineSample(prompt_tokens=6000.0)}),
    ]
    assert signals.prompt_token_rate(samples) == pytest.approx(500.0)
    scaling = PrefillAutoscaling.model_validate({"maxReplicas": 8, "target": {"promptTokensPerSecond": 200}})
    decision, _ = planner.plan("prefill", scaling, samples, 1, (), 10.0)
    assert decision.desired == 3
    kv = [Sample(0.0, engines={("decode", "d1"): EngineSample(kv_usage=0.9)})]
    assert signals.mean_kv_usage(kv) == pytest.approx(0.9)


def test_the_router_text_parses_to_what_the_planner_reads() -> None:
    text = "\n".join(
        [
            "# TYPE disagg_router_in_flight_requests gauge",
            'disagg_router_in_flight_requests{role="prefill"} 1.0',
            'disagg_router_in_flight_requests{role="decode"} 3.0',
            "# TYPE disagg_router_queued_requests gauge",
            "disagg_router_queued_requests 2.0",
            "# TYPE disagg_router_outstanding_legs gauge",
            'disagg_router_outstanding_legs{engine="x-decode-abc",role="decode"} 3.0',
            "# TYPE disagg_router_time_to_first_token_seconds histogram",
            'disagg_router_time_to_first_token_seconds_bucket{endpoint="/v1/completions",le="0.1"} 2.0',
            'disagg_router_time_to_first_token_seconds_bucket{endpoint="/v1/completions",le="+Inf"} 3.0',
            'disagg_router_time_to_first_token_seconds_bucket{endpoint="/v1/chat/completions",le="0.1"} 1.0',
            'disagg_router_time_to_first_token_seconds_bucket{endpoint="/v1/chat/completions",le="+Inf"} 1.0',
            'disagg_router_time_to_first_token_seconds_count{endpoint="/v1/completions"} 3.0',
            'disagg_router_time_to_first_token_seconds_sum{endpoint="/v1/completions"} 0.4',
            "",
        ]
    )
    sample = signals.parse_router(text)
    assert sample.in_flight == {"prefill": 1.0, "decode": 3.0}
    assert sample.legs == {("decode", "x-decode-abc"): 3.0}
    assert signals.mean_in_flight([Sample(0.0, {ROUTER: sample})], "decode") == 5.0
    assert sample.ttft == ((0.1, 3.0), (float("inf"), 4.0))
    assert Sample(0.0, {ROUTER: sample}).busy() == frozenset({"x-decode-abc"})
    engine = signals.parse_engine(
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        "# TYPE vllm:prompt_tokens counter\n"
        'vllm:prompt_tokens_total{engine="0",model_name="m"} 120.0\n'
    )
    assert engine == EngineSample(kv_usage=0.25, prompt_tokens=120.0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"minReplicas": 5, "maxReplicas": 2, "target": {"runningRequests": 4}}, "must not exceed"),
        ({"maxReplicas": 2}, "exactly one target, 0 given"),
        ({"maxReplicas": 2, "target": {"runningRequests": 4, "kvCacheUsage": 0.5}}, "2 given"),
        ({"target": {"runningRequests": 4}}, "needs maxReplicas"),
        ({"mode": "external", "maxReplicas": 2}, "give no target, minReplicas or maxReplicas"),
        ({"maxReplicas": 300, "target": {"runningRequests": 4}}, "less than or equal to 256"),
        ({"maxReplicas": 2, "target": {"kvCacheUsage": 1.5}}, "less than or equal to 1"),
    ],
)
def test_autoscaling_specs_are_refused_with_a_clear_reason(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        DecodeAutoscaling.model_validate(fields)


def test_external_mode_is_for_decode_only_and_defaults_are_an_hpas() -> None:
    with pytest.raises(ValidationError, match="External is for decode only"):
        PrefillAutoscaling.model_validate({"mode": "External"})
    scaling = DecodeAutoscaling.model_validate({"maxReplicas": 3, "target": {"runningRequests": 2}})
    assert scaling.bounds == (1, 3)
    assert scaling.scale_up_stabilization_window_seconds == 0
    assert scaling.scale_down_stabilization_window_seconds == 300
    assert scaling.tolerance == 0.1 and scaling.metric_window_seconds == 30
    assert DecodeAutoscaling.model_validate({"mode": "External"}).mode is ScalingMode.EXTERNAL


@pytest.mark.parametrize(
    ("old", "new"), [("planner", ScalingMode.PLANNER), ("external", ScalingMode.EXTERNAL)]
)
def test_the_old_lowercase_modes_are_accepted_read_as_the_new_and_warned_of(
    old: str, new: ScalingMode
) -> None:
    raw = {"decode": {"autoscaling": {"mode": old}}}
    given = (
        {"mode": old, "maxReplicas": 2, "target": {"runningRequests": 2}}
        if new is ScalingMode.PLANNER
        else {}
    )
    assert DecodeAutoscaling.model_validate({"mode": old, **given}).mode is new
    assert scaling_mode(old) is scaling_mode(new.value) is new
    assert old_spellings(raw) == [
        f"spec.decode.autoscaling.mode: {old!r} is the old spelling of {new.value!r}; both are accepted, "
        f"write {new.value!r}"
    ]
    assert old_spellings({"decode": {"autoscaling": {"mode": new.value}}}) == []
    assert scaling_mode("Sometimes") is None


def test_the_crd_takes_both_spellings_and_defaults_to_the_new() -> None:
    crd = build_crd(with_cel=False)
    version = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    mode = version["properties"]["spec"]["properties"]["decode"]["properties"]["autoscaling"]["properties"][
        "mode"
    ]
    assert mode["enum"] == ["Planner", "External", "planner", "external"]
    assert mode["default"] == "Planner"


@pytest.mark.parametrize(
    "page",
    [
        "this is not prometheus text {{{",
        'disagg_router_time_to_first_token_seconds_bucket{le="soon"} 3\n',
    ],
)
def test_a_page_that_is_not_prometheus_text_is_refused_with_value_error(page: str) -> None:
    with pytest.raises(ValueError):
        signals.parse_router(page)


def test_nan_and_infinite_readings_are_skipped() -> None:
    router = signals.parse_router(
        'disagg_router_queued_requests NaN\ndisagg_router_in_flight_requests{role="decode"} +Inf\n'
    )
    assert router.queued == 0.0 and router.in_flight == {}
    engine = signals.parse_engine('vllm:kv_cache_usage_perc{engine="0"} NaN\nvllm:prompt_tokens_total 7\n')
    assert engine.kv_usage is None and engine.prompt_tokens == 7.0


@pytest.mark.parametrize("mode", ["Planner", "planner", None])
def test_the_clock_plans_a_stored_spec_in_either_spelling(mode: str | None) -> None:
    scaling = {"maxReplicas": 2} if mode is None else {"mode": mode, "maxReplicas": 2}
    assert planned({"spec": {"decode": {"autoscaling": scaling}}})
    assert not planned({"spec": {"decode": {"autoscaling": {"mode": "external"}}}})
    assert not planned({"spec": {"decode": {}}})


@pytest.mark.parametrize(
    ("target", "series", "want", "reason"),
    [
        # An admitted target at the float edge: any load divides to infinity.
        ({"runningRequests": 5e-324}, [1.0, 1.0], 4, planner.AT_MAX),
        ({"interTokenLatencyP90Seconds": 5e-324}, [1.0, 1.0], 1, planner.STABLE),
        # A page's values at the float edge (two routers' sum overflows to infinity).
        ({"runningRequests": 1}, [1e308, 1e308], 4, planner.AT_MAX),
        ({"runningRequests": 1}, [-1e308, -1e308], 1, planner.STABLE),
        ({"runningRequests": 1.7976931348623157e308}, [1e308, 1e308], 4, planner.AT_MAX),
    ],
)
def test_float_edges_plan_within_the_bounds(
    target: dict[str, float], series: list[float], want: int, reason: str
) -> None:
    scaling = decode_scaling(target=target)
    samples = [
        Sample(k * 5.0, {f"10.0.0.{r}:8000": RouterSample(in_flight={"decode": v}) for r in (1, 2)})
        for k, v in enumerate(series)
    ]
    decision = run(scaling, samples, 1)[-1]
    assert (decision.desired, decision.reason) == (want, reason)


def test_a_histogram_of_huge_counts_reads_as_missing_not_nan() -> None:
    def page(count: float) -> RouterSample:
        return RouterSample(itl=((0.1, count), (1.0, 1.7976931348623157e308), (float("inf"), count)))

    samples = [Sample(0.0, {ROUTER: page(-1.7976931348623157e308)}), Sample(5.0, {ROUTER: page(1e308)})]
    scaling = decode_scaling(target={"interTokenLatencyP90Seconds": 0.05})
    decision = run(scaling, samples, 2)[-1]
    assert (decision.desired, decision.reason) == (2, planner.METRICS_MISSING)
