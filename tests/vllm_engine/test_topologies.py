"""(b) and (c): a hybrid model (sliding-window and full attention, HMA on) PP1 → PP1, and a PP2 prefill into a
PP1 decoder with layer-name routing, dense and hybrid, one process per stage as the operator lays them out
(`--nnodes 2 --node-rank k`, stage 1 `--headless`, the side channel at the head). Real vLLM engines, the
project's router, every output equal to the monolithic run, every prompt token transferred."""

from __future__ import annotations

import pytest
from serving import PROMPTS, Serving, serving

from disagg.rig.vllm_engines import tiny_deployment


def _serves_by_transfer(deployment: Serving) -> None:
    expected = deployment.monolithic()
    external, local = (
        deployment.prompt_tokens("external_kv_transfer"),
        deployment.prompt_tokens("local_compute"),
    )
    prompt_tokens = 0
    for prompt, want in zip(PROMPTS, expected, strict=True):
        text, usage = deployment.through_router(prompt)
        prompt_tokens += usage["prompt_tokens"]
        assert text == want, f"{usage['prompt_tokens']}-token prompt"
    assert prompt_tokens > 8 * 32
    assert deployment.prompt_tokens("external_kv_transfer") - external == prompt_tokens
    assert deployment.prompt_tokens("local_compute") == local


def _kv_cache_groups(deployment: Serving) -> str:
    head = deployment.engines.heads("decode")[0]
    lines = [
        line for line in deployment.engines.log_text(head).splitlines() if "kv cache group sizes" in line
    ]
    return lines[-1] if lines else ""


def test_hybrid_pp1_to_pp1() -> None:
    with serving(tiny_deployment("tiny-hybrid", "hybrid")) as deployment:
        # vLLM's hybrid KV cache manager made one group per attention kind's layer set (here 3).
        assert "(32, 32, 32)" in _kv_cache_groups(deployment)
        _serves_by_transfer(deployment)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_pp2_prefill_into_a_pp1_decoder_by_layer_name(kind: str) -> None:
    with serving(tiny_deployment(f"tiny-{kind}-pp2", kind, prefill_pp=2)) as deployment:
        stages = [pod for pod in deployment.engines.pods if pod.role == "prefill"]
        assert [(pod.ordinal, pod.serves_http) for pod in stages] == [(0, True), (1, False)]
        assert "--headless" in stages[1].argv[2], "the generated stage launcher runs rank 1 headless"
        routing = deployment.engines.routing()
        assert routing.prefills[0].pp_size == 2
        assert routing.prefills[0].kv_hash == deployment.engines.hashes["prefill"]
        _serves_by_transfer(deployment)
