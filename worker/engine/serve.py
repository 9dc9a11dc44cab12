"""`disagg engine serve`: the reference engine behind an OpenAI-compatible HTTP server, as a process.

One process per engine worker, next to its transfer sidecar. It maps its KV pool from a /dev/shm file,
registers it with the sidecar (`pool_registration`, `link_events`), and then serves until SIGTERM:

- a decode engine, and the head (stage 0) of a prefill engine: the engine (`core`) behind the OpenAI routes
  (`http_server`);
- another stage of a PP prefill engine: only the health routes, while the head drives it (`headless`).

Every process serves `/healthz`, `/readyz` and `/metrics` (`http_common`). The legs, as vLLM's push connector
runs them:
- prefill leg (`do_remote_decode`, `prefill_leg`): the head prefills the prompt on every stage (`stages`),
  each stage tells its sidecar `RequestFinished` for its own layers, and the response carries the first
  token and the `kv_transfer_params` a decoder needs; the blocks are held until every stage's push is done;
- decode leg (`do_remote_prefill`, `decode_leg`): the decoder sends `ExpectRequest`, waits for `KVReady`,
  then decodes from the received KV;
- neither: the whole request here (a decoder, or a prefill engine without PP; `core`).

What the process is configured with: `settings`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading

from aiohttp import web

from disagg.worker.engine.core import Engine
from disagg.worker.engine.headless import HeadlessStage
from disagg.worker.engine.http_server import Server
from disagg.worker.engine.settings import ServeSettings

log = logging.getLogger(__name__)

SHUTDOWN_S = 5.0


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
