"""Fail closed on real vLLM engines (issue 42): a request is answered 200 only with its whole answer. A dead
prefill engine or a decoder killed mid-stream ends its requests with an error that names the leg, never with
wrong or silently cut tokens, and the surviving engine frees what it held for them; a decoder restarted
between the legs answers right.

One dense PP1 deployment with two decoders, as the operator generates it (`kv_load_failure_policy: fail` in
the generated `--kv-transfer-config`, checked here in vLLM's own log of its config). The router of each case
routes one pair, so that which engine dies is the case's choice.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from serving import MAX_TOKENS, PROMPTS, holds_nothing, post, request, wait_until

from disagg.rig.local_router import LocalRouter
from disagg.rig.vllm_engines import EnginePod, VllmEngines, tiny_deployment
from disagg.worker.router.protocol import COMPLETIONS, build_legs, parse_client_request

# Long enough to outlast a decoder's restart: the restarted decoder must still find the KV held for it.
LEASE_S = 300


@pytest.fixture(scope="module")
def engines() -> Iterator[VllmEngines]:
    with VllmEngines(tiny_deployment("tiny-faults", "dense", decoders=2, lease_s=LEASE_S)) as started:
        yield started


def router_for(engines: VllmEngines, decoder: EnginePod) -> LocalRouter:
    return LocalRouter(engines.routing([decoder]))


def test_the_generated_config_fails_a_load_that_did_not_arrive_whole(engines: VllmEngines) -> None:
    for pod in engines.heads("decode"):
        assert "kv_load_failure_policy='fail'" in engines.log_text(pod)


def test_a_decoder_restarted_between_the_legs_gets_the_kv_and_answers_right(engines: VllmEngines) -> None:
    # The router's two legs, sent one after the other with the decoder restarted between them: the restarted
    # decoder (a new engine id) registers with the prefill, which still holds the KV within its lease, and
    # either answers right or fails; it must not answer wrong.
    decoder = engines.heads("decode")[1]
    model = engines.deployment.spec.model.name
    body = {"model": model, "prompt": PROMPTS[4], "max_tokens": MAX_TOKENS, "temperature": 0}
    want = post(decoder.url, body)["choices"][0]["text"]
    legs = build_legs(
        parse_client_request(COMPLETIONS, json.dumps(body).encode()),
        engines.routing([decoder]).pairs[0],
        uuid.uuid4().hex,
    )
    prefill = engines.heads("prefill")[0]
    status, raw = request(prefill.url, legs.prefill, legs.headers)
    assert status == 200 and "kv_transfer_params" in json.loads(raw), raw
    engines.restart(decoder)
    status, raw = request(decoder.url, legs.decode, legs.headers)
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["text"] == want


def test_a_decoder_killed_mid_stream_ends_the_stream_with_an_error_and_the_prefill_frees_its_blocks(
    engines: VllmEngines,
) -> None:
    decoder = engines.heads("decode")[0]
    with router_for(engines, decoder) as router:
        model = engines.deployment.spec.model.name
        body = {"model": model, "prompt": PROMPTS[4], "max_tokens": 1500, "temperature": 0, "stream": True}
        req = urllib.request.Request(
            router.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=180) as response:
            assert response.status == 200
            first = response.readline()
            assert first.startswith(b"data: {"), first
            engines.kill(decoder)
            rest = response.read()
    events = [line[len(b"data: ") :] for line in (first + rest).split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "upstream_error" and "decoder" in error["message"], error
    # The prefill holds nothing for the request (its KV had crossed before the first token; otherwise its
    # lease would return the blocks).
    prefill = engines.heads("prefill")[0]
    wait_until(lambda: holds_nothing(prefill.url), LEASE_S + 60, "the prefill still holds the request's KV")


def test_a_dead_prefill_fails_the_request_naming_it_and_the_decoder_holds_nothing(
    engines: VllmEngines,
) -> None:
    decoder = engines.heads("decode")[1]
    with router_for(engines, decoder) as router:
        model = engines.deployment.spec.model.name
        body: dict[str, Any] = {
            "model": model,
            "prompt": PROMPTS[3],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        status, raw = request(router.url, body)
        assert status == 200, raw
        engines.kill(engines.heads("prefill")[0])
        for stream in (False, True):
            status, raw = request(router.url, {**body, "stream": stream})
            assert status == 502, raw
            error = json.loads(raw)["error"]
            assert error["type"] == "upstream_error" and "prefill engine" in error["message"], error
    wait_until(lambda: holds_nothing(decoder.url), 60, "the decoder still holds the failed requests")
