"""The topology document: what the builders encode is what the sidecar decodes, and versions are refused."""

from __future__ import annotations

import json
from typing import Any

import pytest

from disagg.worker.contracts.topology import (
    TOPOLOGY_VERSION,
    ModelDocument,
    StageDocument,
    TopologyDocument,
    WorkerEndpoint,
    decode_topology,
    encode_topology,
)
from disagg.worker.kv.errors import WorkerConfigError
from disagg.worker.kv.layout import AttentionKind


def document() -> TopologyDocument:
    return TopologyDocument(
        transfer_mode="push",
        block_size=16,
        prefill_tensor_parallel_size=2,
        stages=(
            StageDocument(stage=0, start_layer=0, end_layer=2),
            StageDocument(stage=1, start_layer=2, end_layer=3, layers=("model.layers.2.self_attn.attn",)),
        ),
        model=ModelDocument(
            layer_kinds=(AttentionKind.SLIDING_WINDOW, AttentionKind.SLIDING_WINDOW, AttentionKind.FULL),
            num_kv_heads=2,
            head_size=16,
            dtype_bytes=4,
            name="tiny",
            dtype="float32",
        ),
        workers={"prefill": (WorkerEndpoint(pp_rank=1, host="10.0.0.7", port=5600),)},
        kv_lease_duration_seconds=60,
    )


def test_what_is_encoded_is_what_is_decoded() -> None:
    raw = json.loads(encode_topology(document()))
    assert raw["version"] == TOPOLOGY_VERSION == 1
    assert raw["model"]["numKVHeads"] == 2 and raw["model"]["layerKinds"][2] == "full"
    assert raw["stages"][1] == {
        "stage": 1,
        "startLayer": 2,
        "endLayer": 3,
        "routingMode": None,
        "layers": ["model.layers.2.self_attn.attn"],
    }
    topology = decode_topology(raw)
    assert topology.stage_layers == (range(0, 2), range(2, 3))
    assert (topology.prefill_tp, topology.decode_tp, topology.block_size) == (2, 1, 16)
    assert topology.model.kinds[2] is AttentionKind.FULL
    assert [(w.pp_rank, w.tp_rank, w.host, w.port) for w in topology.workers["prefill"]] == [
        (1, 0, "10.0.0.7", 5600)
    ]
    assert topology.kv_lease_duration_s == 60 and topology.push_registration_timeout_s == 480


def test_a_document_written_before_versions_is_version_one() -> None:
    raw = json.loads(encode_topology(document()))
    del raw["version"]
    assert decode_topology(raw).prefill_pp == 2


@pytest.mark.parametrize("version", [2, 0, "1", True])
def test_an_unknown_version_is_refused(version: Any) -> None:
    raw = {**json.loads(encode_topology(document())), "version": version}
    with pytest.raises(WorkerConfigError) as caught:
        decode_topology(raw)
    assert caught.value.message == (
        f"topology: version {version!r} is not one this worker reads (it reads version 1): run a worker "
        "image as new as the operator that wrote it"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"blockSize": 0}, "topology: blockSize must be int >= 1, got 0"),
        ({"packed": "no"}, "topology: packed must be bool, got 'no'"),
        ({"stages": "x"}, "topology: stages must be a list, got 'x'"),
        ({"model": None}, "topology: model must be a mapping, got None"),
        (
            {"workers": {"prefill": [{"ppRank": 1, "host": "h"}]}},
            "topology: workers.<key>[0].port is missing",
        ),
        ({"kvLeaseDurationSeconds": "30"}, "topology: kvLeaseDurationSeconds must be float, got '30'"),
    ],
)
def test_malformed_documents_name_the_key(change: dict[str, Any], message: str) -> None:
    raw = {**json.loads(encode_topology(document())), **change}
    with pytest.raises(WorkerConfigError) as caught:
        decode_topology(raw)
    assert caught.value.message == message


def test_the_push_sidecar_refuses_a_mamba_hybrid_at_start() -> None:
    raw = json.loads(encode_topology(document()))
    raw["model"]["layerKinds"] = ["mamba", "mamba", "full"]
    with pytest.raises(WorkerConfigError) as caught:
        decode_topology(raw)
    assert caught.value.reason == "MambaStateNotSupported"
    assert caught.value.message.startswith("topology: the model has Mamba/SSM layers")
