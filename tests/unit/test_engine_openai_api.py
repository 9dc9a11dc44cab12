"""The reference engine server's pure parts: the OpenAI subset, vLLM's push `kv_transfer_params`, the block
bookkeeping."""

from __future__ import annotations

import json
from typing import Any

import pytest

from disagg.worker.contracts.kv_transfer_params import DecodeLeg, PrefillLeg, handoff
from disagg.worker.engine.api_errors import ApiError
from disagg.worker.engine.kv_cache import BlockPool, OutOfBlocks
from disagg.worker.engine.openai_api import (
    Output,
    ResponseHead,
    chat_prompt,
    parse_json,
    parse_request,
    sse,
)
from disagg.worker.engine.scheduler import BlockScheduler
from disagg.worker.engine.transfer_params import (
    internal_request_id,
    parse_kv_transfer_params,
)
from disagg.worker.kv.errors import DuplicateRequest

# What vLLM 0.33's NixlPushConnectorScheduler.request_finished returns (push_scheduler.py), key for key.
VLLM_PREFILL_RESPONSE_KEYS = {
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "transfer_mode",
}
DECODE = {
    "do_remote_prefill": True,
    "remote_engine_id": "p",
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
    "pp_size": 2,
    "remote_request_id": "cmpl-1",
}


def parse(body: dict[str, Any], endpoint: str = "completions") -> Any:
    return parse_request(endpoint, body, max_model_len=64)  # type: ignore[arg-type]


def refused(body: dict[str, Any], endpoint: str = "completions") -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(body, endpoint)
    assert caught.value.status == 400
    return caught.value


def test_a_completion_request_and_its_defaults() -> None:
    req = parse({"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}, "unknown": 1})
    assert req.prompt == (104, 105) and req.max_tokens == 16 and req.stream and req.include_usage
    assert req.transfer is None and req.stop == ()
    assert parse({"prompt": [1, 2, 3], "max_tokens": 2, "stop": "x"}).stop == (b"x",)
    assert parse({"prompt": ["hi"]}).prompt == (104, 105)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": 3}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [True]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 64}, "max_tokens"),
        ({"prompt": "x" * 64}, "prompt"),
        ({"prompt": "x", "temperature": 1}, "temperature"),
        ({"prompt": "x", "temperature": "0"}, "temperature"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "logprobs": 3}, "logprobs"),
        ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
        ({"prompt": "x", "stream_options": 1}, "stream_options"),
    ],
)
def test_bad_completion_requests_name_their_field(body: dict[str, Any], param: str) -> None:
    assert refused(body).param == param


def test_temperature_zero_is_greedy_and_accepted() -> None:
    assert parse({"prompt": "x", "temperature": 0.0}).max_tokens == 16


def test_chat_renders_the_fixed_template() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    assert chat_prompt(messages) == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    req = parse({"messages": messages, "max_completion_tokens": 3}, "chat")
    assert bytes(req.prompt).decode() == chat_prompt(messages) and req.max_tokens == 3
    assert refused({"messages": []}, "chat").param == "messages"
    assert refused({"messages": [{"role": "user", "content": 5}]}, "chat").param == "messages[0].content"


def test_bodies_that_are_not_json_objects() -> None:
    for raw in (b"{", b"[]", b"\xff", b"1"):
        with pytest.raises(ApiError):
            parse_json(raw)


def test_kv_transfer_params_legs() -> None:
    assert parse_kv_transfer_params(None) is None
    assert parse_kv_transfer_params({"do_remote_decode": False, "do_remote_prefill": False}) is None
    assert parse_kv_transfer_params({"do_remote_decode": True, "remote_engine_id": None}) == PrefillLeg()
    leg = parse_kv_transfer_params({**DECODE, "remote_block_ids": [[1]], "remote_num_tokens": 5})
    assert leg == DecodeLeg("p", "10.0.0.1", 5600, 1, 2, "cmpl-1", 5)


@pytest.mark.parametrize(
    "missing", ["remote_engine_id", "remote_host", "remote_port", "tp_size", "pp_size", "remote_request_id"]
)
def test_a_decode_leg_without_a_required_param_is_refused(missing: str) -> None:
    params = {k: v for k, v in DECODE.items() if k != missing}
    with pytest.raises(ApiError) as caught:
        parse_kv_transfer_params(params)
    assert caught.value.param == f"kv_transfer_params.{missing}"


