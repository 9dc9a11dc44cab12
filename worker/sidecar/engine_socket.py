"""The engine's Unix socket: one reader thread per connection decodes frames into the sidecar's inbox; the
main thread writes replies and events back through `EngineConnection.send`.

A frame that does not decode is queued as a `Refusal` in the same inbox, so the main thread answers every
frame of a connection in the order it came (the protocol's promise), and nothing one frame holds can end a
reader: a frame the reader cannot delimit (over the size bound, or stalled past `FRAME_TIMEOUT_S`) is
refused and that connection closed after the reply."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
from dataclasses import dataclass

from disagg.worker.kv import wire
from disagg.worker.kv.errors import DisaggError, EngineProtocolError, InternalError
from disagg.worker.link.engine_link import (
    FRAME_TIMEOUT_S,
    EngineMessage,
    SidecarMessage,
    decode_engine_message,
    encode_frame,
    read_frame,
)
from disagg.worker.sidecar.logs import event

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


@dataclass(frozen=True)
class Refusal:
    """A frame that is no engine message: the main thread answers it with `Error`, in its turn."""

    error: DisaggError
    hang_up: bool = False
    """The frame could not be delimited: after the reply, the connection is closed."""


Inbound = tuple[EngineConnection, EngineMessage | Refusal]


class EngineSocketServer:
    """Accepts engine connections on a Unix socket; decoded messages go to `inbox`, garbage gets an error."""

    def __init__(self, path: str, inbox: queue.Queue[Inbound]) -> None:
        self.path = path
        self._inbox = inbox
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(16)
        self._connections: list[EngineConnection] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="engine-socket", daemon=True)

    @property
    def alive(self) -> bool:
        """The accepting thread runs (readiness reports a dead one)."""
        return self._thread.is_alive()

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
        hung_up = False
        while conn.open:
            try:
                body = read_frame(conn.sock, FRAME_TIMEOUT_S)
            except (OSError, EngineProtocolError) as exc:
                # A frame that cannot be delimited leaves no way to resynchronise: answer, then hang up.
                self._inbox.put((conn, Refusal(EngineProtocolError(wire.clip(str(exc))), hang_up=True)))
                hung_up = True
                break
            if body is None:
                break
            try:
                message: EngineMessage | Refusal = decode_engine_message(body)
            except DisaggError as exc:
                message = Refusal(exc)
            except Exception as exc:
                # Whatever decoding one frame raises (a bug, deep nesting) refuses that frame only.
                message = Refusal(InternalError(f"{type(exc).__name__}: {wire.clip(str(exc))}"))
            self._inbox.put((conn, message))
        event(log, logging.INFO, "engine disconnected", connection=conn.number)
        if not hung_up:
            conn.close()

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
