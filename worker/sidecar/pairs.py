"""What each pair's KV moved over, how much and how fast: the prefill worker's side of the transport report.

A prefill worker writes the KV, so its NIXL agent's UCX endpoints to a decode engine's agents are the pair's
transport (`NixlTransport.lanes`, from UCX's own protocol selection). Every completed push, the canary's
one-block request and clients' requests alike, adds its bytes and seconds. The main loop (which owns the
agent) writes here; the peer reporter's thread reads a snapshot for the peer report, so the ledger locks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Final

from disagg.worker.contracts.ucx_lanes import transport_name

MAX_PAIRS: Final = 1024
"""Decode engines remembered; an evicted engine is forgotten, so this bounds only a churning deployment."""


@dataclass(frozen=True)
class PairStats:
    lanes: tuple[str, ...] = ()
    nbytes: int = 0
    seconds: float = 0.0
    last_gbps: float = 0.0
    """The latest push's bytes over its seconds (a one-block canary is mostly latency, not bandwidth)."""

    @property
    def transport(self) -> str:
        """`shm`, `rdma`, `tcp`, ... ("" while UCX has not said)."""
        return transport_name(self.lanes)

    @property
    def gbps(self) -> float:
        """Every push's bytes over every push's seconds."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class PairLedger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pairs: dict[str, PairStats] = {}

    def connected(self, decode_engine_id: str, lanes: tuple[str, ...]) -> PairStats:
        with self._lock:
            stats = replace(self._pairs.pop(decode_engine_id, PairStats()), lanes=lanes)
            self._keep(decode_engine_id, stats)
            return stats

    def sent(self, decode_engine_id: str, nbytes: int, seconds: float) -> PairStats:
        with self._lock:
            old = self._pairs.pop(decode_engine_id, PairStats())
            gbps = nbytes / seconds / 1e9 if seconds > 0 else old.last_gbps
            stats = replace(old, nbytes=old.nbytes + nbytes, seconds=old.seconds + seconds, last_gbps=gbps)
            self._keep(decode_engine_id, stats)
            return stats

    def forget(self, decode_engine_id: str) -> None:
        with self._lock:
            self._pairs.pop(decode_engine_id, None)

    def snapshot(self) -> dict[str, PairStats]:
        with self._lock:
            return dict(self._pairs)

    def _keep(self, engine_id: str, stats: PairStats) -> None:
        self._pairs[engine_id] = stats
        while len(self._pairs) > MAX_PAIRS:
            del self._pairs[next(iter(self._pairs))]
