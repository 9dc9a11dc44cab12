"""`disagg engine serve`: the reference engine behind an OpenAI-compatible HTTP server (aiohttp).

One process per engine worker, next to its transfer sidecar. It maps its KV pool from a /dev/shm file,
registers it with the sidecar (`link_events`), and then serves:

- a decode engine, and the head (stage 0) of a prefill engine: `/v1/completions`, `/v1/chat/completions`
  (`openai_api` for the subset, `transfer_params` for vLLM's push `kv_transfer_params`), `/v1/models`;
- every process: `/healthz` (the process serves), `/readyz` (200 once registered with its sidecar and, on a
  PP head, once every stage joined), `/metrics` (`metrics`).

The legs, as vLLM's push connector runs them:
- prefill leg (`do_remote_decode`): the head prefills the prompt on every stage (`stages`), each stage tells
  its sidecar `RequestFinished` for its own layers, and the response carries the first token (one token,
  whatever `max_tokens` asks: vLLM's routers send 1) and the `kv_transfer_params` a decoder needs. The
  blocks are held until every stage's sidecar reports the push done or the lease over (`scheduler`).
- decode leg (`do_remote_prefill`): the decoder allocates blocks for the prompt and the output, sends
  `ExpectRequest` naming the prefill engine, and waits for `KVReady`. Then it recomputes the last prompt
  token from the received KV, as vLLM does after a full prompt hit, which yields the first token (the model
  computes a prompt's last token alone so these are the prefill's bits), and decodes greedily.
- neither: the whole request here (a decoder, or a prefill engine without PP).

Every model step and every block-id change runs on one model thread, never on the event loop; requests
interleave step by step. A client that goes away mid-decode frees its blocks at once; one that goes away
while its KV is still expected frees them when the sidecar's registration ends (a prefill may still write).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from aiohttp import web

from disagg.worker.contracts.kv_transfer_params import DecodeLeg, Endpoint, PrefillLeg
from disagg.worker.contracts.topology import Role, Topology
from disagg.worker.engine import stages
from disagg.worker.engine.api_errors import ApiError, bad_request, error_body
from disagg.worker.engine.config import TinyConfig
from disagg.worker.engine.kv_cache import BlockTables, OutOfBlocks, PagedKVCache
from disagg.worker.engine.link_events import LinkEvents, connect_and_register
from disagg.worker.engine.metrics import EngineMetrics
from disagg.worker.engine.model import TinyModel
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
from disagg.worker.engine.pp import map_kv_cache
from disagg.worker.engine.scheduler import BlockScheduler, State
from disagg.worker.engine.transfer_params import internal_request_id, prefill_response_params
from disagg.worker.kv.errors import DisaggError, DuplicateRequest, WorkerConfigError
from disagg.worker.link.engine_link import (
    EngineLink,
    Event,
    KVFailed,
    KVReady,
    KVSent,
    PrefillEngine,
    RegisterLayout,
    register_layout_message,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_BODY_BYTES = 8 * 1024 * 1024
KV_WAIT_GRACE_S = 30.0
"""Past the registration timeout, how long a decode leg still waits for its sidecar's verdict."""
LINK_REPLY_TIMEOUT_S = 60.0
SHUTDOWN_S = 5.0
# The sidecar refused the decode leg's parameters (the client's fault), rather than failing to serve them.
_CLIENT_REASONS = {"EngineProtocolError", "UnsupportedPeerTopology", "DuplicateRequest", "BlockIdOutOfRange"}


@dataclass(frozen=True)
class ServeSettings:
    """Everything `disagg engine serve` needs: its flags and what `sidecar.config.from_env` read."""

    role: Role
    engine_id: str
    pp_rank: int
    pp_size: int
    tp_size: int
    advertised_host: str
    """`remote_host` of a prefill response: where the engine's side channel answers (its head)."""
    advertised_port: int
    engine_socket: str
    kv_pool: str
    topology: Topology
    model_name: str
    host: str = "0.0.0.0"
    port: int = 8000
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    num_blocks: int = 1024

    @property
    def headless(self) -> bool:
        return self.role == "prefill" and self.pp_rank > 0


