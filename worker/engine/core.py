"""The serving engine (a decoder, or a prefill engine's head): its start-up and stop, its sidecar's events,
admission and release of KV blocks, the model steps, the monolithic leg and, on a PP head, the stages'
reports.

The prefill and decode legs (`prefill_leg`, `decode_leg`) run on top of this: they admit blocks, wait on a
request's terminal sidecar event (`on_terminal`) and run steps on the model thread through it. Every model
step and every block-id change runs on `model_thread`, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable

import torch

from disagg.worker.contracts.topology import lease_wait_s
from disagg.worker.engine import stages
from disagg.worker.engine.api_errors import ApiError, bad_request
from disagg.worker.engine.kv_cache import BlockTables, OutOfBlocks, PagedKVCache
from disagg.worker.engine.link_events import LinkEvents, connect_and_register
from disagg.worker.engine.metrics import EngineMetrics
from disagg.worker.engine.model import TinyModel
from disagg.worker.engine.model_thread import ModelThread
from disagg.worker.engine.openai_api import GenerationRequest
from disagg.worker.engine.pool_registration import LINK_REPLY_TIMEOUT_S, layout_message, new_pool
from disagg.worker.engine.scheduler import BlockScheduler, State
from disagg.worker.engine.settings import ServeSettings, model_config
from disagg.worker.kv.errors import DisaggError, DuplicateRequest
from disagg.worker.link.engine_link import EngineLink, Event, KVFailed, KVReady, KVSent

log = logging.getLogger(__name__)


class Engine:
    """The serving engine (a decoder, or a prefill engine's head), under its request legs."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.config = model_config(settings.topology, settings.role)
        self.metrics = EngineMetrics(settings.model_name)
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
            self.fail(f"startup failed: {type(exc).__name__}: {exc}")

    def _load(self) -> None:
        s = self.settings
        torch.set_num_threads(1)
        self.model = TinyModel(self.config)
        self.kv = new_pool(self.model, s)
        groups = len(self.config.stage_layout(s.num_blocks).groups)
        self.scheduler = BlockScheduler(self.kv.pool, s.num_blocks, groups, self.config.block_size)

    def fail(self, reason: str) -> None:
        """The engine cannot serve any more: not ready, not healthy, and the process ends."""
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

    def on_terminal(self, request_id: str, handler: Callable[[Event], None]) -> None:
        """Hand the request's next `KVReady`, `KVSent` or `KVFailed` to `handler` (on the event loop)."""
        self._on_terminal[request_id] = handler

    def forget_terminal(self, request_id: str) -> None:
        self._on_terminal.pop(request_id, None)

    def _event_from_thread(self, event: Event) -> None:
        self._loop.call_soon_threadsafe(self._deliver, event)

    def _lost_from_thread(self, why: str) -> None:
        self._loop.call_soon_threadsafe(self.fail, f"the link to the sidecar is gone: {why}")

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

    def sched(self) -> BlockScheduler:
        if self.scheduler is None:
            raise ApiError(503, "the engine is not ready")
        return self.scheduler

    def freed_blocks(self) -> None:
        """Wake the admissions waiting for blocks (from the model thread)."""
        self._loop.call_soon_threadsafe(self._wake_admissions)

    def _wake_admissions(self) -> None:
        self._freed.set()
        self._freed = asyncio.Event()

    def release(self, request_id: str) -> None:
        """Return a request's ids, after any model step already queued (which may still use them)."""

        def job() -> None:
            if self.sched().release(request_id):
                self.freed_blocks()

        self.model_thread.submit(job)

    def cancel_expected(self, request_id: str) -> None:
        """A decode leg gave up a request whose KV its sidecar still expects: tell the sidecar, and free the
        blocks once it answers (it waits no more; an event it sent before is let go), or, when its prefill
        was already told the blocks, once the prefill's lease on the KV has surely ended: a WRITE may land in
        them until then, and a block given to another request meanwhile would take it. Should the sidecar
        refuse, the blocks wait for the request's event as before."""
        self._spawn(self._cancel_expected(request_id))

    async def _cancel_expected(self, request_id: str) -> None:
        if self.link is None:
            return
        try:
            status = await asyncio.to_thread(self.link.cancel_request, request_id)
        except DisaggError as exc:
            log.warning("the sidecar did not cancel request %s (%s): %s", request_id, exc.reason, exc.message)
            return
        self.forget_terminal(request_id)
        if status.state == "cancelled" and status.registered:
            # No heartbeat extends the lease after the cancel, so it ends within one lease; the margin
            # covers a WRITE posted just before it ends (`lease_wait_s`).
            hold = lease_wait_s(self.settings.topology.kv_lease_duration_s)
            log.info("request %s cancelled with its sidecar; its blocks free in %.0f s", request_id, hold)
            await asyncio.sleep(hold)
        else:
            log.info("request %s cancelled with its sidecar (%s); blocks freed", request_id, status.state)
        self.release(request_id)

    def stage_done(self, request_id: str, stage: int) -> None:
        def job() -> None:
            if self.sched().stage_done(request_id, stage):
                self.freed_blocks()

        self.model_thread.submit(job)

    async def admit(
        self, request_id: str, num_tokens: int, state: State, waiting_on: range = range(0)
    ) -> BlockTables:
        scheduler = self.sched()
        if not scheduler.ever_fits(num_tokens):
            raise bad_request(
                f"{num_tokens} tokens need {scheduler.blocks_needed(num_tokens)} KV blocks; this engine has "
                f"{scheduler.usable_blocks}",
                "max_tokens",
            )
        waiting = False
        try:
            while True:
                freed = self._freed
                job = self.model_thread.submit(
                    lambda: scheduler.admit(request_id, num_tokens, state, waiting_on)
                )
                try:
                    return await asyncio.shield(asyncio.wrap_future(job))
                except OutOfBlocks:
                    if not waiting:
                        waiting = True
                        self.metrics.waiting_for_blocks += 1
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
        finally:
            if waiting:
                self.metrics.waiting_for_blocks -= 1

    # -- model steps (on the model thread) -----------------------------------------------------------------

    def step(self, token: int, position: int, tables: BlockTables) -> int:
        assert self.model is not None and self.kv is not None
        return int(torch.argmax(self.model.decode_step(token, position, self.kv, tables)))

    def prefill_first(self, prompt: tuple[int, ...], tables: BlockTables) -> int:
        assert self.model is not None and self.kv is not None
        return int(torch.argmax(self.model.prefill(prompt, self.kv, tables)[-1]))

    async def decode_from(
        self, first: int, num_prompt: int, tables: BlockTables, max_tokens: int
    ) -> AsyncIterator[int]:
        token = first
        yield token
        for step in range(max_tokens - 1):
            token = await self.model_thread.run(
                functools.partial(self.step, token, num_prompt + step, tables)
            )
            self.metrics.tokens.inc()
            yield token

    # -- the monolithic leg --------------------------------------------------------------------------------

    async def monolithic(self, req: GenerationRequest, request_id: str) -> AsyncIterator[int]:
        if self.settings.pp_size > 1:
            raise bad_request(
                "this is a pipeline-parallel prefill engine: it serves prefill legs "
                "(kv_transfer_params.do_remote_decode) only",
                "kv_transfer_params",
            )
        n = len(req.prompt)
        tables = await self.admit(request_id, n + req.max_tokens - 1, "running")
        try:
            first = await self.model_thread.run(lambda: self.prefill_first(req.prompt, tables))
            self.metrics.tokens.inc()
            async for token in self.decode_from(first, n, tables, req.max_tokens):
                yield token
        finally:
            self.release(request_id)

    # -- PP: stage reports ---------------------------------------------------------------------------------

    async def _poll_stages(self) -> None:
        assert self.pipeline is not None
        pipeline = self.pipeline

        def job() -> bool:
            freed = False
            for report in pipeline.poll():
                self.metrics.kv_events.labels("sent" if report.ok else "failed", report.reason).inc()
                freed |= self.sched().stage_done(report.request_id, report.stage)
            if freed:
                self.freed_blocks()
            counts = self.sched().counts()
            return bool(counts["prefilling"] or counts["held_for_push"])

        busy = False
        while True:
            await asyncio.sleep(stages.BUSY_POLL_S if busy else stages.IDLE_POLL_S)
            try:
                busy = await self.model_thread.run(job)
            except RuntimeError as exc:
                self.fail(f"the pipeline broke: {exc}")
                return
