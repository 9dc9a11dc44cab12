"""The refusal chain: one ordered list of named policies, run by reconcile, the webhook and `disagg check`."""

from __future__ import annotations

import kopf
import pytest
from dd_specs import DELETE, spec, spec_dict

from disagg.operator.api import ROLES
from disagg.operator.control.reconcile import judge
from disagg.operator.control.webhook import refusal, validate
from disagg.operator.naming import Installation
from disagg.operator.policies.chain import COMPATIBILITY_CHAIN, REFUSAL_CHAIN
from disagg.operator.policies.compat import evaluate
from disagg.operator.policies.policy import PolicyInput, evaluate_chain
from disagg.worker.kv.errors import Violation


def test_the_chain_reads_top_to_bottom() -> None:
    assert [policy.__name__ for policy in REFUSAL_CHAIN] == [
        "model_geometry_is_valid",
        "worker_topology_rules",
        "transfer_sidecar_moves_the_model",
        "kv_heads_divide_over_tp",
        "handshake_factors_match",
        "kv_pool_is_valid",
        "model_volume_is_valid",
        "engine_release_is_supported",
        "sliding_window_kv_loads_whole",
        "kernel_blocks_match",
        "engine_arguments_agree",
        "engine_arguments_parse",
        "prefill_context_is_not_split",
        "decode_context_is_not_split",
        "reference_engine_can_run",
        "worker_image_is_named",
        "transport_has_devices",
        "objects_build",
    ]
    assert REFUSAL_CHAIN[: len(COMPATIBILITY_CHAIN)] == COMPATIBILITY_CHAIN


def test_every_violation_is_kept_in_chain_order() -> None:
    patch = {"decode": {"pipelineParallelSize": 2, "extraArgs": ["--block-size", "64"]}, "worker": DELETE}
    reasons = ["DecodePipelineParallel", "EngineArgumentConflict", "WorkerImageMissing"]
    verdict = judge(spec_dict(spec(patch)), Installation())
    assert [v.reason for v in verdict.violations] == reasons
    assert evaluate(spec(patch), REFUSAL_CHAIN, Installation()).reasons == reasons
    # The spec alone decides only the first; the installation names an image for the last.
    assert evaluate(spec(patch)).reasons == reasons[:1]
    assert evaluate(spec(patch), REFUSAL_CHAIN, Installation(worker_image="w:1")).reasons == reasons[:2]


def test_the_webhook_refuses_with_the_chains_message() -> None:
    patch = {"engine": {"extraArgs": ["--block-size", "64"]}}
    message = refusal(spec_dict(spec(patch)))
    assert message is not None and message.startswith("EngineArgumentConflict: ")
    assert refusal(spec_dict(spec())) is None


def test_a_mamba_hybrid_is_refused_for_the_push_sidecar_before_any_pod() -> None:
    mamba = {
        "model": {"layerPattern": {"fullEvery": 8, "otherKind": "Mamba"}},
        "prefill": {"pipelineParallelSize": 1},
    }
    report = evaluate(spec(mamba))
    assert report.reasons == ["MambaStateNotSupported"]
    assert "Mamba" in report.violations[0].message and "Pull" in report.violations[0].message
    assert evaluate(spec({**mamba, "kvTransfer": {"connector": "Pull"}})).reasons == []


def test_prefill_context_parallelism_is_refused_before_any_pod() -> None:
    for args in (
        ["--prefill-context-parallel-size", "2"],
        ["--prefill_context_parallel_size=4"],
        ["-pcp", "2"],
    ):
        patch = {"prefill": {"extraArgs": args}}
        reasons = evaluate(spec(patch), REFUSAL_CHAIN, Installation(worker_image="w:1")).reasons
        assert reasons == ["PrefillContextParallel"], args
    for args in (["--prefill-context-parallel-size", "1"], ["--max-model-len", "2"]):
        patch = {"engine": {"extraArgs": args}}
        assert evaluate(spec(patch), REFUSAL_CHAIN, Installation(worker_image="w:1")).reasons == [], args


def test_decode_context_parallelism_is_refused_before_any_pod() -> None:
    for args in (
        ["--decode-context-parallel-size", "2"],
        ["--decode_context_parallel_size=4"],
        ["-dcp", "2"],
    ):
        patch = {"decode": {"extraArgs": args}}
        reasons = evaluate(spec(patch), REFUSAL_CHAIN, Installation(worker_image="w:1")).reasons
        assert reasons == ["DecodeContextParallel"], args
    for args in (["--decode-context-parallel-size", "1"], ["--max-model-len", "2"]):
        patch = {"decode": {"extraArgs": args}}
        assert evaluate(spec(patch), REFUSAL_CHAIN, Installation(worker_image="w:1")).reasons == [], args


