"""Status conditions with apimachinery's `meta.SetStatusCondition` semantics. Pure: the caller passes `now`.

`lastTransitionTime` moves only when a condition's status flips; reason, message and observedGeneration are
always refreshed. The whole list is written back on every change because a merge patch replaces arrays.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, Final

from disagg.operator.api import Condition, ConditionStatus

COMPATIBLE: Final = "Compatible"
AVAILABLE: Final = "Available"
PROGRESSING: Final = "Progressing"
KV_TRANSFER_READY: Final = "KVTransferReady"
ROUTABLE: Final = "Routable"
SCALING: Final = "Scaling"
# The order in which conditions are listed, so the stored list (and `kubectl describe`) never reshuffles.
CONDITION_TYPES: Final = (COMPATIBLE, AVAILABLE, PROGRESSING, KV_TRANSFER_READY, ROUTABLE, SCALING)


def find(conditions: Iterable[Condition], type_: str) -> Condition | None:
    return next((condition for condition in conditions if condition.type == type_), None)


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    *,
    generation: int | None,
    now: datetime,
) -> list[Condition]:
    """`conditions` with `type_` set; lastTransitionTime is `now` only if it is new or its status flips."""
    previous = find(conditions, type_)
    since = previous.last_transition_time if previous is not None and previous.status is status else now
    updated = Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        observed_generation=generation,
        last_transition_time=since,
    )
    kept = [condition for condition in conditions if condition.type != type_]
    return _ordered([*kept, updated])


def merge(
    conditions: Sequence[Condition], updates: Iterable[Condition], *, generation: int | None, now: datetime
) -> list[Condition]:
    """Apply several updates; their own lastTransitionTime is ignored in favour of the flip rule."""
    merged = list(conditions)
    for update in updates:
        merged = set_condition(
            merged, update.type, update.status, update.reason, update.message, generation=generation, now=now
        )
    return merged


def desired(type_: str, status: ConditionStatus, reason: str, message: str, now: datetime) -> Condition:
    """A condition to hand to `merge` (which decides its lastTransitionTime)."""
    return Condition(type=type_, status=status, reason=reason, message=message, last_transition_time=now)


def parse(raw: Iterable[dict[str, Any]] | None) -> list[Condition]:
    """Conditions as stored in `status.conditions`."""
    return [Condition.model_validate(item) for item in raw or ()]


def to_json(conditions: Iterable[Condition]) -> list[dict[str, Any]]:
    """JSON-ready conditions; times in RFC 3339 with a `Z`, as the API server writes them."""
    out = []
    for condition in conditions:
        item = condition.model_dump(mode="json", by_alias=True, exclude_none=True)
        item["lastTransitionTime"] = rfc3339(condition.last_transition_time)
        out.append(item)
    return out


def rfc3339(moment: datetime) -> str:
    """Seconds precision in UTC, the form metav1.Time serialises to."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ordered(conditions: list[Condition]) -> list[Condition]:
    rank = {type_: index for index, type_ in enumerate(CONDITION_TYPES)}
    return sorted(conditions, key=lambda condition: (rank.get(condition.type, len(rank)), condition.type))
