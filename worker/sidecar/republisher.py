"""The serving worker's side channel answers for the engine's other workers too, as vLLM's scheduler serves
every worker of an engine: this thread fetches their handshake payloads and keeps them fresh."""

from __future__ import annotations

import logging
import threading

from disagg.worker.connector.side_channel import SideChannelServer, fetch_payloads
from disagg.worker.contracts.topology import WorkerEndpoint
from disagg.worker.kv import wire
from disagg.worker.kv.errors import DisaggError
from disagg.worker.sidecar.config import SidecarConfig
from disagg.worker.sidecar.logs import event

log = logging.getLogger(__name__)

REPUBLISH_RETRY_S = 0.5
REPUBLISH_REFRESH_S = 30.0


class Republisher:
    """Fetches the other workers' handshake payloads for the serving worker's side channel, and refreshes them
    (a restarted worker comes back with a new NIXL agent)."""

    def __init__(self, config: SidecarConfig, server: SideChannelServer) -> None:
        self._config = config
        self._server = server
        self._missing = {(w.pp_rank, w.tp_rank) for w in config.republished_workers}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="republisher", daemon=True)

    @property
    def missing(self) -> set[tuple[int, int]]:
        with self._lock:
            return set(self._missing)

    def start(self) -> Republisher:
        if self._config.republished_workers:
            self._thread.start()
        return self

    def _fetch(self, worker: WorkerEndpoint) -> bool:
        try:
            (reply,) = fetch_payloads(
                worker.host, worker.port, [(worker.pp_rank, worker.tp_rank)], timeout_s=2.0
            )
            wire.decode_handshake_payload(
                reply.payload,
                expected_hash=self._config.compat_hash,
                expected_engine_id=self._config.engine_id,
                local_factors=self._config.compat_factors,
            )
        except DisaggError as exc:
            event(
                log,
                logging.DEBUG if self._stop.is_set() else logging.INFO,
                "worker payload not available yet",
                pp_rank=worker.pp_rank,
                tp_rank=worker.tp_rank,
                reason=exc.reason,
                error=exc.message,
            )
            return False
        self._server.set_payload(worker.pp_rank, worker.tp_rank, reply.payload)
        with self._lock:
            if (worker.pp_rank, worker.tp_rank) in self._missing:
                self._missing.discard((worker.pp_rank, worker.tp_rank))
                event(
                    log,
                    logging.INFO,
                    "republishing worker payload",
                    pp_rank=worker.pp_rank,
                    tp_rank=worker.tp_rank,
                )
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            done = all([self._fetch(w) for w in self._config.republished_workers])
            self._stop.wait(REPUBLISH_REFRESH_S if done else REPUBLISH_RETRY_S)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
