"""The reference engine's server in this process, without its sidecar: its model, KV cache, scheduler and
HTTP app are the real ones, so its monolithic leg and its block admission run as in `disagg engine serve`.

With no sidecar there is no KV transfer: the prefill and decode legs are refused, everything else is served.
The metrics tests use it where NIXL is not installed (`local_engines` needs real sidecars):

    async with engine_in_process(tmp_path, num_blocks=32) as (engine, url):
        ...
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from disagg.rig.demo import topology_document
from disagg.rig.local import HOST
from disagg.worker.contracts.topology import topology_of
from disagg.worker.engine.config import TinyConfig
from disagg.worker.engine.core import Engine
from disagg.worker.engine.http_server import Server
from disagg.worker.engine.settings import ServeSettings

MODEL_NAME = "disagg-tiny-in-process"


@contextlib.asynccontextmanager
async def engine_in_process(
    workdir: Path, *, role: str = "decode", num_blocks: int = 64
) -> AsyncIterator[tuple[Engine, str]]:
    """A ready engine (model loaded, scheduler up, no link) and the URL its app serves on."""
    settings = ServeSettings(
        role="decode" if role == "decode" else "prefill",
        engine_id=f"in-process-{role}",
        pp_rank=0,
        pp_size=1,
        tp_size=1,
        advertised_host=HOST,
        advertised_port=0,
        engine_socket=str(workdir / "engine.sock"),
        kv_pool=str(workdir / "kv-pool"),
        topology=topology_of(topology_document(TinyConfig(), 1, [])),
        model_name=MODEL_NAME,
        num_blocks=num_blocks,
    )
    engine = Engine(settings)
    # What `Engine.start` does but for the sidecar's registration.
    engine._loop = asyncio.get_running_loop()
    await engine.model_thread.run(engine._load)
    engine.not_ready = None
    engine.metrics.ready.set(1)
    runner = web.AppRunner(Server(engine).app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, HOST, 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield engine, f"http://{HOST}:{port}"
    finally:
        await runner.cleanup()
        await engine.stop()