def test_an_unknown_release_is_refused_naming_the_supported_ones() -> None:
    for version in ("0.30.0", "0.35.0", "0.34.0.dev12+g1a2b3c", "latest"):
        report = evaluate(
            spec({"engine": {"version": version}}), REFUSAL_CHAIN, Installation(worker_image="w:1")
        )
        assert "UnsupportedEngineVersion" in report.reasons, version
        (violation,) = [v for v in report.violations if v.reason == "UnsupportedEngineVersion"]
        assert f"spec.engine.version is {version!r}" in violation.message
        assert (
            "0.31.x (connector version 13), 0.32.x (connector version 14), 0.33.x (connector version 15), "
            "0.34.x (connector version 16)" in (violation.message)
        )
    for version in ("0.31.0", "0.32.0", "0.33.0", "0.33.1", "0.34.0"):
        verdict = evaluate(
            spec({"engine": {"version": version}}), REFUSAL_CHAIN, Installation(worker_image="w:1")
        )
        assert verdict.reasons == [], version
    patch = {"decode": {"overrides": {"version": "0.29.1"}}}
    reasons = evaluate(spec(patch), REFUSAL_CHAIN, Installation(worker_image="w:1")).reasons
    # HMA is off for this model (Auto), so PP push without it is all 0.29 must run: it has that.
    assert reasons == ["CompatibilityHashMismatch", "UnsupportedEngineVersion"]
    with_hma = {**patch, "engine": {"hybridKvCacheManager": "Enabled"}}
    reasons = evaluate(spec(with_hma), REFUSAL_CHAIN, Installation(worker_image="w:1")).reasons
    assert reasons == [
        "CompatibilityHashMismatch",
        "UnsupportedEngineVersion",
        "EngineVersionCannotRunTopology",
        "SlidingWindowLoadDefect",
    ]


def test_a_release_that_cannot_run_the_topology_is_refused_naming_those_that_can() -> None:
    # The example with HMA is PP2 + HMA push: 0.30 has push and PP push, but not PP + HMA push.
    report = evaluate(
        spec({"engine": {"version": "0.30.0", "hybridKvCacheManager": "Enabled"}}),
        REFUSAL_CHAIN,
        Installation(worker_image="w:1"),
    )
    assert report.reasons == [
        "UnsupportedEngineVersion",
        "EngineVersionCannotRunTopology",
        "SlidingWindowLoadDefect",
    ]
    message = report.violations[1].message
    assert "vLLM before 0.31 has no pipeline-parallel push with the hybrid KV cache manager" in message
    assert "0.31, 0.32, 0.33" in message
    old = evaluate(
        spec({"engine": {"version": "0.23.2", "hybridKvCacheManager": "Enabled"}}),
        REFUSAL_CHAIN,
        Installation(worker_image="w:1"),
    )
    assert old.reasons == [
        "UnsupportedEngineVersion",
        *["EngineVersionCannotRunTopology"] * 3,
        "SlidingWindowLoadDefect",
    ]
    # PP1 needs only push: 0.30 lacks nothing but support.
    pp1 = spec({"engine": {"version": "0.30.0"}, "prefill": {"pipelineParallelSize": 1}})
    assert evaluate(pp1, REFUSAL_CHAIN, Installation(worker_image="w:1")).reasons == [
        "UnsupportedEngineVersion"
    ]


def test_more_stages_than_layers_on_the_reference_engine_is_refused_with_its_own_reason() -> None:
    # pp_partition raised LayoutError inside reference_engine_violations: the webhook said VerdictFailed.
    patch = {
        "model": {"numLayers": 9},
        "prefill": {"pipelineParallelSize": 64},
        "engine": {"image": "ghcr.io/disagg/disagg-transfer:0.1.0"},
    }
    with pytest.raises(kopf.AdmissionError) as refused:
        validate(spec=kopf.Spec(kopf.Body({"spec": spec_dict(spec(patch))})))
    message = str(refused.value)
    assert message.startswith("InvalidLayerPartition: 9 layers cannot fill 64 pipeline stages"), message
    assert "VerdictFailed" not in message and "PolicyFailed" not in message


def test_a_policy_that_raises_is_a_named_refusal_not_an_exception() -> None:
    def broken(given: PolicyInput) -> list[Violation]:
        raise ZeroDivisionError("a gap")

    given = PolicyInput.of(spec(), {role: {} for role in ROLES}, Installation(), {})
    found = evaluate_chain((COMPATIBILITY_CHAIN[0], broken), given)
    assert [v.reason for v in found] == ["PolicyFailed"]
    assert "broken" in found[0].message and "ZeroDivisionError: a gap" in found[0].message


def test_a_033_034_pair_is_refused_before_any_pod_naming_the_connector_versions() -> None:
    """vLLM 0.34 (connector version 16) and 0.33 (15) never pass each other's hash, and a 0.34 prefill
    refuses a 0.33 decoder's regions anyway (no layers advertised): refused before any pod, with both."""
    for prefill, decode in (("0.33.0", "0.34.0"), ("0.34.0", "0.33.0")):
        patch = {
            "engine": {"version": decode, "image": f"vllm/vllm-openai:v{decode}"},
            "prefill": {"overrides": {"version": prefill, "image": f"vllm/vllm-openai:v{prefill}"}},
        }
        report = evaluate(spec(patch), REFUSAL_CHAIN, Installation(worker_image="w:1"))
        assert report.reasons == ["CompatibilityHashMismatch"], report.reasons
        (violation,) = report.violations
        versions = {"0.33.0": 15, "0.34.0": 16}
        assert f"nixl_connector_version (prefill {versions[prefill]}, decode {versions[decode]})" in (
            violation.message
        )
        assert f"version (prefill '{prefill}', decode '{decode}')" in violation.message
        assert report.hashes["prefill"] != report.hashes["decode"]
