"""One side channel per engine, on the head pod: how peers are addressed, what the builders tell each stage,
and what a payload itself shows (connector version, backend), read from vLLM's own golden vectors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from built import container, env, objects
from dd_specs import spec
from test_kv_report import built_pods, sidecar_config

from disagg.worker.contracts.payload_facts import live_differences, payload_facts, prediction_differences
from disagg.worker.contracts.pod_contract import SIDECAR_CONTAINER
from disagg.worker.contracts.topology import WorkerEndpoint
from disagg.worker.kv import wire
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
    assert other[0].startswith("a factor the payload does not show: one of vllm_version")


# --- mismatch reasons name only what the payloads or the spec show ------------------------------------------


def golden_factors(version: str, case: str) -> dict[str, Any]:
    """The factors vLLM hashed for a golden case, as captured from its own `hash_factors` call."""
    cases = json.loads((GOLDEN / version / "compat_hash_cases.json").read_text())["cases"]
    factors: dict[str, Any] = next(c["factors"] for c in cases if c["id"] == case)
    return factors


# vLLM 0.32.0's own pp1_decode_hma payload: Gemma 3 1B in bfloat16, FLASH_ATTN, its hash this case's.
BF16_CASE = "gemma3_1b_push_pp1_tp2_decode"


def variant(version: str, factors: dict[str, Any], **changes: Any) -> bytes:
    """The release's real pp1_decode_hma payload with some metadata fields changed, re-encoded by the
    project's wire encoder at that release's connector version and hashed from `factors`."""
    meta = wire.decode_agent_metadata(
        wire.decode_payload_envelope(golden(version, "pp1_decode_hma")).agent_metadata_bytes
    )
    changed = msgspec.structs.replace(meta, **changes)
    return wire.encode_handshake_payload(
        changed, wire.compat_hash(factors), connector_version=factors["nixl_connector_version"]
    )


def test_the_golden_payload_is_the_bf16_case_hash() -> None:
    # The tests below lean on this: the golden bytes really are that engine's, hash and all.
    facts = payload_facts(golden("0.32.0", "pp1_decode_hma"))
    assert facts.compatibility_hash == wire.compat_hash(golden_factors("0.32.0", BF16_CASE))
    assert (facts.block_lens, facts.block_size, facts.kv_cache_layout) == ((16384,) * 4, 16, "LBHNC")


def test_a_bf16_peer_of_the_same_release_is_named_by_its_dtype_never_its_version() -> None:
    # The case: a float32 engine as the spec says and a decoder started with --dtype bfloat16, both
    # on vLLM 0.32.0.
    spec = {**golden_factors("0.32.0", BF16_CASE), "dtype": "torch.float32"}
    here = payload_facts(variant("0.32.0", spec, block_lens=[32768] * 4, block_strides=[32768] * 4))
    peer = payload_facts(golden("0.32.0", "pp1_decode_hma"))
    told = live_differences(here, peer, spec)
    assert told == [
        "the KV dtype (dtype, or cache_dtype where set), likely, by block_lens: 2048 KV bytes per token "
        "here, 1024 there (block_lens 32768 here, 16384 there at block size 16, backend 'FLASH_ATTN' and "
        "layout 'LBHNC' on both), what torch.float32 (the spec's) here against bfloat16 or float16 there "
        "gives; otherwise num_kv_heads x head_size is 2 times as large here",
        "this engine's hash is the spec's prediction with vLLM 0.32.0; the peer's is the prediction with no "
        "known release, so the peer departs from the spec in more than the release",
    ]
    assert not any("version" in line for line in told)
    # From the decoder's side the spec's element is the peer's; without the spec both widths are inferred.
    (named, _) = live_differences(peer, here, spec)
    assert "what bfloat16 or float16 here against torch.float32 (the spec's) there gives" in named
    (bare,) = live_differences(here, peer)
    assert (
        "what float32 here against bfloat16 or float16 there; or bfloat16 or float16 here against fp8" in bare
    )


def test_a_block_len_ratio_no_dtype_gives_names_the_head_shape() -> None:
    factors = golden_factors("0.32.0", BF16_CASE)
    here = payload_facts(golden("0.32.0", "pp1_decode_hma"))
    peer = payload_facts(variant("0.32.0", {**factors, "num_kv_heads": 3}, block_lens=[49152] * 4))
    (named,) = live_differences(here, peer)
    assert named.startswith(
        "num_kv_heads x head_size, by block_lens: 1024 KV bytes per token here, 3072 there"
    )
    assert "3 times as large there, which no dtype change gives alone" in named


def test_same_release_and_block_lens_list_the_factors_the_payloads_do_not_show() -> None:
    # Another --model string, the mismatch that leaves every visible field equal.
    spec = golden_factors("0.32.0", BF16_CASE)
    here = payload_facts(golden("0.32.0", "pp1_decode_hma"))
    peer = payload_facts(variant("0.32.0", {**spec, "model": "/models/gemma-3-1b-it"}))
    told = live_differences(here, peer, spec)
    assert told[0] == (
        "a factor the payloads do not show: one of vllm_version (the exact release string), "
        "nixl_connector_version (14 and 15 write the same fields), model (the raw --model string: a repo id "
        "and a local path differ), dtype or cache_dtype only as bfloat16 against float16, or under one "
        "cache_dtype, num_kv_heads and head_size only with the same product, num_hidden_layers, "
        "is_hma_enabled, speculative_config, transfer_mode"
    )
    assert told[1].startswith("this engine's hash is the spec's prediction with vLLM 0.32.0; the peer's")
    assert not any(line.startswith("vLLM version") for line in told)


def test_two_pp_stages_holding_other_layers_are_not_blamed_on_their_block_lens() -> None:
    # A PP stage's regions are other layers than a PP1 decoder's: their block_lens pair up with nothing.
    stage = wire.decode_agent_metadata(
        wire.decode_payload_envelope(golden("0.32.0", "pp2_stage1_prefill_hma")).agent_metadata_bytes
    )
    other = msgspec.structs.replace(stage, block_lens=[8192] * 4)
    peer = payload_facts(wire.encode_handshake_payload(other, "0" * 64, connector_version=14))
    (told,) = live_differences(payload_facts(golden("0.32.0", "pp1_decode_hma")), peer)
    assert told.startswith("a factor the payloads do not show: one of vllm_version") and ", dtype, " in told


def test_another_backend_is_named_and_its_block_lens_are_not_compared() -> None:
    factors = golden_factors("0.32.0", BF16_CASE)
    here = payload_facts(golden("0.32.0", "pp1_decode_hma"))
    peer = payload_facts(
        variant(
            "0.32.0",
            {**factors, "attn_backend_name": "CPU_ATTN"},
            attn_backend_name="CPU_ATTN",
            block_lens=[8192] * 4,
        )
    )
    assert live_differences(here, peer) == ["attention backend 'FLASH_ATTN' here, 'CPU_ATTN' there"]


def test_different_releases_are_named_by_field_set_and_by_hash() -> None:
    new = golden_factors("0.32.0", BF16_CASE)
    old = {**new, "vllm_version": "0.31.0", "nixl_connector_version": 13}
    here = payload_facts(golden("0.32.0", "pp1_decode_hma"))
    peer = payload_facts(variant("0.31.0", old))
    assert live_differences(here, peer, new) == [
        "vLLM version: this engine runs vLLM 0.32.0, the peer vLLM 0.31.0 (by their hashes)",
        "NIXL connector version 14 or 15 here, 13 there (by the metadata's fields): the engines run "
        "different vLLM releases",
    ]
    # 0.32 and 0.33 write the same fields: only the hashes, each the spec's with one release, tell them apart.
    newer = payload_facts(variant("0.33.0", {**new, "vllm_version": "0.33.0", "nixl_connector_version": 15}))
    assert live_differences(here, newer, new) == [
        "vLLM version: this engine runs vLLM 0.32.0, the peer vLLM 0.33.0 (by their hashes)"
    ]
