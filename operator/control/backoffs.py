"""How long kopf retries a failed API request: until it succeeds. Pure.

kopf retries a request that fails with a connection error, a timeout, a 5xx, 403 or 429 on the delays of
`settings.networking.error_backoffs` (by default 8 retries, about 54 s) and then raises. Its watches swallow
an escalated connection error and start over, but not a 5xx: a kube-apiserver that comes back answering
503 "server is starting" for longer than the retries makes the CRD and Namespace watches that kopf's
resource and namespace observers run raise, those root tasks end, and kopf ends the operator when any root
task ends (the 70 s outage of issue 22). The same escalation ends each per-kind watcher's task, which kopf
never restarts, so the operator would live on blind to that kind. An operator must outlast outages of any
length and carry on once the server is back: `EndlessBackoffs` gives every request the same growing
delays, capped, forever. (Events are posted on kopf's own schedule and may still be given up on.)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True)
class EndlessBackoffs:
    """The delays (seconds) before each retry: `first`, then `then` forever.

    An iterable, not an iterator: kopf iterates it afresh for every request, so each request starts from
    `first`; it has no length, so kopf counts attempts without a total ("attempt #12") and never escalates.
    """

    first: Sequence[float]
    then: float

    def __iter__(self) -> Iterator[float]:
        return itertools.chain(self.first, itertools.repeat(self.then))


# kopf's own schedule, then its last delay for as long as the outage lasts.
API_BACKOFFS: Final = EndlessBackoffs(first=(1, 1, 2, 3, 5, 8, 13), then=21)