def model_config(topology: Topology, role: Role) -> TinyConfig:
    """The tiny model the topology describes; `WorkerConfigError` when it describes another model."""
    geometry = topology.model
    try:
        config = TinyConfig(
            num_layers=len(geometry.kinds),
            num_kv_heads=geometry.num_kv_heads,
            head_size=geometry.head_size,
            block_size=topology.block_size,
        )
    except DisaggError as exc:
        raise WorkerConfigError(
            f"the reference engine cannot serve the topology's model: {exc.message}"
        ) from None
    if config.geometry != geometry:
        raise WorkerConfigError(
            f"the reference engine serves {config.geometry}, the topology's model is {geometry}"
        )
    if role == "prefill" and tuple(config.stages(topology.prefill_pp)) != tuple(topology.stage_layers):
        raise WorkerConfigError(
            f"the reference engine splits layers evenly ({config.stages(topology.prefill_pp)}), the "
            f"topology's stages are {list(topology.stage_layers)}"
        )
    if topology.prefill_tp != 1 or topology.decode_tp != 1 or topology.packed:
        raise WorkerConfigError("the reference engine runs TP 1 with layer-outer (not packed) pools")
    return config


class ModelThread:
    """The one thread that runs model steps, gloo exchanges and block bookkeeping, in submission order."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-model")

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self._executor.submit(fn))

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future = self._executor.submit(fn)
        future.add_done_callback(_log_failure)
        return future

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def _log_failure(future: Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("a model-thread job failed", exc_info=future.exception())


class Engine:
    """The serving engine (a decoder, or a prefill engine's head) and its request legs."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.config = model_config(settings.topology, settings.role)
        self.metrics = EngineMetrics()
        self.model_thread = ModelThread()
        self.model: TinyModel | None = None
        self.kv: PagedKVCache | None = None
        self.scheduler: BlockScheduler | None = None
        self.link: EngineLink | None = None
        self.pipeline: stages.PipelineHead | None = None
        self.not_ready: str | None = "starting"
        self.fatal: str | None = None
        self.done = asyncio.Event()
        self._stopping = threading.Event()
        self._events: LinkEvents | None = None
        self._on_terminal: dict[str, Callable[[Event], None]] = {}
        self._freed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.metrics.watch(lambda: self.scheduler)

    @property
    def max_model_len(self) -> int:
        return self.config.max_positions

    # -- start and stop ------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._spawn(self._start())

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start(self) -> None:
        s = self.settings
        try:
            await self.model_thread.run(self._load)
            assert self.kv is not None
            self.not_ready = "registering the KV pool with the sidecar"
            message = layout_message(self.config, s, self.kv)
            self.link = await asyncio.to_thread(
                connect_and_register,
                s.engine_socket,
                message,
                reply_timeout_s=LINK_REPLY_TIMEOUT_S,
                stopping=self._stopping,
            )
            if self.link is None:
                return
            self._events = LinkEvents(self.link, self._event_from_thread, self._lost_from_thread).start()
            if s.pp_size > 1:
                self.not_ready = f"waiting for the engine's {s.pp_size} stages to join"
                await self.model_thread.run(lambda: stages.join(s.master_addr, s.master_port, 0, s.pp_size))
                self.pipeline = stages.PipelineHead(self.model, self.kv, s.pp_size)  # type: ignore[arg-type]
                self._spawn(self._poll_stages())
            self.not_ready = None
            self.metrics.ready.set(1)
            log.info("engine ready: %s %s, %d KV blocks", s.role, s.engine_id, s.num_blocks)
        except Exception as exc:
            self._fail(f"startup failed: {type(exc).__name__}: {exc}")

    def _load(self) -> None:
        s = self.settings
        torch.set_num_threads(1)
        self.model = TinyModel(self.config)
        self.kv = new_pool(self.model, s)
        groups = len(self.config.stage_layout(s.num_blocks).groups)
        self.scheduler = BlockScheduler(self.kv.pool, s.num_blocks, groups, self.config.block_size)

    def _fail(self, reason: str) -> None:
        if self.fatal is None:
            log.error("engine failed: %s", reason)
            self.fatal = reason
            self.not_ready = reason
            self.metrics.ready.set(0)
            self.done.set()

    async def stop(self) -> None:
        self._stopping.set()
        self.not_ready = "stopping"
        self.metrics.ready.set(0)
        for task in list(self._tasks):
            task.cancel()
        if self.pipeline is not None and self.fatal is None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.model_thread.run(self.pipeline.quit), 10)
        if self.settings.pp_size > 1:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.model_thread.run(stages.leave), 10)
        if self._events is not None:
            await asyncio.to_thread(self._events.stop)
        await asyncio.to_thread(self.model_thread.close)

    # -- sidecar events ------------------------------------------------------------------------------------

    def _event_from_thread(self, event: Event) -> None:
        self._loop.call_soon_threadsafe(self._deliver, event)

    def _lost_from_thread(self, why: str) -> None:
        self._loop.call_soon_threadsafe(self._fail, f"the link to the sidecar is gone: {why}")

    def _deliver(self, event: Event) -> None:
        reason = event.reason if isinstance(event, KVFailed) else ""
        kind = {KVReady: "ready", KVSent: "sent", KVFailed: "failed"}[type(event)]
        self.metrics.kv_events.labels(kind, reason).inc()
        handler = self._on_terminal.pop(event.request_id, None)
        if handler is None:
            log.warning("a %s event for request %s that nothing waits for", kind, event.request_id)
            return
        handler(event)

    # -- block bookkeeping (on the model thread) -----------------------------------------------------------

    def _sched(self) -> BlockScheduler:
        if self.scheduler is None:
            raise ApiError(503, "the engine is not ready")
        return self.scheduler

    def _freed_blocks(self) -> None:
        self._loop.call_soon_threadsafe(self._wake_admissions)

    def _wake_admissions(self) -> None:
        self._freed.set()
        self._freed = asyncio.Event()

    def release(self, request_id: str) -> None:
        """Return a request's ids, after any model step already queued (which may still use them)."""

        def job() -> None:
            if self._sched().release(request_id):
                self._freed_blocks()

        self.model_thread.submit(job)

    def _stage_done(self, request_id: str, stage: int) -> None:
        def job() -> None:
            if self._sched().stage_done(request_id, stage):
                self._freed_blocks()

        self.model_thread.submit(job)

    async def _admit(
        self, request_id: str, num_tokens: int, state: State, waiting_on: range = range(0)
    ) -> BlockTables:
        scheduler = self._sched()
        if not scheduler.ever_fits(num_tokens):
            raise bad_request(
                f"{num_tokens} tokens need {scheduler.blocks_needed(num_tokens)} KV blocks; this engine has "
                f"{scheduler.usable_blocks}",
                "max_tokens",
            )
        while True:
            freed = self._freed
            job = self.model_thread.submit(lambda: scheduler.admit(request_id, num_tokens, state, waiting_on))
            try:
                return await asyncio.shield(asyncio.wrap_future(job))
            except OutOfBlocks:
                await freed.wait()
            except DuplicateRequest as exc:
                raise bad_request(exc.message, "X-Request-Id") from None
            except asyncio.CancelledError:
                # The allocation runs anyway: give its ids back once it has.
                job.add_done_callback(
                    lambda f: (
                        self.release(request_id) if not f.cancelled() and f.exception() is None else None
                    )
                )
                raise

    # -- model steps (on the model thread) -----------------------------------------------------------------

    def _step(self, token: int, position: int, tables: BlockTables) -> int:
        assert self.model is not None and self.kv is not None
        return int(torch.argmax(self.model.decode_step(token, position, self.kv, tables)))

    def _prefill_first(self, prompt: tuple[int, ...], tables: BlockTables) -> int:
        assert self.model is not None and self.kv is not None
        return int(torch.argmax(self.model.prefill(prompt, self.kv, tables)[-1]))

    async def _decode_from(
        self, first: int, num_prompt: int, tables: BlockTables, max_tokens: int
    ) -> AsyncIterator[int]:
        token = first
        yield token
        for step in range(max_tokens - 1):
            token = await self.model_thread.run(
                functools.partial(self._step, token, num_prompt + step, tables)
            )
            self.metrics.tokens.inc()
            yield token

    # -- the legs ------------------------------------------------------------------------------------------

    async def monolithic(self, req: GenerationRequest, request_id: str) -> AsyncIterator[int]:
        if self.settings.pp_size > 1:
            raise bad_request(
                "this is a pipeline-parallel prefill engine: it serves prefill legs "
                "(kv_transfer_params.do_remote_decode) only",
                "kv_transfer_params",
            )
        n = len(req.prompt)
        tables = await self._admit(request_id, n + req.max_tokens - 1, "running")
        try:
            first = await self.model_thread.run(lambda: self._prefill_first(req.prompt, tables))
            self.metrics.tokens.inc()
            async for token in self._decode_from(first, n, tables, req.max_tokens):
                yield token
        finally:
            self.release(request_id)

    async def prefill_leg(self, req: GenerationRequest, request_id: str) -> tuple[int, dict[str, Any]]:
        """The first token and the `kv_transfer_params` for the decoder; the blocks stay held."""
        s = self.settings
        if s.role != "prefill":
            raise bad_request(
                "this engine decodes: a prefill leg goes to a prefill engine", "kv_transfer_params"
            )
        n = len(req.prompt)
        tables = await self._admit(request_id, n, "prefilling", waiting_on=range(s.pp_size))
        self._on_terminal[request_id] = lambda event: self._stage_done(request_id, 0)
        blocks = stages.prompt_block_ids(tables, n, self.config.block_size)

        def job() -> int:
            if self.pipeline is not None:
                first = self.pipeline.prefill(request_id, req.prompt, tables)
            else:
                try:
                    first = self._prefill_first(req.prompt, tables)
                except Exception:
                    self._on_terminal.pop(request_id, None)
                    self.release(request_id)
                    raise
            try:
                assert self.link is not None
                self.link.request_finished(request_id, blocks)
            except DisaggError:
                self._on_terminal.pop(request_id, None)
                if self._sched().stage_done(request_id, 0):
                    self._freed_blocks()
                raise
            self._sched().set_state(request_id, "held_for_push")
            return first

        future = self.model_thread.submit(job)
        try:
            first = await asyncio.shield(asyncio.wrap_future(future))
        except DisaggError as exc:
            raise ApiError(
                502, f"the sidecar refused the finished prefill ({exc.reason}): {exc.message}"
            ) from None
        except RuntimeError as exc:
            if self.pipeline is None:
                raise
            # A gloo exchange failed: a stage is gone, and the group with it.
            self._fail(f"the pipeline broke: {exc}")
            raise ApiError(503, f"the pipeline broke: {exc}") from None
        self.metrics.tokens.inc()
        params = prefill_response_params(
            block_ids=blocks,
            engine_id=s.engine_id,
            request_id=request_id,
            host=s.advertised_host,
            port=s.advertised_port,
            tp_size=s.tp_size,
            pp_size=s.pp_size,
            num_tokens=n,
        )
        return first, params

    async def decode_leg(self, req: GenerationRequest, request_id: str, leg: DecodeLeg) -> AsyncIterator[int]:
        s = self.settings
        if s.role != "decode":
            raise bad_request(
                "this engine prefills: a decode leg goes to a decode engine", "kv_transfer_params"
            )
        n = len(req.prompt)
        if leg.remote_num_tokens is not None and leg.remote_num_tokens != n:
            raise bad_request(
                f"the prefill computed {leg.remote_num_tokens} prompt tokens, this request's prompt has {n}",
                "kv_transfer_params.remote_num_tokens",
            )
        tables = await self._admit(request_id, n + req.max_tokens - 1, "awaiting_kv")
        ready: asyncio.Future[Event] = self._loop.create_future()

        def on_event(event: Event) -> None:
            if ready.done():  # nobody decodes it any more
                self.release(request_id)
            else:
                ready.set_result(event)

        self._on_terminal[request_id] = on_event
        prefill = PrefillEngine(
            leg.remote_engine_id, leg.remote_host, leg.remote_port, leg.tp_size, leg.pp_size
        )
        blocks = stages.prompt_block_ids(tables, n, self.config.block_size)
        assert self.link is not None
        call = asyncio.ensure_future(asyncio.to_thread(self.link.expect_request, request_id, blocks, prefill))
        try:
            await asyncio.shield(call)
        except asyncio.CancelledError:
            ready.cancel()
            call.add_done_callback(lambda c: self._expect_refused(request_id) if c.exception() else None)
            raise
        except DisaggError as exc:
            self._expect_refused(request_id)
            status = 400 if exc.reason in _CLIENT_REASONS else 502
            raise ApiError(
                status, f"the sidecar refused the decode leg ({exc.reason}): {exc.message}"
            ) from None
        try:
            timeout = s.topology.push_registration_timeout_s + KV_WAIT_GRACE_S
            event = await asyncio.wait_for(asyncio.shield(ready), timeout)
        except TimeoutError:
            self._on_terminal.pop(request_id, None)
            self.release(request_id)
            raise ApiError(504, f"no verdict from the sidecar on request {request_id}'s KV") from None
        except asyncio.CancelledError:
            if ready.done() and not ready.cancelled():
                self.release(request_id)  # the KV came, but nobody decodes it
            else:
                ready.cancel()  # its event frees the blocks: until then a prefill may still write
            raise
        if isinstance(event, KVFailed):
            self.release(request_id)
            status = 504 if event.reason == "RegistrationTimeout" else 502
            raise ApiError(status, f"the KV transfer failed ({event.reason}): {event.message}")
        try:
            await self.model_thread.run(lambda: self._sched().set_state(request_id, "decoding"))
            # The first token: the last prompt token recomputed from the pushed KV (vLLM's full-hit rule).
            first = await self.model_thread.run(lambda: self._step(req.prompt[-1], n - 1, tables))
            self.metrics.tokens.inc()
            async for token in self._decode_from(first, n, tables, req.max_tokens):
                yield token
        finally:
            self.release(request_id)

    def _expect_refused(self, request_id: str) -> None:
        self._on_terminal.pop(request_id, None)
        self.release(request_id)

    # -- PP: stage reports ---------------------------------------------------------------------------------

    async def _poll_stages(self) -> None:
        assert self.pipeline is not None
        pipeline = self.pipeline

        def job() -> bool:
            freed = False
            for report in pipeline.poll():
                self.metrics.kv_events.labels("sent" if report.ok else "failed", report.reason).inc()
                freed |= self._sched().stage_done(report.request_id, report.stage)
            if freed:
                self._freed_blocks()
            counts = self._sched().counts()
            return bool(counts["prefilling"] or counts["held_for_push"])

        busy = False
        while True:
            await asyncio.sleep(stages.BUSY_POLL_S if busy else stages.IDLE_POLL_S)
            try:
                busy = await self.model_thread.run(job)
            except RuntimeError as exc:
                self._fail(f"the pipeline broke: {exc}")
                return


