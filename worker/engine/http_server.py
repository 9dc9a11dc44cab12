"""The engine's HTTP front (aiohttp): what a decode engine and a prefill engine's head serve.

- a decode engine, and the head (stage 0) of a prefill engine: `/v1/completions`, `/v1/chat/completions`
  (`openai_api` for the subset, `transfer_params` for vLLM's push `kv_transfer_params`), `/v1/models`;
- `/healthz`, `/readyz` and `/metrics`, as every engine process serves them (`http_common`).

A request goes to its leg (`prefill_leg`, `decode_leg`, or the engine's monolithic one); this module turns
the leg's tokens into a response or an SSE stream, and any failure into an OpenAI error body. A client that
goes away mid-decode closes the leg's token stream, which frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from aiohttp import web

from disagg.worker.contracts.kv_transfer_params import DecodeLeg, Endpoint, PrefillLeg
from disagg.worker.engine.api_errors import ApiError
from disagg.worker.engine.core import Engine
from disagg.worker.engine.decode_leg import decode_leg
from disagg.worker.engine.http_common import add_health_routes, errors_middleware, json_response
from disagg.worker.engine.openai_api import (
    SSE_DONE,
    GenerationRequest,
    Output,
    ResponseHead,
    api_error_of,
    models_response,
    parse_json,
    parse_request,
    sse,
)
from disagg.worker.engine.prefill_leg import prefill_leg
from disagg.worker.engine.transfer_params import internal_request_id

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024

Leg = Literal["prefill", "decode", "none"]


class Server:
    """The OpenAI-compatible app over one engine: each request to its leg, its tokens to the client."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.created = int(time.time())
        app = web.Application(middlewares=[errors_middleware], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        add_health_routes(app, lambda: engine.not_ready, lambda: engine.fatal, engine.metrics)
        self.app = app

    async def models(self, request: web.Request) -> web.Response:
        e = self.engine
        return json_response(models_response(e.settings.model_name, self.created, e.max_model_len))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        e = self.engine
        leg: Leg = "none"
        outcome = "error"
        try:
            if e.not_ready is not None:
                raise ApiError(503, f"the engine is not ready: {e.not_ready}")
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes") from None
            req = parse_request(endpoint, parse_json(raw), max_model_len=e.max_model_len)
            request_id = internal_request_id(endpoint, request.headers.get("X-Request-Id"), uuid.uuid4().hex)
            head = ResponseHead(req, request_id, e.settings.model_name, int(time.time()))
            if isinstance(req.transfer, PrefillLeg):
                leg = "prefill"
                response = await self._prefill(request, req, request_id, head)
            else:
                if isinstance(req.transfer, DecodeLeg):
                    leg = "decode"
                    tokens = decode_leg(e, req, request_id, req.transfer)
                else:
                    tokens = e.monolithic(req, request_id)
                response = await self._respond(request, head, self._count_prompt(tokens, len(req.prompt)))
            outcome = "ok"
            return response
        except ApiError as exc:
            outcome = "client_error" if exc.status < 500 else "error"
            return json_response(exc.body(), exc.status)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as exc:
            log.exception("request failed")
            return json_response(api_error_of(exc).body(), 500)
        finally:
            e.metrics.requests.labels(endpoint, leg, outcome).inc()

    async def _prefill(
        self, request: web.Request, req: GenerationRequest, request_id: str, head: ResponseHead
    ) -> web.StreamResponse:
        first, params = await prefill_leg(self.engine, req, request_id)
        self.engine.metrics.prompt_tokens.inc(len(req.prompt))
        output = Output(req.stop, 1)
        delta = output.push(first)
        if not req.stream:
            return json_response(head.response(output, params))
        response = await self._start_stream(request)
        await response.write(sse(head.chunk(delta, first=True, output=output, kv_transfer_params=params)))
        await self._end_stream(response, head, output)
        return response

    async def _count_prompt(self, tokens: AsyncIterator[int], num_prompt: int) -> AsyncIterator[int]:
        """`tokens`, counting the prompt's tokens (`vllm:prompt_tokens`) when the first one comes, as vLLM
        counts a prompt once its prefill (or its KV's arrival) gave the first token."""
        async with contextlib.aclosing(tokens):  # type: ignore[type-var]
            first = True
            async for token in tokens:
                if first:
                    first = False
                    self.engine.metrics.prompt_tokens.inc(num_prompt)
                yield token

    async def _start_stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        return response

    async def _end_stream(self, response: web.StreamResponse, head: ResponseHead, output: Output) -> None:
        if head.request.include_usage:
            await response.write(sse(head.usage_chunk(output)))
        await response.write(SSE_DONE)
        await response.write_eof()

    async def _respond(
        self, request: web.Request, head: ResponseHead, tokens: AsyncIterator[int]
    ) -> web.StreamResponse:
        req = head.request
        output = Output(req.stop, req.max_tokens)
        async with contextlib.aclosing(tokens):  # type: ignore[type-var]
            if not req.stream:
                async for token in tokens:
                    output.push(token)
                    if output.finished:
                        break
                return json_response(head.response(output, None))
            response: web.StreamResponse | None = None
            first = True
            try:
                async for token in tokens:
                    delta = output.push(token)
                    if response is None:
                        response = await self._start_stream(request)
                    if output.finished:
                        await response.write(sse(head.chunk(delta, first=first, output=output)))
                        break
                    if delta.text or delta.token_ids or first:
                        await response.write(sse(head.chunk(delta, first=first)))
                        first = False
                assert response is not None
                await self._end_stream(response, head, output)
                return response
            except ConnectionResetError:
                assert response is not None
                return response
            except Exception as exc:
                if response is None:
                    raise
                # Headers are gone: the error travels in the stream, as vLLM sends it.
                with contextlib.suppress(ConnectionResetError):
                    await response.write(sse(api_error_of(exc).body()))
                    await response.write(SSE_DONE)
                return response
