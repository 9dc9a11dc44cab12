"""Outlier ejection: an engine whose legs keep failing leaves the routing. Pure: no I/O, the clock passed in.

The canary proves a pair once; nothing after it said that an engine still serves. A decoder that passed its
canary and then failed every leg kept its pairs, and least-loaded balancing made it worse: a leg that fails at
once frees its load at once, so the failing decoder always looked the least loaded and drew most requests (134
of 200, all failed). A killed decoder drew traffic the same way until its sidecars' reports excluded it.

So the router counts each engine's consecutive failed legs (by live engine id: a restarted engine starts
clean). At `eject_after` in a row the engine is ejected: every pair that has it leaves the routing at once,
for `eject_s`, doubled for each ejection since the engine last served a leg (up to `max_eject_s`), so an
engine that passes its canary and fails again is tried ever less often. When the hold ends its pairs come
back as new pairs: through the KV canary where the router runs one. A leg counts as failed when its engine
failed it (an error answer other than a verdict on the client's request, garbage, a broken or stalled
stream, a timeout, a refused connection); one answered is a success and resets the count.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

EJECTED_REASON = "EjectedAfterFailures"


@dataclass
class _Ejection:
    until: float
    times: int
    why: str


@dataclass
class Outliers:
    """Consecutive failed legs per engine id, and the engines ejected now. `eject_after` 0: never eject."""

    eject_after: int
    eject_s: float
    max_eject_s: float
    _failures: Counter[str] = field(default_factory=Counter)
    _ejections: dict[str, _Ejection] = field(default_factory=dict)

    def failed(self, engine_id: str, why: str, now: float) -> float | None:
        """A leg of `engine_id` failed (`why`). Returns how long the engine is now ejected for when this
        failure ejected it, else None."""
        if self.eject_after <= 0 or self.ejected(engine_id, now):
            # A leg sent before the ejection that fails during the hold says nothing new.
            return None
        self._failures[engine_id] += 1
        if self._failures[engine_id] < self.eject_after:
            return None
        del self._failures[engine_id]
        previous = self._ejections.get(engine_id)
        times = 1 if previous is None else previous.times + 1
        hold = min(self.max_eject_s, self.eject_s * (1 << min(times - 1, 32)))
        self._ejections[engine_id] = _Ejection(now + hold, times, why)
        return hold

    def succeeded(self, engine_id: str, now: float) -> None:
        """A leg of `engine_id` was served: its count, and its ejection history once its hold is over, start
        again (a leg sent before an ejection may still end well: it does not cut the hold short)."""
        self._failures.pop(engine_id, None)
        if engine_id in self._ejections and not self.ejected(engine_id, now):
            del self._ejections[engine_id]

    def ejected(self, engine_id: str, now: float) -> bool:
        ejection = self._ejections.get(engine_id)
        return ejection is not None and now < ejection.until

    def why(self, engine_id: str) -> str:
        ejection = self._ejections.get(engine_id)
        return "" if ejection is None else ejection.why
