"""The sidecar's configuration: environment plus topology file, and every contradiction named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from disagg.worker.contracts.topology import decode_topology
from disagg.worker.kv import wire
from disagg.worker.kv.errors import WorkerConfigError
from disagg.worker.kv.layout import AttentionKind
from disagg.worker.sidecar.config import from_env, load_topology


def topology(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "transferMode": "push",
        "blockSize": 16,
        "prefillTensorParallelSize": 2,
        "decodeTensorParallelSize": 1,
        "stages": [
            {"stage": 0, "startLayer": 0, "endLayer": 5, "routingMode": "LayerName"},
            {"stage": 1, "startLayer": 5, "endLayer": 9},
        ],
        "model": {
            "layerKinds": ["sliding_window", "sliding_window", "full"] * 3,
            "numKVHeads": 2,
            "headSize": 16,
            "dtypeBytes": 4,
            "name": "tiny",
            "dtype": "float32",
        },
        "workers": {"prefill": [{"ppRank": 1, "host": "10.0.0.7", "port": 5600}]},
        "someFutureKey": {"ignored": True},
    }
    doc.update(changes)
    return doc


def env_for(tmp_path: Path, doc: dict[str, Any], **env: str) -> dict[str, str]:
    path = tmp_path / "topology.json"
    path.write_text(json.dumps(doc))
    return {"DISAGG_TOPOLOGY_FILE": str(path), **env}


def test_prefill_identity_comes_from_the_statefulset_pod_name(tmp_path: Path) -> None:
    config = from_env(
        env_for(tmp_path, topology(), DISAGG_ROLE="prefill", POD_NAME="llm-prefill-0-1", POD_IP="10.0.0.7")
    )
    assert (config.engine_id, config.pp_rank, config.tp_rank) == ("llm-prefill-0", 1, 0)
    assert (config.pp_size, config.tp_size) == (2, 2)
    assert config.side_channel_host == "10.0.0.7"
    assert config.side_channel_port == 5600 and config.metrics_port == 9090
    assert not config.serves_engine and config.republished_workers == ()
    assert config.topology.layer_partition == (5, 4)
    assert config.topology.model.kinds[2] is AttentionKind.FULL
    factors = config.topology.compat_factors()
    assert factors is not None and config.compat_hash == wire.compat_hash(factors)
    push = config.push_config()
    assert (push.engine_id, push.tp_size, push.compat_hash) == ("llm-prefill-0", 2, config.compat_hash)


def test_stage_zero_republishes_the_other_stages(tmp_path: Path) -> None:
    config = from_env(env_for(tmp_path, topology(), DISAGG_ROLE="prefill", POD_NAME="llm-prefill-0-0"))
    assert config.serves_engine
    assert [(w.pp_rank, w.host, w.port) for w in config.republished_workers] == [(1, "10.0.0.7", 5600)]


def test_decode_is_one_stage_and_yaml_works(tmp_path: Path) -> None:
    path = tmp_path / "topology.yaml"
    import yaml

    path.write_text(yaml.safe_dump(topology(compatibilityHashes={"decode": "ab" * 32})))
    config = from_env(
        {"DISAGG_TOPOLOGY_FILE": str(path), "DISAGG_ROLE": "decode", "POD_NAME": "llm-decode-7c9-x"}
    )
    assert (config.engine_id, config.pp_rank, config.pp_size, config.tp_size) == ("llm-decode-7c9-x", 0, 1, 1)
    assert config.compat_hash == "ab" * 32 and config.compat_factors is None
    assert load_topology(path).prefill_pp == 2


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DISAGG_ROLE": "router"}, "DISAGG_ROLE must be one of ['prefill', 'decode'], got 'router'"),
        (
            {"DISAGG_ROLE": "prefill"},
            "DISAGG_ENGINE_ID is not set and there is no POD_NAME to derive it from",
        ),
        (
            {"DISAGG_ROLE": "prefill", "DISAGG_ENGINE_ID": "p"},
            "DISAGG_PP_RANK is not set and POD_NAME has no -<ordinal> to derive it from",
        ),
        (
            {"DISAGG_ROLE": "prefill", "POD_NAME": "p-2"},
            "DISAGG_PP_RANK=2 is outside the prefill pipeline of size 2",
        ),
        (
            {"DISAGG_ROLE": "decode", "POD_NAME": "d", "DISAGG_TP_RANK": "1"},
            "DISAGG_TP_RANK=1 is outside the decode TP size 1",
        ),
        (
            {"DISAGG_ROLE": "prefill", "POD_NAME": "p-0", "DISAGG_BLOCK_SIZE": "32"},
            "DISAGG_BLOCK_SIZE=32 contradicts the topology file's blockSize 16",
        ),
        (
            {"DISAGG_ROLE": "prefill", "POD_NAME": "p-0", "DISAGG_PIPELINE_PARALLEL_SIZE": "4"},
            "DISAGG_PIPELINE_PARALLEL_SIZE=4 contradicts the topology file's prefill pipeline size 2",
        ),
        (
            {"DISAGG_ROLE": "decode", "POD_NAME": "d", "DISAGG_METRICS_PORT": "http"},
            "DISAGG_METRICS_PORT='http' is not an integer",
        ),
    ],
)
def test_environment_contradictions_are_named(tmp_path: Path, env: dict[str, str], message: str) -> None:
    with pytest.raises(WorkerConfigError) as caught:
        from_env(env_for(tmp_path, topology(), **env))
    assert caught.value.message == message
    assert caught.value.reason == "InvalidWorkerConfig"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"transferMode": "pull"},
            "transferMode is 'pull'; the sidecar moves KV with the push connector only",
        ),
        ({"blockSize": "16"}, "blockSize must be int, got '16'"),
        ({"stages": []}, "stages is empty; a prefill engine has at least one stage"),
        (
            {"stages": [{"startLayer": 0, "endLayer": 4}, {"startLayer": 5, "endLayer": 10}]},
            "stages [(0, 4), (5, 10)] are not contiguous from layer 0 to 9",
        ),
        (
            {"stages": [{"startLayer": 0, "endLayer": 4}, {"startLayer": 4, "endLayer": 8}]},
            "layerPartition [4, 4] sums to 8 but the model has 9 layers",
        ),
        (
            {"stages": [{"startLayer": 0, "endLayer": 9, "layers": ["model.layers.0.self_attn.attn"]}]},
            "stages[0].layers",
        ),
        ({"model": {"numKVHeads": 2}}, "model.layerKinds is missing"),
        ({"workers": {"router": []}}, "workers.router must be a list under prefill or decode"),
    ],
)
def test_topology_problems_are_named(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(WorkerConfigError) as caught:
        decode_topology(topology(**changes))
    assert message in caught.value.message


def test_model_kind_typo_names_the_value() -> None:
    doc = topology()
    doc["model"] = {**doc["model"], "layerKinds": ["ful"] * 9}
    with pytest.raises(WorkerConfigError, match="'ful' is not a valid AttentionKind"):
        decode_topology(doc)


@pytest.mark.parametrize(("version", "connector"), [("0.31.0", 13), ("0.32.0", 14), ("0.33.0", 15)])
def test_the_sidecar_speaks_the_connector_version_of_the_release_its_spec_names(
    tmp_path: Path, version: str, connector: int
) -> None:
    import yaml

    from disagg.operator.api import DisaggDeployment
    from disagg.operator.builders.topology import topology_document
    from disagg.operator.naming import Owner
    from disagg.operator.policies.compat import evaluate, role_factors
    from disagg.worker.contracts.topology import encode_topology

    example = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "pp2-hma.yaml").read_text())
    example["spec"]["engine"].update(version=version, image=f"vllm/vllm-openai:v{version}")
    model = DisaggDeployment.model_validate(example).spec
    report = evaluate(model)
    assert report.plan is not None
    document = topology_document(model, Owner("dd", "ns", "uid", 1), report.plan, report.hashes)
    doc = json.loads(encode_topology(document))
    assert (doc["vllmVersion"], doc["connectorVersion"]) == (version, connector)
    config = from_env(env_for(tmp_path, doc, DISAGG_ROLE="prefill", POD_NAME="dd-prefill-0-1"))
    assert config.push_config().connector_version == connector
    # The sidecar's own hash factors are the operator's prediction, so a mismatch is explained, not generic.
    assert config.compat_factors == role_factors(model, "prefill")
    assert config.compat_hash == report.hashes["prefill"]


def test_a_document_without_a_release_reads_as_the_newest_connector_and_no_vllm(tmp_path: Path) -> None:
    config = from_env(env_for(tmp_path, topology(), DISAGG_ROLE="decode", POD_NAME="llm-decode-7c9-x"))
    assert config.topology.connector_version == wire.LATEST_CONNECTOR_VERSION
    factors = config.topology.compat_factors()
    assert factors is not None and factors["vllm_version"] == "disagg"
    with pytest.raises(WorkerConfigError, match="connectorVersion 12 is not a NIXL connector version"):
        decode_topology(topology(connectorVersion=12))
