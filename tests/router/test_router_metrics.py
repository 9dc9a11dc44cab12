"""The router's `/metrics` after real requests through the real router app to the fake engines: latency
histograms from the streamed events, failures by reason, in-flight legs per role, routable pairs."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from engine_fakes import completion_text, tokens
from prometheus_client.parser import text_string_to_metric_families
from router_rig import COMPLETION, Rig, hang, rig, run, until

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(r: Rig) -> Samples:
    async with r.client.get(r.url + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


ENDPOINT = "/v1/completions"


def test_a_streamed_request_times_its_first_token_each_next_token_and_its_legs() -> None:
    async def go() -> None:
        async with rig() as r:
            status, _, raw = await r.post(ENDPOINT, {**COMPLETION, "stream": True})
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
            s = await scrape(r)
            n = len(tokens(completion_text(COMPLETION)))
            assert value(s, "disagg_router_time_to_first_token_seconds_count", endpoint=ENDPOINT) == 1
            assert value(s, "disagg_router_inter_token_latency_seconds_count", endpoint=ENDPOINT) == n - 1
            assert value(s, "disagg_router_kv_wait_seconds_count", endpoint=ENDPOINT) == 1
            assert value(s, "disagg_router_prefill_leg_seconds_count", endpoint=ENDPOINT) == 1
            assert value(s, "disagg_router_decode_leg_seconds_count", endpoint=ENDPOINT) == 1
            assert value(s, "disagg_router_dispatch_seconds_count", endpoint=ENDPOINT) == 1
            duration = value(s, "disagg_router_request_duration_seconds_sum", endpoint=ENDPOINT, outcome="ok")
            ttft = value(s, "disagg_router_time_to_first_token_seconds_sum", endpoint=ENDPOINT)
            dispatch = value(s, "disagg_router_dispatch_seconds_sum", endpoint=ENDPOINT)
            prefill = value(s, "disagg_router_prefill_leg_seconds_sum", endpoint=ENDPOINT)
            # The hops of the first token follow one another: the router's own share, then the prefill leg.
            assert 0 < dispatch < dispatch + prefill <= ttft <= duration
            assert value(s, "disagg_router_requests_total", endpoint=ENDPOINT, outcome="ok") == 1

            # Not streamed: no first token is observable, the request's duration is its latency.
            assert (await r.post(ENDPOINT, COMPLETION))[0] == 200
            s = await scrape(r)
            assert value(s, "disagg_router_time_to_first_token_seconds_count", endpoint=ENDPOINT) == 1
            assert value(s, "disagg_router_kv_wait_seconds_count", endpoint=ENDPOINT) == 1
            assert value(s, "disagg_router_prefill_leg_seconds_count", endpoint=ENDPOINT) == 2
            assert value(s, "disagg_router_decode_leg_seconds_count", endpoint=ENDPOINT) == 2
            assert value(s, "disagg_router_dispatch_seconds_count", endpoint=ENDPOINT) == 2
            assert (
                value(s, "disagg_router_request_duration_seconds_count", endpoint=ENDPOINT, outcome="ok") == 2
            )
            assert not [k for k in s if k[0] == "disagg_router_request_failures_total"]

    run(go())


def test_failures_are_counted_by_reason_and_timed_by_whose_fault() -> None:
    async def fail(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.Response(status=500, text="boom")

    async def go() -> None:
        async with rig() as r:
            r.prefill.behaviour = fail
            assert (await r.post(ENDPOINT, COMPLETION))[0] == 502
            async with r.client.post(r.url + ENDPOINT, data=b"not JSON") as response:
                assert response.status == 400
            s = await scrape(r)
            failures = "disagg_router_request_failures_total"
            assert value(s, failures, endpoint=ENDPOINT, reason="PrefillFailed") == 1
            assert sum(v for (name, _), v in s.items() if name == failures) == 2
            count = "disagg_router_request_duration_seconds_count"
            assert value(s, count, endpoint=ENDPOINT, outcome="upstream") == 1
            assert value(s, count, endpoint=ENDPOINT, outcome="client") == 1
            assert value(s, count, endpoint=ENDPOINT, outcome="ok") == 0

    run(go())


def test_in_flight_legs_are_counted_per_role_and_a_disconnect_is_a_failure() -> None:
    async def go() -> None:
        async with rig() as r:
            r.decode.behaviour = hang
            request = asyncio.ensure_future(r.post(ENDPOINT, {**COMPLETION, "stream": True}))
            await until(lambda: len(r.prefill.finished) == 1 and len(r.decode.received) == 1)
            s = await scrape(r)
            assert value(s, "disagg_router_in_flight_requests", role="decode") == 1
            assert value(s, "disagg_router_in_flight_requests", role="prefill") == 0
            assert value(s, "disagg_router_routable_pairs") == 1
            request.cancel()
            await until(lambda: len(r.decode.aborted) == 1)
            await until(lambda: r.router.balancer.decode_legs == {})
            s = await scrape(r)
            assert value(s, "disagg_router_in_flight_requests", role="decode") == 0
            assert (
                value(
                    s, "disagg_router_request_failures_total", endpoint=ENDPOINT, reason="ClientDisconnected"
                )
                == 1
            )
            count = "disagg_router_request_duration_seconds_count"
            assert value(s, count, endpoint=ENDPOINT, outcome="disconnected") == 1

    run(go())
