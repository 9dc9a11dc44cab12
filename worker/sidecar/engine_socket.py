"""The engine's Unix socket: one reader thread per connection decodes frames into the sidecar's inbox; the
main thread writes replies and events back through `EngineConnection.send`."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading

from disagg.worker.kv.errors import DisaggError, EngineProtocolError
from disagg.worker.sidecar.engine_link import (
    EngineMessage,
    Error,
    SidecarMessage,
    decode_engine_message,
    encode_frame,
    read_frame,
)
from disagg.worker.sidecar.logs import event
from disagg.worker.sidecar.metrics import SidecarMetrics

log = logging.getLogger(__name__)


class EngineConnection:
    """One engine connection; the main thread writes replies and events, a reader thread queues messages."""

    def __init__(self, sock: socket.socket, number: int) -> None:
        self.sock = sock
        self.number = number
        self._lock = threading.Lock()
        self.open = True

    def send(self, message: SidecarMessage) -> None:
        with self._lock:
            if not self.open:
                return
            try:
                self.sock.sendall(encode_frame(message))
            except OSError as exc:
                self.open = False
                event(log, logging.WARNING, "engine connection lost", connection=self.number, error=str(exc))

    def close(self) -> None:
        with self._lock:
            self.open = False
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


Inbound = tuple[EngineConnection, EngineMessage]


class EngineSocketServer:
    """Accepts engine connections on a Unix socket; decoded messages go to `inbox`, garbage gets an error."""

    def __init__(self, path: str, inbox: queue.Queue[Inbound], metrics: SidecarMetrics) -> None:
        self.path = path
        self._inbox = inbox
        self._metrics = metrics
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(16)
        self._connections: list[EngineConnection] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="engine-socket", daemon=True)

    def start(self) -> EngineSocketServer:
        self._thread.start()
        return self

    def _accept(self) -> None:
        number = 0
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            number += 1
            conn = EngineConnection(sock, number)
            with self._lock:
                self._connections.append(conn)
            event(log, logging.INFO, "engine connected", connection=number)
            threading.Thread(
                target=self._read, args=(conn,), name=f"engine-conn-{number}", daemon=True
            ).start()

    def _read(self, conn: EngineConnection) -> None:
        while conn.open:
            try:
                body = read_frame(conn.sock)
            except (OSError, EngineProtocolError) as exc:
                # A frame that cannot be delimited leaves no way to resynchronise: answer, then hang up.
                self._refuse(conn, EngineProtocolError(str(exc)))
                break
            if body is None:
                break
            try:
                message = decode_engine_message(body)
            except EngineProtocolError as exc:
                self._refuse(conn, exc)
                continue
            self._inbox.put((conn, message))
        event(log, logging.INFO, "engine disconnected", connection=conn.number)
        conn.close()

    def _refuse(self, conn: EngineConnection, error: DisaggError) -> None:
        self._metrics.engine_errors.labels(error.reason).inc()
        event(log, logging.WARNING, "refused an engine message", reason=error.reason, error=error.message)
        conn.send(Error(error.reason, error.message))

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        # Closing the listening socket ends accept(); join so no connection is accepted after stop().
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._lock:
            for conn in self._connections:
                conn.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
