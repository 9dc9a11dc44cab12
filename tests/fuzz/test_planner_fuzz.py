"""Seeded fuzz of what a pod's `/metrics` page and an admitted autoscaling spec give the planner: values and
targets at the float edges never raise, and every decision stays within the role's bounds."""

from __future__ import annotations

import random

import pytest

from disagg.operator.api import DecodeAutoscaling, PrefillAutoscaling, Role
from disagg.operator.scaling import planner, signals
from disagg.operator.scaling.signals import Sample

pytestmark = pytest.mark.fuzz

SEED = 45
ROUNDS = 300
EDGES = (
    "0", "-0", "1", "5e-324", "-5e-324", "2.2250738585072014e-308", "1e-300", "1e308", "-1e308",
    "1.7976931348623157e308", "-1.7976931348623157e308", "NaN", "+Inf", "-Inf", "3", "0.5",
)  # fmt: skip
TARGETS = (5e-324, 2.2250738585072014e-308, 1e-300, 0.01, 1.0, 1e300, 1.7976931348623157e308)
BOUNDS = ("0.01", "0.1", "1.0", "1e308", "+Inf")


def _router_page(rng: random.Random) -> str:
    lines = [
        f'disagg_router_in_flight_requests{{role="decode"}} {rng.choice(EDGES)}',
        f'disagg_router_in_flight_requests{{role="prefill"}} {rng.choice(EDGES)}',
        f"disagg_router_queued_requests {rng.choice(EDGES)}",
    ]
    for histogram in (signals.TTFT, signals.ITL):
        lines += [f'{histogram}_bucket{{le="{bound}"}} {rng.choice(EDGES)}' for bound in BOUNDS]
    return "\n".join(lines) + "\n"


def _engine_page(rng: random.Random) -> str:
    return f"{signals.KV_USAGE} {rng.choice(EDGES)}\n{signals.PROMPT_TOKENS}_total {rng.choice(EDGES)}\n"


def test_float_edges_of_pages_and_targets_plan_within_the_bounds() -> None:
    rng = random.Random(SEED)
    for _ in range(ROUNDS):
        samples = [
            Sample(
                k * 5.0,
                {f"r{r}": signals.parse_router(_router_page(rng)) for r in range(rng.randint(0, 3))},
                {
                    (role, f"e{e}"): signals.parse_engine(_engine_page(rng))
                    for role in ("prefill", "decode")
                    for e in range(rng.randint(0, 2))
                },
            )
            for k in range(rng.randint(1, 4))
        ]
        low = rng.randint(1, 3)
        common = {"minReplicas": low, "maxReplicas": rng.randint(low, 256), "metricWindowSeconds": 60}
        decode_target = rng.choice(("interTokenLatencyP90Seconds", "kvCacheUsage", "runningRequests"))
        prefill_target = rng.choice(("ttftP90Seconds", "promptTokensPerSecond"))
        specs: list[tuple[Role, DecodeAutoscaling | PrefillAutoscaling]] = [
            (
                "decode",
                DecodeAutoscaling.model_validate(
                    {**common, "target": {decode_target: min(rng.choice(TARGETS), 1.0)}}
                ),
            ),
            (
                "prefill",
                PrefillAutoscaling.model_validate(
                    {**common, "target": {prefill_target: min(rng.choice(TARGETS), 3600.0)}}
                ),
            ),
        ]
        for role, scaling in specs:
            current = rng.randint(1, 256)
            history: planner.Recommendations = ((0.0, rng.randint(1, 256), False),)
            decision, _ = planner.plan(role, scaling, samples, current, history, samples[-1].at)
            low_bound, high_bound = scaling.bounds
            assert low_bound <= decision.desired <= high_bound, decision
