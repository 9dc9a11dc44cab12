"""The router as a real process in front of the real reference engine (`disagg engine serve`, a PP2 prefill
with HMA and two decoders, each worker with its transfer sidecar moving the KV over real NIXL): every output
equals the monolithic run token for token, and a bounded load run has no failure."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from disagg.rig.local_engines import LocalEngines, get, metric
from disagg.rig.local_router import LocalRouter, cases, load_run, routing_for, tokens_of

pytestmark = [pytest.mark.nixl, pytest.mark.slow]


@pytest.fixture(scope="module")
def deployment() -> Iterator[tuple[LocalEngines, LocalRouter]]:
    with LocalEngines(pp_size=2, decoders=2) as engines, LocalRouter(routing_for(engines)) as router:
        yield engines, router


def test_every_endpoint_streamed_or_not_equals_the_monolithic_run(
    deployment: tuple[LocalEngines, LocalRouter],
) -> None:
    engines, router = deployment

    async def go() -> None:
        async with aiohttp.ClientSession() as session:
            for case in cases(max_tokens=10):
                monolithic = await tokens_of(session, engines.decode_urls[0], case, engines.model_name)
                assert len(monolithic) == 10
                assert await tokens_of(session, router.url, case, engines.model_name) == monolithic, case

    asyncio.run(go())
    text = get(router.url + "/metrics")[1]
    assert metric(text, "disagg_router_requests_total", 'endpoint="/v1/completions",outcome="ok"') == 8
    assert metric(text, "disagg_router_requests_total", 'endpoint="/v1/chat/completions",outcome="ok"') == 8


def test_a_bounded_load_run_has_no_failure(deployment: tuple[LocalEngines, LocalRouter]) -> None:
    engines, router = deployment
    report = asyncio.run(
        load_run(router.url, engines.decode_urls[0], engines.model_name, requests=120, concurrency=16)
    )
    assert (report.failed, report.mismatched) == (0, 0), report.failures[:5]
    # The second decoder took part (the monolithic runs all went to the first).
    assert metric(get(engines.decode_urls[1] + "/metrics")[1], "disagg_engine_generated_tokens_total") > 0
    engines.check_alive()
