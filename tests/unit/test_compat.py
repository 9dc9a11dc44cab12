"""Pre-flight compatibility (`compat.evaluate`): every rule broken and kept, the plan and the hashes."""

from __future__ import annotations

from typing import Any

import pytest
from dd_specs import EXAMPLES, HMA_ENABLED, load, spec

from disagg.operator.api import DisaggDeployment, RoutingMode
from disagg.operator.policies.compat import evaluate, role_factors
from disagg.worker.kv.wire import compat_hash

PP2 = {"prefill": {"pipelineParallelSize": 2}}

# (spec patch, the reasons evaluate() must report). Each patch is applied to examples/pp2-hma.yaml
# (Gemma-style 62 layers, 5:1 sliding/full, push, prefill PP2 TP2, decode TP2, block size 32).
BROKEN: dict[str, tuple[dict[str, Any], list[str]]] = {
    "decode-pp": ({"decode": {"pipelineParallelSize": 2}}, ["DecodePipelineParallel"]),
    "pull-hma-pp": ({**HMA_ENABLED, "kvTransfer": {"connector": "Pull"}}, ["PullConnectorWithHybridPP"]),
    "mamba-pp": (
        {"model": {"layerPattern": {"fullEvery": 8, "otherKind": "Mamba"}}},
        ["MambaUnderPipelineParallel", "MambaStateNotSupported"],
    ),
    "mamba-push-without-pp": (
        {
            "model": {"layerPattern": {"fullEvery": 8, "otherKind": "Mamba"}},
            "prefill": {"pipelineParallelSize": 1},
        },
        ["MambaStateNotSupported"],
    ),
    "block-size": ({"decode": {"blockSize": 16}}, ["BlockSizeMismatch"]),
    "decode-tp-above-prefill": (
        {**HMA_ENABLED, "decode": {"tensorParallelSize": 4}},
        ["DecodeTPExceedsPrefillTP"],
    ),
    "tp-not-divisible": (
        {"prefill": {"tensorParallelSize": 4}, "decode": {"tensorParallelSize": 3}},
        ["TensorParallelNotDivisible", "KVHeadsNotDivisible"],
    ),
    "partition-sum": ({"prefill": {"layerPartition": [30, 30]}}, ["InvalidLayerPartition"]),
    "partition-empty-stage": ({"prefill": {"layerPartition": [62, 0]}}, ["InvalidLayerPartition"]),
    "partition-length": ({"prefill": {"layerPartition": [62]}}, ["InvalidLayerPartition"]),
    "more-stages-than-layers": (
        {"model": {"numLayers": 3, "layerPattern": {"fullEvery": 3}}, "prefill": {"pipelineParallelSize": 4}},
        ["InvalidLayerPartition"],
    ),
    "kv-heads": ({"model": {"numKvHeads": 6}, "prefill": {"tensorParallelSize": 4}}, ["KVHeadsNotDivisible"]),
    "version": ({"decode": {"overrides": {"version": "0.32.0"}}}, ["CompatibilityHashMismatch"]),
    "image": (
        {"prefill": {"overrides": {"image": "registry.local/vllm:patched"}}},
        ["CompatibilityHashMismatch"],
    ),
    "dtype": ({"decode": {"overrides": {"dtype": "float16"}}}, ["CompatibilityHashMismatch"]),
    "kv-cache-dtype": ({"decode": {"overrides": {"kvCacheDtype": "fp8"}}}, ["CompatibilityHashMismatch"]),
    "attention-backend": (
        {"prefill": {"overrides": {"attentionBackend": "FLASHINFER"}}},
        ["CompatibilityHashMismatch"],
    ),
    "revision": ({"decode": {"overrides": {"revision": "abc123"}}}, ["CompatibilityHashMismatch"]),
    "mamba-all-layers": ({"model": {"attentionKind": "Mamba", "layerPattern": None}}, ["InvalidKVLayout"]),
}

