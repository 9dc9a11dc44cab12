"""Engines for the router's tests: small aiohttp servers that answer like vLLM's push connector and record
what they received. The router is the thing under test; these stand in for the engines on the other side of
its sockets, and each can be told to misbehave (fail, stall, answer garbage) on one leg.

A fake prefill answers with the `kv_transfer_params` vLLM's `request_finished` returns and the prompt's
length in words as its `usage.prompt_tokens`; a fake decoder answers with a text derived from the prompt,
once "its KV has arrived": the prefill leg of the same request id has finished (at once for a request without
`kv_transfer_params`, which it computes alone). A fake prefill can also wait for the decoder's registration
first (`wait_for_decode`), which a router that sent the legs one after the other would never satisfy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from disagg.worker.contracts.pairing import DecodeTarget, Pair, PrefillTarget, Routing

HOST = "127.0.0.1"
Behaviour = Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


@dataclass
class Received:
    path: str
    headers: CIMultiDict[str]
    body: dict[str, Any]


@dataclass
class Exchange:
    """What the fake engines of one test share: which request ids' prefills finished, which decoders
    registered, and which legs were ended by the router closing the connection."""

    prefilled: dict[str, asyncio.Event] = field(default_factory=dict)
    registered: dict[str, asyncio.Event] = field(default_factory=dict)

    def event(self, table: dict[str, asyncio.Event], request_id: str) -> asyncio.Event:
        return table.setdefault(request_id, asyncio.Event())


def completion_text(body: dict[str, Any]) -> str:
    """The decoder's deterministic answer: what the monolithic engine would say, for the tests' purposes."""
    if "messages" in body:
        prompt = " ".join(str(m.get("content")) for m in body["messages"])
    else:
        prompt = str(body.get("prompt"))
    return f"answer to [{prompt}]"


def tokens(text: str) -> list[str]:
    words = text.split(" ")
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


class FakeEngine:
    """One engine (role "prefill" or "decode") on 127.0.0.1, serving the OpenAI subset the router uses."""

    def __init__(
        self, role: str, exchange: Exchange, *, engine_id: str = "", pp_size: int = 1, tp_size: int = 1
    ):
        self.role = role
        self.exchange = exchange
        self.engine_id = engine_id or f"{role}-engine"
        self.pp_size = pp_size
        self.tp_size = tp_size
        self.received: list[Received] = []
        self.aborted: list[str] = []  # X-Request-Ids whose connection the router closed mid-request
        self.finished: list[str] = []
        self.behaviour: Behaviour | None = None
        self.wait_for_decode = False
        self.says_prompt_length = True
        self.metrics_page: Callable[[], str] | None = None
        """What `/metrics` answers (404 when None)."""
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, HOST, 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics_page is None:
            raise web.HTTPNotFound()
        return web.Response(text=self.metrics_page())

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        request_id = request.headers.get("X-Request-Id", "")
        self.received.append(Received(request.path, CIMultiDict(request.headers), body))
        try:
            if self.behaviour is not None:
                response = await self.behaviour(request, body)
            elif self.role == "prefill":
                response = await self._prefill(request, body, request_id)
            else:
                response = await self._decode(request, body, request_id)
        except asyncio.CancelledError:
            self.aborted.append(request_id)
            raise
        self.finished.append(request_id)
        return response

    async def _prefill(self, request: web.Request, body: dict[str, Any], request_id: str) -> web.Response:
        if self.wait_for_decode:
            await self.exchange.event(self.exchange.registered, request_id).wait()
        prefix = "chatcmpl" if request.path.endswith("chat/completions") else "cmpl"
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[1, 2], [201, 202]],
            "remote_engine_id": self.engine_id,
            "remote_request_id": f"{prefix}-{request_id}",
            "remote_host": HOST,
            "remote_port": 5600,
            "tp_size": self.tp_size,
            "dcp_size": 1,
            "pp_size": self.pp_size,
            "remote_num_tokens": 20,
            "transfer_mode": "push",
        }
        self.exchange.event(self.exchange.prefilled, request_id).set()
        answer: dict[str, Any] = {
            "id": f"{prefix}-{request_id}",
            "object": "text_completion",
            "choices": [{"text": "x"}],
            "kv_transfer_params": params,
        }
        if self.says_prompt_length:
            answer["usage"] = {"prompt_tokens": len(str(body.get("prompt", "")).split())}
        return web.json_response(answer)

    async def _decode(
        self, request: web.Request, body: dict[str, Any], request_id: str
    ) -> web.StreamResponse:
        if "kv_transfer_params" in body:
            self.exchange.event(self.exchange.registered, request_id).set()
            await self.exchange.event(self.exchange.prefilled, request_id).wait()
        text = completion_text(body)
        chat = request.path.endswith("chat/completions")
        if not body.get("stream"):
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if chat
                else {"index": 0, "text": text}
            )
            return web.json_response(
                {"id": request_id, "choices": [choice], "usage": {"completion_tokens": 4}}
            )
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for token in tokens(text):
            delta = {"index": 0, "delta": {"content": token}} if chat else {"index": 0, "text": token}
            await out.write(b"data: " + json.dumps({"id": request_id, "choices": [delta]}).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


def pair_of(prefill: FakeEngine, decode: FakeEngine, *, decode_pod: str = "") -> Pair:
    return Pair(
        PrefillTarget(
            engine_id=prefill.engine_id,
            head_pod=f"{prefill.engine_id}-0",
            host=HOST,
            http_port=prefill.port,
            side_channel_port=5600,
            tp_size=prefill.tp_size,
            pp_size=prefill.pp_size,
            stage_pods=tuple(f"{prefill.engine_id}-{i}" for i in range(prefill.pp_size)),
            kv_hash="h",
        ),
        DecodeTarget(
            pod=decode_pod or decode.engine_id,
            engine_id=decode.engine_id,
            host=HOST,
            http_port=decode.port,
            tp_size=decode.tp_size,
            kv_hash="h",
        ),
    )


def routing_of(*pairs: Pair) -> Routing:
    return Routing(
        prefills=tuple({p.prefill for p in pairs}),
        decodes=tuple({p.decode for p in pairs}),
        pairs=pairs,
        exclusions=(),
    )


@contextlib.asynccontextmanager
async def engines(exchange: Exchange, *specs: tuple[str, str, int]) -> AsyncIterator[list[FakeEngine]]:
    """Fake engines (role, engine id, pp size), started; stopped on exit."""
    started = [FakeEngine(role, exchange, engine_id=engine_id, pp_size=pp) for role, engine_id, pp in specs]
    for engine in started:
        await engine.start()
    try:
        yield started
    finally:
        for engine in started:
            await engine.stop()
