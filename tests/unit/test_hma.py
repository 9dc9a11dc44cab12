"""The hybrid KV cache manager the operator generates: the spec's choice, or Auto's (issue 42)."""

from __future__ import annotations

from built import objects
from dd_specs import DELETE, HMA_ENABLED, spec

from disagg.operator.hma import hma_choice, window_edge_defect
from disagg.operator.naming import Installation
from disagg.operator.policies.chain import REFUSAL_CHAIN
from disagg.operator.policies.compat import evaluate
from disagg.worker.contracts.releases import RELEASES

REFERENCE = {"engine": {"image": "ghcr.io/disagg/disagg-transfer:0.1.0", "extraArgs": []}}


def reasons(patch: dict[str, object]) -> list[str]:
    return evaluate(spec(patch), REFUSAL_CHAIN, Installation(worker_image="w:1")).reasons


def engine_args(patch: dict[str, object], role: str = "decode") -> list[str]:
    name = "gemma-pp2-decode" if role == "decode" else "gemma-pp2-prefill-0"
    kind = "Deployment" if role == "decode" else "StatefulSet"
    containers = objects(spec(patch))[kind, name]["spec"]["template"]["spec"]["containers"]
    args: list[str] = next(c for c in containers if c["name"] == "engine")["args"]
    return args


def test_every_supported_release_has_the_defect() -> None:
    # When a release fixes it, its row says so (releases.FIXED_IN_LINE) and Auto keeps HMA there.
    assert all(release.has("sliding_window_load_edge") for release in RELEASES)


def test_auto_turns_hma_off_for_a_vllm_sliding_window_model_and_says_why() -> None:
    example = spec()
    assert window_edge_defect(example)
    choice = hma_choice(example)
    assert not choice.enabled and choice.chosen_by == "operator"
    assert "docs/vllm-sliding-window-load.md" in choice.why
    for role in ("prefill", "decode"):
        assert "--disable-hybrid-kv-cache-manager" in engine_args({}, role)
    assert reasons({}) == []


def test_auto_keeps_hma_where_no_load_loses_a_key() -> None:
    dense = {"model": {"layerPattern": DELETE}}
    assert hma_choice(spec(dense)).enabled and not window_edge_defect(spec(dense))
    assert "--disable-hybrid-kv-cache-manager" not in engine_args(dense)
    # The reference engine computes the window of the token it recomputes from what it loaded.
    reference = spec(REFERENCE)
    assert hma_choice(reference).enabled and not window_edge_defect(reference)


def test_hma_asked_for_on_a_model_that_would_lose_a_key_is_refused_before_any_pod() -> None:
    assert reasons(HMA_ENABLED) == ["SlidingWindowLoadDefect"]
    (violation,) = evaluate(spec(HMA_ENABLED), REFUSAL_CHAIN, Installation(worker_image="w:1")).violations
    assert "(L - window + 1) a multiple of the block size" in violation.message
    assert "Auto or Disabled" in violation.message
    assert reasons({"engine": {"hybridKvCacheManager": "Disabled"}}) == []


def test_a_model_that_cannot_run_without_hma_is_refused_rather_than_served_wrong() -> None:
    # Sliding-window layers beside MLA ones: vLLM needs HMA for the mix, and under it the defect applies.
    mixed = {"model": {"attentionKinds": ["SlidingWindow", "MLA"] * 31, "layerPattern": DELETE}}
    assert hma_choice(spec(mixed)).enabled
    assert "SlidingWindowLoadDefect" in reasons(mixed)
