"""The hybrid KV cache manager the operator generates: the spec's choice, or Auto's (issue 42)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from built import objects
from dd_specs import DELETE, HMA_ENABLED, spec, valid_document

from disagg.operator.cli.main import main
from disagg.operator.hma import hma_choice, window_edge_defect, window_edges
from disagg.operator.naming import Installation
from disagg.operator.policies.chain import REFUSAL_CHAIN
from disagg.operator.policies.compat import evaluate
from disagg.worker.contracts.releases import RELEASES, loses_window_edge

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


# The prompt lengths real vLLM 0.32 engines of the 8-layer, window-64 model answered wrong with HMA on (block
# size 32; docs/vllm-sliding-window-load.md): every one, and none of the lengths around them, loses a key.
SEEN_WRONG = (95, 127, 255, 415, 511, 703, 735, 831, 927)


def test_the_lengths_that_lose_a_key_are_the_ones_real_engines_answered_wrong() -> None:
    assert all(loses_window_edge(n, 64, 32) for n in SEEN_WRONG)
    right = (96, 128, 200, 256, 416, 512, 63, 64, 94)
    assert not any(loses_window_edge(n, 64, 32) for n in right)
    assert [n for n in range(1, 200) if loses_window_edge(n, 64, 32)] == [95, 127, 159, 191]
    # A window that is no multiple of the block: (L - 48 + 1) % 32 == 0.
    assert [n for n in range(1, 160) if loses_window_edge(n, 48, 32)] == [79, 111, 143]


WITH_WINDOW = {"model": {"slidingWindow": 1024}}


def check_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], patch: dict[str, object]
) -> tuple[int, str, str]:
    path = tmp_path / "dd.yaml"
    path.write_text(yaml.safe_dump(valid_document(patch)))
    code = main(["check", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_sliding_window_the_router_knows_keeps_hma_and_the_router_serves_the_lost_lengths_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    choice = hma_choice(spec(WITH_WINDOW))
    assert choice.enabled and choice.chosen_by == "operator" and "router" in choice.why
    assert reasons(WITH_WINDOW) == [] and reasons({**WITH_WINDOW, **HMA_ENABLED}) == []
    assert window_edges(spec(WITH_WINDOW)) == ((1024, 32),)
    router = objects(spec(WITH_WINDOW))["Deployment", "gemma-pp2-router"]["spec"]["template"]["spec"]
    assert "--recompute-window-edge=1024:32" in router["containers"][0]["args"]
    assert "--disable-hybrid-kv-cache-manager" not in engine_args(WITH_WINDOW)
    code, out, _ = check_file(tmp_path, capsys, WITH_WINDOW)
    assert code == 0 and "  hybrid KV cache manager on: Auto: " in out and "decoder alone" in out
    # Without HMA, or without the defect, the router has nothing to serve alone.
    assert window_edges(spec({**WITH_WINDOW, "engine": {"hybridKvCacheManager": "Disabled"}})) == ()
    assert window_edges(spec()) == ()


def test_without_a_router_no_one_guards_the_lost_lengths() -> None:
    no_router = {**WITH_WINDOW, "router": {"enabled": False}}
    assert not hma_choice(spec(no_router)).enabled
    assert reasons({**no_router, **HMA_ENABLED}) == ["SlidingWindowLoadDefect"]
