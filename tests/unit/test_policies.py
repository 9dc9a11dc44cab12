"""The refusal chain: one ordered list of named policies, run by reconcile, the webhook and `disagg check`."""

from __future__ import annotations

from dd_specs import DELETE, spec, spec_dict

from disagg.operator.builders import Installation
from disagg.operator.compat import evaluate
from disagg.operator.policies import COMPATIBILITY_CHAIN, REFUSAL_CHAIN
from disagg.operator.reconcile import judge
from disagg.operator.webhook import refusal


def test_the_chain_reads_top_to_bottom() -> None:
    assert [policy.__name__ for policy in REFUSAL_CHAIN] == [
        "model_geometry_is_valid",
        "worker_topology_rules",
        "transfer_sidecar_moves_the_model",
        "kv_heads_divide_over_tp",
        "handshake_factors_match",
        "kv_pool_is_valid",
        "engine_arguments_agree",
        "prefill_context_is_not_split",
        "worker_image_is_named",
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
