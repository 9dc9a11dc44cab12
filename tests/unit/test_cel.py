"""The CRD's CEL rules, evaluated with cel-python, agree with the Python pre-flight check.

Kubernetes 1.20 ignores `x-kubernetes-validations`, so these rules are proven here, offline: each rule from
the generated CEL CRD variant is compiled and run against the defaulted spec of valid and broken objects.
`sum()` comes from the Kubernetes CEL lists library; cel-python lacks it, so it is supplied with the same
meaning.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from functools import cache
from typing import Any, cast

import celpy
import pytest
from celpy import celtypes
from dd_specs import EXAMPLES, load, spec, spec_dict

from disagg.operator.api import DisaggDeployment, DisaggDeploymentSpec
from disagg.operator.crd import SPEC_RULES, build_crd
from disagg.operator.policies.compat import evaluate

# Rules that guard the model's own shape: pydantic refuses such objects before evaluate() runs.
SHAPE_REASONS = {"InvalidModelLayers"}


def _cel_sum(values: celtypes.ListType) -> celtypes.IntType:
    return celtypes.IntType(sum(int(cast(celtypes.IntType, v)) for v in values))


@cache
def _programs() -> tuple[tuple[str, str, celpy.Runner], ...]:
    """(reason, message, program) for every rule in the generated CEL CRD, compiled once."""
    schema = build_crd(with_cel=True)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    env = celpy.Environment()
    programs = []
    for entry in schema["properties"]["spec"]["x-kubernetes-validations"]:
        reason = entry["message"].split(":", 1)[0]
        programs.append(
            (reason, entry["message"], env.program(env.compile(entry["rule"]), functions={"sum": _cel_sum}))
        )
    return tuple(programs)


def cel_failures(document: dict[str, Any]) -> list[str]:
    """Reasons of the CEL rules that reject this spec document (a CEL error counts as a rejection)."""
    activation = {"self": celpy.json_to_cel(document)}  # type: ignore[attr-defined]
    failed = []
    for reason, _, program in _programs():
        result = program.evaluate(activation)
        # a CEL error (celpy returns it as a value) fails the rule, as it does in the API server
        if not (isinstance(result, celtypes.BoolType) and bool(result)):
            failed.append(reason)
    return failed


def test_the_cel_variant_carries_every_rule_and_the_plain_one_none() -> None:
    assert len(_programs()) == len(SPEC_RULES)
    plain = build_crd(with_cel=False)
    assert "x-kubernetes-validations" not in str(plain)


def test_rule_messages_start_with_the_reason() -> None:
    for reason, message, _ in _programs():
        assert reason[0].isupper() and " " not in reason
        assert len(message) > len(reason) + 10


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_cel_rejects_exactly_what_the_preflight_check_rejects_in_the_examples(path: Any) -> None:
    model = DisaggDeployment.model_validate(load(path)).spec
    assert sorted(set(cel_failures(spec_dict(model)))) == sorted(set(evaluate(model).reasons))


def test_shape_rules_reject_what_pydantic_rejects() -> None:
    both = spec_dict(spec())
    both["model"]["attentionKinds"] = ["Full"] * both["model"]["numLayers"]
    assert cel_failures(both) == ["InvalidModelLayers"]
    wrong_length = spec_dict(spec({"model": {"numLayers": 4}}))
    del wrong_length["model"]["layerPattern"]
    wrong_length["model"]["attentionKinds"] = ["Full", "SlidingWindow"]
    assert cel_failures(wrong_length) == ["InvalidModelLayers"]


def _variations() -> Iterator[dict[str, Any]]:
    """A deterministic sweep over the fields the rules read (a fixed stride through the full product)."""
    kinds: list[dict[str, Any]] = [
        {"layerPattern": {"fullEvery": 6}},
        {"layerPattern": {"fullEvery": 1}},
        {"layerPattern": {"fullEvery": 4, "otherKind": "Mamba"}},
        {"attentionKind": "MLA", "numKvHeads": 1, "layerPattern": None},
        {"attentionKinds": ["SlidingWindow", "Full"] * 6, "numLayers": 12, "layerPattern": None},
    ]
    product = itertools.product(
        kinds,
        ["Push", "Pull"],
        ["Enabled", "Disabled"],
        ["LayerOutermost", "BlockOutermost"],
        [1, 2, 3],  # prefill PP
        [1, 2],  # decode PP
        [(2, 2), (4, 2), (2, 4), (4, 3), (1, 8)],  # prefill / decode TP
        [(32, 32), (16, 32)],  # prefill / decode block size
        [None, [4, 8], [12, 0]],  # prefill layer partition
        [None, {"version": "0.32.0"}],  # decode overrides
    )
    # KV pools rotate with the stride rather than multiply the product; the cpu/memory requests keep
    # KVPoolResourcesInvalid (Python only: CEL cannot see container resources) out of the comparison.
    pools: list[dict[str, Any] | None] = [
        None,
        {"medium": "HugePages-2Mi"},
        {"medium": "HugePages-1Gi", "sizeLimit": "2Gi"},
        {"medium": "Memory"},
    ]
    memory = {"resources": {"requests": {"memory": "1Gi"}}}
    for index, combo in enumerate(product):
        if index % 131:
            continue
        pool = pools[(index // 131) % len(pools)]
        kind, connector, hma, layout, p_pp, d_pp, (p_tp, d_tp), (p_bs, d_bs), partition, overrides = combo
        prefill: dict[str, Any] = {
            "pipelineParallelSize": p_pp,
            "tensorParallelSize": p_tp,
            "blockSize": p_bs,
        }
        if partition is not None:
            prefill["layerPartition"] = partition
        decode: dict[str, Any] = {"pipelineParallelSize": d_pp, "tensorParallelSize": d_tp, "blockSize": d_bs}
        if overrides is not None:
            decode["overrides"] = overrides
        model: dict[str, Any] = {"numLayers": 12, **kind}
        variation: dict[str, Any] = {
            "model": model,
            "kvTransfer": {"connector": connector},
            "engine": {"hybridKvCacheManager": hma, "kvCacheLayout": layout},
            "prefill": prefill,
            "decode": decode,
        }
        if pool is not None:
            variation["kvTransfer"]["kvPool"] = pool
            prefill.update(memory)
            decode.update(memory)
            variation["worker"] = memory
        yield variation


def _spec_from(patch: dict[str, Any]) -> DisaggDeploymentSpec:
    from dd_specs import DELETE

    model = {k: (DELETE if v is None else v) for k, v in patch["model"].items()}
    return spec({**patch, "model": model})


def test_cel_agrees_with_the_preflight_check_across_a_sweep() -> None:
    checked = 0
    reasons_seen: set[str] = set()
    for patch in _variations():
        model = _spec_from(patch)
        expected = set(evaluate(model).reasons)
        assert set(cel_failures(spec_dict(model))) == expected, patch
        reasons_seen |= expected
        checked += 1
    assert checked > 100
    # the sweep is only meaningful if it breaks every rule the CEL variant carries at least once
    assert reasons_seen >= {rule.reason for rule in SPEC_RULES} - SHAPE_REASONS


@pytest.mark.parametrize("medium", ["HugePages-2Mi", "HugePages-1Gi"])
def test_a_huge_page_pool_without_a_size_is_refused_by_cel_and_the_preflight_check(medium: str) -> None:
    memory = {"resources": {"requests": {"memory": "1Gi"}}}
    model = spec(
        {"kvTransfer": {"kvPool": {"medium": medium}}, "decode": memory, "prefill": memory, "worker": memory}
    )
    assert cel_failures(spec_dict(model)) == ["KVPoolSizeInvalid"] == evaluate(model).reasons
    sized = spec(
        {
            "kvTransfer": {"kvPool": {"medium": medium, "sizeLimit": "4Gi"}},
            "decode": memory,
            "prefill": memory,
            "worker": memory,
        }
    )
    assert cel_failures(spec_dict(sized)) == [] == evaluate(sized).reasons
