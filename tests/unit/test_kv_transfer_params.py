"""The typed `kv_transfer_params` contract: round trips, every refusal with its message and field, hostile
input, and the router and the reference engine agreeing on what the other writes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.worker.contracts import kv_transfer_params as kv
from disagg.worker.contracts.pairing import DecodeTarget, Pair, PrefillTarget
from disagg.worker.engine.api_errors import ApiError
from disagg.worker.engine.transfer_params import (
    internal_request_id,
    parse_kv_transfer_params,
)
from disagg.worker.router.protocol import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    RouterError,
    build_legs,
    parse_client_request,
    parse_prefill_response,
)

LEG = kv.DecodeLeg("p@1", "10.0.0.1", 5600, 2, 2, "cmpl-1")
HANDOFF = kv.handoff(
    block_ids=[[1, 2], [3]],
    engine_id="p@1",
    request_id="cmpl-1",
    host="10.0.0.1",
    port=5600,
    tp_size=2,
    pp_size=2,
    num_tokens=20,
)


def refusal(value: object) -> tuple[str, str]:
    with pytest.raises(kv.InvalidTransferParams) as caught:
        kv.parse_leg(value)
    return caught.value.message, caught.value.param


def handoff_refusal(params: dict[str, Any]) -> tuple[str, str]:
    with pytest.raises(kv.InvalidTransferParams) as caught:
        kv.parse_handoff(params)
    return caught.value.message, caught.value.param


# --- round trips -----------------------------------------------------------------------------------------


def test_each_message_reads_back_as_itself() -> None:
    assert kv.parse_leg(kv.PrefillLeg().to_json()) == kv.PrefillLeg()
    assert kv.parse_leg(LEG.to_json()) == LEG
    with_tokens = kv.DecodeLeg("p", "h", 1, 1, 1, "chatcmpl-x", 7)
    assert kv.parse_leg(with_tokens.to_json()) == with_tokens
    assert kv.parse_handoff(HANDOFF.to_json()) == HANDOFF
    # JSON in between changes nothing either.
    assert kv.parse_handoff(json.loads(json.dumps(HANDOFF.to_json()))) == HANDOFF


def test_a_decoder_takes_the_prefills_answer_as_its_decode_leg() -> None:
    assert kv.parse_leg(HANDOFF.to_json()) == kv.DecodeLeg("p@1", "10.0.0.1", 5600, 2, 2, "cmpl-1", 20)


def test_no_leg_and_defaults() -> None:
    assert kv.parse_leg(None) is None
    assert kv.parse_leg({}) is None
    assert kv.parse_leg({"do_remote_decode": False, "do_remote_prefill": None}) is None
    # vLLM's proxies send null remote_* on the prefill leg.
    assert kv.parse_leg({"do_remote_decode": True, "remote_engine_id": None}) == kv.PrefillLeg()
    without_pp = {k: v for k, v in HANDOFF.to_json().items() if k != "pp_size"}
    assert kv.parse_handoff(without_pp).pp_size == 1
    assert kv.parse_handoff({**HANDOFF.to_json(), "remote_num_tokens": "x"}).remote_num_tokens is None


def test_request_ids_pair_by_endpoint_family() -> None:
    assert kv.request_id_for("completions", "abc") == "cmpl-abc"
    assert kv.internal_request_id("chat", None, "gen") == "chatcmpl-gen"
    assert kv.internal_request_id("completions", "a.b:c@d/e+f=g-h_", "gen") == "cmpl-a.b:c@d/e+f=g-h_"


# --- refusals --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message", "param"),
    [
        ([], "kv_transfer_params must be an object", "kv_transfer_params"),
        ("x", "kv_transfer_params must be an object", "kv_transfer_params"),
        (
            {"do_remote_decode": 1},
            "kv_transfer_params.do_remote_decode must be a boolean",
            "kv_transfer_params.do_remote_decode",
        ),
        (
            {"do_remote_prefill": "yes"},
            "kv_transfer_params.do_remote_prefill must be a boolean",
            "kv_transfer_params.do_remote_prefill",
        ),
        (
            {"do_remote_decode": True, "do_remote_prefill": True},
            "kv_transfer_params asks for both do_remote_decode and do_remote_prefill",
            "kv_transfer_params",
        ),
        (
            {**LEG.to_json(), "transfer_mode": "pull"},
            "this engine speaks the push protocol; transfer_mode 'pull' is not push",
            "kv_transfer_params.transfer_mode",
        ),
        (
            {**LEG.to_json(), "dcp_size": 2},
            "decode context parallelism (dcp_size > 1) is not supported",
            "kv_transfer_params.dcp_size",
        ),
        (
            {**LEG.to_json(), "remote_num_tokens": True},
            "kv_transfer_params.remote_num_tokens must be an integer",
            "kv_transfer_params.remote_num_tokens",
        ),
        (
            {**LEG.to_json(), "remote_num_tokens": 1.5},
            "kv_transfer_params.remote_num_tokens must be an integer",
            "kv_transfer_params.remote_num_tokens",
        ),
    ],
)
def test_a_leg_that_is_not_one_is_refused(value: object, message: str, param: str) -> None:
    assert refusal(value) == (message, param)


@pytest.mark.parametrize(
    "key", ["remote_engine_id", "remote_host", "remote_port", "tp_size", "pp_size", "remote_request_id"]
)
@pytest.mark.parametrize("absent", ["missing", "null"])
def test_a_decode_leg_without_a_required_param_is_refused(key: str, absent: str) -> None:
    params = {k: v for k, v in LEG.to_json().items() if k != key}
    if absent == "null":
        params[key] = None
    assert refusal(params) == (f"the decode leg needs kv_transfer_params.{key}", f"kv_transfer_params.{key}")


@pytest.mark.parametrize(
    ("key", "high"), [("remote_port", 65535), ("tp_size", kv.MAX_PARALLEL), ("pp_size", kv.MAX_PARALLEL)]
)
def test_a_decode_leg_integer_out_of_range_or_of_another_type_is_refused(key: str, high: int) -> None:
    param = f"kv_transfer_params.{key}"
    for bad in (0, -1, high + 1, True, "5600", 1.0):
        assert refusal({**LEG.to_json(), key: bad}) == (f"{param} must be an integer in 1..{high}", param)
    assert kv.parse_leg({**LEG.to_json(), key: high}) is not None


@pytest.mark.parametrize("key", ["remote_engine_id", "remote_host", "remote_request_id"])
@pytest.mark.parametrize("bad", ["", "x" * (kv.MAX_STRING_CHARS + 1), 5, ["h"]])
def test_a_decode_leg_string_empty_too_long_or_not_a_string_is_refused(key: str, bad: object) -> None:
    param = f"kv_transfer_params.{key}"
    assert refusal({**LEG.to_json(), key: bad}) == (
        f"{param} must be a non-empty string of at most 1024 characters",
        param,
    )


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("do_remote_prefill", "true"),
        ("remote_engine_id", 1),
        ("remote_host", None),
        ("remote_port", "5600"),
        ("remote_port", True),
        ("tp_size", True),
        ("tp_size", 2.0),
        ("remote_request_id", ["x"]),
        ("remote_block_ids", {"0": [1]}),
        ("remote_block_ids", None),
    ],
)
def test_a_handoff_without_a_valid_key_a_decoder_reads_is_refused(key: str, bad: object) -> None:
    params = {**HANDOFF.to_json(), key: bad}
    message = f"the prefill engine's kv_transfer_params lack a valid {key!r}"
    assert handoff_refusal(params) == (message, f"kv_transfer_params.{key}")
    del params[key]
    assert handoff_refusal(params) == (message, f"kv_transfer_params.{key}")


def test_a_handoff_with_a_bad_pp_size_or_no_kv_is_refused() -> None:
    for bad in ("2", True, None):
        assert handoff_refusal({**HANDOFF.to_json(), "pp_size": bad}) == (
            "the prefill engine's pp_size is not an int",
            "kv_transfer_params.pp_size",
        )
    assert handoff_refusal({**HANDOFF.to_json(), "do_remote_prefill": False}) == (
        "the prefill engine's kv_transfer_params hand no KV over",
        "kv_transfer_params.do_remote_prefill",
    )


@pytest.mark.parametrize("bad", ["", "a,b", "a b", "x" * 257, "a\nb", "é"])
def test_an_x_request_id_that_could_not_travel_in_a_notification_is_refused(bad: str) -> None:
    with pytest.raises(kv.InvalidTransferParams) as caught:
        kv.internal_request_id("chat", bad, "gen")
    assert caught.value.param == "X-Request-Id"


# --- hostile input ---------------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
KEYS = st.sampled_from(
    [
        "do_remote_decode",
        "do_remote_prefill",
        "remote_engine_id",
        "remote_host",
        "remote_port",
        "tp_size",
        "pp_size",
        "dcp_size",
        "remote_request_id",
        "remote_num_tokens",
        "remote_block_ids",
        "transfer_mode",
    ]
)


@settings(max_examples=300, deadline=None)
@given(base=st.sampled_from([LEG.to_json(), HANDOFF.to_json(), {}]), changes=st.dictionaries(KEYS, JSON))
def test_any_json_is_a_message_or_a_typed_refusal(base: dict[str, Any], changes: dict[str, Any]) -> None:
    params = {**base, **changes}
    for parse in (kv.parse_leg, kv.parse_handoff):
        try:
            parse(params)
        except kv.InvalidTransferParams as exc:
            assert exc.param.startswith("kv_transfer_params") and len(exc.message) < 2000


def test_keys_the_contract_does_not_name_are_never_read() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    assert kv.parse_leg({**LEG.to_json(), "extra": deep}) == LEG
    assert kv.parse_handoff({**HANDOFF.to_json(), "extra": deep}) == HANDOFF


# --- the router and the engine agree -------------------------------------------------------------------


def pair() -> Pair:
    return Pair(
        PrefillTarget("tiny-prefill-0@1a2b", "tiny-prefill-0-0", "10.0.0.5", 8000, 5600, 2, 2, ("p-0",), "h"),
        DecodeTarget("tiny-decode-x", "tiny-decode-x@e", "10.0.0.9", 8000, 1, "h"),
    )


@pytest.mark.parametrize(("endpoint", "family"), [(COMPLETIONS, "completions"), (CHAT_COMPLETIONS, "chat")])
def test_the_engine_reads_the_legs_the_router_writes_and_the_router_reads_the_engines_answer(
    endpoint: str, family: kv.Endpoint
) -> None:
    body = {"model": "m", "prompt": "hi"} if endpoint == COMPLETIONS else {"messages": [{"content": "hi"}]}
    legs = build_legs(parse_client_request(endpoint, json.dumps(body).encode()), pair(), "rid")
    # The router's bodies cross the wire as JSON.
    prefill_leg = json.loads(json.dumps(legs.prefill))["kv_transfer_params"]
    decode_leg = json.loads(json.dumps(legs.decode))["kv_transfer_params"]
    assert parse_kv_transfer_params(prefill_leg) == kv.PrefillLeg()
    request_id = internal_request_id(family, legs.headers["X-Request-Id"], "gen")
    target = pair().prefill
    assert parse_kv_transfer_params(decode_leg) == kv.DecodeLeg(
        target.engine_id, target.host, target.side_channel_port, target.tp_size, target.pp_size, request_id
    )

    # The prefill engine answers under its own engine id and the request id both legs share.
    answer = kv.handoff(
        block_ids=[[4, 5]],
        engine_id=target.engine_id,
        request_id=request_id,
        host=target.host,
        port=target.side_channel_port,
        tp_size=target.tp_size,
        pp_size=target.pp_size,
        num_tokens=2,
    ).to_json()
    raw = json.dumps({"id": request_id, "choices": [{"text": "x"}], "kv_transfer_params": answer}).encode()
    handoff = parse_prefill_response(200, raw, pair())
    assert (handoff.remote_engine_id, handoff.remote_request_id, handoff.pp_size) == (
        target.engine_id,
        request_id,
        target.pp_size,
    )
    assert handoff.to_json() == answer


def test_each_side_answers_a_refusal_in_its_own_terms() -> None:
    with pytest.raises(ApiError) as engine:
        parse_kv_transfer_params({**LEG.to_json(), "tp_size": 0})
    assert (engine.value.status, engine.value.param) == (400, "kv_transfer_params.tp_size")
    assert engine.value.message == "kv_transfer_params.tp_size must be an integer in 1..1024"
    with pytest.raises(ApiError) as header:
        internal_request_id("chat", "a b", "gen")
    assert (header.value.status, header.value.param) == (400, "X-Request-Id")

    bad = {**HANDOFF.to_json(), "remote_engine_id": "tiny-prefill-0@1a2b", "tp_size": "2"}
    raw = json.dumps({"kv_transfer_params": bad}).encode()
    with pytest.raises(RouterError) as router:
        parse_prefill_response(200, raw, pair())
    assert (router.value.status, router.value.reason, router.value.message) == (
        502,
        "PrefillInvalidKVParams",
        "the prefill engine's kv_transfer_params lack a valid 'tp_size'",
    )
