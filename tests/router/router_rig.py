"""What the router's tests share: the real router app on a real socket in front of two fake engines
(`engine_fakes`), and a client session."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from engine_fakes import HOST, Exchange, FakeEngine, engines, pair_of, routing_of
from multidict import CIMultiDict

from disagg.worker.router.app import Router, RouterConfig, start

T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        async with asyncio.timeout(60):
            return await coro

    return asyncio.run(bounded())


@dataclass
class Rig:
    router: Router
    url: str
    prefill: FakeEngine
    decode: FakeEngine
    client: aiohttp.ClientSession
    exchange: Exchange

    async def post(self, path: str, body: Any) -> tuple[int, CIMultiDict[str], bytes]:
        async with self.client.post(self.url + path, json=body) as response:
            return response.status, CIMultiDict(response.headers), await response.read()


@contextlib.asynccontextmanager
async def rig(
    config: RouterConfig | None = None, *, routed: bool = True, canary: bool = False
) -> AsyncIterator[Rig]:
    """The router in front of the fakes. The KV canary is off unless asked for: these tests count the
    requests the fakes see, and `test_router_canary` tests the canary itself."""
    exchange = Exchange()
    async with engines(
        exchange, ("prefill", "tiny-prefill-0@1a2b", 2), ("decode", "tiny-decode@9f8e", 1)
    ) as (
        prefill,
        decode,
    ):
        router = Router(dataclasses.replace(config or RouterConfig(), kv_canary=canary))
        if routed:
            router.set_routing(routing_of(pair_of(prefill, decode, decode_pod="tiny-decode-x")))
        runner = await start(router, HOST, 0)
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as client:
                yield Rig(router, f"http://{HOST}:{port}", prefill, decode, client, exchange)
        finally:
            await runner.cleanup()


async def until(condition: Callable[[], bool]) -> None:
    """Wait for `condition` (the test's overall bound in `run` fails it if it never holds)."""
    while not condition():
        await asyncio.sleep(0.01)


def sse_events(raw: bytes) -> list[Any]:
    events = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


COMPLETION = {
    "model": "tiny",
    "prompt": "The capital of France is",
    "max_tokens": 8,
    "temperature": 0,
    "seed": 7,
}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8}


async def hang(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")
