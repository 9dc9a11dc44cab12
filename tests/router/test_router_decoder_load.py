"""Backpressure by what a decoder can really take (`decoder_load`): at concurrency 128 against two decoders
that each run a few requests at once, every request is served or shed by the router with Retry-After; none
is sent to wait inside a decoder until the prefill's lease on its KV has run out. The fixed cap of 256 legs
per decoder never engaged at 64 legs each, and the decoders' queues expired them (issue 45, finding 4). The
real router app in front of fake decoders that run `CAPACITY` legs at once, queue the rest, and fail a leg
that waited for a slot past the lease, as the reference engine and vLLM do; they export the running and KV
usage gauges under vLLM's names."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import aiohttp
from aiohttp import web
from engine_fakes import Exchange, FakeEngine, engines, pair_of, routing_of
from router_rig import COMPLETION, run

from disagg.worker.router.app import Router, RouterConfig, start
from disagg.worker.router.decoder_load import DecoderLoad, parse_load, window

REQUESTS = 256
CONCURRENCY = 128
CAPACITY = 4
HOLD_S = 0.2
"""How long a leg runs once it has a slot."""
LEASE_S = 1.5
"""How long a leg may wait for a slot: with the 60 legs a fixed cap lets wait at each decoder, the last
would wait some 3 s; with the headroom of 2 the router leaves, a leg waits at most about one hold."""


class SlottedDecoder:
    """A decoder that runs `CAPACITY` legs at once; the others wait for a slot, and fail past the lease."""

    def __init__(self, engine: FakeEngine, exchange: Exchange) -> None:
        self.exchange = exchange
        self.slots = asyncio.Semaphore(CAPACITY)
        self.running = self.waiting = self.expired = self.served = 0
        engine.behaviour = self.decode
        engine.metrics_page = self.page

    def page(self) -> str:
        labels = '{engine="0",model_name="tiny"}'
        return (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{labels} {float(self.running)}\n"
            f"vllm:num_requests_waiting{labels} {float(self.waiting)}\n"
            f"vllm:kv_cache_usage_perc{labels} {self.running / CAPACITY}\n"
        )

    async def decode(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        request_id = request.headers["X-Request-Id"]
        await self.exchange.event(self.exchange.prefilled, request_id).wait()  # the KV has arrived
        self.waiting += 1
        try:
            async with asyncio.timeout(LEASE_S):
                await self.slots.acquire()
        except TimeoutError:
            self.expired += 1
            message = f"the KV transfer failed (LeaseExpired): request {request_id} waited for blocks"
            return web.json_response({"error": {"message": message, "code": 504}}, status=504)
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            await asyncio.sleep(HOLD_S)
        finally:
            self.running -= 1
            self.slots.release()
        self.served += 1
        return web.json_response({"id": request_id, "choices": [{"index": 0, "text": "ok"}]})


def test_at_concurrency_128_every_request_is_served_or_shed_and_none_expires_in_a_decoder() -> None:
    async def go() -> None:
        exchange = Exchange()
        async with engines(exchange, ("prefill", "p@1", 1), ("decode", "d0@1", 1), ("decode", "d1@1", 1)) as (
            prefill,
            d0,
            d1,
        ):
            decoders = [SlottedDecoder(d0, exchange), SlottedDecoder(d1, exchange)]
            config = RouterConfig(
                kv_canary=False,
                load_poll_s=0.05,
                decoder_headroom=2,
                decoder_headroom_fraction=0.0,
                queue_timeout_s=30,
            )
            router = Router(config)
            router.set_routing(
                routing_of(pair_of(prefill, d0, decode_pod="d0"), pair_of(prefill, d1, decode_pod="d1"))
            )
            runner = await start(router, "127.0.0.1", 0)
            url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
            outcomes: Counter[tuple[int, bool]] = Counter()
            queue = list(range(REQUESTS))
            try:
                async with aiohttp.ClientSession() as client:

                    async def one_client() -> None:
                        while queue:
                            queue.pop()
                            async with client.post(url, json=COMPLETION) as response:
                                await response.read()
                                outcomes[(response.status, "Retry-After" in response.headers)] += 1

                    await asyncio.gather(*(one_client() for _ in range(CONCURRENCY)))
            finally:
                await runner.cleanup()
        assert [d.expired for d in decoders] == [0, 0], outcomes
        assert set(outcomes) <= {(200, False), (503, True), (429, True)}, outcomes
        assert outcomes[(200, False)] == sum(d.served for d in decoders) > 0
        assert all(d.served > 0 for d in decoders)

    run(go())


PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 10.0
vllm:num_requests_running{engine="1",model_name="m"} 6.0
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75 1700000000000
vllm:num_requests_running_other 99
"""


def test_a_decoders_load_is_read_from_the_gauges_vllm_and_the_reference_engine_export() -> None:
    load = parse_load(PAGE)
    assert load == DecoderLoad(running=16, kv_usage=0.75)
    free = DecoderLoad(16, 0.25)
    assert window(free, headroom=8, headroom_fraction=0.125) == 16 + 8
    assert window(free, headroom=1, headroom_fraction=1.0) == 16 + 16
    # No more legs than its free blocks hold at what a running request holds: 0.25 free at 0.75 / 16 each.
    assert window(load, headroom=8, headroom_fraction=0.125) == 16 + 5
    assert window(DecoderLoad(16, 0.97), headroom=8, headroom_fraction=0.125) == 16
    # Idle, or with blocks held by legs whose KV is on its way and nothing running yet.
    assert window(DecoderLoad(0, 0.0), headroom=8, headroom_fraction=0.125) == 8
    assert window(DecoderLoad(0, None), headroom=8, headroom_fraction=0.125) == 8
    assert window(DecoderLoad(0, 0.5), headroom=8, headroom_fraction=0.125) == 1
    # What the page cannot vouch for is no sample: the fixed cap alone bounds that decoder.
    usage_only = "vllm:kv_cache_usage_perc 0.5\n"
    for page in ("", usage_only, PAGE.replace("10.0", "-1"), PAGE.replace("0.5", "1.5")):
        assert parse_load(page) is None, page
    # A value that is no finite number is left out, as is a sample line without one.
    assert parse_load(PAGE.replace("10.0", "NaN") + "vllm:num_requests_running{x}\n") == DecoderLoad(6, 0.75)
