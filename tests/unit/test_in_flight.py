"""A draining pod's in-flight count: read from the engine's own metrics, written into its peer report."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from disagg.worker.contracts.peer_report import PEER_REPORT_VERSION, InFlight, PeerReport
from disagg.worker.contracts.pod_contract import DRAINING_ANNOTATION
from disagg.worker.engine.metrics import EngineMetrics
from disagg.worker.reporting.in_flight import engine_in_flight, parse_in_flight
from disagg.worker.reporting.pod_report import with_in_flight

T0 = datetime(2026, 12, 2, 9, 0, 0, tzinfo=UTC)
# What vLLM 0.32's /metrics shows of its scheduler (labels and neighbours as it writes them).
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/models/tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="/models/tiny"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="/models/tiny",reason="capacity"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="/models/tiny"} 0.25
"""


class Scheduler:
    """What the reference engine's gauges read of its block scheduler, at one moment."""

    usable_blocks = 16
    free_blocks = 10

    def __init__(self, **counts: int) -> None:
        self._counts = Counter(counts)

    def counts(self) -> Counter[str]:
        return self._counts


def reference_metrics(scheduler: Scheduler | None) -> str:
    metrics = EngineMetrics("tiny")
    metrics.watch(lambda: scheduler)  # type: ignore[arg-type, return-value]
    return metrics.render().decode()


def test_the_count_is_what_either_engine_reports_running_and_waiting() -> None:
    assert parse_in_flight(VLLM_METRICS) == 3
    busy = Scheduler(prefilling=1, decoding=2, running=0, awaiting_kv=1)
    assert parse_in_flight(reference_metrics(busy)) == 4
    assert (
        parse_in_flight(reference_metrics(Scheduler(prefilling=0, decoding=0, running=0, awaiting_kv=0))) == 0
    )
    # No sample at all (an engine whose scheduler is not up, or not an engine): unknown, not idle.
    assert parse_in_flight("# HELP x\nother_metric 1\n") is None


def test_the_sidecar_reads_the_count_from_the_engines_metrics_endpoint(
    pages: tuple[str, dict[str, bytes]],
) -> None:
    base, served = pages
    url = base + "/metrics"
    served["/metrics"] = VLLM_METRICS.encode()
    assert engine_in_flight(url) == 3
    served["/metrics"] = reference_metrics(
        Scheduler(prefilling=0, decoding=0, running=0, awaiting_kv=0)
    ).encode()
    assert engine_in_flight(url) == 0
    # An engine that does not answer is not idle: nothing is reported.
    assert engine_in_flight("http://127.0.0.1:9/metrics", timeout_s=0.5) is None


def report() -> PeerReport:
    return PeerReport(version=PEER_REPORT_VERSION, engine_id="d-decode-x", kv_hash="h")


def test_only_a_draining_pods_report_carries_the_count_stamped_before_it_was_measured() -> None:
    clock = iter([T0, T0 + timedelta(seconds=1)])
    measured: list[datetime] = []

    def probe() -> int:
        measured.append(T0)
        return 0

    assert with_in_flight(report(), {}, probe, lambda: next(clock)) == report()
    assert measured == [], "a pod that is not draining is not even measured"
    draining = {DRAINING_ANNOTATION: "2026-12-02T08:59:50Z"}
    found = with_in_flight(report(), draining, probe, lambda: next(clock))
    assert found is not None and found.in_flight == InFlight(requests=0, at=T0)
    # An engine that cannot tell leaves the report as it was: the operator's bound ends that drain.
    assert with_in_flight(report(), draining, lambda: None, lambda: T0) == report()
    assert with_in_flight(None, draining, probe, lambda: T0) is None


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-1", "1e400"])
def test_a_gauge_that_is_no_count_makes_the_engine_unknown_not_idle(value: str) -> None:
    text = f'vllm:num_requests_running{{engine="0"}} 0\nvllm:num_requests_waiting{{engine="0"}} {value}\n'
    assert parse_in_flight(text) is None
