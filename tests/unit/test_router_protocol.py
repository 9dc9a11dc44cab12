"""The router's pure parts: the two legs' bodies, the prefill answer's check, errors, the balance policy, and
the SSE check, on hostile input too."""

from __future__ import annotations

import json
from typing import Any

import pytest

from disagg.worker.contracts.pairing import DecodeTarget, Pair, PrefillTarget
from disagg.worker.router.balance import Balancer
from disagg.worker.router.protocol import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    Fault,
    RouterError,
    build_legs,
    engine_error,
    loses_window_edge,
    parse_client_request,
    parse_prefill_answer,
    parse_prefill_response,
)
from disagg.worker.router.upstream import SseEvents


def pair(
    engine: str = "tiny-prefill-0@1a2b", decoder: str = "tiny-decode-x", pp: int = 2, tp: int = 2
) -> Pair:
    return Pair(
        PrefillTarget(engine, f"{engine}-0", "10.0.0.5", 8000, 5600, tp, pp, ("p-0", "p-1"), "h"),
        DecodeTarget(decoder, f"{decoder}@e", "10.0.0.9", 8000, 1, "h"),
    )


def request(endpoint: str = COMPLETIONS, **body: Any) -> bytes:
    base: dict[str, Any] = (
        {"model": "m", "prompt": "hello"}
        if endpoint == COMPLETIONS
        else {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    )
    return json.dumps({**base, **body}).encode()


# What vLLM 0.33's NixlPushConnectorScheduler.request_finished returns (push_scheduler.py), for a PP2 TP2
# prefill; the interop test checks the router against the release's own output.
VLLM_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2, 3], [201, 202, 203]],
    "remote_engine_id": "tiny-prefill-0@1a2b",
    "remote_request_id": "cmpl-abc-1f2e3d4c",
    "remote_host": "10.0.0.5",
    "remote_port": 5600,
    "tp_size": 2,
    "dcp_size": 1,
    "pp_size": 2,
    "remote_num_tokens": 40,
    "transfer_mode": "push",
}


def prefill_answer(**params: Any) -> bytes:
    kv = {k: v for k, v in {**VLLM_PARAMS, **params}.items() if v is not ...}
    return json.dumps({"id": "cmpl-abc", "choices": [{"text": "x"}], "kv_transfer_params": kv}).encode()


# --- legs ------------------------------------------------------------------------------------------------


