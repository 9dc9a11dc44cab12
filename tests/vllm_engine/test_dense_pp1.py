"""(a) Dense PP1 → PP1 on real vLLM engines, run as the operator generates them, through the project's router.

The first request after the pair starts must succeed (the first-handshake loss seen before is gone); 50
consecutive requests must equal the monolithic run token for token; and the decoder's own metrics must show
that every prompt token arrived by KV transfer and none was computed there.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from serving import PROMPTS, Serving, serving

from disagg.rig.vllm_engines import tiny_deployment
from disagg.worker.reporting.engine_lanes import EngineLanes


@pytest.fixture(scope="module")
def dense() -> Iterator[Serving]:
    with serving(tiny_deployment("tiny-dense", "dense")) as deployment:
        yield deployment


def test_the_first_request_after_the_pair_starts_succeeds(dense: Serving) -> None:
    # Nothing has crossed the pair before this request (the routing was read from the side channels only).
    text, usage = dense.through_router(PROMPTS[4])
    assert usage["prompt_tokens"] > 8 * 32, "the prompt spans more than 8 blocks"
    assert text == dense.monolithic([PROMPTS[4]])[0]


def test_the_live_hashes_are_the_ones_pre_flight_predicted(dense: Serving) -> None:
    routing = dense.engines.routing()
    assert routing.prefills[0].kv_hash == dense.engines.hashes["prefill"]
    assert routing.decodes[0].kv_hash == dense.engines.hashes["decode"]
    assert routing.prefills[0].engine_id.startswith("tiny-dense-prefill-0-")


def test_fifty_consecutive_requests_equal_the_monolithic_run_and_their_kv_was_transferred(
    dense: Serving,
) -> None:
    expected = dense.monolithic()
    external, local = dense.prompt_tokens("external_kv_transfer"), dense.prompt_tokens("local_compute")
    prompt_tokens = 0
    mismatches = []
    for k in range(50):
        text, usage = dense.through_router(PROMPTS[k % len(PROMPTS)])
        prompt_tokens += usage["prompt_tokens"]
        if text != expected[k % len(PROMPTS)]:
            mismatches.append((k, text, expected[k % len(PROMPTS)]))
    assert mismatches == []
    # Every prompt token of the 50 requests came by KV transfer; the decoder computed none of them.
    assert dense.prompt_tokens("external_kv_transfer") - external == prompt_tokens
    assert dense.prompt_tokens("local_compute") == local


def test_the_prefill_engines_own_ucx_log_names_the_transport_its_kv_took(dense: Serving) -> None:
    # What a watching sidecar reads in the pod's /dev/shm (`reporting.engine_lanes`): the lanes vLLM's agent
    # chose for its WRITEs, as its UCX printed them under the operator's generated UCX settings. On loopback,
    # shared memory (cma) or tcp.
    dense.through_router(PROMPTS[2])
    prefill = dense.engines.heads("prefill")[0]
    assert prefill.env.get("UCX_PROTO_INFO") == "y", prefill.env
    stats = EngineLanes(dense.engines.shm(prefill)).snapshot()
    assert stats, f"no put table in {sorted(p.name for p in dense.engines.shm(prefill).iterdir())}"
    assert stats["any decoder"].transport in ("shm", "tcp", "shm+tcp"), stats["any decoder"]