# Near misses: the same fields, set so that the rule holds.
KEPT: dict[str, dict[str, Any]] = {
    "decode-pp-1": {"decode": {"pipelineParallelSize": 1}},
    "pull-without-pp": {"kvTransfer": {"connector": "Pull"}, "prefill": {"pipelineParallelSize": 1}},
    "pull-pp-uniform-model": {
        "kvTransfer": {"connector": "Pull"},
        "model": {"layerPattern": {"fullEvery": 1}},
    },
    "pull-pp-hma-disabled": {
        "kvTransfer": {"connector": "Pull"},
        "engine": {"hybridKvCacheManager": "Disabled"},
    },
    # The push transfer sidecar moves attention pages only (MambaStateNotSupported); vLLM's pull connector
    # moves Mamba state itself.
    "mamba-without-pp": {
        "kvTransfer": {"connector": "Pull"},
        "model": {"layerPattern": {"fullEvery": 8, "otherKind": "Mamba"}},
        "prefill": {"pipelineParallelSize": 1},
    },
    # region-index routing (no PP) allows different block sizes and decode TP above prefill TP
    "smaller-prefill-block-with-pull-without-hma": {
        "kvTransfer": {"connector": "Pull"},
        "engine": {"hybridKvCacheManager": "Disabled"},
        "prefill": {"blockSize": 16},
        "decode": {"blockSize": 32},
    },
    "decode-tp-above-without-pp": {
        "prefill": {"pipelineParallelSize": 1},
        "decode": {"tensorParallelSize": 4},
    },
    "decode-tp-above-mla": {
        "model": {"layerPattern": None, "attentionKind": "MLA", "numKvHeads": 1, "headSize": 576},
        "decode": {"tensorParallelSize": 4},
    },
    "decode-tp-below-prefill": {"prefill": {"tensorParallelSize": 4}, "decode": {"tensorParallelSize": 1}},
    "partition-explicit": {"prefill": {"layerPartition": [20, 42]}},
    "kv-heads-replicated": {
        "model": {"numKvHeads": 2},
        "prefill": {"tensorParallelSize": 4},
        "decode": {"tensorParallelSize": 4},
    },
    "same-overrides": {
        "prefill": {"overrides": {"version": "0.32.0", "image": "vllm/vllm-openai:v0.32.0"}},
        "decode": {"overrides": {"version": "0.32.0", "image": "vllm/vllm-openai:v0.32.0"}},
    },
    "override-equal-to-shared": {"decode": {"overrides": {"attentionBackend": "FLASH_ATTN"}}},
}


def _without_nulls(patch: dict[str, Any]) -> dict[str, Any]:
    from dd_specs import DELETE

    return {
        k: (DELETE if v is None else _without_nulls(v) if isinstance(v, dict) else v)
        for k, v in patch.items()
    }


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_each_broken_rule_is_reported_with_its_reason(case: str) -> None:
    patch, reasons = BROKEN[case]
    report = evaluate(spec(_without_nulls(patch)))
    assert not report.compatible
    assert report.reasons == reasons
    for violation in report.violations:
        assert violation.message and violation.reason not in violation.message


@pytest.mark.parametrize("case", sorted(KEPT))
def test_near_misses_are_compatible(case: str) -> None:
    report = evaluate(spec(_without_nulls(KEPT[case])))
    assert report.violations == ()
    assert report.compatible


def test_messages_say_what_to_change() -> None:
    decode_pp = evaluate(spec({"decode": {"pipelineParallelSize": 2}})).violations[0]
    assert "set decode pipelineParallelSize to 1" in decode_pp.message
    heads = evaluate(spec({"model": {"numKvHeads": 6}, "prefill": {"tensorParallelSize": 4}})).violations[0]
    assert "6 KV heads" in heads.message and "prefill tensorParallelSize 4" in heads.message
    version = evaluate(spec({"decode": {"overrides": {"version": "0.32.0"}}})).violations[0]
    assert "version (prefill '0.33.0', decode '0.32.0')" in version.message
    assert "overrides" in version.message


def test_several_broken_rules_are_all_reported() -> None:
    report = evaluate(
        spec(
            {
                **HMA_ENABLED,
                "decode": {"pipelineParallelSize": 2, "blockSize": 16},
                "kvTransfer": {"connector": "Pull"},
            }
        )
    )
    # pull cannot remap the blocks of a hybrid KV cache, so the unequal block sizes are refused as well
    assert report.reasons == ["DecodePipelineParallel", "PullConnectorWithHybridPP", "BlockSizeMismatch"]
    assert report.plan is not None and report.plan.routing_mode is RoutingMode.REGION_INDEX


