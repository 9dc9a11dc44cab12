"""One side channel per engine, on the head pod: how peers are addressed, what the builders tell each stage,
and what a payload itself shows (connector version, backend), read from vLLM's own golden vectors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from dd_specs import spec
from test_builders import container, env, objects
from test_kv_report import built_pods, sidecar_config

from disagg.operator.builders import SIDECAR_CONTAINER
from disagg.worker.kv import wire
from disagg.worker.kv.payload_facts import live_differences, payload_facts, prediction_differences
from disagg.worker.kv.topology import WorkerEndpoint
from disagg.worker.reporting.peer_check import Peer, peers_from_pods, summarize, through_heads
from disagg.worker.sidecar.config import from_env

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "vllm"


def test_every_stage_of_a_prefill_engine_is_asked_for_at_its_head(tmp_path: Path) -> None:
    decode = sidecar_config(tmp_path, "decode", "gemma-decode-7c9-abcde")
    peers = through_heads(peers_from_pods(built_pods().values(), decode))
    assert [(p.pod, p.stage, p.host, p.head) for p in peers] == [
        ("gemma-prefill-0-0", 0, "10.0.0.1", None),
        ("gemma-prefill-0-1", 1, "10.0.0.1", "gemma-prefill-0-0"),
    ]
    assert peers[1].address == "10.0.0.1:5600 (the side channel of its head pod gemma-prefill-0-0)"


def test_a_stage_whose_head_has_no_ip_waits_for_the_head(tmp_path: Path) -> None:
    pods = built_pods()
    del pods["gemma-prefill-0-0"]["status"]["podIP"]
    decode = sidecar_config(tmp_path, "decode", "gemma-decode-7c9-abcde")
    peers = through_heads(peers_from_pods(pods.values(), decode))
    assert [p.host for p in peers] == [None, None]
    outcome = summarize(decode, [], peers)
    assert outcome.status == "Unknown"
    assert "prefill stage 1 (pod gemma-prefill-0-1)'s head pod gemma-prefill-0-0" in outcome.message


def test_a_stage_without_its_head_among_the_pods_has_no_address() -> None:
    stage = Peer("p-1", "prefill", 1, "p", "10.0.0.2", 5600)
    assert through_heads([stage]) == [Peer("p-1", "prefill", 1, "p", None, 5600)]


def test_vllm_prefill_stages_read_their_engine_at_the_head_pod() -> None:
    workload = objects(spec())["StatefulSet", "gemma-pp2-prefill-0"]
    sidecar = env(container(workload, SIDECAR_CONTAINER))
    assert sidecar["DISAGG_ENGINE_SIDE_CHANNEL_HOST"] == "gemma-pp2-prefill-0-0.gemma-pp2-prefill-0.ns1.svc"
    assert "DISAGG_ENGINE_WORKERS" not in sidecar
    decode = env(container(objects(spec())["Deployment", "gemma-pp2-decode"], SIDECAR_CONTAINER))
    assert "DISAGG_ENGINE_SIDE_CHANNEL_HOST" not in decode


def test_the_head_transfer_sidecar_is_told_the_other_stages_pods(tmp_path: Path) -> None:
    model = spec({"engine": {"image": "ghcr.io/disagg/reference-engine:0.1.0"}})
    workload = objects(model)["StatefulSet", "gemma-pp2-prefill-0"]
    sidecar = env(container(workload, SIDECAR_CONTAINER))
    workers = json.loads(sidecar["DISAGG_ENGINE_WORKERS"])
    assert workers == [
        {"ppRank": 1, "tpRank": 0, "host": "gemma-pp2-prefill-0-1.gemma-pp2-prefill-0.ns1.svc", "port": 5600}
    ]
    doc = {
        "transferMode": "push",
        "blockSize": 16,
        "stages": [{"startLayer": 0, "endLayer": 1}, {"startLayer": 1, "endLayer": 2}],
        "model": {"layerKinds": ["full"] * 2, "numKVHeads": 2, "headSize": 16, "dtypeBytes": 2},
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    base = {"DISAGG_ROLE": "prefill", "DISAGG_TOPOLOGY_FILE": str(path)}
    head = from_env({**base, "POD_NAME": "e-0", "DISAGG_ENGINE_WORKERS": sidecar["DISAGG_ENGINE_WORKERS"]})
    stage = from_env({**base, "POD_NAME": "e-1", "DISAGG_ENGINE_WORKERS": sidecar["DISAGG_ENGINE_WORKERS"]})
    assert head.republished_workers == (
        WorkerEndpoint(pp_rank=1, tp_rank=0, host=workers[0]["host"], port=5600),
    )
    assert stage.republished_workers == ()


def golden(version: str, case: str) -> bytes:
    return (GOLDEN / version / f"handshake_payload_{case}.msgpack").read_bytes()


@pytest.mark.parametrize(
    ("version", "connector"), [("0.31.0", "13"), ("0.32.0", "14 or 15"), ("0.33.0", "14 or 15")]
)
def test_the_connector_version_is_read_from_the_fields_vllm_sent(version: str, connector: str) -> None:
    facts = payload_facts(golden(version, "pp1_decode_hma"))
    assert facts.connector_version == connector
    assert facts.attn_backend_name is not None


def test_a_packed_payload_keeps_ple_block_len_and_packed_member_layouts() -> None:
    meta = json.loads((GOLDEN / "0.33.0" / "agent_metadata_ple_packed.json").read_text())["decoded"]
    facts = payload_facts(golden("0.33.0", "ple_packed"))
    assert facts.ple_block_len == meta["ple_block_len"] and facts.ple_block_len is not None
    assert facts.packed_member_layouts is not None
    assert {k: list(v) for k, v in facts.packed_member_layouts.items()} == {
        k: list(v) for k, v in meta["packed_member_layouts"].items()
    }


def test_live_payloads_of_two_releases_name_the_connector_version() -> None:
    old, new = (
        payload_facts(golden("0.31.0", "pp1_decode_hma")),
        payload_facts(golden("0.33.0", "pp1_decode_hma")),
    )
    (difference,) = live_differences(new, old)
    assert "NIXL connector version 14 or 15 here, 13 there" in difference


def test_a_prediction_on_connector_version_12_is_named_against_a_v15_engine() -> None:
    live = payload_facts(golden("0.33.0", "pp1_decode_hma"))
    factors: dict[str, Any] = wire.compat_factors(
        vllm_version="0.33.0",
        model="m",
        dtype="bfloat16",
        num_kv_heads=1,
        head_size=256,
        num_hidden_layers=26,
        attn_backend_name=live.attn_backend_name or "",
        is_hma_enabled=True,
        transfer_mode="push",
        nixl_connector_version=12,
    )
    (named,) = prediction_differences(factors, live)
    assert named.startswith("nixl_connector_version (the engine speaks 14 or 15")
    other = prediction_differences({**factors, "nixl_connector_version": 15}, live)
    assert other[0].startswith("one the payload does not show: vllm_version")
