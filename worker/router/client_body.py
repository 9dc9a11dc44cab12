"""The clients' request bodies: each read with a size bound before it is buffered (its content-length first,
then as it streams), within a time bound and above a rate floor, and all those being read at once within one
shared memory budget, shared fairly, so that slow or oversize clients can neither grow the router nor lock
others out of it.

The budget is shared max-min fair between the bodies being read (one per connection): when a chunk does not
fit, the body it belongs to is refused only if it holds more than its share (the budget over the bodies being
read) already; otherwise the bodies over their share, largest first, are cut (503 with Retry-After, their
connection closed) until it fits. A shared first-come budget let 16 slow uploads fill all of it and every
other client get 503 until their body timeout, a minute later. Now a body within its share always gets in,
whoever holds the rest. The rate floor bounds how long a slow upload holds anything: a body must arrive at
`min_body_rate_bytes_s` on average from its headers on, once `body_rate_grace_s` has passed, or it gets 408.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import StreamReader, web

from disagg.worker.router.config import RouterConfig
from disagg.worker.router.protocol import Fault, RouterError
from disagg.worker.router.upstream import describe


@dataclass(eq=False)
class _Reading:
    """One body being read: the bytes it holds of the budget, and its stream (to cut it)."""

    content: StreamReader
    held: int = 0


class ClientBodies:
    """The bodies being read, and the bytes they hold together (`buffered`)."""

    def __init__(self, config: RouterConfig) -> None:
        self._config = config
        self.buffered = 0
        self._reading: set[_Reading] = set()

    async def read(self, request: web.Request) -> bytes:
        """The client's body, read with a size bound before it is buffered (its content-length first, then
        as it streams), within `body_timeout_s`, above the rate floor, and within its share of the budget
        every body being read shares."""
        config = self._config
        limit = config.max_request_bytes
        too_large = RouterError(
            Fault.CLIENT, "RequestTooLarge", f"the request body exceeds {limit} bytes", status=413
        )
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        body = bytearray()
        reading = _Reading(request.content)
        self._reading.add(reading)
        loop = asyncio.get_running_loop()
        started = loop.time()
        too_slow = False
        try:
            async with asyncio.timeout(config.body_timeout_s):
                chunks = request.content.iter_any().__aiter__()
                while True:
                    # The rate floor: the next chunk is due by when the bytes so far fall under it.
                    due = (
                        started + max(config.body_rate_grace_s, len(body) / config.min_body_rate_bytes_s)
                        if config.min_body_rate_bytes_s > 0
                        else None
                    )
                    try:
                        async with asyncio.timeout_at(due):
                            chunk = await anext(chunks)
                    except StopAsyncIteration:
                        break
                    except TimeoutError:
                        if due is not None and loop.time() >= due:
                            too_slow = True
                        raise
                    if len(body) + len(chunk) > limit:
                        raise too_large
                    self._make_room(reading, len(chunk))
                    self.buffered += len(chunk)
                    reading.held += len(chunk)
                    body += chunk
        except TimeoutError:
            if too_slow:
                raise RouterError(
                    Fault.CLIENT,
                    "RequestBodyTooSlow",
                    f"the request body arrived slower than {config.min_body_rate_bytes_s} bytes/s",
                    status=408,
                ) from None
            raise RouterError(
                Fault.CLIENT,
                "RequestBodyTimeout",
                f"the request body did not arrive in {config.body_timeout_s:g} s",
                status=408,
            ) from None
        except web.RequestPayloadError as exc:
            # A body the client's framing or encoding broke (bad chunking, a gzip body that is not gzip).
            raise RouterError(
                Fault.CLIENT, "InvalidRequestBody", f"the request body cannot be read: {describe(exc)}"
            ) from None
        finally:
            self._reading.discard(reading)
            self.buffered -= reading.held
        return bytes(body)

    def _make_room(self, reading: _Reading, size: int) -> None:
        """Room in the budget for `size` more bytes of `reading`: cut the bodies over their share, largest
        first, if `reading` stays within its own; else refuse it."""
        budget = self._config.max_body_buffer_bytes
        share = budget // len(self._reading)
        while self.buffered + size > budget:
            others = [r for r in self._reading if r is not reading]
            largest = max(others, key=lambda r: r.held, default=None)
            if reading.held + size > share or largest is None or largest.held <= share:
                raise RouterError(
                    Fault.UNAVAILABLE,
                    "RequestBodyBufferFull",
                    "the router is reading as many request bytes as it may hold; retry later",
                    retry_after_s=self._config.retry_after_s,
                )
            # Its bytes are counted free now: its reader wakes to the error and drops them at its next turn.
            self._reading.discard(largest)
            self.buffered -= largest.held
            largest.held = 0
            largest.content.set_exception(
                RouterError(
                    Fault.UNAVAILABLE,
                    "RequestBodyEvicted",
                    f"the request body held more than its share ({share} bytes) of the router's body budget "
                    "while other clients waited; retry later",
                    retry_after_s=self._config.retry_after_s,
                )
            )
