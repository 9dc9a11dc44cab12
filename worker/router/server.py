"""The router's listening socket: a cap on client connections, and what happens past it.

aiohttp bounds a connection's header bytes (`max_field_size`, `max_headers`) but neither how many connections
it holds nor, by default, for how long one may sit without sending a request (its keep-alive timer starts at
3630 s). The router sets that timer to `RouterConfig.header_timeout_s`; aiohttp starts it when a connection
opens and when a response ends, and bytes that arrive do not restart it, so it is a header timeout too: a
client that trickles half a request line or half its headers is dropped when it expires (a test pins that).

The cap counts the connections handed to aiohttp. One past it is answered at once, without reading its
request, with a 503 in OpenAI's error JSON and a Retry-After, then closed: the client learns it should come
back, and the router spends a few hundred bytes on it. Refused connections linger (half-closed, their input
discarded) for a second at most, so the answer is not lost to a reset while the client is still sending; past
`limit` of those at once, a further one is reset at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web

from disagg.worker.router.protocol import Fault, RouterError, error_body

ProtocolFactory = Callable[[], asyncio.Protocol]


def refusal_response(retry_after_s: int, limit: int) -> bytes:
    """The whole HTTP answer to a connection past the cap."""
    error = RouterError(
        Fault.UNAVAILABLE,
        "TooManyConnections",
        f"the router holds its maximum of {limit} client connections; retry after {retry_after_s} s",
        retry_after_s=retry_after_s,
    )
    body = error_body(error)
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"Retry-After: {retry_after_s}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


class ConnectionGate:
    """Counts the client connections handed to aiohttp and refuses those past `limit` (0: no cap)."""

    def __init__(self, limit: int, *, retry_after_s: int = 1, linger_s: float = 1.0) -> None:
        self.limit = limit
        self.linger_s = linger_s
        self.refusal = refusal_response(retry_after_s, limit)
        self.open = 0
        self.refused = 0
        self._lingering: set[asyncio.Transport] = set()

    def factory(self, inner: ProtocolFactory) -> ProtocolFactory:
        return lambda: _Gated(self, inner)

    def admits(self) -> bool:
        return self.limit <= 0 or self.open < self.limit

    def close_refused(self) -> None:
        for transport in list(self._lingering):
            transport.abort()


class _Gated(asyncio.Protocol):
    """One accepted connection: either aiohttp's protocol (forwarded to), or a refusal."""

    def __init__(self, gate: ConnectionGate, inner: ProtocolFactory) -> None:
        self._gate = gate
        self._factory = inner
        self._inner: asyncio.Protocol | None = None
        self._refused: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Decided here rather than in the factory: asyncio may create several protocols before any connection
        # is made, and a connection that fails before this point never reports its loss.
        gate = self._gate
        if gate.admits():
            gate.open += 1
            self._inner = self._factory()
            self._inner.connection_made(transport)
            return
        gate.refused += 1
        stream = cast(asyncio.Transport, transport)
        if gate.limit > 0 and len(gate._lingering) >= gate.limit:
            stream.abort()
            return
        self._refused = stream
        gate._lingering.add(stream)
        stream.write(gate.refusal)
        if stream.can_write_eof():
            stream.write_eof()
        self._timer = asyncio.get_running_loop().call_later(gate.linger_s, stream.abort)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._inner is not None:
            return self._inner.eof_received()
        # A refused client has sent everything it will: the transport closes.
        return None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._inner is not None:
            self._gate.open -= 1
            self._inner.connection_lost(exc)
            self._inner = None
        if self._refused is not None:
            self._gate._lingering.discard(self._refused)
            self._refused = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Serving:
    """A started router: where it listens, and `cleanup` to stop it (as `web.AppRunner` has them)."""

    def __init__(self, runner: web.AppRunner, server: asyncio.Server, gate: ConnectionGate) -> None:
        self.runner = runner
        self.server = server
        self.gate = gate

    @property
    def addresses(self) -> list[Any]:
        return [sock.getsockname() for sock in self.server.sockets]

    async def cleanup(self) -> None:
        self.server.close()
        self.gate.close_refused()
        await self.runner.cleanup()
        # Last: from Python 3.12 this waits for every connection, which the runner's cleanup has closed.
        with contextlib.suppress(Exception):
            await self.server.wait_closed()


async def serve(
    app: web.Application,
    gate: ConnectionGate,
    host: str,
    port: int,
    *,
    header_timeout_s: float,
    backlog: int = 512,
) -> Serving:
    """Serve `app` on host:port behind `gate`. A client that disconnects cancels its handler (aiohttp's
    handler_cancellation), which is what closes both legs of a non-streamed request."""
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, keepalive_timeout=header_timeout_s
    )
    await runner.setup()
    server = runner.server
    assert server is not None, "set up above"
    listening = await asyncio.get_running_loop().create_server(
        gate.factory(server), host, port, backlog=backlog, reuse_address=True
    )
    return Serving(runner, listening, gate)