def test_the_pp2_hma_example_runs_without_hma_on_the_releases_with_the_window_defect() -> None:
    plan = evaluate(spec()).plan
    assert plan is not None and not plan.hma and plan.routing_mode is RoutingMode.REGION_INDEX
    assert [(s.stage, s.layers) for s in plan.stages] == [(0, range(0, 31)), (1, range(31, 62))]


def test_plan_of_the_pp2_hma_example_with_hma() -> None:
    report = evaluate(spec(HMA_ENABLED))
    plan = report.plan
    assert plan is not None
    assert plan.routing_mode is RoutingMode.LAYER_NAME and plan.hma and plan.transfer_mode == "push"
    assert [(s.stage, s.layers) for s in plan.stages] == [(0, range(0, 31)), (1, range(31, 62))]
    assert plan.stages[1].layer_names[0] == "model.layers.31.self_attn.attn"
    assert all(s.routing_mode is RoutingMode.LAYER_NAME for s in plan.stages)
    assert plan.notifications_per_request == 2
    status = plan.to_status()
    assert [(s.start_layer, s.end_layer) for s in status.stages] == [(0, 31), (31, 62)]


@pytest.mark.parametrize(
    ("patch", "mode"),
    [
        (HMA_ENABLED, RoutingMode.LAYER_NAME),
        ({}, RoutingMode.REGION_INDEX),
        ({"prefill": {"pipelineParallelSize": 1}}, RoutingMode.REGION_INDEX),
        ({"model": {"layerPattern": {"fullEvery": 1}}}, RoutingMode.REGION_INDEX),
        (
            {"model": {"layerPattern": {"fullEvery": 1}}, "engine": {"kvCacheLayout": "BlockOutermost"}},
            RoutingMode.LAYER_NAME,
        ),
        ({"engine": {"hybridKvCacheManager": "Disabled"}}, RoutingMode.REGION_INDEX),
    ],
)
def test_routing_mode_follows_the_worker_rule(patch: dict[str, Any], mode: RoutingMode) -> None:
    plan = evaluate(spec(patch)).plan
    assert plan is not None and plan.routing_mode is mode


def test_explicit_partition_and_even_split_with_remainder() -> None:
    explicit = evaluate(spec({"prefill": {"layerPartition": [20, 42]}})).plan
    assert explicit is not None and [s.layers for s in explicit.stages] == [range(0, 20), range(20, 62)]
    # vLLM's even split gives the remainder to the stages just before the last one: 62 = 15 + 16 + 16 + 15
    four = evaluate(spec({"prefill": {"pipelineParallelSize": 4}})).plan
    assert four is not None and [len(s.layers) for s in four.stages] == [15, 16, 16, 15]


def test_no_plan_when_the_partition_is_invalid() -> None:
    report = evaluate(spec({"prefill": {"layerPartition": [30, 30]}}))
    assert report.plan is None


def test_hashes_are_the_worker_hash_of_each_roles_factors() -> None:
    report = evaluate(spec({"decode": {"overrides": {"kvCacheDtype": "fp8"}}}))
    s = spec({"decode": {"overrides": {"kvCacheDtype": "fp8"}}})
    for role in ("prefill", "decode"):
        assert report.hashes[role] == compat_hash(role_factors(s, role))
    assert report.factors["prefill"]["cache_dtype"] == "auto"
    assert report.factors["decode"]["cache_dtype"] == "fp8"
    assert report.factors["prefill"]["dtype"] == "torch.bfloat16"
    assert report.factors["prefill"]["num_hidden_layers"] == 62
    assert report.hashes["prefill"] != report.hashes["decode"]


def test_push_and_pull_hash_differently() -> None:
    push = evaluate(spec({"prefill": {"pipelineParallelSize": 1}})).hashes["prefill"]
    pull = evaluate(spec({"prefill": {"pipelineParallelSize": 1}, "kvTransfer": {"connector": "Pull"}}))
    assert pull.compatible and pull.hashes["prefill"] != push


EXPECTED_EXAMPLES = {
    "pp2-hma.yaml": [],
    "reference-pp2-hma.yaml": [],
    "vllm-cpu-pp1.yaml": [],
    "vllm-cpu-pp2.yaml": [],
    "bad-decode-pp.yaml": ["DecodePipelineParallel"],
    "bad-pull-hma-pp.yaml": ["PullConnectorWithHybridPP"],
    "bad-block-size.yaml": ["BlockSizeMismatch"],
    "bad-tp-not-divisible.yaml": ["TensorParallelNotDivisible", "KVHeadsNotDivisible"],
    "bad-mamba-pp.yaml": ["MambaUnderPipelineParallel", "MambaStateNotSupported"],
    "bad-layer-partition.yaml": ["InvalidLayerPartition"],
    "bad-version-mismatch.yaml": ["CompatibilityHashMismatch"],
}


