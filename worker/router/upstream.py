"""What the router reads from an engine, all of it untrusted: a leg's answer read up to a bound, a decoder's
SSE stream split into events and each checked before it reaches the client, and how a failed connection is
named (whose fault, which leg)."""

from __future__ import annotations

import json
from typing import Final

import aiohttp

from disagg.worker.router.protocol import Fault, RouterError

_SSE_DONE: Final = b"[DONE]"


class SseEvents:
    """Splits a decoder's byte stream into SSE events and checks each: every `data:` line is JSON or
    `[DONE]`. An event that is not, or grows past the bound without ending, is the decoder's failure. Each
    event comes with whether it is `[DONE]` and whether it carries a token (a JSON object with a non-empty
    `choices`: the metrics time tokens by these, not by usage-only or keep-alive events)."""

    def __init__(self, max_event_bytes: int) -> None:
        self.max_event_bytes = max_event_bytes
        # Events with a data line so far (comment-only events, such as keep-alives, are not counted).
        self.data_events = 0
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list[tuple[bytes, bool, bool]]:
        """The complete events in `chunk` (with what came before): (event, is `[DONE]`, carries a token)."""
        self._buffer += chunk.replace(b"\r\n", b"\n")
        events: list[tuple[bytes, bool, bool]] = []
        while True:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                break
            event = bytes(self._buffer[: end + 2])
            del self._buffer[: end + 2]
            done, data, token = _check_event(event)
            self.data_events += data
            events.append((event, done, token))
            if done:
                return events
        if len(self._buffer) > self.max_event_bytes:
            raise RouterError(
                Fault.UPSTREAM,
                "DecodeInvalidStream",
                f"an SSE event of the decoder exceeds {self.max_event_bytes} bytes",
            )
        return events


def _check_event(event: bytes) -> tuple[bool, bool, bool]:
    """Whether the event is `[DONE]`, whether it carries data at all, and whether a token."""
    done = data_lines = token = False
    for line in event.split(b"\n"):
        if not line or line.startswith(b":") or line.startswith((b"event:", b"id:", b"retry:")):
            continue
        if not line.startswith(b"data:"):
            raise RouterError(
                Fault.UPSTREAM, "DecodeInvalidStream", "the decoder sent a line that is not SSE"
            )
        data_lines = True
        data = line[5:].strip()
        if data == _SSE_DONE:
            done = True
            continue
        try:
            value = json.loads(data)
        except (ValueError, RecursionError, UnicodeDecodeError):
            raise RouterError(
                Fault.UPSTREAM, "DecodeInvalidStream", "the decoder sent an SSE event that is not JSON"
            ) from None
        token = token or (isinstance(value, dict) and bool(value.get("choices")))
    return done, data_lines, token


async def read_bounded(response: aiohttp.ClientResponse, limit: int, leg: str) -> bytes:
    if response.content_length is not None and response.content_length > limit:
        raise RouterError(
            Fault.UPSTREAM, f"{leg.capitalize()}TooLarge", f"the {leg} answer exceeds {limit} bytes"
        )
    body = bytearray()
    async for chunk in response.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise RouterError(
                Fault.UPSTREAM, f"{leg.capitalize()}TooLarge", f"the {leg} answer exceeds {limit} bytes"
            )
    return bytes(body)


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def unreachable_or(leg: str, exc: BaseException) -> str:
    """`<Leg>Unreachable` when no connection could be made, else `<Leg>Failed` (the engine broke the
    protocol: an oversize header, a malformed status line, a reset)."""
    return f"{leg}Unreachable" if isinstance(exc, aiohttp.ClientConnectorError) else f"{leg}Failed"


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
