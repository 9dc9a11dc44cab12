"""Condition helpers with SetStatusCondition semantics: lastTransitionTime moves only on a flip."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from disagg.operator import conditions as cond
from disagg.operator.api import Condition, ConditionStatus

T0 = datetime(2026, 11, 30, 9, 0, 0, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)


def test_new_condition_gets_now_and_generation() -> None:
    result = cond.set_condition(
        [], cond.COMPATIBLE, ConditionStatus.TRUE, "Compatible", "ok", generation=3, now=T0
    )
    assert [(c.type, c.status, c.reason, c.observed_generation, c.last_transition_time) for c in result] == [
        ("Compatible", ConditionStatus.TRUE, "Compatible", 3, T0)
    ]


def test_same_status_keeps_transition_time_but_refreshes_the_rest() -> None:
    first = cond.set_condition(
        [], cond.AVAILABLE, ConditionStatus.FALSE, "AwaitingPods", "0/2", generation=1, now=T0
    )
    second = cond.set_condition(
        first, cond.AVAILABLE, ConditionStatus.FALSE, "AwaitingPods", "1/2", generation=2, now=T1
    )
    (only,) = second
    assert only.last_transition_time == T0
    assert (only.message, only.observed_generation) == ("1/2", 2)


def test_flip_moves_transition_time() -> None:
    first = cond.set_condition(
        [], cond.AVAILABLE, ConditionStatus.FALSE, "AwaitingPods", "", generation=1, now=T0
    )
    flipped = cond.set_condition(
        first, cond.AVAILABLE, ConditionStatus.TRUE, "AllReplicasReady", "", generation=1, now=T1
    )
    assert flipped[0].last_transition_time == T1


def test_merge_keeps_other_types_and_a_stable_order() -> None:
    start = cond.set_condition(
        [], cond.KV_TRANSFER_READY, ConditionStatus.UNKNOWN, "NoPods", "", generation=1, now=T0
    )
    merged = cond.merge(
        start,
        [
            cond.desired(cond.PROGRESSING, ConditionStatus.TRUE, "RollingOut", "", T1),
            cond.desired(cond.COMPATIBLE, ConditionStatus.TRUE, "Compatible", "", T1),
        ],
        generation=2,
        now=T1,
    )
    assert [c.type for c in merged] == ["Compatible", "Progressing", "KVTransferReady"]
    assert cond.find(merged, cond.KV_TRANSFER_READY) == start[0]


def test_json_round_trip_uses_api_server_time_format() -> None:
    conditions = cond.set_condition(
        [], "Compatible", ConditionStatus.TRUE, "Compatible", "m", generation=4, now=T0
    )
    rendered = cond.to_json(conditions)
    assert rendered == [
        {
            "type": "Compatible",
            "status": "True",
            "reason": "Compatible",
            "message": "m",
            "observedGeneration": 4,
            "lastTransitionTime": "2026-11-30T09:00:00Z",
        }
    ]
    assert cond.parse(rendered) == conditions


statuses = st.sampled_from(list(ConditionStatus))


@given(st.lists(st.tuples(statuses, st.integers(min_value=0, max_value=10**6)), min_size=1, max_size=20))
def test_transition_time_changes_exactly_on_flips(steps: list[tuple[ConditionStatus, int]]) -> None:
    conditions: list[Condition] = []
    previous: Condition | None = None
    for index, (status, seconds) in enumerate(steps):
        now = T0 + timedelta(seconds=seconds + index)
        conditions = cond.set_condition(conditions, "Available", status, "R", "", generation=index, now=now)
        (current,) = conditions
        if previous is not None and previous.status is status:
            assert current.last_transition_time == previous.last_transition_time
        else:
            assert current.last_transition_time == now
        previous = current
