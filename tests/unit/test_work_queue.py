"""The work queue of spec reconciles and status refreshes: bursts of events for one deployment collapse, no
key runs twice at once, nothing requested is lost, and a failed run is retried, later each time it fails."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from disagg.operator.runtime.work_queue import WorkQueue

Key = tuple[str, str]
LOG = logging.getLogger("test.work_queue")


class Recorder:
    def __init__(self, block_first: bool = False, fail_first: int = 0) -> None:
        self.calls: list[Key] = []
        self.lock = threading.Lock()
        self.started = threading.Event()
        self.release = threading.Event()
        self.block_first = block_first
        self.fail_first = fail_first
        self.running: set[Key] = set()
        self.overlap = False
        self.done = threading.Condition()

    def __call__(self, key: Key) -> None:
        with self.lock:
            self.overlap |= key in self.running
            self.running.add(key)
            first = not self.calls
            self.calls.append(key)
        try:
            if first and self.block_first:
                self.started.set()
                assert self.release.wait(10)
            if self.fail_first > 0:
                self.fail_first -= 1
                raise RuntimeError("apiserver unavailable")
        finally:
            with self.lock:
                self.running.discard(key)
            with self.done:
                self.done.notify_all()

    def wait_calls(self, count: int) -> list[Key]:
        with self.done:
            assert self.done.wait_for(lambda: len(self.calls) >= count, timeout=10), self.calls
        return self.calls


def test_a_burst_during_a_refresh_costs_one_more_refresh() -> None:
    recorder = Recorder(block_first=True)
    queue = WorkQueue(recorder, what="Run", logger=LOG, workers=3, settle=0.0)
    try:
        queue.request(("ns", "a"))
        assert recorder.started.wait(10)
        for _ in range(50):
            queue.request(("ns", "a"))
        queue.request(("ns", "b"))
        assert sorted(recorder.wait_calls(2)) == [("ns", "a"), ("ns", "b")]
        recorder.release.set()
        calls = recorder.wait_calls(3)
        assert calls.count(("ns", "a")) == 2 and calls.count(("ns", "b")) == 1
        assert not recorder.overlap
    finally:
        queue.stop()


def test_a_failed_refresh_is_retried() -> None:
    recorder = Recorder(fail_first=2)
    queue = WorkQueue(recorder, what="Run", logger=LOG, workers=1, retry=0.01, settle=0.0)
    try:
        queue.request(("ns", "a"))
        assert recorder.wait_calls(3) == [("ns", "a")] * 3
    finally:
        queue.stop()


def test_no_refresh_runs_while_a_reconcile_holds_its_key_and_requests_meanwhile_cost_one_after() -> None:
    recorder = Recorder()
    queue = WorkQueue(recorder, what="Run", logger=LOG, workers=3, settle=0.0)
    try:
        with queue.holding(("ns", "a")):
            for _ in range(20):
                queue.request(("ns", "a"))
            queue.request(("ns", "b"))
            assert recorder.wait_calls(1) == [("ns", "b")]
            assert ("ns", "a") not in recorder.calls
        assert recorder.wait_calls(2) == [("ns", "b"), ("ns", "a")]
        queue.request(("ns", "b"))
        assert recorder.wait_calls(3)[-1] == ("ns", "b")
        assert recorder.calls.count(("ns", "a")) == 1
    finally:
        queue.stop()


def test_holding_a_key_waits_for_its_running_refresh_and_none_runs_while_held() -> None:
    recorder = Recorder(block_first=True)
    inside = threading.Event()
    during: list[Key] = []

    def refresh(key: Key) -> None:
        if inside.is_set():
            during.append(key)
        recorder(key)

    queue = WorkQueue(refresh, what="Run", logger=LOG, workers=2, settle=0.0)
    results: list[bool] = []

    def reconcile() -> None:
        with queue.holding(("ns", "a")):
            inside.set()
            results.append(not recorder.running)
            queue.request(("ns", "a"))
            time.sleep(0.2)  # room for a wrongly scheduled refresh to show up in `during`
            inside.clear()

    try:
        queue.request(("ns", "a"))
        assert recorder.started.wait(10)
        queue.request(("ns", "a"))  # queued again behind the running refresh
        thread = threading.Thread(target=reconcile)
        thread.start()
        assert not inside.wait(0.2)  # the reconcile waits for the running refresh
        recorder.release.set()
        thread.join(10)
        assert results == [True] and during == []
        # The request made while held ran after the reconcile.
        calls = recorder.wait_calls(2)
        assert calls[-1] == ("ns", "a") and not recorder.overlap
    finally:
        queue.stop()


def test_requests_within_the_settle_window_share_one_refresh_after_it() -> None:
    recorder = Recorder()
    queue = WorkQueue(recorder, what="Run", logger=LOG, workers=2, settle=0.3)
    try:
        start = time.monotonic()
        for _ in range(10):
            queue.request(("ns", "a"))
            time.sleep(0.01)
        assert recorder.wait_calls(1) == [("ns", "a")]
        assert time.monotonic() - start >= 0.3
        time.sleep(0.4)  # room for a wrongly scheduled second refresh
        assert recorder.calls == [("ns", "a")]
    finally:
        queue.stop()


def test_a_failing_key_waits_twice_as_long_each_time_up_to_the_cap_and_a_success_resets_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recorder = Recorder(fail_first=4)
    caplog.set_level(logging.ERROR, logger=LOG.name)
    queue = WorkQueue(recorder, what="Run", logger=LOG, workers=1, retry=0.1, max_retry=0.4, settle=0.0)
    try:
        queue.request(("ns", "a"))
        recorder.wait_calls(5)  # four failures, then a success
        recorder.fail_first = 1
        queue.request(("ns", "a"))
        recorder.wait_calls(7)  # a failure, then a success
    finally:
        queue.stop()
    assert [record.getMessage() for record in caplog.records if record.name == LOG.name] == [
        f"Run of ns/a failed; retrying in {delay} s" for delay in ("0.1", "0.2", "0.4", "0.4", "0.1")
    ]


def test_stop_waits_for_the_run_under_way_and_takes_no_more_keys() -> None:
    recorder = Recorder(block_first=True)
    queue = WorkQueue(recorder, what="Run", logger=LOG, workers=1, settle=0.0)
    queue.request(("ns", "a"))
    assert recorder.started.wait(10)
    queue.request(("ns", "b"))
    stopping = threading.Thread(target=queue.stop)
    stopping.start()
    stopping.join(0.2)
    assert stopping.is_alive()  # waits for the run of a
    recorder.release.set()
    stopping.join(10)
    assert not stopping.is_alive() and recorder.calls == [("ns", "a")]
