"""A prefill stage other than the head: its own layers, KV pool and sidecar, driven by the head over gloo.

It serves only the health routes (`/v1/*` answers 404, pointing at stage 0); its life runs on a thread of
its own, since gloo receives block: register the pool, join the head's group, then serve the head's commands
(`stages.run_headless`) until the head ends the pipeline or the group breaks.
"""

from __future__ import annotations

import logging
import threading

import torch
from aiohttp import web

from disagg.worker.engine import stages
from disagg.worker.engine.api_errors import ApiError
from disagg.worker.engine.http_common import add_health_routes, errors_middleware
from disagg.worker.engine.link_events import LinkEvents, connect_and_register
from disagg.worker.engine.metrics import EngineMetrics
from disagg.worker.engine.model import TinyModel
from disagg.worker.engine.pool_registration import LINK_REPLY_TIMEOUT_S, layout_message, new_pool
from disagg.worker.engine.settings import ServeSettings, model_config

log = logging.getLogger(__name__)


class HeadlessStage:
    """A prefill stage other than the head: its layers, its sidecar, and the head's commands over gloo."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.config = model_config(settings.topology, settings.role)
        self.metrics = EngineMetrics(settings.model_name)
        self.not_ready: str | None = "starting"
        self.fatal: str | None = None
        self.exited = threading.Event()
        self._stopping = threading.Event()
        self._events: LinkEvents | None = None
        self.app = web.Application(middlewares=[errors_middleware])
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