def test_every_example_is_listed() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(EXPECTED_EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXPECTED_EXAMPLES))
def test_examples_give_their_documented_verdict(name: str) -> None:
    report = evaluate(DisaggDeployment.model_validate(load(EXAMPLES / name)).spec)
    assert report.reasons == EXPECTED_EXAMPLES[name]


MEMORY = {"resources": {"requests": {"memory": "2Gi"}}}


def huge_page_spec(pool: dict[str, Any], **roles: Any) -> Any:
    return spec(
        {"kvTransfer": {"kvPool": pool}, "prefill": MEMORY, "decode": MEMORY, "worker": MEMORY, **roles}
    )


@pytest.mark.parametrize(
    "pool",
    [
        {"medium": "HugePages-2Mi"},
        {"medium": "HugePages-2Mi", "sizeLimit": "0"},
        {"medium": "HugePages-2Mi", "sizeLimit": "3Mi"},
        {"medium": "HugePages-2Mi", "sizeLimit": "1G"},
        {"medium": "HugePages-1Gi", "sizeLimit": "1536Mi"},
    ],
)
def test_a_huge_page_pool_needs_a_size_in_whole_pages(pool: dict[str, Any]) -> None:
    (violation,) = evaluate(huge_page_spec(pool)).violations
    assert violation.reason == "KVPoolSizeInvalid"
    assert "spec.kvTransfer.kvPool.sizeLimit" in str(violation) and pool["medium"] in str(violation)


@pytest.mark.parametrize(
    "pool",
    [
        {"medium": "HugePages-2Mi", "sizeLimit": "4Gi"},
        {"medium": "HugePages-2Mi", "sizeLimit": "1.5Gi"},
        {"medium": "HugePages-2Mi", "sizeLimit": "4000Mi"},
        {"medium": "HugePages-1Gi", "sizeLimit": "2Gi"},
        {"medium": "Memory"},
        {"medium": "Memory", "sizeLimit": "3M"},
    ],
)
def test_whole_page_pools_and_memory_pools_are_accepted(pool: dict[str, Any]) -> None:
    assert evaluate(huge_page_spec(pool)).violations == ()


def test_every_container_mapping_a_huge_page_pool_needs_cpu_or_memory() -> None:
    gpus_only = {"resources": {"limits": {"nvidia.com/gpu": 2}}}
    report = evaluate(
        huge_page_spec(
            {"medium": "HugePages-2Mi", "sizeLimit": "4Gi"}, decode=gpus_only, worker={"resources": {}}
        )
    )
    assert report.reasons == ["KVPoolResourcesInvalid", "KVPoolResourcesInvalid"]
    assert "spec.decode.resources" in str(report.violations[0]) and "hugepages-2Mi" in str(
        report.violations[0]
    )
    assert "spec.worker.resources" in str(report.violations[1])
    cpu_limit = {"resources": {"limits": {"cpu": "8"}}}
    assert evaluate(
        huge_page_spec({"medium": "HugePages-2Mi", "sizeLimit": "4Gi"}, decode=cpu_limit)
    ).compatible
    # Without huge pages Kubernetes asks nothing of the containers' resources.
    assert evaluate(spec({"kvTransfer": {"kvPool": {"medium": "Memory"}}})).compatible


def test_a_users_hugepages_resource_must_match_the_pool() -> None:
    other = {"resources": {"requests": {"memory": "1Gi", "hugepages-2Mi": "1Gi"}}}
    (violation,) = evaluate(
        huge_page_spec({"medium": "HugePages-2Mi", "sizeLimit": "4Gi"}, prefill=other)
    ).violations
    assert violation.reason == "KVPoolResourcesInvalid" and "spec.prefill.resources" in str(violation)
    same = {"resources": {"requests": {"memory": "1Gi"}, "limits": {"hugepages-2Mi": "4Gi"}}}
    assert evaluate(huge_page_spec({"medium": "HugePages-2Mi", "sizeLimit": "4Gi"}, prefill=same)).compatible
