"""What every engine process's HTTP app has: the error middleware and `/healthz`, `/readyz`, `/metrics`.

`/healthz` answers 200 while the process serves, `/readyz` 200 once it is registered with its sidecar (and,
on a PP head, once every stage joined); a reason says why not. `/metrics` renders `metrics`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from disagg.worker.engine.api_errors import ApiError, error_body
from disagg.worker.engine.metrics import EngineMetrics


def json_response(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.json_response(body, status=status)


@web.middleware
async def errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return json_response(error_body(exc.status, exc.reason), exc.status)
    except ApiError as exc:
        return json_response(exc.body(), exc.status)


def add_health_routes(
    app: web.Application,
    not_ready: Callable[[], str | None],
    fatal: Callable[[], str | None],
    metrics: EngineMetrics,
) -> None:
    async def healthz(request: web.Request) -> web.Response:
        reason = fatal()
        return json_response({"healthy": reason is None, "reason": reason}, 200 if reason is None else 503)

    async def readyz(request: web.Request) -> web.Response:
        reason = not_ready()
        return json_response({"ready": reason is None, "reason": reason}, 200 if reason is None else 503)

    async def prometheus(request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", prometheus)
