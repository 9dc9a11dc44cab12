"""kopf's own request machinery with the operator's retry schedule outlasts an API server outage (issue 22,
finding 6): kopf's default gives up after 9 attempts, and the watch that raises ends the operator.

The request is kopf's `api.request`, over a real aiohttp session, to a port where nothing listens; after more
attempts than kopf's default allows, a server appears there that first answers 503 "server is starting" (as
the restarted kube-apiserver did), then 200. The schedule's delays are scaled down here; the operator's
`API_BACKOFFS` is the same class with kopf's own delays."""

from __future__ import annotations

import asyncio
import itertools
import logging

import aiohttp
import aiohttp.web
import kopf
from kopf._cogs.clients import api, auth
from kopf._cogs.structs import credentials

from disagg.operator.control.kopf_tuning import API_BACKOFFS, EndlessBackoffs
from disagg.rig.local import free_port

# kopf's default schedule has 8 delays: a 9th failed attempt escalates.
KOPF_DEFAULT_ATTEMPTS = len(tuple(kopf.OperatorSettings().networking.error_backoffs)) + 1  # type: ignore[arg-type]
OUTAGE_ATTEMPTS = 3 * KOPF_DEFAULT_ATTEMPTS
STARTING_ANSWERS = 5


class Attempts(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def failed(self) -> int:
        return sum("failed; will retry" in message for message in self.messages)


async def outage_then_recovery() -> tuple[int, Attempts, int]:
    port = free_port()
    attempts = Attempts()
    logger = logging.getLogger("test-api-backoffs")
    logger.addHandler(attempts)
    logger.setLevel(logging.DEBUG)
    starting = itertools.count()

    async def apiserver(request: aiohttp.web.Request) -> aiohttp.web.Response:
        if next(starting) < STARTING_ANSWERS:
            return aiohttp.web.json_response(
                {"kind": "Status", "status": "Failure", "message": "server is starting", "code": 503},
                status=503,
            )
        return aiohttp.web.json_response({"kind": "APIResourceList", "resources": []})

    async def come_back() -> aiohttp.web.AppRunner:
        while attempts.failed() < OUTAGE_ATTEMPTS:
            await asyncio.sleep(0.01)
        app = aiohttp.web.Application()
        app.add_routes([aiohttp.web.get("/{path:.*}", apiserver)])
        runner = aiohttp.web.AppRunner(app)
        await runner.setup()
        await aiohttp.web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    settings = kopf.OperatorSettings()
    settings.networking.error_backoffs = EndlessBackoffs(first=(0.001, 0.002), then=0.005)
    context = auth.APIContext(credentials.ConnectionInfo(server=f"http://127.0.0.1:{port}"))
    server = asyncio.create_task(come_back())
    try:
        response = await api.request(
            "get", "/apis/disagg.io/v1alpha1", settings=settings, context=context, logger=logger
        )
        status = response.status
        response.release()
    finally:
        runner = await server
        await runner.cleanup()
        await context.session.close()
        logger.removeHandler(attempts)
    return status, attempts, next(starting)  # how many requests it answered


def test_a_request_outlasts_an_outage_of_three_times_kopfs_attempts_and_a_starting_server() -> None:
    status, attempts, answered = asyncio.run(outage_then_recovery())
    assert status == 200
    assert answered == STARTING_ANSWERS + 1  # every 503 "server is starting" was retried too
    assert attempts.failed() >= OUTAGE_ATTEMPTS + STARTING_ANSWERS
    assert not [message for message in attempts.messages if "escalating" in message]


def test_every_request_gets_the_whole_schedule_and_it_never_ends() -> None:
    first = list(itertools.islice(API_BACKOFFS, 10))
    assert first == [1, 1, 2, 3, 5, 8, 13, 21, 21, 21]
    # kopf iterates the setting afresh per request: a second request starts from the first delay again.
    assert list(itertools.islice(API_BACKOFFS, 3)) == [1, 1, 2]
    assert max(itertools.islice(API_BACKOFFS, 10_000)) == 21
