"""`disagg engine serve` as real processes: a PP2 prefill engine (HMA, the default tiny model) and a decoder,
each worker with its transfer sidecar moving the KV over real NIXL on loopback (`disagg.rig.local_engines`).

Every request's output must equal the monolithic run token for token, and after every test both engines
must hold no KV block (`wait_idle`): nothing leaks on either side, whatever the test did to the requests.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import torch

from disagg.rig.local import free_port
from disagg.rig.local_engines import LocalEngines, get, metric, vllm_labels
from disagg.worker.contracts.topology import lease_wait_s
from disagg.worker.engine.config import TinyConfig, encode
from disagg.worker.engine.model import TinyModel
from disagg.worker.engine.openai_api import chat_prompt

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

CONFIG = TinyConfig()
LEASE_S = 4.0
REGISTRATION_TIMEOUT_S = (
    12.0  # past the sidecar's 5 s handshake timeout, so an unreachable prefill fails first
)
PROMPTS = [
    "Hello!",
    "Disaggregated serving moves the KV cache from prefill to decode, layer by layer and block by block.",
    "A sliding window of 32 tokens hides the early tokens from most layers, while every third layer sees "
    "the whole prompt. " * 2,
]
MESSAGES = [
    {"role": "system", "content": "You are a tiny model."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Push the KV, "}, {"type": "text", "text": "please."}],
    },
]


@pytest.fixture(scope="module")
def engines() -> Iterator[LocalEngines]:
    with LocalEngines(
        pp_size=2, decoders=1, kv_lease_s=LEASE_S, registration_timeout_s=REGISTRATION_TIMEOUT_S
    ) as started:
        yield started
    # Every engine and sidecar left cleanly on SIGTERM (a headless stage when its head ended the pipeline).
    assert set(started.exit_codes.values()) == {0}, started.exit_codes


_REFERENCE_MODEL: list[TinyModel] = []


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    if not _REFERENCE_MODEL:
        _REFERENCE_MODEL.append(TinyModel(CONFIG))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine processes' kernels
    try:
        return _REFERENCE_MODEL[0].generate(prompt, max_tokens)
    finally:
        torch.set_num_threads(threads)


def blocks(url: str) -> dict[str, float]:
    text = get(url + "/metrics")[1]
    counts = {
        state: metric(text, "disagg_engine_requests_holding_blocks", f'state="{state}"')
        for state in ("prefilling", "held_for_push", "awaiting_kv", "decoding", "running")
    }
    return {
        "free": metric(text, "disagg_engine_kv_blocks_free"),
        "usable": metric(text, "disagg_engine_kv_blocks_usable"),
        **counts,
    }


def idle(url: str) -> bool:
    b = blocks(url)
    return b["free"] == b["usable"] and not any(b[s] for s in b if s not in ("free", "usable"))


def wait_idle(engines: LocalEngines, timeout_s: float = LEASE_S + 10) -> None:
    deadline = time.monotonic() + timeout_s
    urls = [engines.prefill_url, *engines.decode_urls]
    while not all(idle(u) for u in urls):
        engines.check_alive()
        assert time.monotonic() < deadline, {u: blocks(u) for u in urls}
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def nothing_leaks(engines: LocalEngines) -> Iterator[None]:
    wait_idle(engines)
    yield
    wait_idle(engines)
    engines.check_alive()


def body(endpoint: str, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    common = {
        "model": "disagg-tiny-1234",
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
    }
    if endpoint == "chat":
        return {**common, "messages": MESSAGES, **extra}
    return {**common, "prompt": prompt, **extra}


def path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


def prompt_tokens(endpoint: str, prompt: str) -> list[int]:
    return encode(chat_prompt(MESSAGES)) if endpoint == "chat" else encode(prompt)


async def read_stream(response: aiohttp.ClientResponse) -> tuple[list[dict[str, Any]], bool]:
    chunks, done = [], False
    async for raw in response.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: "), line
        if line == "data: [DONE]":
            done = True
            continue
        chunks.append(json.loads(line[len("data: ") :]))
    return chunks, done


def streamed_tokens(endpoint: str, chunks: list[dict[str, Any]]) -> tuple[list[int], str]:
    tokens, text = [], ""
    for chunk in chunks:
        for choice in chunk["choices"]:
            tokens += choice.get("token_ids", [])
            text += choice["text"] if endpoint == "completions" else choice["delta"].get("content", "")
    return tokens, text


async def prefill_leg(
    session: aiohttp.ClientSession, engines: LocalEngines, endpoint: str, prompt: str, rid: str
) -> dict[str, Any]:
    request = body(
        endpoint, prompt, 1, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False}
    )
    async with session.post(
        engines.prefill_url + path(endpoint), json=request, headers={"X-Request-Id": rid}
    ) as r:
        answer: dict[str, Any] = await r.json()
        assert r.status == 200, answer
        return answer


async def decode_leg(
    session: aiohttp.ClientSession,
    engines: LocalEngines,
    endpoint: str,
    prompt: str,
    rid: str,
    max_tokens: int,
    stream: bool,
    params: dict[str, Any] | None = None,
) -> tuple[int, list[int], str, dict[str, Any]]:
    prefix = "chatcmpl-" if endpoint == "chat" else "cmpl-"
    kv = params or {**engines.decode_leg_params(), "remote_request_id": prefix + rid}
    request = body(endpoint, prompt, max_tokens, stream=stream, kv_transfer_params=kv)
    url = engines.decode_urls[0] + path(endpoint)
    async with session.post(url, json=request, headers={"X-Request-Id": rid}) as r:
        if r.status != 200 or not stream:
            answer = await r.json()
            if r.status != 200:
                return r.status, [], "", answer
            choice = answer["choices"][0]
            text = choice["text"] if endpoint == "completions" else choice["message"]["content"]
            return r.status, choice["token_ids"], text, answer
        chunks, done = await read_stream(r)
        assert done
        tokens, text = streamed_tokens(endpoint, chunks)
        return r.status, tokens, text, chunks[-1]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_both_legs_at_once_equal_the_monolithic_run(
    engines: LocalEngines, endpoint: str, stream: bool
) -> None:
    max_tokens = 12

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            rids = [uuid.uuid4().hex for _ in PROMPTS]
            results = await asyncio.gather(
                *(
                    prefill_leg(session, engines, endpoint, p, rid)
                    for p, rid in zip(PROMPTS, rids, strict=True)
                ),
                *(
                    decode_leg(session, engines, endpoint, p, rid, max_tokens, stream)
                    for p, rid in zip(PROMPTS, rids, strict=True)
                ),
            )
        prefills, decodes = results[: len(PROMPTS)], results[len(PROMPTS) :]
        for prompt, rid, prefilled, decoded in zip(PROMPTS, rids, prefills, decodes, strict=True):
            status, tokens, text, last = decoded  # type: ignore[misc]
            assert status == 200, last
            expected = reference(prompt_tokens(endpoint, prompt), max_tokens)
            assert tokens == expected
            assert text == bytes(expected).decode("utf-8", errors="replace")
            assert last["choices"][0]["finish_reason"] == "length"
            # The prefill leg answers the first token and the params of vLLM's request_finished.
            assert prefilled["choices"][0]["token_ids"] == expected[:1]  # type: ignore[index]
            params = prefilled["kv_transfer_params"]  # type: ignore[index]
            prefix = "chatcmpl-" if endpoint == "chat" else "cmpl-"
            assert params["remote_request_id"] == prefix + rid
            assert params["remote_engine_id"] == "ref-prefill" and params["pp_size"] == 2
            assert params["remote_num_tokens"] == len(prompt_tokens(endpoint, prompt))
            assert params["transfer_mode"] == "push" and params["do_remote_prefill"] is True

    asyncio.run(run())


def test_prefill_first_then_decode_with_its_params_and_decode_first_then_prefill(
    engines: LocalEngines,
) -> None:
    prompt, max_tokens = PROMPTS[1], 10
    expected = reference(encode(prompt), max_tokens)

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            # Sequential: forward the prefill response's params verbatim, as a pull-style router does.
            rid = uuid.uuid4().hex
            prefilled = await prefill_leg(session, engines, "completions", prompt, rid)
            held = blocks(engines.prefill_url)
            assert held["held_for_push"] == 1 and held["free"] < held["usable"]
            status, tokens, _, answer = await decode_leg(
                session,
                engines,
                "completions",
                prompt,
                rid,
                max_tokens,
                False,
                prefilled["kv_transfer_params"],
            )
            assert status == 200 and tokens == expected, answer
            # The decoder registers first and the prefill comes a while later.
            rid = uuid.uuid4().hex
            decoding = asyncio.ensure_future(
                decode_leg(session, engines, "completions", prompt, rid, max_tokens, True)
            )
            await asyncio.sleep(1.0)
            assert blocks(engines.decode_urls[0])["awaiting_kv"] == 1
            await prefill_leg(session, engines, "completions", prompt, rid)
            status, tokens, _, answer = await decoding
            assert status == 200 and tokens == expected, answer

    asyncio.run(run())


def lease_expiries(url: str) -> float:
    text = get(url + "/metrics")[1]
    try:
        return metric(text, "disagg_engine_kv_events_total", 'event="failed",reason="LeaseExpired"')
    except KeyError:
        return 0.0


def test_prefill_blocks_return_when_the_lease_expires(engines: LocalEngines) -> None:
    expiries = lease_expiries(engines.prefill_url)

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            await prefill_leg(session, engines, "completions", PROMPTS[2], uuid.uuid4().hex)

    asyncio.run(run())
    assert blocks(engines.prefill_url)["held_for_push"] == 1  # no decoder came: held for the lease
    deadline = time.monotonic() + LEASE_S + 10
    while not idle(engines.prefill_url):
        assert time.monotonic() < deadline, blocks(engines.prefill_url)
        time.sleep(0.2)
    assert lease_expiries(engines.prefill_url) == expiries + engines.pp_size  # each stage's sidecar's


@pytest.mark.parametrize(
    "change",
    # (A decoder caches prefill agents by engine id, as vLLM's does: an unreachable one needs a new id.)
    [{"remote_engine_id": "no-such-engine"}, {"remote_engine_id": "elsewhere", "remote_port": "unreachable"}],
    ids=["wrong-engine-id", "unreachable-prefill"],
)
def test_a_decode_leg_whose_prefill_cannot_be_reached_fails_cleanly(
    engines: LocalEngines, change: dict[str, Any]
) -> None:
    params = {**engines.decode_leg_params(), "remote_request_id": "cmpl-x", **change}
    if params["remote_port"] == "unreachable":
        params["remote_port"] = free_port()

    async def run() -> tuple[int, dict[str, Any]]:
        async with aiohttp.ClientSession() as session:
            status, _, _, answer = await decode_leg(
                session, engines, "completions", PROMPTS[0], uuid.uuid4().hex, 8, True, params
            )
            return status, answer

    status, answer = asyncio.run(run())
    assert status == 502, answer
    assert answer["error"]["code"] == 502 and answer["error"]["type"] == "BadGatewayError"
    assert "KV transfer failed" in answer["error"]["message"]


def test_a_decode_leg_whose_prefill_never_comes_times_out_and_frees_its_blocks(engines: LocalEngines) -> None:
    async def run() -> tuple[int, dict[str, Any]]:
        async with aiohttp.ClientSession() as session:
            status, _, _, answer = await decode_leg(session, engines, "chat", "", uuid.uuid4().hex, 8, False)
            return status, answer

    status, answer = asyncio.run(run())
    assert status == 504, answer
    assert (
        answer["error"]["type"] == "GatewayTimeoutError"
        and "RegistrationTimeout" in answer["error"]["message"]
    )


def test_a_client_that_leaves_frees_the_decode_blocks(engines: LocalEngines) -> None:
    prompt = PROMPTS[1]

    async def leave_mid_stream() -> None:
        async with aiohttp.ClientSession() as session:
            rid = uuid.uuid4().hex
            request = body(
                "completions",
                prompt,
                900,
                stream=True,
                kv_transfer_params={**engines.decode_leg_params(), "remote_request_id": "cmpl-" + rid},
            )
            decoding = asyncio.ensure_future(
                session.post(
                    engines.decode_urls[0] + "/v1/completions", json=request, headers={"X-Request-Id": rid}
                )
            )
            await prefill_leg(session, engines, "completions", prompt, rid)
            response = await decoding
            assert response.status == 200
            events = 0
            while events < 3:
                line = await response.content.readline()
                assert line in (b"\n", b"") or line.startswith(b"data: {"), line
                events += line.startswith(b"data: ")
            assert blocks(engines.decode_urls[0])["decoding"] == 1
            response.close()

    async def leave_before_the_kv() -> None:
        async with aiohttp.ClientSession() as session:
            request = body(
                "completions",
                prompt,
                8,
                kv_transfer_params={**engines.decode_leg_params(), "remote_request_id": "cmpl-gone"},
            )
            with pytest.raises(asyncio.TimeoutError):
                await session.post(
                    engines.decode_urls[0] + "/v1/completions",
                    json=request,
                    timeout=aiohttp.ClientTimeout(total=1.0),
                )

    def generated() -> float:
        return metric(
            get(engines.decode_urls[0] + "/metrics")[1], "vllm:generation_tokens_total", vllm_labels(engines)
        )

    before = generated()
    asyncio.run(leave_mid_stream())
    wait_idle(engines)
    assert generated() - before < 900  # it stopped decoding when the client left, not at max_tokens
    asyncio.run(leave_before_the_kv())
    # The engine cancels the expectation with its sidecar; the prefill was told the blocks, so they are
    # freed once its lease surely ended (`lease_wait_s`), still well before the registration would have
    # timed out (issue 22, finding 11a).
    assert lease_wait_s(LEASE_S) + 3 < REGISTRATION_TIMEOUT_S
    wait_idle(engines, lease_wait_s(LEASE_S) + 3)


def test_a_decode_leg_queued_for_blocks_past_the_lease_fails_lease_expired(engines: LocalEngines) -> None:
    """With the decoder's KV full, a decode leg still waiting for blocks when the prefill's lease on its KV
    must have run out fails at once (issue 22, finding 2), not after the registration timeout."""
    max_tokens = 900  # 3 groups of 57 blocks each, of the 255: two such requests are never held at once

    async def run() -> tuple[int, dict[str, Any], float]:
        async with aiohttp.ClientSession() as session:
            rid = uuid.uuid4().hex
            holder = body(
                "completions",
                PROMPTS[0],
                max_tokens,
                kv_transfer_params={**engines.decode_leg_params(), "remote_request_id": "cmpl-" + rid},
            )
            # Its prefill never comes: it holds its blocks, awaiting KV, until its client leaves.
            holding = asyncio.ensure_future(
                session.post(
                    engines.decode_urls[0] + "/v1/completions", json=holder, headers={"X-Request-Id": rid}
                )
            )
            deadline = time.monotonic() + 30
            while blocks(engines.decode_urls[0])["awaiting_kv"] < 1:
                assert time.monotonic() < deadline, blocks(engines.decode_urls[0])
                await asyncio.sleep(0.1)
            started = time.monotonic()
            status, _, _, answer = await decode_leg(
                session, engines, "completions", PROMPTS[0], uuid.uuid4().hex, max_tokens, False
            )
            waited = time.monotonic() - started
            holding.cancel()
            return status, answer, waited

    status, answer, waited = asyncio.run(run())
    assert status == 504, answer
    assert "LeaseExpired" in answer["error"]["message"], answer
    # Queued past 1.5 leases (6 s), well before the first request's registration timeout (12 s) would have
    # freed the blocks it waited for.
    assert waited < REGISTRATION_TIMEOUT_S, waited


def test_monolithic_requests_and_the_other_endpoints(engines: LocalEngines) -> None:
    expected = reference(encode(PROMPTS[1]), 9)
    status, text = post(engines.decode_urls[0], "/v1/completions", body("completions", PROMPTS[1], 9))
    assert status == 200 and json.loads(text)["choices"][0]["token_ids"] == expected
    # A stop string: the first printable ASCII byte the model emits after its first token.
    stop = next(t for t in expected[1:] if 32 <= t < 127)
    status, text = post(
        engines.decode_urls[0], "/v1/completions", body("completions", PROMPTS[1], 9, stop=[chr(stop)])
    )
    choice = json.loads(text)["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", chr(stop))
    assert choice["token_ids"] == expected[: expected.index(stop)]
    status, text = post(engines.prefill_url, "/v1/completions", body("completions", PROMPTS[1], 9))
    assert status == 400 and "prefill legs" in json.loads(text)["error"]["message"]

    # A streamed prefill leg: one chunk with the first token and the params, then [DONE].
    leg = body("completions", PROMPTS[1], 1, stream=True, kv_transfer_params={"do_remote_decode": True})
    status, text = post(engines.prefill_url, "/v1/completions", leg)
    events = [line for line in text.splitlines() if line]
    assert status == 200 and events[-1] == "data: [DONE]" and len(events) == 2, text
    chunk = json.loads(events[0][len("data: ") :])
    assert chunk["choices"][0]["token_ids"] == expected[:1] and chunk["kv_transfer_params"]["pp_size"] == 2

    status, text = get(engines.prefill_url + "/v1/models")
    assert status == 200 and json.loads(text)["data"][0]["id"] == engines.model_name
    for worker in [*engines.prefill, *engines.decode]:
        assert get(worker.url + "/readyz")[0] == 200 and get(worker.url + "/healthz")[0] == 200
    status, text = post(engines.prefill[1].url, "/v1/completions", body("completions", "x", 1))
    assert status == 404 and "headless" in json.loads(text)["error"]["message"]


def post(
    url: str, route: str, payload: Any, headers: dict[str, str] | None = None, raw: bytes | None = None
) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    data = raw if raw is not None else json.dumps(payload).encode()
    request = urllib.request.Request(
        url + route, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


HOSTILE = [
    (b"not json", None),
    (b"[1, 2]", None),
    (b'{"prompt": 5}', "prompt"),
    (b'{"prompt": [300]}', "prompt"),
    (b'{"prompt": "x", "max_tokens": "9"}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": true}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 1000000000}', "max_tokens"),
    (json.dumps({"prompt": "x" * 5000}).encode(), "prompt"),
    (b'{"prompt": "x", "temperature": 0.7}', "temperature"),
    (b'{"prompt": "x", "stream": "yes"}', "stream"),
    (b'{"prompt": "x", "echo": true}', "echo"),
    (b'{"prompt": "x", "stop": [1]}', "stop"),
    (b'{"prompt": "x", "kv_transfer_params": {"do_remote_prefill": true, "remote_engine_id": "p"}}', None),
    (b'{"prompt": "x", "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": true}}', None),
    (b'{"prompt": "x", "kv_transfer_params": []}', "kv_transfer_params"),
    (b'{"messages": "hi"}', "messages"),
    (b'{"messages": [{"role": "wizard", "content": "hi"}]}', "messages[0]"),
]


@pytest.mark.parametrize("payload,param", HOSTILE)
def test_hostile_bodies_get_a_400_and_the_server_serves_on(
    engines: LocalEngines, payload: bytes, param: str | None
) -> None:
    route = "/v1/chat/completions" if b"messages" in payload else "/v1/completions"
    status, text = post(engines.decode_urls[0], route, None, raw=payload)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError" and error["message"]
    if param is not None:
        assert error["param"] == param
    assert get(engines.decode_urls[0] + "/readyz")[0] == 200


def test_bad_request_ids_and_routes_are_refused(engines: LocalEngines) -> None:
    status, text = post(
        engines.decode_urls[0],
        "/v1/completions",
        body("completions", "x", 2),
        headers={"X-Request-Id": "a,b"},
    )
    assert status == 400 and json.loads(text)["error"]["param"] == "X-Request-Id"
    status, text = post(engines.decode_urls[0], "/v1/nothing", {})
    assert status == 404 and json.loads(text)["error"]["code"] == 404
    assert get(engines.decode_urls[0] + "/readyz")[0] == 200
