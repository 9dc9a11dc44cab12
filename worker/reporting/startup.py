"""The startup grace of a pod's KV condition: a peer (or the pod's own engine) that has never answered a
handshake is pending, not failed, for a bounded time after this sidecar first saw it.

When a deployment starts, every sidecar checks peers whose engines are still loading: their side channels
do not answer yet (`PeerUnreachable`) or answer without a payload (a transfer sidecar whose engine has not
registered). Reported as failures, they made every deployment show `KVTransferReady=False` for its first
minutes, then flip to True: a false alarm. So a peer that has never answered with a payload is pending (the
condition is Unknown, `AwaitingPeers` or `AwaitingEngine`, naming it and the grace left) until `grace_s`
after it was first seen. After that, or once it has answered a single time, each failure is reported at
once, as before: an engine that was up and went away is news. A peer is known by its pod and address, so a
pod recreated at a new IP starts a grace of its own; one that restarts in place was up, and is reported.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

PeerKey = tuple[str, str]
"""(pod name, side-channel address)."""


class StartupGrace:
    """Which never-answered peers are still within their grace; kept from round to round."""

    def __init__(self, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        """`grace_s`: the sidecar's `peer_startup_grace_s` (`DISAGG_PEER_STARTUP_GRACE_S`)."""
        self.grace_s = grace_s
        self._clock = clock
        self._first_seen: dict[PeerKey, float] = {}
        self._answered: set[PeerKey] = set()

    def left(self, key: PeerKey, answered: bool) -> float | None:
        """Seconds of grace left for the peer `key` whose check failed this round, or None when its failure
        is reported now (it answered this round or before, or its grace has passed). `answered`: whether it
        answered this round with a payload."""
        now = self._clock()
        first = self._first_seen.setdefault(key, now)
        if answered:
            self._answered.add(key)
        if key in self._answered:
            return None
        remaining = first + self.grace_s - now
        return remaining if remaining > 0 else None

    def answered(self, key: PeerKey) -> None:
        """The peer `key` passed its check this round."""
        self._first_seen.setdefault(key, self._clock())
        self._answered.add(key)

    def keep_only(self, keys: Iterable[PeerKey]) -> None:
        """Forget the peers not among `keys` (pods gone from the deployment), so the memory stays bounded by
        the live peers."""
        live = set(keys)
        self._first_seen = {key: since for key, since in self._first_seen.items() if key in live}
        self._answered &= live
