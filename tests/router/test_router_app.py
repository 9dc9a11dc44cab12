"""The router's HTTP behaviour over real sockets: both legs, concurrency, failures on either side, a client
that goes away, and engines that answer garbage. The engines are `engine_fakes` servers that record what they
received; the router is the real `disagg.worker.router.app`."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from engine_fakes import HOST, Exchange, completion_text, engines, pair_of, routing_of
from router_rig import CHAT, COMPLETION, Rig, hang, rig, run, sse_events, until

from disagg.worker.router.app import Router, RouterConfig, start

# --- the protocol on the wire ---------------------------------------------------------------------------


def test_a_completion_goes_to_both_legs_as_vllm_push_needs_it() -> None:
    async def go() -> None:
        async with rig() as r:
            body = {**COMPLETION, "vendor_field": {"kept": [1, 2]}, "stream_options": {"include_usage": True}}
            status, headers, raw = await r.post("/v1/completions", body)
            assert status == 200, raw
            assert json.loads(raw)["choices"][0]["text"] == completion_text(COMPLETION)
            [p], [d] = r.prefill.received, r.decode.received
            assert p.path == d.path == "/v1/completions"
            request_id = p.headers["X-Request-Id"]
            assert d.headers["X-Request-Id"] == request_id == headers["X-Request-Id"]
            assert p.body == {
                **{k: v for k, v in body.items() if k != "stream_options"},
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
            }
            assert d.body == {
                **body,
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_engine_id": "tiny-prefill-0@1a2b",
                    "remote_host": HOST,
                    "remote_port": 5600,
                    "tp_size": 1,
                    "pp_size": 2,
                    "remote_request_id": f"cmpl-{request_id}",
                },
            }

    run(go())


def test_every_request_has_its_own_request_id() -> None:
    async def go() -> None:
        async with rig() as r:
            for _ in range(3):
                assert (await r.post("/v1/completions", COMPLETION))[0] == 200
            ids = [x.headers["X-Request-Id"] for x in r.prefill.received]
            assert len(set(ids)) == 3
            assert ids == [x.headers["X-Request-Id"] for x in r.decode.received]

    run(go())


def test_the_legs_are_sent_concurrently() -> None:
    # The fake prefill answers only once the decoder has registered: sequential dispatch would never finish.
    async def go() -> None:
        async with rig() as r:
            r.prefill.wait_for_decode = True
            status, _, raw = await r.post("/v1/completions", COMPLETION)
            assert status == 200, raw

    run(go())


def test_a_streamed_chat_reaches_the_client_event_by_event() -> None:
    async def go() -> None:
        async with rig() as r:
            body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
            async with r.client.post(r.url + "/v1/chat/completions", json=body) as response:
                assert response.status == 200
                assert response.headers["Content-Type"].startswith("text/event-stream")
                raw = await response.read()
            events = sse_events(raw)
            assert events[-1] == "[DONE]"
            assert "".join(e["choices"][0]["delta"]["content"] for e in events[:-1]) == completion_text(CHAT)
            [p], [d] = r.prefill.received, r.decode.received
            assert p.path == d.path == "/v1/chat/completions"
            assert p.body["stream"] is False and "stream_options" not in p.body and p.body["max_tokens"] == 1
            assert d.body["stream"] is True and d.body["stream_options"] == {"include_usage": True}
            assert (
                d.body["kv_transfer_params"]["remote_request_id"] == f"chatcmpl-{p.headers['X-Request-Id']}"
            )

    run(go())


def test_chat_max_completion_tokens_is_capped_on_the_prefill_leg() -> None:
    async def go() -> None:
        async with rig() as r:
            status, _, _ = await r.post("/v1/chat/completions", {**CHAT, "max_completion_tokens": 50})
            assert status == 200
            assert r.prefill.received[0].body["max_completion_tokens"] == 1
            assert r.decode.received[0].body["max_completion_tokens"] == 50

    run(go())


# --- the client's mistakes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "payload", "reason"),
    [
        ("/v1/completions", b"{not json", "not JSON"),
        ("/v1/completions", b"[1, 2]", "JSON object"),
        ("/v1/completions", json.dumps({"model": "tiny"}).encode(), "prompt"),
        ("/v1/chat/completions", json.dumps({"model": "tiny", "messages": []}).encode(), "messages"),
        ("/v1/completions", json.dumps({**COMPLETION, "stream": "yes"}).encode(), "stream"),
        (
            "/v1/completions",
            json.dumps({**COMPLETION, "kv_transfer_params": {"remote_host": "evil"}}).encode(),
            "kv_transfer_params",
        ),
    ],
)
def test_a_bad_request_is_the_clients_fault_and_reaches_no_engine(
    path: str, payload: bytes, reason: str
) -> None:
    async def go() -> None:
        async with rig() as r:
            async with r.client.post(r.url + path, data=payload) as response:
                assert response.status == 400
                error = (await response.json())["error"]
            assert (
                reason in error["message"]
                and error["type"] == "invalid_request_error"
                and error["code"] == 400
            )
            assert r.prefill.received == [] and r.decode.received == []

    run(go())


def test_a_request_body_past_the_bound_is_refused() -> None:
    async def go() -> None:
        async with rig(RouterConfig(max_request_bytes=1024)) as r:
            status, _, raw = await r.post("/v1/completions", {**COMPLETION, "prompt": "x" * 4096})
            assert status == 413 and "exceeds" in json.loads(raw)["error"]["message"]
            assert r.prefill.received == []

    run(go())


def test_an_engine_refusing_the_clients_request_keeps_its_status() -> None:
    async def refuse(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response(
            {"error": {"message": "model 'nope' does not exist", "code": 404}}, status=404
        )

    async def go() -> None:
        async with rig() as r:
            r.decode.behaviour = refuse
            status, _, raw = await r.post("/v1/completions", {**COMPLETION, "model": "nope"})
            assert status == 404
            assert json.loads(raw)["error"]["message"] == "model 'nope' does not exist"
            await until(lambda: r.prefill.aborted or r.prefill.finished)

    run(go())


# --- routing ---------------------------------------------------------------------------------------------


def test_no_routable_pair_is_503_and_not_ready() -> None:
    async def go() -> None:
        async with rig(routed=False) as r:
            status, _, raw = await r.post("/v1/completions", COMPLETION)
            assert status == 503 and json.loads(raw)["error"]["type"] == "service_unavailable"
            async with r.client.get(r.url + "/readyz") as response:
                assert response.status == 503
            r.router.set_routing(routing_of())
            async with r.client.get(r.url + "/readyz") as response:
                assert response.status == 503
            r.router.set_routing(routing_of(pair_of(r.prefill, r.decode)))
            async with r.client.get(r.url + "/readyz") as response:
                assert response.status == 200
            assert (await r.post("/v1/completions", COMPLETION))[0] == 200

    run(go())


def test_load_spreads_over_two_decoders() -> None:
    async def go() -> None:
        exchange = Exchange()
        async with engines(exchange, ("prefill", "p0", 1), ("decode", "d0", 1), ("decode", "d1", 1)) as (
            p,
            d0,
            d1,
        ):
            router = Router(RouterConfig(kv_canary=False))  # these fakes count every request they see
            router.set_routing(routing_of(pair_of(p, d0), pair_of(p, d1)))
            runner = await start(router, HOST, 0)
            url = f"http://{HOST}:{runner.addresses[0][1]}/v1/completions"
            try:
                async with aiohttp.ClientSession() as client:

                    async def one(i: int) -> int:
                        async with client.post(url, json={**COMPLETION, "prompt": f"p{i}"}) as response:
                            await response.read()
                            return response.status

                    assert await asyncio.gather(*(one(i) for i in range(20))) == [200] * 20
            finally:
                await runner.cleanup()
            assert len(d0.received) + len(d1.received) == 20
            assert abs(len(d0.received) - len(d1.received)) <= 2
            assert router.balancer.decode_legs == {} and router.balancer.prefill_weight == {}

    run(go())


def test_models_come_from_a_routable_decoder() -> None:
    async def go() -> None:
        async with rig() as r, r.client.get(r.url + "/v1/models") as response:
            assert response.status == 200
            assert (await response.json())["data"][0]["id"] == "tiny"

    run(go())


def test_metrics_count_outcomes_and_pairs() -> None:
    async def fail(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.Response(status=500, text="boom")

    async def go() -> None:
        async with rig() as r:
            assert (await r.post("/v1/completions", COMPLETION))[0] == 200
            r.prefill.behaviour = fail
            assert (await r.post("/v1/completions", COMPLETION))[0] == 502
            async with r.client.get(r.url + "/metrics") as response:
                text = await response.text()
            assert 'disagg_router_requests_total{endpoint="/v1/completions",outcome="ok"} 1.0' in text
            assert (
                'disagg_router_requests_total{endpoint="/v1/completions",outcome="PrefillFailed"} 1.0' in text
            )
            assert "disagg_router_routable_pairs 1.0" in text
            assert 'disagg_router_prefill_leg_seconds_count{endpoint="/v1/completions"} 1.0' in text

    run(go())


# --- one leg fails: the other is closed ------------------------------------------------------------------


def test_a_failed_prefill_closes_the_decode_leg() -> None:
    async def fail(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        # Only once the decode leg is in, so there is a decode leg to close.
        await r.exchange.event(r.exchange.registered, request.headers["X-Request-Id"]).wait()
        return web.json_response({"error": {"message": "prefill OOM"}}, status=500)

    async def go() -> None:
        nonlocal r
        async with rig() as r:
            r.prefill.behaviour = fail
            status, _, raw = await r.post("/v1/completions", COMPLETION)
            assert status == 502 and "prefill OOM" in json.loads(raw)["error"]["message"]
            await until(lambda: len(r.decode.aborted) == 1)
            assert r.decode.finished == []

    r: Rig
    run(go())


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ({"id": "x", "choices": [{"text": "a"}]}, "no kv_transfer_params"),
        ({"id": "x", "kv_transfer_params": None}, "no kv_transfer_params"),
        ({"error": {"message": "engine dead"}}, "engine dead"),
        ({"kv_transfer_params": {"do_remote_prefill": True}}, "remote_engine_id"),
    ],
)
def test_a_prefill_answer_without_kv_is_a_prefill_failure(answer: dict[str, Any], reason: str) -> None:
    async def answer_with(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response(answer)

    async def go() -> None:
        async with rig() as r:
            r.prefill.behaviour = answer_with
            status, _, raw = await r.post("/v1/completions", COMPLETION)
            assert status == 502 and reason in json.loads(raw)["error"]["message"]
            await until(lambda: len(r.decode.aborted) == 1)

    run(go())


def test_a_prefill_timeout_is_504_and_closes_both_legs() -> None:
    async def go() -> None:
        async with rig(RouterConfig(prefill_timeout_s=0.3)) as r:
            r.prefill.behaviour = hang
            status, _, raw = await r.post("/v1/completions", {**COMPLETION, "stream": True})
            assert status == 504 and json.loads(raw)["error"]["type"] == "timeout"
            await until(lambda: len(r.decode.aborted) == 1 and len(r.prefill.aborted) == 1)

    run(go())


def test_a_failed_decode_closes_the_prefill_leg() -> None:
    async def fail(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.Response(status=503, text="decoder draining")

    async def go() -> None:
        async with rig() as r:
            r.prefill.behaviour = hang
            r.decode.behaviour = fail
            status, _, raw = await r.post("/v1/completions", COMPLETION)
            assert status == 502 and "HTTP 503" in json.loads(raw)["error"]["message"]
            await until(lambda: len(r.prefill.aborted) == 1)
            # Decode is never retried alone.
            assert len(r.decode.received) == 1

    run(go())


def test_an_unreachable_decoder_is_502_and_closes_the_prefill_leg() -> None:
    async def go() -> None:
        async with rig() as r:
            r.prefill.behaviour = hang
            await r.decode.stop()
            status, _, raw = await r.post("/v1/completions", COMPLETION)
            assert status == 502 and json.loads(raw)["error"]["type"] == "upstream_error"
            await until(lambda: len(r.prefill.aborted) == 1)

    run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_ends_both_legs(stream: bool) -> None:
    async def go() -> None:
        async with rig() as r:
            r.prefill.behaviour = hang
            request = asyncio.create_task(r.post("/v1/completions", {**COMPLETION, "stream": stream}))
            await until(lambda: len(r.prefill.received) == 1 and len(r.decode.received) == 1)
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request
            await until(lambda: len(r.prefill.aborted) == 1 and len(r.decode.aborted) == 1)
            await until(lambda: not r.router.balancer.decode_legs and not r.router.balancer.prefill_legs)

    run(go())


def test_a_client_that_disconnects_mid_stream_ends_the_decode_leg() -> None:
    async def slow_stream(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        await asyncio.Event().wait()
        return out

    async def go() -> None:
        async with rig() as r:
            r.decode.behaviour = slow_stream
            async with r.client.post(
                r.url + "/v1/completions", json={**COMPLETION, "stream": True}
            ) as response:
                assert response.status == 200
                assert b'"a"' in await response.content.readuntil(b"\n\n")
            await until(lambda: len(r.decode.aborted) == 1)

    run(go())


# --- engines that answer garbage: the request fails, the router keeps serving -------------------------------


def _stream(
    *chunks: bytes, then_hang: bool = False
) -> Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]:
    async def send(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for chunk in chunks:
            await out.write(chunk)
        if then_hang:
            await asyncio.Event().wait()
        await out.write_eof()
        return out

    return send


def _raw(
    status: int, payload: bytes
) -> Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]:
    async def send(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.Response(status=status, body=payload, content_type="application/json")

    return send


def _headers(
    headers: dict[str, str],
) -> Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]:
    async def send(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response({"choices": []}, headers=headers)

    return send


HOSTILE_DECODES = {
    "invalid JSON": (False, _raw(200, b"{oops"), "DecodeInvalidResponse"),
    "a JSON list": (False, _raw(200, b"[1]"), "DecodeInvalidResponse"),
    "a huge body": (False, _raw(200, b'{"a": "' + b"x" * (3 * 1024 * 1024) + b'"}'), "DecodeTooLarge"),
    "a huge error": (False, _raw(500, b"x" * (3 * 1024 * 1024)), "DecodeTooLarge"),
    "deep JSON": (False, _raw(200, b"[" * 100_000 + b"]" * 100_000), "DecodeInvalidResponse"),
    "SSE garbage": (True, _stream(b"data: {nope}\n\n"), "DecodeInvalidStream"),
    "not SSE": (True, _stream(b"<html>hello</html>\n\n"), "DecodeInvalidStream"),
    "an endless SSE event": (True, _stream(b"data: " + b"x" * (3 * 1024 * 1024)), "DecodeInvalidStream"),
    "a stream cut short": (True, _stream(b'data: {"choices": []}\n\n'), "DecodeTruncated"),
    "a stalled stream": (True, _stream(b'data: {"choices": []}\n\n', then_hang=True), "DecodeStalled"),
    "huge headers": (False, _headers({"X-Big": "x" * 100_000}), "DecodeFailed"),
    "binary noise": (True, _stream(bytes(range(256)) * 64 + b"\n\n"), "DecodeInvalidStream"),
}


@pytest.mark.parametrize("name", list(HOSTILE_DECODES))
def test_a_hostile_decoder_fails_its_request_and_nothing_else(name: str) -> None:
    stream, behaviour, reason = HOSTILE_DECODES[name]
    config = RouterConfig(
        max_response_bytes=2 * 1024 * 1024,
        max_error_bytes=2 * 1024 * 1024,
        max_sse_event_bytes=2 * 1024 * 1024,
        stall_timeout_s=0.3,
    )

    async def go() -> None:
        async with rig(config) as r:
            r.decode.behaviour = behaviour
            status, _, raw = await r.post("/v1/completions", {**COMPLETION, "stream": stream})
            if stream:
                assert status == 200
                # What reached the client is SSE throughout: the garbage stopped at the router.
                events = sse_events(raw)
                assert events[-1] == "[DONE]" and "error" in events[-2]
                assert events[-2]["error"]["code"] in (502, 504)
            else:
                assert status == 502, raw
                assert json.loads(raw)["error"]["type"] == "upstream_error"
            async with r.client.get(r.url + "/metrics") as response:
                assert f'outcome="{reason}"' in await response.text()
            r.decode.behaviour = None
            assert (await r.post("/v1/completions", COMPLETION))[0] == 200
            assert not r.router.balancer.decode_legs

    run(go())


@pytest.mark.parametrize(
    "behaviour",
    [_raw(200, b"not json"), _raw(200, b"x" * (3 * 1024 * 1024)), _raw(200, b'{"kv_transfer_params": [1]}')],
    ids=["invalid JSON", "a huge body", "params not an object"],
)
def test_a_hostile_prefill_fails_its_request_and_nothing_else(
    behaviour: Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]],
) -> None:
    async def go() -> None:
        async with rig(RouterConfig(max_prefill_response_bytes=1024 * 1024)) as r:
            r.prefill.behaviour = behaviour
            status, _, raw = await r.post("/v1/completions", COMPLETION)
            assert status == 502 and json.loads(raw)["error"]["type"] == "upstream_error"
            await until(lambda: len(r.decode.aborted) == 1)
            r.prefill.behaviour = None
            assert (await r.post("/v1/completions", COMPLETION))[0] == 200

    run(go())


def test_a_prefill_that_restarted_with_another_engine_id_is_refused() -> None:
    async def go() -> None:
        async with rig() as r:
            r.prefill.engine_id = "tiny-prefill-0@new"
            status, _, raw = await r.post("/v1/completions", COMPLETION)
            assert status == 502 and "tiny-prefill-0@new" in json.loads(raw)["error"]["message"]

    run(go())


# --- prompts whose transferred KV is known to be wrong (issue 42) -------------------------------------------

# A window of 4 tokens in blocks of 2: a prompt of L tokens loses a key when (L - 3) is a whole number of
# blocks (`releases.loses_window_edge`). COMPLETION's prompt is 5 words, which the fake prefill counts as 5.
EDGES = RouterConfig(window_edges=((4, 2),))


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_that_loses_a_window_key_is_served_again_by_the_decoder_alone(stream: bool) -> None:
    async def go() -> None:
        async with rig(EDGES) as r:
            status, _, raw = await r.post("/v1/completions", {**COMPLETION, "stream": stream})
            assert status == 200, raw
            text = (
                "".join(e["choices"][0]["text"] for e in sse_events(raw) if e != "[DONE]")
                if stream
                else json.loads(raw)["choices"][0]["text"]
            )
            assert text == completion_text(COMPLETION)
            transferred, alone = r.decode.received
            assert "kv_transfer_params" in transferred.body and "kv_transfer_params" not in alone.body
            assert alone.body == {**COMPLETION, "stream": stream}
            assert alone.headers["X-Request-Id"] == transferred.headers["X-Request-Id"] + "-alone"
            assert len(r.prefill.received) == 1
            metrics = r.router.metrics.render().decode()
            assert (
                'disagg_router_recomputed_requests_total{endpoint="/v1/completions",reason="WindowEdge"} 1.0'
                in metrics
            )

    run(go())


def test_a_prompt_that_keeps_its_window_keys_is_served_by_the_transfer() -> None:
    async def go() -> None:
        async with rig(EDGES) as r:
            body = {**COMPLETION, "prompt": "The capital of France is Paris"}
            status, _, raw = await r.post("/v1/completions", body)
            assert status == 200 and json.loads(raw)["choices"][0]["text"] == completion_text(body)
            [decode_leg] = r.decode.received
            assert "kv_transfer_params" in decode_leg.body
            assert "disagg_router_recomputed_requests_total{" not in r.router.metrics.render().decode()

    run(go())


def test_a_prefill_that_does_not_say_the_prompt_length_is_not_trusted_where_lengths_matter() -> None:
    async def go() -> None:
        async with rig(EDGES) as r:
            r.prefill.says_prompt_length = False
            body = {**COMPLETION, "prompt": "The capital of France is Paris"}
            status, _, raw = await r.post("/v1/completions", body)
            assert status == 200 and json.loads(raw)["choices"][0]["text"] == completion_text(body)
            assert [("kv_transfer_params" in leg.body) for leg in r.decode.received] == [True, False]

    run(go())
