"""The DisaggDeployment models: camelCase wire names, defaults, and validation errors that name the field."""

from __future__ import annotations

from typing import Any

import pytest
from dd_specs import DELETE, VALID_EXAMPLE, load, patched, valid_document
from pydantic import ValidationError

from disagg.operator.api import (
    AttentionKind,
    Condition,
    Connector,
    DecodeSpec,
    DisaggDeployment,
    DisaggDeploymentSpec,
    EngineSpec,
    KVTransferSpec,
    ModelSpec,
    PrefillSpec,
    WorkerSpec,
)
from disagg.operator.plan import model_geometry
from disagg.worker.kv.layout import AttentionKind as LayoutKind


def _errors(document: dict[str, Any]) -> list[tuple[tuple[Any, ...], str]]:
    with pytest.raises(ValidationError) as caught:
        DisaggDeployment.model_validate(document)
    return [(tuple(error["loc"]), error["msg"]) for error in caught.value.errors()]


def test_the_example_round_trips_through_the_camel_case_wire_form() -> None:
    document = valid_document()
    dd = DisaggDeployment.model_validate(document)
    assert dd.spec.prefill.pipeline_parallel_size == 2
    assert dd.spec.kv_transfer.side_channel_port == 5600
    dumped = dd.to_dict()
    assert dumped["spec"]["prefill"]["pipelineParallelSize"] == 2
    assert dumped["spec"]["model"]["numKvHeads"] == 16
    assert "pipeline_parallel_size" not in str(dumped)
    assert DisaggDeployment.model_validate(dumped) == dd


def test_models_can_be_built_with_python_names() -> None:
    spec = DisaggDeploymentSpec(
        model=ModelSpec(name="m", num_layers=4, num_kv_heads=2, head_size=64),
        engine=EngineSpec(image="img", version="1.0"),
        prefill=PrefillSpec(pipeline_parallel_size=2),
        decode=DecodeSpec(),
        worker=WorkerSpec(image="worker"),
    )
    assert spec.kv_transfer == KVTransferSpec()
    assert spec.kv_transfer.connector is Connector.PUSH
    assert spec.model.layer_kinds() == (AttentionKind.FULL,) * 4


def test_defaults() -> None:
    document = valid_document()
    minimal = patched(document, {"spec": {"kvTransfer": DELETE}})
    spec = DisaggDeployment.model_validate(minimal).spec
    assert spec.kv_transfer.connector is Connector.PUSH
    assert [b.value for b in spec.kv_transfer.backends] == ["UCX"]
    assert spec.kv_transfer.side_channel_port == 5600
    assert spec.kv_transfer.rdma is None
    assert spec.worker.metrics_port == 9400
    assert spec.engine.attention_backend == "FLASH_ATTN"


def test_layer_pattern_marks_every_nth_layer_full() -> None:
    model = ModelSpec.model_validate(
        {"name": "m", "numLayers": 12, "numKvHeads": 8, "headSize": 128, "layerPattern": {"fullEvery": 6}}
    )
    kinds = model.layer_kinds()
    assert [i for i, kind in enumerate(kinds) if kind is AttentionKind.FULL] == [5, 11]
    assert kinds[0] is AttentionKind.SLIDING_WINDOW


def test_explicit_attention_kinds_reach_the_worker_geometry() -> None:
    kinds = ["SlidingWindow", "Full", "MLA", "Mamba"]
    document = valid_document(
        {
            "model": {"numLayers": 4, "layerPattern": DELETE, "attentionKinds": kinds},
            "prefill": {"pipelineParallelSize": 1},
        }
    )
    spec = DisaggDeployment.model_validate(document).spec
    geometry = model_geometry(spec)
    assert geometry.kinds == (LayoutKind.SLIDING_WINDOW, LayoutKind.FULL, LayoutKind.MLA, LayoutKind.MAMBA)
    assert geometry.layer_names[3] == "model.layers.3.self_attn.attn"


@pytest.mark.parametrize(
    ("spec_patch", "loc", "message"),
    [
        ({"model": {"numLayers": DELETE}}, ("spec", "model", "numLayers"), "Field required"),
        (
            {"prefill": {"tensorParallelSize": 0}},
            ("spec", "prefill", "tensorParallelSize"),
            "greater than or equal to 1",
        ),
        ({"prefill": {"tensorParallelsize": 2}}, ("spec", "prefill", "tensorParallelsize"), "Extra inputs"),
        ({"kvTransfer": {"connector": "push"}}, ("spec", "kvTransfer", "connector"), "'Push' or 'Pull'"),
        (
            {"kvTransfer": {"sideChannelPort": 0}},
            ("spec", "kvTransfer", "sideChannelPort"),
            "greater than or equal",
        ),
        ({"engine": {"version": 0.14}}, ("spec", "engine", "version"), "valid string"),
        (
            {"model": {"layerNameTemplate": "model.layers.self_attn"}},
            ("spec", "model", "layerNameTemplate"),
            "pattern",
        ),
        (
            {"model": {"attentionKinds": ["Full"] * 62}},
            ("spec", "model"),
            "either layerPattern or attentionKinds",
        ),
        (
            {"model": {"layerPattern": DELETE, "attentionKinds": ["Full", "SlidingWindow"]}},
            ("spec", "model"),
            "attentionKinds has 2 entries but numLayers is 62",
        ),
        (
            {"decode": {"overrides": {"dtype": "fp16"}}},
            ("spec", "decode", "overrides", "dtype"),
            "'bfloat16'",
        ),
    ],
)
def test_validation_errors_name_the_field(
    spec_patch: dict[str, Any], loc: tuple[str, ...], message: str
) -> None:
    errors = _errors(valid_document(spec_patch))
    assert any(error_loc == loc and message in msg for error_loc, msg in errors), errors


def test_api_version_and_kind_are_checked() -> None:
    document = valid_document()
    wrong = patched(document, {"apiVersion": "disagg.io/v1"})
    assert _errors(wrong)[0][0] == ("apiVersion",)
    wrong_kind = patched(document, {"kind": "Deployment"})
    assert _errors(wrong_kind)[0][0] == ("kind",)


def test_specs_are_immutable() -> None:
    spec = DisaggDeployment.model_validate(valid_document()).spec
    with pytest.raises(ValidationError):
        spec.prefill.replicas = 3


def test_condition_reason_must_be_camel_case() -> None:
    base = {
        "type": "Compatible",
        "status": "False",
        "message": "",
        "lastTransitionTime": "2026-11-30T09:00:00Z",
    }
    assert (
        Condition.model_validate({**base, "reason": "DecodePipelineParallel"}).reason
        == "DecodePipelineParallel"
    )
    with pytest.raises(ValidationError, match="reason"):
        Condition.model_validate({**base, "reason": "decode pp > 1"})
    with pytest.raises(ValidationError, match="status"):
        Condition.model_validate({**base, "reason": "X", "status": "Maybe"})


def test_metadata_keeps_fields_the_operator_does_not_read() -> None:
    document = patched(load(VALID_EXAMPLE), {"metadata": {"uid": "u-1", "resourceVersion": "7"}})
    dd = DisaggDeployment.model_validate(document)
    assert dd.metadata.uid == "u-1"
    assert dd.to_dict()["metadata"]["resourceVersion"] == "7"
