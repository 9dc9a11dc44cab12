"""Outlier ejection: a decoder that passed its canary and then fails every leg, or was killed, leaves the
routing after a few failures instead of drawing most of the traffic (a leg that fails at once frees its load
at once, so least-loaded balancing favoured it), and comes back only through the canary. The real router app
in front of fake engines; the KV canary on."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from typing import Any

import aiohttp
from aiohttp import web
from engine_fakes import Exchange, FakeEngine, engines, pair_of, routing_of
from router_rig import Rig, run, until

from disagg.worker.router.app import CANARY_PROMPT, Router, RouterConfig, start
from disagg.worker.router.canary import KvCanary
from disagg.worker.router.outliers import EJECTED_REASON, Outliers

COMPLETION = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}
REQUESTS = 200
CONCURRENCY = 8
# Ejected for the whole test (60 s, the test's bound) unless a test asks for a short hold.
CONFIG = RouterConfig(eject_after_failures=3, eject_s=60.0, canary_retry_s=0.05)


async def _load(url: str, client: aiohttp.ClientSession) -> Counter[int]:
    statuses: Counter[int] = Counter()
    queue = list(range(REQUESTS))

    async def one_client() -> None:
        while queue:
            queue.pop()
            async with client.post(url + "/v1/completions", json=COMPLETION) as response:
                await response.read()
                statuses[response.status] += 1

    await asyncio.gather(*(one_client() for _ in range(CONCURRENCY)))
    return statuses


def _client_legs(engine: Any) -> int:
    return sum(1 for r in engine.received if r.body.get("prompt") != CANARY_PROMPT)


async def _two_decoders(config: RouterConfig, go: Any) -> None:
    exchange = Exchange()
    async with engines(exchange, ("prefill", "p@1", 1), ("decode", "good@1", 1), ("decode", "bad@1", 1)) as (
        prefill,
        good,
        bad,
    ):
        router = Router(config)
        runner = await start(router, "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as client:
                url = f"http://127.0.0.1:{runner.addresses[0][1]}"
                router.set_routing(
                    routing_of(
                        pair_of(prefill, good, decode_pod="good-0"), pair_of(prefill, bad, decode_pod="bad-0")
                    )
                )
                await until(lambda: bool(router.routing and len(router.routing.pairs) == 2))
                await go(Rig(router, url, prefill, bad, client, exchange), good, bad)
        finally:
            await runner.cleanup()


def _failing(bad: FakeEngine) -> None:
    async def behaviour(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if body.get("prompt") == CANARY_PROMPT:
            return await bad._decode(request, body, request.headers.get("X-Request-Id", ""))
        return web.json_response({"error": {"message": "CUDA error: device lost", "code": 500}}, status=500)

    bad.behaviour = behaviour


def test_a_decoder_that_fails_after_its_canary_is_ejected_and_draws_no_more_traffic() -> None:
    async def go(r: Rig, good: Any, bad: Any) -> None:
        _failing(bad)
        statuses = await _load(r.url, r.client)
        # Before: the failing decoder, always the least loaded, took most of the 200 and failed them all.
        # Now it fails at most its ejection bound plus the legs already in flight when it was ejected.
        assert _client_legs(bad) <= CONFIG.eject_after_failures + CONCURRENCY, _client_legs(bad)
        assert statuses[502] == _client_legs(bad)
        assert statuses[200] == REQUESTS - statuses[502] == _client_legs(good)
        routing = r.router.routing
        assert routing is not None and [p.decode.pod for p in routing.pairs] == ["good-0"]
        [exclusion] = [e for e in routing.exclusions if e.decode == "bad-0"]
        assert exclusion.reason == EJECTED_REASON and "DecodeFailed" in exclusion.message

    run(_two_decoders(CONFIG, go))


def test_a_killed_decoder_is_ejected_at_once_not_when_its_sidecars_report_it() -> None:
    async def go(r: Rig, good: Any, bad: Any) -> None:
        await bad.stop()  # its pod is still Ready and paired as far as the routing knows
        statuses = await _load(r.url, r.client)
        assert statuses[502] <= CONFIG.eject_after_failures + CONCURRENCY, statuses
        assert statuses[200] == REQUESTS - statuses[502]
        routing = r.router.routing
        assert routing is not None and [p.decode.pod for p in routing.pairs] == ["good-0"]

    run(_two_decoders(CONFIG, go))


def test_an_ejected_decoder_comes_back_through_the_canary_once_its_hold_ends() -> None:
    async def go(r: Rig, good: Any, bad: Any) -> None:
        _failing(bad)
        canaries = len(bad.received) - _client_legs(bad)
        for _ in range(CONFIG.eject_after_failures * 2):
            await r.post("/v1/completions", COMPLETION)
        await until(lambda: r.router.routing is not None and len(r.router.routing.pairs) == 1)
        bad.behaviour = None  # repaired
        # After the short hold a new canary crosses the pair before any client's request goes to it.
        await until(lambda: len(bad.received) - _client_legs(bad) > canaries)
        await until(lambda: r.router.routing is not None and len(r.router.routing.pairs) == 2)
        served = _client_legs(bad)
        for _ in range(8):
            status, _, raw = await r.post("/v1/completions", COMPLETION)
            assert status == 200, raw
        assert _client_legs(bad) > served

    run(_two_decoders(dataclasses.replace(CONFIG, eject_s=0.2), go))


def test_each_ejection_since_the_engine_last_served_doubles_its_hold_up_to_the_cap() -> None:
    outliers = Outliers(eject_after=2, eject_s=1.0, max_eject_s=3.0)
    holds = []
    now = 0.0
    for _ in range(4):
        assert outliers.failed("d", "x", now) is None
        hold = outliers.failed("d", "x", now)
        assert hold is not None and outliers.ejected("d", now) and outliers.ejected("other", now) is False
        # A leg already in flight that fails during the hold neither extends nor repeats it.
        assert outliers.failed("d", "x", now) is None and outliers.failed("d", "x", now) is None
        holds.append(hold)
        now += hold
        assert not outliers.ejected("d", now)
    assert holds == [1.0, 2.0, 3.0, 3.0]
    outliers.succeeded("d", now)
    outliers.failed("d", "x", now)
    assert outliers.failed("d", "x", now) == 1.0  # served since: back to the first hold


def test_an_ejection_makes_the_canary_forget_every_pair_of_that_engine_and_only_those() -> None:
    async def go() -> None:
        exchange = Exchange()
        async with engines(exchange, ("prefill", "p@1", 1), ("decode", "d0@1", 1), ("decode", "d1@1", 1)) as (
            prefill,
            d0,
            d1,
        ):
            pairs = [pair_of(prefill, d0, decode_pod="d0"), pair_of(prefill, d1, decode_pod="d1")]
            canary = KvCanary(lambda pair: asyncio.sleep(0), lambda: None)
            canary.admit(routing_of(*pairs))
            await until(lambda: all(canary.verified(p) for p in pairs))
            canary.forget("d1@1")
            assert [canary.verified(p) for p in pairs] == [True, False]
            # Its pairs are new to the canary: it crosses them again before they are admitted.
            assert [p.decode.pod for p in canary.admit(routing_of(*pairs)).pairs] == ["d0"]
            await canary.close()

    run(go())