def test_the_decode_leg_is_the_clients_body_and_the_prefills_identity() -> None:
    body = {
        "model": "m",
        "prompt": [1, 2, 3],
        "stream": True,
        "stream_options": {"include_usage": True},
        "x": {"y": 1},
    }
    legs = build_legs(parse_client_request(COMPLETIONS, json.dumps(body).encode()), pair(), "rid")
    assert legs.decode == {
        **body,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "tiny-prefill-0@1a2b",
            "remote_host": "10.0.0.5",
            "remote_port": 5600,
            "tp_size": 2,
            "pp_size": 2,
            "remote_request_id": "cmpl-rid",
        },
    }
    assert legs.prefill == {
        "model": "m",
        "prompt": [1, 2, 3],
        "x": {"y": 1},
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    assert legs.headers["X-Request-Id"] == "rid"


def test_a_chat_request_pairs_by_its_own_id_prefix() -> None:
    legs = build_legs(parse_client_request(CHAT_COMPLETIONS, request(CHAT_COMPLETIONS)), pair(), "rid")
    assert legs.decode["kv_transfer_params"]["remote_request_id"] == "chatcmpl-rid"


def test_the_clients_body_is_not_changed_by_building_legs() -> None:
    parsed = parse_client_request(COMPLETIONS, request(max_tokens=9))
    build_legs(parsed, pair(), "rid")
    assert parsed.body == {"model": "m", "prompt": "hello", "max_tokens": 9}


@pytest.mark.parametrize(
    ("endpoint", "body", "weight"),
    [
        (COMPLETIONS, {"prompt": "abcd"}, 4),
        (COMPLETIONS, {"prompt": [5, 6, 7]}, 3),
        (COMPLETIONS, {"prompt": ["ab", "cde"]}, 5),
        (COMPLETIONS, {"prompt": ""}, 1),
        (
            CHAT_COMPLETIONS,
            {"messages": [{"content": "abc"}, {"content": [{"type": "text", "text": "de"}]}]},
            5,
        ),
    ],
)
def test_prompt_weight(endpoint: str, body: dict[str, Any], weight: int) -> None:
    assert parse_client_request(endpoint, json.dumps(body).encode()).prompt_weight == weight


@pytest.mark.parametrize(
    "raw", [b"", b"nul", b"\xff\xfe", b"[" * 100_000, b'"s"', b"{}", b'{"prompt": "a", "stream": 1}']
)
def test_a_bad_client_body_is_a_client_error(raw: bytes) -> None:
    with pytest.raises(RouterError) as caught:
        parse_client_request(COMPLETIONS, raw)
    assert caught.value.fault is Fault.CLIENT and caught.value.status == 400


# --- the prefill's answer --------------------------------------------------------------------------------


def test_vllms_request_finished_params_are_accepted() -> None:
    result = parse_prefill_response(200, prefill_answer(), pair())
    assert (result.remote_engine_id, result.remote_request_id, result.pp_size) == (
        "tiny-prefill-0@1a2b",
        "cmpl-abc-1f2e3d4c",
        2,
    )


def test_params_without_pp_size_are_pp1() -> None:
    assert parse_prefill_response(200, prefill_answer(pp_size=...), pair()).pp_size == 1


@pytest.mark.parametrize(
    "key",
    [
        "do_remote_prefill",
        "remote_engine_id",
        "remote_host",
        "remote_port",
        "tp_size",
        "remote_request_id",
        "remote_block_ids",
    ],
)
def test_params_missing_a_key_the_decoder_needs_are_refused(key: str) -> None:
    with pytest.raises(RouterError) as caught:
        parse_prefill_response(200, prefill_answer(**{key: ...}), pair())
    assert caught.value.fault is Fault.UPSTREAM and key in caught.value.message


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({"remote_port": "5600"}, "PrefillInvalidKVParams"),
        ({"tp_size": True}, "PrefillInvalidKVParams"),
        ({"pp_size": "2"}, "PrefillInvalidKVParams"),
        ({"do_remote_prefill": False}, "PrefillInvalidKVParams"),
        ({"remote_engine_id": "tiny-prefill-0@ffff"}, "PrefillEngineIdChanged"),
    ],
)
def test_params_that_cannot_be_what_the_decoder_registered_with_are_refused(
    params: dict[str, Any], reason: str
) -> None:
    with pytest.raises(RouterError) as caught:
        parse_prefill_response(200, prefill_answer(**params), pair())
    assert caught.value.reason == reason and caught.value.status == 502


@pytest.mark.parametrize(
    ("status", "raw", "reason"),
    [
        (200, b'{"id": "x", "choices": []}', "PrefillHoldsNoKV"),
        (200, b'{"kv_transfer_params": null}', "PrefillHoldsNoKV"),
        (200, b'{"error": {"message": "boom"}, "kv_transfer_params": {}}', "PrefillFailed"),
        (200, b'{"object": "error", "message": "boom"}', "PrefillFailed"),
        (200, b"<html>", "PrefillInvalidResponse"),
        (200, b"[]", "PrefillInvalidResponse"),
        (200, b"[" * 100_000, "PrefillInvalidResponse"),
        (500, b'{"error": {"message": "boom"}}', "PrefillFailed"),
        (503, b"", "PrefillFailed"),
    ],
)
def test_a_prefill_answer_without_usable_kv_is_a_prefill_failure(
    status: int, raw: bytes, reason: str
) -> None:
    with pytest.raises(RouterError) as caught:
        parse_prefill_response(status, raw, pair())
    assert caught.value.reason == reason and caught.value.fault is Fault.UPSTREAM


def test_an_engine_4xx_is_the_clients_fault_with_the_engines_status_and_message() -> None:
    error = engine_error("decode", 422, b'{"error": {"message": "max_tokens too large"}}')
    assert (error.fault, error.status, error.message) == (Fault.CLIENT, 422, "max_tokens too large")
    assert error.body()["error"] == {
        "message": "max_tokens too large",
        "type": "invalid_request_error",
        "param": None,
        "code": 422,
    }
    assert engine_error("decode", 429, b"").fault is Fault.UPSTREAM
    assert engine_error("decode", 500, b"x" * 10_000).status == 502


def test_each_fault_has_its_status() -> None:
    assert [f.value for f in (Fault.CLIENT, Fault.UPSTREAM, Fault.UNAVAILABLE, Fault.TIMEOUT)] == [
        400,
        502,
        503,
        504,
    ]
    assert RouterError(Fault.TIMEOUT, "X", "m").body()["error"]["type"] == "timeout"


