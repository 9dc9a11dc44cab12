"""The clients' request bodies: each read with a size bound before it is buffered (its content-length first,
then as it streams), within a time bound, and all those being read at once within one shared memory budget,
so slow or oversize clients cannot grow the router."""

from __future__ import annotations

import asyncio

from aiohttp import web

from disagg.worker.router.config import RouterConfig
from disagg.worker.router.protocol import Fault, RouterError
from disagg.worker.router.upstream import describe


class ClientBodies:
    """The bodies being read, and the bytes they hold together (`buffered`)."""

    def __init__(self, config: RouterConfig) -> None:
        self._config = config
        self.buffered = 0

    async def read(self, request: web.Request) -> bytes:
        """The client's body, read with a size bound before it is buffered (its content-length first, then
        as it streams), within `body_timeout_s`, and within the budget every body being read shares."""
        limit = self._config.max_request_bytes
        too_large = RouterError(
            Fault.CLIENT, "RequestTooLarge", f"the request body exceeds {limit} bytes", status=413
        )
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        body = bytearray()
        taken = 0
        try:
            async with asyncio.timeout(self._config.body_timeout_s):
                async for chunk in request.content.iter_any():
                    if len(body) + len(chunk) > limit:
                        raise too_large
                    if self.buffered + len(chunk) > self._config.max_body_buffer_bytes:
                        raise RouterError(
                            Fault.UNAVAILABLE,
                            "RequestBodyBufferFull",
                            "the router is reading as many request bytes as it may hold; retry later",
                            retry_after_s=self._config.retry_after_s,
                        )
                    self.buffered += len(chunk)
                    taken += len(chunk)
                    body += chunk
        except TimeoutError:
            raise RouterError(
                Fault.CLIENT,
                "RequestBodyTimeout",
                f"the request body did not arrive in {self._config.body_timeout_s:g} s",
                status=408,
            ) from None
        except web.RequestPayloadError as exc:
            # A body the client's framing or encoding broke (bad chunking, a gzip body that is not gzip).
            raise RouterError(
                Fault.CLIENT, "InvalidRequestBody", f"the request body cannot be read: {describe(exc)}"
            ) from None
        finally:
            self.buffered -= taken
        return bytes(body)
