"""Fail closed when the KV can no longer arrive (issue 42), on real vLLM engines with a short lease: a decoder
that registers after the prefill's lease ran out, a reference replayed after its KV was written, and a prefill
killed while it holds the KV a decoder waits for. Each ends in an error the router names (its decode timeout:
vLLM's decoder waits for a WRITE that will never come and says nothing) or in the right answer, never in other
tokens with a 200, and the engines free what they held.

One dense PP1 pair as the operator generates it (`kv_lease_duration` from `spec.kvTransfer.leaseSeconds`,
`kv_load_failure_policy: fail`), and the router with its decode timeout shortened so that a case ends in
bounded time. The prefill is killed by the last case.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from serving import (
    MAX_TOKENS,
    PROMPTS,
    Pending,
    answered,
    decoder_full,
    holds_nothing,
    post,
    request,
    wait_until,
)

from disagg.rig.local_router import LocalRouter
from disagg.rig.vllm_engines import VllmEngines, tiny_deployment
from disagg.worker.router.protocol import COMPLETIONS, build_legs, parse_client_request

LEASE_S = 6
LEASE_EXPIRED = "Releasing expired KV blocks for request"
# Longer than a paused decoder's wait (twice the lease) plus its work once resumed, and bounded.
DECODE_TIMEOUT_S = 45


@pytest.fixture(scope="module")
def engines() -> Iterator[VllmEngines]:
    with VllmEngines(tiny_deployment("tiny-lease", "dense", decoders=1, lease_s=LEASE_S)) as started:
        yield started


@pytest.fixture(scope="module")
def router(engines: VllmEngines) -> Iterator[LocalRouter]:
    with LocalRouter(engines.routing(), args=("--decode-timeout", str(DECODE_TIMEOUT_S))) as started:
        yield started


def body_for(engines: VllmEngines, prompt: str) -> dict[str, Any]:
    model = engines.deployment.spec.model.name
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}


def alone(engines: VllmEngines, prompt: str) -> str:
    """The prompt computed by the decoder alone: the right answer."""
    text: str = post(engines.heads("decode")[0].url, body_for(engines, prompt))["choices"][0]["text"]
    return text


def expired_leases(engines: VllmEngines) -> int:
    return engines.log_text(engines.heads("prefill")[0]).count(LEASE_EXPIRED)


def queued_past_its_lease(engines: VllmEngines, router: LocalRouter, prompt: str) -> Pending:
    """A request through the router whose decoder is full: the prefill answers, nobody registers for its
    KV and no heartbeat extends the lease, so the prefill frees the KV (and logs it); then the decoder has
    room."""
    prefill = engines.heads("prefill")[0]
    before, expired = answered(prefill.url), expired_leases(engines)
    with decoder_full(engines):
        pending = Pending(router.url, body_for(engines, prompt), DECODE_TIMEOUT_S + 60)
        wait_until(lambda: answered(prefill.url) > before, 120, "the prefill did not answer")
        wait_until(lambda: expired_leases(engines) > expired, 4 * LEASE_S, "the prefill kept the KV")
    return pending


def test_a_decoder_registering_after_the_lease_fails_the_request_and_the_pair_still_serves(
    engines: VllmEngines, router: LocalRouter
) -> None:
    prompt = PROMPTS[4]
    want = alone(engines, prompt)
    status, raw = queued_past_its_lease(engines, router, prompt).wait()
    assert status == 504, raw
    assert "decoder" in json.loads(raw)["error"]["message"], raw
    wait_until(lambda: holds_nothing(engines.heads("prefill")[0].url), 60, "the prefill still holds KV")
    status, raw = request(router.url, body_for(engines, prompt))
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == want, raw


@pytest.mark.xfail(
    strict=True,
    reason="vLLM 0.32's push connector never fails a registration that no WRITE answers, and an aborted "
    "request waiting for remote KV keeps its blocks until one does (docs/vllm-push-registration-leak.md)",
)
def test_the_decoder_frees_the_blocks_of_a_request_whose_kv_cannot_arrive(engines: VllmEngines) -> None:
    wait_until(lambda: holds_nothing(engines.heads("decode")[0].url), 30, "the decoder still holds KV blocks")


def test_a_replayed_reference_reaches_no_kv(engines: VllmEngines) -> None:
    # The two legs as the router sends them, then the decode leg again under the same reference, as a
    # replaying client could if the router let it (it refuses `kv_transfer_params` from a client). The prefill
    # freed the KV once written: the replay waits (the router's decode timeout would end it); it takes no KV.
    prefill, decoder = engines.heads("prefill")[0], engines.heads("decode")[0]
    body = body_for(engines, PROMPTS[3])
    want = alone(engines, PROMPTS[3])
    legs = build_legs(
        parse_client_request(COMPLETIONS, json.dumps(body).encode()),
        engines.routing().pairs[0],
        uuid.uuid4().hex,
    )
    status, raw = request(prefill.url, legs.prefill, legs.headers)
    assert status == 200, raw
    status, raw = request(decoder.url, legs.decode, legs.headers)
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == want, raw
    with pytest.raises(TimeoutError):
        request(decoder.url, legs.decode, legs.headers, timeout_s=2 * LEASE_S)


def test_a_prefill_killed_holding_the_kv_a_decoder_waits_for_fails_the_request_naming_the_decoder(
    engines: VllmEngines, router: LocalRouter
) -> None:
    prefill = engines.heads("prefill")[0]
    before = answered(prefill.url)
    with decoder_full(engines):
        pending = Pending(router.url, body_for(engines, PROMPTS[6]), DECODE_TIMEOUT_S + 60)
        wait_until(lambda: answered(prefill.url) > before, 120, "the prefill did not answer")
        engines.kill(prefill)
    status, raw = pending.wait()
    assert status in (502, 504), raw
    assert "decoder" in json.loads(raw)["error"]["message"], raw
