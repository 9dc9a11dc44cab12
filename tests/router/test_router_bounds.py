"""What a client may make the router hold, and for how long: slow headers and bodies are dropped, bodies are
bounded before they are buffered, connections are capped, engine streams that only keep alive are stalled,
every request ends by its deadline, and under load requests wait for a decoder with room or are shed, never
sent to expire. Clients here speak raw HTTP over sockets where aiohttp's client would not misbehave."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web
from router_rig import COMPLETION, Rig, hang, rig, run, sse_events, until

from disagg.worker.router.app import RouterConfig
from disagg.worker.router.protocol import MAX_JSON_DEPTH, parse_client_request


async def raw_connection(r: Rig) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = r.url.removeprefix("http://").rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def closed_by_router(reader: asyncio.StreamReader, bound_s: float = 5.0) -> bytes:
    """Everything the router sent until it closed the connection (the bound fails a router that does not)."""
    received = b""
    async with asyncio.timeout(bound_s):
        try:
            while chunk := await reader.read(65536):
                received += chunk
        except ConnectionResetError:
            pass
    return received


def head(path: str = "/v1/completions", **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: router", "Content-Type: application/json"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def status_and_body(raw: bytes) -> tuple[int, dict[str, Any]]:
    header, _, body = raw.partition(b"\r\n\r\n")
    return int(header.split(b" ", 2)[1]), json.loads(body)


async def metrics(r: Rig) -> str:
    async with r.client.get(r.url + "/metrics") as response:
        return await response.text()


# --- slow clients are dropped ----------------------------------------------------------------------------


def test_a_client_trickling_its_headers_is_dropped_at_the_header_timeout() -> None:
    async def go() -> None:
        async with rig(RouterConfig(header_timeout_s=0.5)) as r:
            reader, writer = await raw_connection(r)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n")

            async def trickle() -> None:
                # A byte every 50 ms: a stall timer that any byte resets would never fire.
                for _ in range(400):
                    writer.write(b"X")
                    await writer.drain()
                    await asyncio.sleep(0.05)

            trickling = asyncio.create_task(trickle())
            assert await closed_by_router(reader) == b""
            trickling.cancel()
            writer.close()
            assert r.prefill.received == [] and r.decode.received == []
            assert (await r.post("/v1/completions", COMPLETION))[0] == 200

    run(go())


def test_many_half_sent_headers_are_all_dropped_and_the_router_keeps_serving() -> None:
    async def go() -> None:
        async with rig(RouterConfig(header_timeout_s=0.5)) as r:
            connections = [await raw_connection(r) for _ in range(100)]
            for _, writer in connections:
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: rou")
            # Meanwhile a well-behaved client is served.
            assert (await r.post("/v1/completions", COMPLETION))[0] == 200
            for reader, writer in connections:
                assert await closed_by_router(reader) == b""
                writer.close()
            await until(lambda: r.router.gate.open <= 1)

    run(go())


def test_an_idle_connection_is_closed_at_the_header_timeout() -> None:
    async def go() -> None:
        async with rig(RouterConfig(header_timeout_s=0.5)) as r:
            reader, writer = await raw_connection(r)
            assert await closed_by_router(reader) == b""
            writer.close()

    run(go())


def test_a_client_trickling_its_body_gets_408_and_is_dropped() -> None:
    async def go() -> None:
        async with rig(RouterConfig(body_timeout_s=0.5)) as r:
            reader, writer = await raw_connection(r)
            writer.write(head(Content_Length="1000") + b'{"prompt": "')

            async def trickle() -> None:
                for _ in range(400):
                    writer.write(b"x")
                    await writer.drain()
                    await asyncio.sleep(0.05)

            trickling = asyncio.create_task(trickle())
            received = await closed_by_router(reader)
            trickling.cancel()
            writer.close()
            status, body = status_and_body(received)
            assert status == 408 and "did not arrive" in body["error"]["message"]
            assert r.prefill.received == [] and r.decode.received == []
            assert 'outcome="RequestBodyTimeout"' in await metrics(r)

    run(go())


# --- bodies are bounded before they are buffered ---------------------------------------------------------


def test_a_content_length_past_the_bound_is_refused_before_any_body_arrives() -> None:
    async def go() -> None:
        async with rig(RouterConfig(max_request_bytes=1024)) as r:
            reader, writer = await raw_connection(r)
            # A gigabyte announced, not a byte sent: the answer cannot wait for the body.
            writer.write(head(Content_Length=str(1 << 30)))
            async with asyncio.timeout(5):
                line = await reader.readuntil(b"\r\n\r\n")
            assert line.startswith(b"HTTP/1.1 413 ")
            writer.close()
            assert r.prefill.received == []

    run(go())


def test_a_chunked_body_is_refused_as_it_streams_past_the_bound() -> None:
    async def go() -> None:
        async with rig(RouterConfig(max_request_bytes=4096)) as r:

            async def chunks() -> Any:
                yield b'{"prompt": "'
                for _ in range(64):
                    yield b"x" * 1024
                    await asyncio.sleep(0)
                yield b'"}'

            async with r.client.post(r.url + "/v1/completions", data=chunks()) as response:
                assert response.status == 413
                error = (await response.json())["error"]
            assert error["code"] == 413 and "exceeds 4096 bytes" in error["message"]
            assert r.prefill.received == []

    run(go())


def test_bodies_being_read_share_a_memory_budget_fairly() -> None:
    async def go() -> None:
        config = RouterConfig(
            max_body_buffer_bytes=64 * 1024, max_request_bytes=1024 * 1024, body_timeout_s=30
        )
        async with rig(config) as r:
            # One slow upload holds 60 KiB of the 64 KiB budget ...
            reader, writer = await raw_connection(r)
            writer.write(head(Content_Length=str(512 * 1024)) + b"x" * 60 * 1024)
            await writer.drain()
            await until(lambda: r.router.bodies.buffered >= 60 * 1024)
            # ... more than its share once another body is read: a body within its own share cuts it ...
            body = {**COMPLETION, "prompt": "y" * 16 * 1024}
            status, _, raw = await r.post("/v1/completions", body)
            assert status == 200, raw
            status, cut = status_and_body(await closed_by_router(reader))
            assert status == 503 and cut["error"]["type"] == "service_unavailable"
            assert "more than its share" in cut["error"]["message"]
            writer.close()
            await until(lambda: r.router.bodies.buffered == 0)
            # ... and one body alone may not pass the whole budget.
            status, headers, raw = await r.post("/v1/completions", {**COMPLETION, "prompt": "z" * 80 * 1024})
            assert status == 503 and headers["Retry-After"] == "1"
            assert json.loads(raw)["error"]["type"] == "service_unavailable"
            assert r.router.bodies.buffered == 0

    run(go())


def test_sixteen_slow_uploads_do_not_lock_other_clients_out() -> None:
    """16 uploads that fill the whole body budget and stall: every other client is still served (each
    within its share cuts one of them), where it got 503 until the uploads' body timeout."""

    async def go() -> None:
        uploads, each = 16, 64 * 1024
        config = RouterConfig(
            max_body_buffer_bytes=uploads * each,
            max_request_bytes=4 * each,
            body_timeout_s=30,
            min_body_rate_bytes_s=0,
        )
        async with rig(config) as r:
            connections = [await raw_connection(r) for _ in range(uploads)]
            for _, writer in connections:
                writer.write(head(Content_Length=str(4 * each)) + b"x" * each)
                await writer.drain()
            await until(lambda: r.router.bodies.buffered == uploads * each)
            for i in range(8):
                status, _, raw = await r.post("/v1/completions", {**COMPLETION, "prompt": f"client {i}"})
                assert status == 200, raw
            # The uploads cut are told so, with a Retry-After, and closed.
            answers = [asyncio.create_task(closed_by_router(reader, 30)) for reader, _ in connections]
            done, _ = await asyncio.wait(answers, return_when=asyncio.FIRST_COMPLETED)
            for answer in done:
                raw = answer.result()
                assert raw.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in raw, raw[:200]
            for answer in answers:
                answer.cancel()
            for _, writer in connections:
                writer.close()
            assert 'outcome="RequestBodyEvicted"' in await metrics(r)

    run(go())