# ---- HTTP --------------------------------------------------------------------------------------------------

Leg = Literal["prefill", "decode", "none"]


def _json(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.json_response(body, status=status)


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _json(error_body(exc.status, exc.reason), exc.status)
    except ApiError as exc:
        return _json(exc.body(), exc.status)


class Server:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.created = int(time.time())
        app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        add_health_routes(app, lambda: engine.not_ready, lambda: engine.fatal, engine.metrics)
        self.app = app

    async def models(self, request: web.Request) -> web.Response:
        e = self.engine
        return _json(models_response(e.settings.model_name, self.created, e.max_model_len))

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
                    tokens = e.decode_leg(req, request_id, req.transfer)
                else:
                    tokens = e.monolithic(req, request_id)
                response = await self._respond(request, head, tokens)
            outcome = "ok"
            return response
        except ApiError as exc:
            outcome = "client_error" if exc.status < 500 else "error"
            return _json(exc.body(), exc.status)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as exc:
            log.exception("request failed")
            return _json(api_error_of(exc).body(), 500)
        finally:
            e.metrics.requests.labels(endpoint, leg, outcome).inc()

    async def _prefill(
        self, request: web.Request, req: GenerationRequest, request_id: str, head: ResponseHead
    ) -> web.StreamResponse:
        first, params = await self.engine.prefill_leg(req, request_id)
        output = Output(req.stop, 1)
        delta = output.push(first)
        if not req.stream:
            return _json(head.response(output, params))
        response = await self._start_stream(request)
        await response.write(sse(head.chunk(delta, first=True, output=output, kv_transfer_params=params)))
        await self._end_stream(response, head, output)
        return response

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
                return _json(head.response(output, None))
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


def add_health_routes(
    app: web.Application,
    not_ready: Callable[[], str | None],
    fatal: Callable[[], str | None],
    metrics: EngineMetrics,
) -> None:
    async def healthz(request: web.Request) -> web.Response:
        reason = fatal()
        return _json({"healthy": reason is None, "reason": reason}, 200 if reason is None else 503)

    async def readyz(request: web.Request) -> web.Response:
        reason = not_ready()
        return _json({"ready": reason is None, "reason": reason}, 200 if reason is None else 503)

    async def prometheus(request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", prometheus)


# ---- headless stages ---------------------------------------------------------------------------------------


class HeadlessStage:
    """A prefill stage other than the head: its layers, its sidecar, and the head's commands over gloo."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.config = model_config(settings.topology, settings.role)
        self.metrics = EngineMetrics()
        self.not_ready: str | None = "starting"
        self.fatal: str | None = None
        self.exited = threading.Event()
        self._stopping = threading.Event()
        self._events: LinkEvents | None = None
        self.app = web.Application(middlewares=[_errors])
        self.app.router.add_route("*", "/v1/{tail:.*}", self._headless)
        add_health_routes(self.app, lambda: self.not_ready, lambda: self.fatal, self.metrics)

    async def _headless(self, request: web.Request) -> web.Response:
        s = self.settings
        raise ApiError(
            404, f"stage {s.pp_rank} of prefill engine {s.engine_id} runs headless: send requests to stage 0"
        )

    def run(self) -> None:
        """The stage's life, on a thread of its own (gloo receives block); sets `exited` when it ends."""
        s = self.settings
        try:
            torch.set_num_threads(1)
            model = TinyModel(self.config)
            kv = new_pool(model, s)
            self.not_ready = "registering the KV pool with the sidecar"
            message = layout_message(self.config, s, kv)
            link = connect_and_register(
                s.engine_socket, message, reply_timeout_s=LINK_REPLY_TIMEOUT_S, stopping=self._stopping
            )
            if link is None:
                return
            reports = stages.StageReports(s.pp_rank)
            self._events = LinkEvents(link, reports.on_event, self._lost).start()
            self.not_ready = f"joining the engine's group at {s.master_addr}:{s.master_port}"
            stages.join(s.master_addr, s.master_port, s.pp_rank, s.pp_size)
            self.not_ready = None
            self.metrics.ready.set(1)
            log.info("stage %d of %s ready", s.pp_rank, s.engine_id)
            stages.run_headless(model, kv, link, s.pp_rank, s.pp_size, reports, self.metrics.tokens.inc)
            log.info("the head ended the pipeline")
        except Exception as exc:
            if not self._stopping.is_set():
                self.fatal = f"{type(exc).__name__}: {exc}"
                log.error("stage failed: %s", self.fatal)
        finally:
            self.not_ready = self.not_ready or "stopped"
            self.metrics.ready.set(0)
            stages.leave()
            if self._events is not None:
                self._events.stop()
            self.exited.set()

    def _lost(self, why: str) -> None:
        self.fatal = f"the link to the sidecar is gone: {why}"
        log.error("%s", self.fatal)

    def stop(self) -> None:
        self._stopping.set()


def new_pool(model: TinyModel, s: ServeSettings) -> PagedKVCache:
    """This worker's KV cache over a new pool file. The pool's emptyDir outlives a restart of the container:
    a file there is the last run's, which the sidecar stops using when this run registers its own."""
    Path(s.kv_pool).unlink(missing_ok=True)
    return map_kv_cache(model, s.num_blocks, s.kv_pool, pp_rank=s.pp_rank, pp_size=s.pp_size, create=True)


def layout_message(config: TinyConfig, s: ServeSettings, kv: PagedKVCache) -> RegisterLayout:
    """What the head and a headless stage alike tell their sidecar about their KV pool."""
    return register_layout_message(
        engine_id=s.engine_id,
        role=s.role,
        geometry=config.geometry,
        stage=config.stage_layout(s.num_blocks, pp_rank=s.pp_rank, pp_size=s.pp_size),
        tp_rank=0,
        num_blocks=s.num_blocks,
        pool_path=s.kv_pool,
        pool_bytes=int(kv.buffer.numel()),
    )


# ---- the process -------------------------------------------------------------------------------------------


async def _serve_app(app: web.Application, host: str, port: int) -> web.AppRunner:
    # Requests still in flight at SIGTERM get a few seconds, not aiohttp's 60: a pod's grace period is 30.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_S)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


async def _main(settings: ServeSettings) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if settings.headless:
        stage = HeadlessStage(settings)
        runner = await _serve_app(stage.app, settings.host, settings.port)
        thread = threading.Thread(target=stage.run, name="engine-stage", daemon=True)
        thread.start()
        while not stop.is_set() and not stage.exited.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)
        stage.stop()
        await runner.cleanup()
        return 1 if stage.fatal else 0
    engine = Engine(settings)
    runner = await _serve_app(Server(engine).app, settings.host, settings.port)
    log.info("serving %s on %s:%d", settings.model_name, settings.host, settings.port)
    await engine.start()
    await asyncio.wait(
        [asyncio.ensure_future(engine.done.wait()), asyncio.ensure_future(stop.wait())],
        return_when=asyncio.FIRST_COMPLETED,
    )
    await runner.cleanup()
    await engine.stop()
    return 1 if engine.fatal else 0


def run(settings: ServeSettings) -> int:
    """Serve until SIGTERM (0) or until the engine fails (1)."""
    return asyncio.run(_main(settings))