# --- balance ---------------------------------------------------------------------------------------------


def test_no_pair_no_choice() -> None:
    assert Balancer().choose(()) is None


def test_the_least_loaded_decoder_of_the_least_loaded_prefill_is_chosen() -> None:
    a, b = pair("p-a", "d-1"), pair("p-b", "d-2")
    a2 = pair("p-a", "d-2")
    balancer = Balancer()
    heavy = balancer.start(a, 1000)
    assert balancer.choose((a, b, a2)).prefill.engine_id == "p-b"
    balancer.prefill_done(heavy)
    # p-a is idle again; d-1 still decodes heavy's request, so p-a's choice is d-2.
    chosen = balancer.choose((a, a2))
    assert (chosen.prefill.engine_id, chosen.decode.pod) == ("p-a", "d-2")


def test_prompt_length_weighs_prefill_load() -> None:
    a, b = pair("p-a", "d-1"), pair("p-b", "d-2")
    balancer = Balancer()
    balancer.start(a, 5000)
    for _ in range(4):
        balancer.start(b, 100)
    assert balancer.choose((a, b)).prefill.engine_id == "p-b"


def test_ties_take_turns() -> None:
    pairs = (pair("p-a", "d-1"), pair("p-b", "d-2"), pair("p-c", "d-3"))
    balancer = Balancer()
    assert {balancer.choose(pairs).prefill.engine_id for _ in range(3)} == {"p-a", "p-b", "p-c"}


def test_load_is_released_once_per_side() -> None:
    balancer = Balancer()
    ticket = balancer.start(pair(), 10)
    balancer.prefill_done(ticket)
    balancer.prefill_done(ticket)
    assert balancer.prefill_weight == {} and balancer.decode_legs == {"tiny-decode-x": 1}
    balancer.done(ticket)
    balancer.done(ticket)
    assert balancer.decode_legs == {} and balancer.prefill_legs == {}


# --- the SSE check ---------------------------------------------------------------------------------------


def test_sse_events_split_across_chunks_and_end_at_done() -> None:
    events = SseEvents(1024)
    assert events.feed(b'data: {"a"') == []
    assert events.feed(b': 1}\n\ndata: {"b": 2}\r\n\r\n: keep-alive\n\n') == [
        (b'data: {"a": 1}\n\n', False, False),
        (b'data: {"b": 2}\n\n', False, False),
        (b": keep-alive\n\n", False, False),
    ]
    assert events.feed(b'data: {"choices": [{"text": "x"}]}\n\ndata: {"choices": []}\n\n') == [
        (b'data: {"choices": [{"text": "x"}]}\n\n', False, True),
        (b'data: {"choices": []}\n\n', False, False),
    ]
    assert events.feed(b"data: [DONE]\n\ndata: after\n\n") == [(b"data: [DONE]\n\n", True, False)]


@pytest.mark.parametrize(
    "chunk", [b"data: {x}\n\n", b"hello\n\n", b"data: " + b"[" * 100_000 + b"\n\n", b"x" * 2000]
)
def test_sse_garbage_is_the_decoders_failure(chunk: bytes) -> None:
    with pytest.raises(RouterError) as caught:
        SseEvents(1024).feed(chunk)
    assert caught.value.reason == "DecodeInvalidStream" and caught.value.fault is Fault.UPSTREAM


@pytest.mark.parametrize(
    ("usage", "tokens"),
    [
        ({"prompt_tokens": 255, "total_tokens": 256}, 255),
        ({"prompt_tokens": 0}, 0),
        ({"prompt_tokens": -1}, None),
        ({"prompt_tokens": True}, None),
        ({"prompt_tokens": "255"}, None),
        ({}, None),
        ([255], None),
        (None, None),
    ],
)
def test_the_prefill_answer_carries_the_prompt_length_only_as_a_count(usage: Any, tokens: int | None) -> None:
    answer = json.loads(prefill_answer())
    answer["usage"] = usage
    assert parse_prefill_answer(200, json.dumps(answer).encode(), pair()).prompt_tokens == tokens


def test_which_prompt_lengths_lose_a_window_key() -> None:
    # The router judges nothing where no engine has the defect, and distrusts an unknown length where one has.
    assert not loses_window_edge((), 255) and not loses_window_edge((), None)
    assert loses_window_edge(((64, 32),), 255) and not loses_window_edge(((64, 32),), 256)
    assert loses_window_edge(((64, 32),), None)
    assert loses_window_edge(((1024, 16), (64, 32)), 127)