def test_an_upload_slower_than_the_rate_floor_gets_408_before_its_body_timeout() -> None:
    async def go() -> None:
        config = RouterConfig(body_timeout_s=30, min_body_rate_bytes_s=64 * 1024, body_rate_grace_s=0.2)
        async with rig(config) as r:
            reader, writer = await raw_connection(r)
            writer.write(head(Content_Length=str(100_000)) + b'{"prompt": "' + b"x" * 1024)
            await writer.drain()
            # Bounded well under the body timeout: only the rate floor can answer in time.
            status, body = status_and_body(await closed_by_router(reader, 15))
            writer.close()
            assert status == 408 and "slower than 65536 bytes/s" in body["error"]["message"]
            assert r.prefill.received == [] and r.decode.received == []
            assert 'outcome="RequestBodyTooSlow"' in await metrics(r)
            assert r.router.bodies.buffered == 0

    run(go())


# --- connections are capped ------------------------------------------------------------------------------


def test_a_connection_past_the_cap_gets_503_with_retry_after() -> None:
    async def go() -> None:
        async with rig(RouterConfig(max_connections=3)) as r:
            held = [await raw_connection(r) for _ in range(3)]
            await until(lambda: r.router.gate.open == 3)
            async with (
                aiohttp.ClientSession() as fresh,
                fresh.post(r.url + "/v1/completions", json=COMPLETION) as response,
            ):
                assert response.status == 503 and response.headers["Retry-After"] == "1"
                error = (await response.json())["error"]
            assert error["type"] == "service_unavailable" and "3 client connections" in error["message"]
            assert r.prefill.received == []
            for _, writer in held:
                writer.close()
            await until(lambda: r.router.gate.open == 0)
            assert (await r.post("/v1/completions", COMPLETION))[0] == 200
            text = await metrics(r)
            assert "disagg_router_refused_connections_total 1.0" in text

    run(go())


