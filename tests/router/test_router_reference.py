"""The router as a real process in front of the real reference engine (`disagg engine serve`, a PP2 prefill
with HMA and two decoders, each worker with its transfer sidecar moving the KV over real NIXL): every output
equals the monolithic run token for token, and a bounded load run has no failure."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator

import aiohttp
import pytest

from disagg.rig.local import free_port
from disagg.rig.local_engines import LocalEngines, get, metric, vllm_labels
from disagg.rig.local_router import Case, LocalRouter, cases, load_run, routing_for, tokens_of

pytestmark = [pytest.mark.nixl, pytest.mark.slow]


@pytest.fixture(scope="module")
def deployment() -> Iterator[tuple[LocalEngines, LocalRouter]]:
    with (
        LocalEngines(pp_size=2, decoders=2, kv_lease_s=LEASE_S) as engines,
        LocalRouter(routing_for(engines)) as router,
    ):
        yield engines, router


LEASE_S = 4.0


def idle(url: str) -> bool:
    text = get(url + "/metrics")[1]
    holding = sum(
        metric(text, "disagg_engine_requests_holding_blocks", f'state="{state}"')
        for state in ("prefilling", "held_for_push", "awaiting_kv", "decoding", "running")
    )
    usable = metric(text, "disagg_engine_kv_blocks_usable")
    return holding == 0 and metric(text, "disagg_engine_kv_blocks_free") == usable


def wait_idle(engines: LocalEngines) -> None:
    """Every engine holds no KV block: nothing leaked (a prefill's blocks stay at most its lease)."""
    deadline = time.monotonic() + LEASE_S + 15
    urls = [engines.prefill_url, *engines.decode_urls]
    while not all(idle(u) for u in urls):
        engines.check_alive()
        assert time.monotonic() < deadline, "an engine still holds KV blocks"
        time.sleep(0.1)


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
    assert (
        metric(
            get(engines.decode_urls[1] + "/metrics")[1], "vllm:generation_tokens_total", vllm_labels(engines)
        )
        > 0
    )
    engines.check_alive()


def tokens_generated(engines: LocalEngines) -> float:
    return sum(
        metric(get(u + "/metrics")[1], "vllm:generation_tokens_total", vllm_labels(engines))
        for u in engines.decode_urls
    )


def test_a_client_that_leaves_mid_stream_frees_the_kv_on_both_sides(
    deployment: tuple[LocalEngines, LocalRouter],
) -> None:
    engines, router = deployment
    wait_idle(engines)
    case = Case("/v1/completions", "Leave early. " * 8, True, 400)

    async def go() -> None:
        async with (
            aiohttp.ClientSession() as session,
            session.post(router.url + case.endpoint, json=case.body(engines.model_name)) as response,
        ):
            assert response.status == 200
            assert (await response.content.readuntil(b"\n\n")).startswith(b"data: {")

    generated = tokens_generated(engines)
    asyncio.run(go())
    wait_idle(engines)
    # The decoder stopped when the router closed its leg, far short of the 400 tokens asked for.
    assert tokens_generated(engines) - generated < 200
    text = get(router.url + "/metrics")[1]
    assert (
        metric(
            text, "disagg_router_requests_total", 'endpoint="/v1/completions",outcome="ClientDisconnected"'
        )
        >= 1
    )


def test_a_decoder_that_cannot_be_reached_fails_the_request_and_frees_the_prefills_kv(
    deployment: tuple[LocalEngines, LocalRouter],
) -> None:
    engines, _ = deployment
    wait_idle(engines)
    routing = routing_for(engines)
    dead = dataclasses.replace(routing.pairs[0].decode, http_port=free_port())
    broken = dataclasses.replace(
        routing, decodes=(dead,), pairs=(dataclasses.replace(routing.pairs[0], decode=dead),)
    )
    # Without the canary, which would keep this pair out (the leg failure itself is under test here).
    with LocalRouter(broken, canary=False) as router:

        async def go() -> int:
            async with aiohttp.ClientSession() as session:
                case = cases()[1]
                async with session.post(router.url + case.endpoint, json=case.body(engines.model_name)) as r:
                    return r.status

        assert asyncio.run(go()) == 502
    wait_idle(engines)


def test_at_concurrency_128_no_request_expires_in_a_decoder(
    deployment: tuple[LocalEngines, LocalRouter],
) -> None:
    """Issue 45, finding 4: 256 requests at concurrency 128 against the two decoders. With a fixed cap of
    256 legs per decoder the decoders queued some 60 legs each for KV blocks and their prefills' leases ran
    out (`LeaseExpired`); with the decoders' own load bounding what the router sends them, every request is
    served, or shed with 503 before either leg is sent when the router cannot place it in time."""
    engines, router = deployment
    wait_idle(engines)
    report = asyncio.run(
        load_run(router.url, engines.decode_urls[0], engines.model_name, requests=256, concurrency=128)
    )
    expired = [f for f in report.failures if "LeaseExpired" in f or "RegistrationTimeout" in f]
    assert expired == [], f"{report}: {expired[:3]}"
    # On a loaded machine the router may shed what it could not place within its queue timeout: that is
    # a 503 before either leg was sent, never a failure inside an engine.
    assert all("HTTP 503" in f for f in report.failures), report.failures[:5]
    assert report.mismatched == 0 and report.failed < report.requests, report
    wait_idle(engines)
    engines.check_alive()