@pytest.mark.parametrize(
    "change",
    [
        {"remote_port": 0},
        {"remote_port": "5600"},
        {"tp_size": True},
        {"remote_host": ""},
        {"transfer_mode": "pull"},
        {"dcp_size": 2},
        {"do_remote_decode": True},
        {"do_remote_prefill": "yes"},
    ],
)
def test_bad_decode_params_are_refused(change: dict[str, Any]) -> None:
    with pytest.raises(ApiError):
        parse_kv_transfer_params({**DECODE, **change})


def test_the_prefill_response_has_vllms_keys_and_ids_pair_by_endpoint() -> None:
    params = handoff(
        block_ids=[[1, 2], [3]],
        engine_id="p",
        request_id="cmpl-r",
        host="h",
        port=1,
        tp_size=1,
        pp_size=2,
        num_tokens=20,
    ).to_json()
    assert set(params) == VLLM_PREFILL_RESPONSE_KEYS
    assert (
        params["transfer_mode"] == "push" and params["do_remote_prefill"] and not params["do_remote_decode"]
    )
    # What a prefill answers, a decoder takes as its decode leg's parameters.
    assert parse_kv_transfer_params(params) == DecodeLeg("p", "h", 1, 1, 2, "cmpl-r", 20)
    assert internal_request_id("completions", "abc", "gen") == "cmpl-abc"
    assert internal_request_id("chat", None, "gen") == "chatcmpl-gen"
    for bad in ("", "a,b", "a b", "x" * 300):
        with pytest.raises(ApiError):
            internal_request_id("chat", bad, "gen")


def stream(output: Output, tokens: list[int]) -> tuple[list[int], str]:
    sent: list[int] = []
    text = ""
    for token in tokens:
        delta = output.push(token)
        sent += delta.token_ids
        text += delta.text
        if output.finished:
            break
    return sent, text


def test_output_cuts_at_a_stop_string_and_never_streams_part_of_it() -> None:
    output = Output((b"cd",), 10)
    sent, text = stream(output, list(b"abccde"))
    assert (sent, text, output.finish_reason, output.stop_reason) == (list(b"abc"), "abc", "stop", "cd")
    # A partial match that does not complete is released.
    output = Output((b"cd",), 4)
    assert stream(output, list(b"acab")) == (list(b"acab"), "acab") and output.finish_reason == "length"


def test_streamed_text_decodes_utf8_across_tokens() -> None:
    data = "é€!".encode()
    output = Output((), len(data))
    sent, text = stream(output, list(data))
    assert sent == list(data) and text == "é€!" == output.text


def test_responses_and_chunks() -> None:
    req = parse({"messages": [{"role": "user", "content": "x"}], "return_token_ids": True}, "chat")
    head = ResponseHead(req, "chatcmpl-1", "tiny", 7)
    output = Output((), 2)
    first = output.push(65)
    chunk = head.chunk(first, first=True)
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": "A"}
    last = head.chunk(output.push(66), output=output, kv_transfer_params={"x": 1})
    assert last["choices"][0]["finish_reason"] == "length" and last["kv_transfer_params"] == {"x": 1}
    whole = head.response(output, None)
    assert whole["choices"][0]["message"]["content"] == "AB" and whole["choices"][0]["token_ids"] == [65, 66]
    assert whole["usage"] == {
        "prompt_tokens": len(req.prompt),
        "completion_tokens": 2,
        "total_tokens": len(req.prompt) + 2,
    }
    assert json.loads(sse(whole)[len(b"data: ") :]) == whole


def test_the_scheduler_returns_a_prefills_ids_only_when_every_stage_is_done() -> None:
    pool = BlockPool(16)
    scheduler = BlockScheduler(pool, 16, num_groups=3, block_size=4)
    assert scheduler.ever_fits(20) and not scheduler.ever_fits(21)
    tables = scheduler.admit("p", 5, "prefilling", waiting_on=range(2))
    assert [len(t) for t in tables.values()] == [2, 2, 2] and scheduler.free_blocks == 9
    with pytest.raises(DuplicateRequest):
        scheduler.admit("p", 1, "running")
    with pytest.raises(OutOfBlocks):
        scheduler.admit("q", 13, "running")
    assert not scheduler.stage_done("p", 1) and scheduler.free_blocks == 9
    assert scheduler.stage_done("p", 0) and scheduler.free_blocks == 15
    assert not scheduler.release("p")
    scheduler.admit("d", 4, "awaiting_kv")
    scheduler.set_state("d", "decoding")
    assert scheduler.counts() == {"decoding": 1}
    assert scheduler.release("d") and scheduler.free_blocks == 15
