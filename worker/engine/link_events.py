"""The engine's connection to its sidecar: connect and register the KV pool, then hand every event on.

`EngineLink.wait` serves one waiter; the server has many requests waiting at once, so one thread reads every
event (`KVReady`, `KVSent`, `KVFailed`) and hands each to `on_event`; a lost link goes to `on_lost` once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from disagg.worker.kv.errors import DisaggError, PeerUnreachable
from disagg.worker.link.engine_link import EngineLink, Event, RegisterLayout

log = logging.getLogger(__name__)

CONNECT_RETRY_S = 1.0


def connect_and_register(
    socket_path: str,
    message: RegisterLayout,
    *,
    reply_timeout_s: float,
    stopping: threading.Event,
) -> EngineLink | None:
    """Connect to the sidecar (it may start after the engine) and register; None when `stopping` is set
    first. A refused registration raises its typed error: the configuration will not heal by retrying."""
    while not stopping.is_set():
        try:
            link = EngineLink(socket_path, connect_timeout_s=CONNECT_RETRY_S, reply_timeout_s=reply_timeout_s)
        except PeerUnreachable:
            time.sleep(CONNECT_RETRY_S)
            continue
        try:
            link.register_layout(message)
        except BaseException:
            link.close()
            raise
        return link
    return None


class LinkEvents:
    """Reads the link's events on a thread of its own until the link closes."""

    def __init__(
        self,
        link: EngineLink,
        on_event: Callable[[Event], None],
        on_lost: Callable[[str], None],
    ) -> None:
        self._link = link
        self._on_event = on_event
        self._on_lost = on_lost
        self.closing = False
        self._thread = threading.Thread(target=self._run, name="engine-link-events", daemon=True)

    def start(self) -> LinkEvents:
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            try:
                event = self._link.next_event(1.0)
            except DisaggError as exc:
                if not self.closing:
                    self._on_lost(exc.message)
                return
            if event is not None:
                try:
                    self._on_event(event)
                except Exception:
                    log.exception("handling a sidecar event failed")

    def stop(self) -> None:
        self.closing = True
        self._link.close()
        self._thread.join(timeout=5)