# --- engine streams: only data counts as progress --------------------------------------------------------


def _keep_alive_only(*, data_first: bool) -> Any:
    async def send(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        if data_first:
            await out.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        while True:
            await out.write(b": keep-alive\n\n")
            await asyncio.sleep(0.05)

    return send


def test_a_decoder_sending_only_keep_alives_is_stalled() -> None:
    async def go() -> None:
        async with rig(RouterConfig(stall_timeout_s=0.5)) as r:
            r.decode.behaviour = _keep_alive_only(data_first=True)
            async with asyncio.timeout(10):
                status, _, raw = await r.post("/v1/completions", {**COMPLETION, "stream": True})
            assert status == 200
            events = sse_events(raw)
            assert events[0]["choices"][0]["text"] == "a"
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 504
            assert "no data event" in events[-2]["error"]["message"]
            await until(lambda: len(r.decode.aborted) == 1)
            assert 'outcome="DecodeStalled"' in await metrics(r)

    run(go())


def test_keep_alives_before_the_first_data_event_do_not_extend_the_decode_timeout() -> None:
    async def go() -> None:
        async with rig(RouterConfig(decode_timeout_s=0.5, stall_timeout_s=60)) as r:
            r.decode.behaviour = _keep_alive_only(data_first=False)
            async with asyncio.timeout(10):
                status, _, raw = await r.post("/v1/completions", {**COMPLETION, "stream": True})
            assert status == 200
            assert sse_events(raw)[-2]["error"]["code"] == 504
            await until(lambda: len(r.decode.aborted) == 1)

    run(go())


# --- every request ends by its deadline ------------------------------------------------------------------


def test_a_request_past_its_deadline_is_504_and_both_legs_are_closed() -> None:
    async def go() -> None:
        async with rig(RouterConfig(request_timeout_s=0.5)) as r:
            r.prefill.behaviour = hang
            async with asyncio.timeout(10):
                status, _, raw = await r.post("/v1/completions", COMPLETION)
            error = json.loads(raw)["error"]
            assert status == 504 and error["type"] == "timeout" and "--request-timeout-s" in error["message"]
            await until(lambda: len(r.prefill.aborted) == 1 and len(r.decode.aborted) == 1)
            assert 'outcome="RequestTimeout"' in await metrics(r)

    run(go())


def test_a_stream_past_its_deadline_ends_with_an_error_event_and_closes_the_decode_leg() -> None:
    async def endless(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        # Never stalled, never done: only the deadline ends it.
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        while True:
            await out.write(b'data: {"choices": [{"text": "a"}]}\n\n')
            await asyncio.sleep(0.02)

    async def go() -> None:
        async with rig(RouterConfig(request_timeout_s=0.5, stall_timeout_s=0.3)) as r:
            r.decode.behaviour = endless
            async with asyncio.timeout(10):
                status, _, raw = await r.post("/v1/completions", {**COMPLETION, "stream": True})
            assert status == 200
            events = sse_events(raw)
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 504
            assert "--request-timeout-s" in events[-2]["error"]["message"]
            assert len(events) > 3
            await until(lambda: len(r.decode.aborted) == 1)

    run(go())


# --- backpressure: wait for a decoder with room, or be shed; never sent to expire -------------------------


def _held_decode(release: asyncio.Event, original: Any) -> Any:
    async def decode(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await release.wait()
        result: web.StreamResponse = await original(request, body, request.headers["X-Request-Id"])
        return result

    return decode


def test_a_request_waits_for_a_decoder_with_room_before_either_leg_is_sent() -> None:
    async def go() -> None:
        async with rig(RouterConfig(max_in_flight_per_decoder=1, queue_timeout_s=30)) as r:
            release = asyncio.Event()
            r.decode.behaviour = _held_decode(release, r.decode._decode)
            first = asyncio.create_task(r.post("/v1/completions", {**COMPLETION, "prompt": "one"}))
            await until(lambda: len(r.decode.received) == 1)
            second = asyncio.create_task(r.post("/v1/completions", {**COMPLETION, "prompt": "two"}))
            await until(lambda: r.router.admission.queued == 1)
            assert "disagg_router_queued_requests 1.0" in await metrics(r)
            # The decoder is full: the second request reached neither engine.
            assert len(r.prefill.received) == 1 and len(r.decode.received) == 1
            release.set()
            statuses = [(await first)[0], (await second)[0]]
            assert statuses == [200, 200]
            assert [x.body["prompt"] for x in r.decode.received] == ["one", "two"]
            assert r.router.admission.queued == 0 and not r.router.balancer.decode_legs

    run(go())


def test_a_request_that_finds_no_room_in_time_is_shed_with_503_and_retry_after() -> None:
    async def go() -> None:
        async with rig(RouterConfig(max_in_flight_per_decoder=1, queue_timeout_s=0.3)) as r:
            r.prefill.behaviour = hang
            first = asyncio.create_task(r.post("/v1/completions", COMPLETION))
            await until(lambda: len(r.decode.received) == 1)
            status, headers, raw = await r.post("/v1/completions", COMPLETION)
            assert status == 503 and headers["Retry-After"] == "1"
            assert json.loads(raw)["error"]["type"] == "service_unavailable"
            assert len(r.prefill.received) == 1 and len(r.decode.received) == 1
            assert 'outcome="QueueTimeout"' in await metrics(r)
            first.cancel()

    run(go())


def test_a_request_past_a_full_queue_is_shed_at_once() -> None:
    async def go() -> None:
        async with rig(RouterConfig(max_in_flight_per_decoder=1, max_queued=1, queue_timeout_s=30)) as r:
            r.prefill.behaviour = hang
            first = asyncio.create_task(r.post("/v1/completions", COMPLETION))
            await until(lambda: len(r.decode.received) == 1)
            second = asyncio.create_task(r.post("/v1/completions", COMPLETION))
            await until(lambda: r.router.admission.queued == 1)
            status, headers, raw = await r.post("/v1/completions", COMPLETION)
            assert status == 503 and headers["Retry-After"] == "1"
            assert "wait for room" in json.loads(raw)["error"]["message"]
            assert len(r.decode.received) == 1
            first.cancel()
            second.cancel()

    run(go())


def test_a_request_waiting_for_room_ends_at_its_deadline() -> None:
    async def go() -> None:
        config = RouterConfig(max_in_flight_per_decoder=1, queue_timeout_s=30, request_timeout_s=0.4)
        async with rig(config) as r:
            # The decoder's one slot, taken by load the test holds (as a request would, for longer than the
            # deadline of the one that waits).
            assert r.router.routing is not None
            ticket = r.router.balancer.start(r.router.routing.pairs[0], 1)
            async with asyncio.timeout(10):
                status, _, raw = await r.post("/v1/completions", COMPLETION)
            assert status == 504 and "--request-timeout-s" in json.loads(raw)["error"]["message"]
            assert r.prefill.received == [] and r.decode.received == []
            assert r.router.admission.queued == 0
            r.router.balancer.done(ticket)

    run(go())


# --- no body produces a 500 ------------------------------------------------------------------------------


def test_a_deeply_nested_prompt_is_refused_as_the_clients_fault() -> None:
    # The body of issue 22: a prompt of lists nested 600 deep, 2.4 KB.
    raw = b'{"model": "tiny", "prompt": ' + b"[" * 600 + b"]" * 600 + b"}"

    async def go() -> None:
        async with rig() as r:
            async with r.client.post(r.url + "/v1/completions", data=raw) as response:
                assert response.status == 400
                error = (await response.json())["error"]
            assert f"deeper than {MAX_JSON_DEPTH}" in error["message"]
            assert r.prefill.received == []

    run(go())


def test_a_nested_prompt_within_the_bound_is_weighed() -> None:
    prompt: list[Any] = [1, "abc"]
    for _ in range(MAX_JSON_DEPTH - 2):
        prompt = [prompt, 2]
    request = parse_client_request("/v1/completions", json.dumps({"prompt": prompt}).encode())
    assert request.prompt_weight == 1 + 3 + (MAX_JSON_DEPTH - 2)
