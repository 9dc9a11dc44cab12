"""The spec reconciles (`control.specs`): the spec handler only queues a key; the reconcile reads the newest
deployment when it starts, inside its key's hold, knows a just-created deployment by its uid, posts what it
changed, and is retried (and said to have failed) when it raises, but not when it refuses the spec. And
kopf's poster takes the Events from the reconciles' threads (`kopf_tuning.KopfEvents`)."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import kopf
import pytest
from kopf._core.engines import posting

from disagg.operator.control.kopf_tuning import KopfEvents
from disagg.operator.control.reconcile import Outcome
from disagg.operator.control.specs import SpecReconciles

Key = tuple[str, str]
KEY = ("ns", "dd")


def deployment(uid: str = "uid-1", generation: int = 1, name: str = "dd", **metadata: Any) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": name, "uid": uid, "generation": generation, **metadata},
        "spec": {"generation": generation},
    }


class Cluster:
    """What the reconciles see and do: the index's deployment, the holds, the reconciles, the Events."""

    def __init__(self, outcomes: list[Outcome | Exception]) -> None:
        self.bodies: dict[Key, dict[str, Any]] = {KEY: deployment()}
        self.outcomes = outcomes
        self.lock = threading.Lock()
        self.held: set[Key] = set()
        self.calls: list[tuple[int, bool, bool]] = []  # (generation, created, inside its key's hold)
        self.posted: list[tuple[str, str, str]] = []
        self.done = threading.Condition()
        self.gate: threading.Event | None = None
        self.started = threading.Event()

    def deployment(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        return self.bodies.get((namespace, name))

    @contextmanager
    def hold(self, key: Key) -> Iterator[None]:
        with self.lock:
            self.held.add(key)
        try:
            yield
        finally:
            with self.lock:
                self.held.discard(key)

    def reconcile(self, body: Mapping[str, Any], created: bool) -> Outcome:
        with self.lock:
            key = (body["metadata"]["namespace"], body["metadata"]["name"])
            self.calls.append((body["metadata"]["generation"], created, key in self.held))
            outcome = self.outcomes.pop(0) if self.outcomes else Outcome((), (), None)
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        with self.done:
            self.done.notify_all()
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def post(self, body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        with self.done:
            self.posted.append((type_, reason, message))
            self.done.notify_all()

    def reconciles(self) -> SpecReconciles:
        return SpecReconciles(self.reconcile, self.deployment, self.hold, self.post, workers=1)

    def wait(self, calls: int, posted: int = 0) -> None:
        with self.done:
            assert self.done.wait_for(
                lambda: len(self.calls) >= calls and len(self.posted) >= posted, timeout=10
            ), (self.calls, self.posted)


@pytest.fixture
def stopping() -> Iterator[list[SpecReconciles]]:
    queues: list[SpecReconciles] = []
    yield queues
    for queue in queues:
        queue.stop()


def test_a_created_deployment_is_reconciled_as_created_once_inside_its_hold_and_its_news_posted(
    stopping: list[SpecReconciles],
) -> None:
    cluster = Cluster([Outcome(("StatefulSet dd-prefill-0",), (), None)])
    stopping.append(specs := cluster.reconciles())
    specs.request(KEY, created_uid="uid-1")
    cluster.wait(1, posted=1)
    specs.request(KEY)
    cluster.wait(2)
    assert cluster.calls == [(1, True, True), (1, False, True)]
    assert cluster.posted == [("Normal", "Applied", "Applied StatefulSet dd-prefill-0")]


def test_created_is_for_its_uid_only(stopping: list[SpecReconciles]) -> None:
    # Deleted and made again under the same name before the reconcile ran: the new one is no create of the
    # old's (it has its own create handler), so it may own children already.
    cluster = Cluster([])
    cluster.bodies[KEY] = deployment(uid="uid-2")
    stopping.append(specs := cluster.reconciles())
    specs.request(KEY, created_uid="uid-1")
    cluster.wait(1)
    assert cluster.calls == [(1, False, True)]


def test_requests_during_a_reconcile_cost_one_more_that_reads_the_newest_spec(
    stopping: list[SpecReconciles],
) -> None:
    cluster = Cluster([])
    cluster.gate = threading.Event()
    stopping.append(specs := cluster.reconciles())
    specs.request(KEY)
    assert cluster.started.wait(10)
    for generation in (2, 3, 4):
        cluster.bodies[KEY] = deployment(generation=generation)
        specs.request(KEY)
    cluster.gate.set()
    cluster.wait(2)
    assert [generation for generation, _, _ in cluster.calls] == [1, 4]


def test_a_deployment_gone_or_being_deleted_is_not_reconciled(stopping: list[SpecReconciles]) -> None:
    cluster = Cluster([])
    stopping.append(specs := cluster.reconciles())
    cluster.bodies[KEY] = deployment(deletionTimestamp="2026-12-05T10:00:00Z")
    cluster.bodies[("ns", "last")] = deployment(generation=7, name="last")
    for name in ("dd", "gone", "last"):
        specs.request(("ns", name))
    cluster.wait(1)
    # Only the last found a deployment to reconcile; the others were taken before it (one worker per key,
    # in the order requested), so nothing else comes.
    assert cluster.calls == [(7, False, True)]


def test_a_failed_reconcile_is_said_and_retried_and_a_refusal_is_not_retried(
    stopping: list[SpecReconciles],
) -> None:
    cluster = Cluster([RuntimeError("apiserver unavailable"), Outcome((), (), "no", refused_now=True)])
    stopping.append(specs := cluster.reconciles())
    specs.request(KEY, created_uid="uid-1")
    cluster.wait(2, posted=2)
    assert cluster.calls == [(1, True, True), (1, False, True)]  # the retry is no first try of a create
    assert cluster.posted == [
        ("Warning", "ReconcileFailed", "RuntimeError: apiserver unavailable; retrying"),
        ("Warning", "SpecRefused", "no"),
    ]
    # A refusal is not retried: nothing more comes in twice the first retry's delay.
    with cluster.done:
        assert not cluster.done.wait_for(lambda: len(cluster.calls) > 2, timeout=2.5)


def test_kopfs_poster_takes_an_event_from_another_thread() -> None:
    events = KopfEvents()
    with pytest.raises(RuntimeError, match="no kopf handler has run"):
        events(deployment(), "Normal", "Applied", "Applied x")

    async def handler_then_thread() -> posting.K8sEvent:
        # What kopf sets for its handlers' tasks (`kopf._core.reactor.processing`).
        queue: asyncio.Queue[posting.K8sEvent] = asyncio.Queue()
        posting.settings_var.set(kopf.OperatorSettings())
        posting.event_queue_loop_var.set(asyncio.get_running_loop())
        posting.event_queue_var.set(queue)
        events.keep(contextvars.copy_context())
        thread = threading.Thread(target=events, args=(deployment(), "Normal", "Applied", "Applied x"))
        thread.start()
        thread.join(10)
        return await asyncio.wait_for(queue.get(), 10)

    event = asyncio.run(handler_then_thread())
    assert (event.type, event.reason, event.message) == ("Normal", "Applied", "Applied x")
    assert event.ref == {
        "apiVersion": "disagg.io/v1alpha1",
        "kind": "DisaggDeployment",
        "name": "dd",
        "namespace": "ns",
        "uid": "uid-1",
    }
