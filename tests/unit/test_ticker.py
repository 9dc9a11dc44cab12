"""The operator's clock (`runtime.ticker`): each step on its interval, one at a time per deployment, again
after a failure, and nothing for a deployment that is gone or being deleted."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest

from disagg.operator.runtime.ticker import Tick, Ticker


def body(name: str, *, rolling: bool = True, deleting: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"namespace": "ns", "name": name}
    if deleting:
        metadata["deletionTimestamp"] = "2026-12-02T00:00:00Z"
    return {"metadata": metadata, "status": {"oldRevision": "r1"} if rolling else {}}


class Steps:
    """A tick's run: records each body's name, and blocks while `hold` is clear."""

    def __init__(self, fail: bool = False) -> None:
        self.ran: list[str] = []
        self.hold = threading.Event()
        self.hold.set()
        self.fail = fail

    def __call__(self, body: Mapping[str, Any]) -> None:
        assert self.hold.wait(10), "the test never let the step end"
        self.ran.append(body["metadata"]["name"])
        if self.fail:
            raise RuntimeError("the API server is away")


@pytest.fixture
def bodies() -> list[dict[str, Any]]:
    return []


@pytest.fixture
def forgotten() -> list[tuple[str, str]]:
    return []


@contextmanager
def clock(
    bodies: list[dict[str, Any]], steps: Steps, forgotten: list[tuple[str, str]] | None = None
) -> Iterator[Ticker]:
    """A rollout tick every 2 s, scheduled by hand (`schedule(now)`), its loop never started."""
    tick = Tick("rollout", 2.0, lambda b: bool(b["status"].get("oldRevision")), steps)
    ticker = Ticker(lambda: list(bodies), [tick], forget=(forgotten if forgotten is not None else []).append)
    try:
        yield ticker
    finally:
        ticker.stop()


def test_a_step_runs_once_per_interval_from_one_interval_after_it_applies(
    bodies: list[dict[str, Any]],
) -> None:
    steps = Steps()
    with clock(bodies, steps) as ticker:
        bodies[:] = [body("a"), body("idle", rolling=False), body("going", deleting=True)]
        ticker.schedule(100.0)
        ticker.schedule(101.9)
        assert steps.ran == []
        ticker.schedule(102.0)
        ticker.join(10)
        ticker.schedule(103.0)
        ticker.schedule(104.0)
        ticker.join(10)
        assert steps.ran == ["a", "a"]


def test_a_step_that_no_longer_applies_stops_and_starts_over_when_it_applies_again(
    bodies: list[dict[str, Any]],
) -> None:
    steps = Steps()
    with clock(bodies, steps) as ticker:
        bodies[:] = [body("a")]
        ticker.schedule(0.0)
        bodies[:] = [body("a", rolling=False)]
        ticker.schedule(2.0)
        bodies[:] = [body("a")]
        ticker.schedule(3.0)
        ticker.schedule(4.9)
        assert steps.ran == []
        ticker.schedule(5.0)
        ticker.join(10)
        assert steps.ran == ["a"]


def test_a_slow_step_is_not_started_again_until_it_ends(bodies: list[dict[str, Any]]) -> None:
    steps = Steps()
    steps.hold.clear()
    with clock(bodies, steps) as ticker:
        bodies[:] = [body("a")]
        ticker.schedule(0.0)
        ticker.schedule(2.0)
        ticker.schedule(4.0)
        ticker.schedule(6.0)
        steps.hold.set()
        ticker.join(10)
        ticker.schedule(8.0)
        ticker.join(10)
        assert steps.ran == ["a", "a"]


def test_a_failed_step_is_logged_and_runs_again_at_its_next_time(
    bodies: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    steps = Steps(fail=True)
    with clock(bodies, steps) as ticker:
        bodies[:] = [body("a")]
        ticker.schedule(0.0)
        ticker.schedule(2.0)
        ticker.join(10)
        ticker.schedule(4.0)
        ticker.join(10)
        assert steps.ran == ["a", "a"]
    assert "rollout of ns/a failed" in caplog.text
    assert "the API server is away" in caplog.text


def test_a_deployment_gone_is_forgotten_once(
    bodies: list[dict[str, Any]], forgotten: list[tuple[str, str]]
) -> None:
    with clock(bodies, Steps(), forgotten) as ticker:
        bodies[:] = [body("a"), body("b", rolling=False)]
        ticker.schedule(0.0)
        bodies[:] = [body("a")]
        ticker.schedule(1.0)
        ticker.schedule(1.5)
        assert forgotten == [("ns", "b")]


def test_the_clock_runs_steps_on_its_own_once_started(bodies: list[dict[str, Any]]) -> None:
    steps = Steps()
    ticker = Ticker(lambda: list(bodies), [Tick("rollout", 0.05, lambda b: True, steps)], resolution=0.01)
    bodies[:] = [body("a")]
    ticker.start()
    ticker.start()
    try:
        deadline = time.monotonic() + 30
        while len(steps.ran) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        ticker.stop()
    assert steps.ran[:3] == ["a", "a", "a"]
    ran = len(steps.ran)
    time.sleep(0.2)
    assert len(steps.ran) == ran, "a stopped clock runs nothing"
