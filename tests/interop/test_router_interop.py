"""The router's push protocol against vLLM 0.33's own NixlPushConnectorScheduler, on the argv the operator
generates for a PP2 x TP2 prefill and a TP2 decoder (examples/pp2-hma.yaml, Gemma-3 geometry):

- the decode-leg `kv_transfer_params` the router builds are consumed by vLLM's decoder
  (`get_num_new_matched_tokens`, `update_state_after_alloc`) into a registration with `remote_pp_size` 2 and
  the prefill's engine id, side-channel host and port;
- the prefill-leg params the router sends make vLLM's prefill `request_finished` hand the KV over, and what
  it returns is what the router's parser accepts (one missing a key the decoder needs is refused).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from _engine_argv import EnginePod, engine_pods, example_spec, kv_transfer_config
from _vllm_peer import VllmPeer
from test_hash_interop import GEMMA

from disagg.worker.contracts.pairing import DecodeTarget, Pair, PrefillTarget
from disagg.worker.router.protocol import (
    COMPLETIONS,
    RouterError,
    build_legs,
    parse_client_request,
    parse_prefill_response,
    request_id_for,
)

PREFILL_HOST, SIDE_CHANNEL_PORT = "10.1.2.3", 5600
PROMPT_TOKENS = 40


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> dict[str, EnginePod]:
    spec = example_spec({**GEMMA, "engine": {"version": "0.33.0", "image": "vllm/vllm-openai:v0.33.0"}})
    found = engine_pods(spec, tmp_path_factory.mktemp("router-interop"))
    head = next(p for p in found if p.pod.endswith("prefill-0-0"))
    decode = next(p for p in found if p.role == "decode")
    return {"head": head, "decode": decode}


def pair_for(pods: dict[str, EnginePod]) -> Pair:
    engine_id = kv_transfer_config(pods["head"].argv)["engine_id"]
    assert "--pipeline-parallel-size" in pods["head"].argv and "--tensor-parallel-size" in pods["head"].argv
    return Pair(
        PrefillTarget(
            engine_id=engine_id,
            head_pod=pods["head"].pod,
            host=PREFILL_HOST,
            http_port=8000,
            side_channel_port=SIDE_CHANNEL_PORT,
            tp_size=2,
            pp_size=2,
            stage_pods=(pods["head"].pod, pods["head"].pod[:-1] + "1"),
            kv_hash="",
        ),
        DecodeTarget(pods["decode"].pod, "decode-engine", "10.1.2.9", 8000, 2, ""),
    )


def legs(pair: Pair) -> Any:
    body = json.dumps({"model": "google/gemma-3-1b-it", "prompt": "hello", "max_tokens": 16, "stream": True})
    return build_legs(parse_client_request(COMPLETIONS, body.encode()), pair, "0f3c9a")


def test_vllm_registers_the_decode_leg_with_every_stage_of_a_pp2_tp2_prefill(
    vllm_peer: VllmPeer, pods: dict[str, EnginePod]
) -> None:
    pair = pair_for(pods)
    decode_leg = legs(pair).decode
    internal_id = f"{request_id_for(COMPLETIONS, '0f3c9a')}-1a2b3c4d"
    found = vllm_peer.call(
        "push_decode_registration",
        decode_argv=pods["decode"].argv,
        request_id=internal_id,
        num_tokens=PROMPT_TOKENS,
        kv_transfer_params=decode_leg["kv_transfer_params"],
    )
    assert found["async_load"] is True and found["matched"] > 0 and found["waits_for_kv"] is True
    registration = found["registration"]
    assert registration is not None
    assert registration["request_id"] == internal_id
    assert registration["remote_engine_id"] == pair.prefill.engine_id
    assert (registration["remote_host"], registration["remote_port"]) == (PREFILL_HOST, SIDE_CHANNEL_PORT)
    assert registration["remote_tp_size"] == 2
    assert registration["remote_pp_size"] == 2


def test_without_pp_size_vllm_would_register_with_stage_0_only(
    vllm_peer: VllmPeer, pods: dict[str, EnginePod]
) -> None:
    # Why the router always sends pp_size: vLLM's default is 1.
    params = {k: v for k, v in legs(pair_for(pods)).decode["kv_transfer_params"].items() if k != "pp_size"}
    found = vllm_peer.call(
        "push_decode_registration",
        decode_argv=pods["decode"].argv,
        request_id="cmpl-x-1a2b3c4d",
        num_tokens=PROMPT_TOKENS,
        kv_transfer_params=params,
    )
    assert found["registration"]["remote_pp_size"] == 1


def prefill_finished(peer: VllmPeer, pods: dict[str, EnginePod], status: str) -> dict[str, Any]:
    pair = pair_for(pods)
    found: dict[str, Any] = peer.call(
        "push_prefill_finished",
        prefill_argv=pods["head"].argv,
        request_id=f"{request_id_for(COMPLETIONS, '0f3c9a')}-5e6f7a8b",
        num_tokens=PROMPT_TOKENS,
        prefill_host=PREFILL_HOST,
        prefill_port=SIDE_CHANNEL_PORT,
        kv_transfer_params=legs(pair).prefill["kv_transfer_params"],
        status=status,
    )
    assert found["engine_id"] == pair.prefill.engine_id
    return found


def response_with(params: Any) -> bytes:
    return json.dumps(
        {"id": "cmpl-0f3c9a", "choices": [{"text": "x"}], "kv_transfer_params": params}
    ).encode()


def test_the_router_accepts_what_vllms_request_finished_returns(
    vllm_peer: VllmPeer, pods: dict[str, EnginePod]
) -> None:
    found = prefill_finished(vllm_peer, pods, "FINISHED_LENGTH_CAPPED")
    params = found["kv_transfer_params"]
    assert found["delay_free_blocks"] is True and params["transfer_mode"] == "push"
    result = parse_prefill_response(200, response_with(params), pair_for(pods))
    assert (result.remote_engine_id, result.pp_size) == (pair_for(pods).prefill.engine_id, 2)
    assert result.remote_request_id.startswith("cmpl-0f3c9a")


@pytest.mark.parametrize("key", ["remote_engine_id", "remote_request_id", "tp_size", "remote_block_ids"])
def test_the_router_refuses_vllms_params_missing_a_key(
    vllm_peer: VllmPeer, pods: dict[str, EnginePod], key: str
) -> None:
    params = dict(prefill_finished(vllm_peer, pods, "FINISHED_STOPPED")["kv_transfer_params"])
    del params[key]
    with pytest.raises(RouterError) as caught:
        parse_prefill_response(200, response_with(params), pair_for(pods))
    assert caught.value.status == 502 and key in caught.value.message


def test_an_aborted_prefill_returns_no_params_and_the_router_calls_it_a_failure(
    vllm_peer: VllmPeer, pods: dict[str, EnginePod]
) -> None:
    found = prefill_finished(vllm_peer, pods, "FINISHED_ABORTED")
    assert found["kv_transfer_params"] is None
    with pytest.raises(RouterError) as caught:
        parse_prefill_response(200, response_with(None), pair_for(pods))
    assert caught.value.reason == "PrefillHoldsNoKV"
