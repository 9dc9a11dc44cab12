"""Benchmark: the router's added latency, against calling the engines directly in the same run.

The deployment is the reference engine (`disagg engine serve`: a PP2 HMA prefill and one decoder, with real
transfer sidecars over NIXL on loopback). Each sample is one streamed completion, sent alternately

- directly: the client itself sends both legs at once (the prefill leg and the decode leg with the prefill's
  identity, as a router does), and reads the decoder's stream;
- through the router (a process on loopback), which does the same on the client's behalf;

and the medians of time to first token and time per request are printed as router/direct ratios. Then a
bounded load run through the router, every output compared with the monolithic run.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid

import aiohttp

from disagg.rig.local_engines import LocalEngines
from disagg.rig.local_router import Case, LocalRouter, load_run, routing_for

SAMPLES = 30
MAX_TOKENS = 16
CASE = Case(
    "/v1/completions",
    "Disaggregated serving moves the KV cache from prefill to decode. " * 2,
    True,
    MAX_TOKENS,
)


async def _stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, object], rid: str
) -> tuple[float, float]:
    """(time to the first token, time to the end) of one streamed request."""
    started = time.perf_counter()
    first = 0.0
    async with session.post(url, json=body, headers={"X-Request-Id": rid}) as response:
        assert response.status == 200, await response.read()
        async for line in response.content:
            if line.startswith(b"data: {") and not first:
                first = time.perf_counter() - started
            if line.strip() == b"data: [DONE]":
                break
    return first, time.perf_counter() - started


async def _direct(session: aiohttp.ClientSession, engines: LocalEngines) -> tuple[float, float]:
    rid = uuid.uuid4().hex
    body = CASE.body(engines.model_name)
    prefill = {
        **body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    decode = {
        **body,
        "kv_transfer_params": {**engines.decode_leg_params(), "remote_request_id": f"cmpl-{rid}"},
    }

    async def prefill_leg() -> None:
        async with session.post(
            engines.prefill_url + CASE.endpoint, json=prefill, headers={"X-Request-Id": rid}
        ) as r:
            assert r.status == 200, await r.read()
            await r.read()

    _, timing = await asyncio.gather(
        prefill_leg(), _stream(session, engines.decode_urls[0] + CASE.endpoint, decode, rid)
    )
    return timing


async def _measure(engines: LocalEngines, router: LocalRouter) -> dict[str, list[tuple[float, float]]]:
    samples: dict[str, list[tuple[float, float]]] = {"direct": [], "router": []}
    async with aiohttp.ClientSession() as session:
        for i in range(SAMPLES + 2):
            direct = await _direct(session, engines)
            routed = await _stream(
                session, router.url + CASE.endpoint, CASE.body(engines.model_name), "client"
            )
            if i >= 2:  # the first two warm the pools and the engines' caches
                samples["direct"].append(direct)
                samples["router"].append(routed)
    return samples


def main() -> int:
    # 1024 blocks: with 256 the reference decoder ran out of blocks under this load, and some of its decode
    # requests then waited for KV past the client's timeout (the engine when full, not the router).
    with (
        LocalEngines(pp_size=2, decoders=1, num_blocks=1024) as engines,
        LocalRouter(routing_for(engines)) as router,
    ):
        samples = asyncio.run(_measure(engines, router))
        med = {
            k: (statistics.median(s[0] for s in v), statistics.median(s[1] for s in v))
            for k, v in samples.items()
        }
        print(f"streamed completion, {MAX_TOKENS} tokens, {SAMPLES} samples each, medians:")
        for name in ("direct", "router"):
            print(
                f"  {name:>6}: time to first token {med[name][0] * 1e3:7.1f} ms, "
                f"per request {med[name][1] * 1e3:7.1f} ms"
            )
        print(
            f"  router/direct: time to first token {med['router'][0] / med['direct'][0]:.2f}x, "
            f"per request {med['router'][1] / med['direct'][1]:.2f}x"
        )
        report = asyncio.run(
            load_run(router.url, engines.decode_urls[0], engines.model_name, requests=200, concurrency=16)
        )
        print(f"load run through the router: {report}")
        return 0 if report.failed == report.mismatched == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
