"""The KV canary: a pair gets client traffic only after a request of the router's own crossed it, both legs
as a client's go; a pair whose canary fails stays excluded with the reason and is retried, and a request
meanwhile waits for it; an engine that restarts (a new live engine id) is canaried again. The real router
app in front of fake engines."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from aiohttp import web
from engine_fakes import pair_of, routing_of
from router_rig import rig, run, until

from disagg.worker.contracts.pairing import Pair
from disagg.worker.router.app import CANARY_PROMPT, RouterConfig
from disagg.worker.router.canary import FAILED_REASON, KvCanary

COMPLETION = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}
FAST_RETRY = RouterConfig(canary_retry_s=0.05)


async def _broken(request: web.Request, body: dict[str, Any]) -> web.Response:
    return web.json_response({"error": {"message": "KV load failed", "code": 500}}, status=500)


def test_a_pair_is_routable_only_after_a_canary_carried_kv_through_it() -> None:
    async def go() -> None:
        async with rig(routed=False, canary=True) as r:
            async with r.client.get(r.url + "/readyz") as response:
                assert response.status == 503
            r.router.set_routing(routing_of(pair_of(r.prefill, r.decode)))
            await until(lambda: bool(r.router.routing and r.router.routing.pairs))
            # Exactly one request crossed the pair before any client's: the canary, both legs, one id.
            [p], [d] = r.prefill.received, r.decode.received
            assert p.body["prompt"] == d.body["prompt"] == CANARY_PROMPT
            assert d.body["max_tokens"] == 1 and d.body["kv_transfer_params"]["do_remote_prefill"] is True
            assert p.headers["X-Request-Id"] == d.headers["X-Request-Id"]
            async with r.client.get(r.url + "/readyz") as response:
                assert response.status == 200
            status, _, raw = await r.post("/v1/completions", COMPLETION)
            assert status == 200, raw
            assert len(r.decode.received) == 2

    run(go())


def test_a_failing_canary_keeps_the_pair_out_with_its_reason_until_it_passes() -> None:
    async def go() -> None:
        async with rig(FAST_RETRY, routed=False, canary=True) as r:
            r.decode.behaviour = _broken
            r.router.set_routing(routing_of(pair_of(r.prefill, r.decode)))
            await until(lambda: len(r.decode.received) >= 2)  # failed, then retried
            routing = r.router.routing
            assert routing is not None and routing.pairs == ()
            [exclusion] = routing.exclusions
            assert exclusion.reason == FAILED_REASON and "KV load failed" in exclusion.message
            async with r.client.get(r.url + "/readyz") as response:
                assert response.status == 503 and FAILED_REASON in await response.text()
            # A client's request meanwhile waits for the retries (within its queue bound), rather than
            # failing at once for want of a pair: a restarted vLLM engine's first canary often fails.
            client = asyncio.create_task(r.post("/v1/completions", COMPLETION))
            await until(lambda: r.router.admission.queued == 1)
            assert all(rec.body["prompt"] == CANARY_PROMPT for rec in r.decode.received)
            r.decode.behaviour = None
            status, _, raw = await client
            assert status == 200, raw
            assert r.router.routing is not None and len(r.router.routing.pairs) == 1

    run(go())


def test_a_restarted_engine_is_canaried_again() -> None:
    async def go() -> None:
        async with rig(routed=False, canary=True) as r:
            pair = pair_of(r.prefill, r.decode)
            r.router.set_routing(routing_of(pair))
            await until(lambda: bool(r.router.routing and r.router.routing.pairs))
            # The same routing again (a pod event that changed nothing the pair is known by): no new canary.
            r.router.set_routing(routing_of(pair))
            assert r.router.routing is not None and r.router.routing.pairs == (pair,)
            # The decoder restarted: its launcher drew a new live engine id.
            restarted = dataclasses.replace(
                pair, decode=dataclasses.replace(pair.decode, engine_id="tiny-decode@0000")
            )
            r.router.set_routing(routing_of(restarted))
            assert r.router.routing is not None and r.router.routing.pairs == ()
            await until(lambda: bool(r.router.routing and r.router.routing.pairs))
            canaries = [rec for rec in r.decode.received if rec.body["prompt"] == CANARY_PROMPT]
            assert len(canaries) == 2
            assert json.dumps(r.router.routing.pairs[0].decode.engine_id) == '"tiny-decode@0000"'

    run(go())


def test_an_engine_container_restarted_under_the_same_id_is_canaried_again() -> None:
    # A reference engine's container restarted by the kubelet keeps its pod, address and sidecar (so its id):
    # only the pod's restart count changes, and that alone makes the pair new.
    async def go() -> None:
        async with rig(routed=False, canary=True) as r:
            pair = pair_of(r.prefill, r.decode)
            r.router.set_routing(routing_of(pair))
            await until(lambda: bool(r.router.routing and r.router.routing.pairs))
            restarted = dataclasses.replace(pair, prefill=dataclasses.replace(pair.prefill, restarts=1))
            r.router.set_routing(routing_of(restarted))
            assert r.router.routing is not None and r.router.routing.pairs == ()
            await until(lambda: bool(r.router.routing and r.router.routing.pairs))
            canaries = [rec for rec in r.prefill.received if rec.body["prompt"] == CANARY_PROMPT]
            assert len(canaries) == 2

    run(go())


def test_a_request_arriving_while_the_first_canary_runs_waits_for_it() -> None:
    async def go() -> None:
        async with rig(routed=False, canary=True) as r:
            release = asyncio.Event()

            async def slow_decode(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
                await release.wait()
                r.decode.behaviour = None
                return await r.decode._decode(request, body, request.headers.get("X-Request-Id", ""))

            r.decode.behaviour = slow_decode
            r.router.set_routing(routing_of(pair_of(r.prefill, r.decode)))
            client = asyncio.create_task(r.post("/v1/completions", COMPLETION))
            await until(lambda: r.router.admission.queued == 1)
            release.set()
            status, _, raw = await client
            assert status == 200, raw

    run(go())


def test_a_verified_pair_that_leaves_the_routing_for_a_moment_comes_back_without_a_new_canary() -> None:
    """The scale-up that failed 4 requests: as a decoder joined, the serving pair left the routing for a
    moment and was canaried again, leaving no routable pair. Within `remember_s` it comes back verified;
    after it, or with a restarted engine's new id, it is canaried again."""

    async def go() -> None:
        async with rig(routed=False, canary=True) as r:
            pair = pair_of(r.prefill, r.decode)
            r.router.set_routing(routing_of(pair))
            await until(lambda: bool(r.router.routing and r.router.routing.pairs))
            r.router.set_routing(routing_of())
            assert r.router.routing is not None and r.router.routing.pairs == ()
            r.router.set_routing(routing_of(pair))
            assert r.router.routing is not None and r.router.routing.pairs == (pair,)
            assert [rec.body["prompt"] for rec in r.decode.received] == [CANARY_PROMPT]

    run(go())


def test_a_pair_gone_longer_than_remember_s_is_canaried_again() -> None:
    async def go() -> None:
        async with rig(routed=False, canary=True) as r:
            pair = pair_of(r.prefill, r.decode)
            probes: list[Pair] = []
            now = [0.0]

            async def probe(p: Pair) -> None:
                probes.append(p)

            canary = KvCanary(probe, lambda: None, remember_s=60.0, clock=lambda: now[0])
            canary.admit(routing_of(pair))
            await until(lambda: canary.verified(pair))
            canary.admit(routing_of())
            now[0] = 59.0
            assert canary.admit(routing_of(pair)).pairs == (pair,) and len(probes) == 1
            canary.admit(routing_of())
            now[0] = 120.0
            assert canary.admit(routing_of(pair)).pairs == ()
            await until(lambda: canary.verified(pair))
            assert len(probes) == 2
            await canary.close()

    run(go())
