"""The sidecar's peer check against real side channels serving real NIXL agent metadata.

Each case builds two workers from topology files as the operator writes them (real `LocalKV`, a real NIXL
agent, a real pool), serves one's handshake payload on a real side channel, and checks it from the other:
the verdict must be the push connector's, reason for reason.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from disagg.rig.local import free_port
from disagg.rig.status_sidecar import registered_kv
from disagg.worker.connector.push import LocalKV
from disagg.worker.connector.side_channel import SideChannelServer
from disagg.worker.kv import wire
from disagg.worker.reporting.peer_check import Peer, PeerResult, check_peer, summarize
from disagg.worker.sidecar.config import SidecarConfig, from_env

HOST = "127.0.0.1"
PREFILL_POD = "tiny-prefill-0-1"
HEAD_POD = "tiny-prefill-0-0"
DECODE_POD = "tiny-decode-5d8f-x2k"


def topology(**changes: Any) -> dict[str, Any]:
    """Six layers (5:1-like sliding/full), PP2 prefill: stage 0 holds layers 0-2, stage 1 layers 3-5."""
    model = {
        "layerKinds": ["sliding_window", "sliding_window", "full"] * 2,
        "numKVHeads": 2,
        "headSize": 16,
        "dtypeBytes": 2,
        "name": "tiny",
        "dtype": "float16",
        **changes.pop("model", {}),
    }
    return {
        "transferMode": "push",
        "blockSize": 16,
        "packed": False,
        "prefillTensorParallelSize": 1,
        "decodeTensorParallelSize": 1,
        "stages": [
            {"stage": 0, "startLayer": 0, "endLayer": 3},
            {"stage": 1, "startLayer": 3, "endLayer": 6},
        ],
        "model": model,
        **changes,
    }


def config(tmp_path: Path, role: str, pod: str, doc: dict[str, Any], **env: str) -> SidecarConfig:
    path = tmp_path / f"{pod}-{secrets.token_hex(2)}.json"
    path.write_text(json.dumps(doc))
    return from_env(
        {
            "DISAGG_ROLE": role,
            "DISAGG_TOPOLOGY_FILE": str(path),
            "POD_NAME": pod,
            "POD_IP": HOST,
            "DISAGG_SIDE_CHANNEL_PORT": str(free_port()),
            **env,
        }
    )


@contextlib.contextmanager
def worker(cfg: SidecarConfig) -> Iterator[tuple[LocalKV, SideChannelServer]]:
    pool = Path("/dev/shm") / f"disagg-test-peer-{cfg.engine_id}-{secrets.token_hex(4)}"
    with registered_kv(cfg, 2, pool) as local:
        server = SideChannelServer(cfg.side_channel_host, cfg.side_channel_port)
        server.set_payload(cfg.pp_rank, cfg.tp_rank, local.handshake_payload())
        with server:
            yield local, server


@contextlib.contextmanager
def engine(*cfgs: SidecarConfig) -> Iterator[SideChannelServer]:
    """One engine's workers with one side channel, at the first's address, serving every worker's payload:
    a PP prefill's head pod answering for every stage, as vLLM's EngineCore does."""
    with contextlib.ExitStack() as stack:
        locals_ = [
            stack.enter_context(
                registered_kv(cfg, 2, Path("/dev/shm") / f"disagg-test-engine-{secrets.token_hex(4)}")
            )
            for cfg in cfgs
        ]
        server = SideChannelServer(cfgs[0].side_channel_host, cfgs[0].side_channel_port)
        for cfg, local in zip(cfgs, locals_, strict=True):
            server.set_payload(cfg.pp_rank, cfg.tp_rank, local.handshake_payload())
        with server:
            yield server


def peer_of(cfg: SidecarConfig, pod: str, *, engine_id: str | None = None, port: int | None = None) -> Peer:
    stage = cfg.pp_rank
    return Peer(pod, cfg.role, stage, engine_id or cfg.engine_id, HOST, port or cfg.side_channel_port)


def check_stage_against_decoder(
    tmp_path: Path, prefill_doc: dict[str, Any], decode_doc: dict[str, Any], **peer: Any
) -> PeerResult:
    prefill = config(tmp_path, "prefill", PREFILL_POD, prefill_doc)
    decode = config(tmp_path, "decode", DECODE_POD, decode_doc)
    with worker(prefill) as (local, _), worker(decode):
        target = peer_of(decode, DECODE_POD, **peer)
        return PeerResult(target, check_peer(prefill, local, target, timeout_s=2.0))


def test_a_matching_decoder_is_accepted_by_the_prefill_stage(tmp_path: Path) -> None:
    result = check_stage_against_decoder(tmp_path, topology(), topology())
    assert result.error is None
    prefill = config(tmp_path, "prefill", PREFILL_POD, topology())
    outcome = summarize(prefill, [result], [])
    assert (outcome.status, outcome.reason) == ("True", "HandshakesSucceeded")
    assert f"decode pod {DECODE_POD}" in outcome.message


def test_a_decoder_of_another_engine_version_is_refused_with_the_hash(tmp_path: Path) -> None:
    factors = wire.compat_factors(
        vllm_version="0.32.0",
        model="tiny",
        dtype="float16",
        num_kv_heads=2,
        head_size=16,
        num_hidden_layers=6,
        attn_backend_name="FLASH_ATTN",
        is_hma_enabled=True,
        transfer_mode="push",
        nixl_connector_version=14,
    )
    other = wire.compat_hash(factors)
    result = check_stage_against_decoder(
        tmp_path, topology(), topology(compatibilityHashes={"decode": other})
    )
    assert result.error is not None
    assert result.error.reason == "CompatibilityHashMismatch"
    assert other in result.error.message


def test_a_decoder_on_connector_version_11_is_refused_as_a_version_mismatch(tmp_path: Path) -> None:
    prefill = config(tmp_path, "prefill", PREFILL_POD, topology())
    assert prefill.compat_factors is not None
    v11 = wire.compat_hash({**prefill.compat_factors, "nixl_connector_version": 11})
    result = check_stage_against_decoder(tmp_path, topology(), topology(compatibilityHashes={"decode": v11}))
    assert result.error is not None
    assert result.error.reason == "ConnectorVersionMismatch"
    assert "version 11" in result.error.message


def test_a_stage_whose_layer_names_the_decoder_lacks_is_refused_with_missing_layers(tmp_path: Path) -> None:
    renamed = topology(model={"layerNameTemplate": "model.language_model.layers.{i}.self_attn.attn"})
    result = check_stage_against_decoder(tmp_path, renamed, topology())
    assert result.error is not None
    assert result.error.reason == "MissingLayers"
    assert "model.language_model.layers.3.self_attn.attn" in result.error.message


def test_a_decoder_with_another_block_size_is_refused(tmp_path: Path) -> None:
    result = check_stage_against_decoder(tmp_path, topology(), topology(blockSize=32))
    assert result.error is not None
    assert result.error.reason == "BlockSizeMismatch"


def test_a_decoder_with_other_region_geometry_is_refused_when_the_hash_check_is_off(tmp_path: Path) -> None:
    # No model name: no hash, so only the geometry can tell that the decoder's KV heads are bigger.
    no_hash: dict[str, Any] = {"name": None, "dtype": None}
    result = check_stage_against_decoder(
        tmp_path, topology(model=no_hash), topology(model={**no_hash, "headSize": 32})
    )
    assert result.error is not None
    assert result.error.reason == "RegionGeometryMismatch"


def test_a_side_channel_answering_for_another_engine_is_refused(tmp_path: Path) -> None:
    result = check_stage_against_decoder(tmp_path, topology(), topology(), engine_id="tiny-decode-other")
    assert result.error is not None
    assert result.error.reason == "EngineIdMismatch"


def test_a_silent_peer_is_unreachable_and_named_in_the_condition(tmp_path: Path) -> None:
    prefill = config(tmp_path, "prefill", PREFILL_POD, topology())
    with worker(prefill) as (local, _):
        silent = Peer(DECODE_POD, "decode", 0, DECODE_POD, HOST, free_port())
        result = PeerResult(silent, check_peer(prefill, local, silent, timeout_s=0.5))
    assert result.error is not None and result.error.reason == "PeerUnreachable"
    outcome = summarize(prefill, [result], [])
    assert (outcome.status, outcome.reason) == ("False", "PeerUnreachable")
    assert f"decode pod {DECODE_POD} at {HOST}:{silent.port}" in outcome.message


def test_the_decoder_checks_each_prefill_stage_by_hash_and_engine_id(tmp_path: Path) -> None:
    decode = config(tmp_path, "decode", DECODE_POD, topology())
    stage1 = config(tmp_path, "prefill", PREFILL_POD, topology())
    other = config(tmp_path, "prefill", PREFILL_POD, topology(compatibilityHashes={"prefill": "0" * 64}))
    with worker(stage1), worker(other):
        good = peer_of(stage1, PREFILL_POD)
        bad = peer_of(other, PREFILL_POD)
        assert good.engine_id == "tiny-prefill-0" and good.stage == 1
        assert check_peer(decode, None, good, timeout_s=2.0) is None
        refused = check_peer(decode, None, bad, timeout_s=2.0)
    assert refused is not None and refused.reason == "CompatibilityHashMismatch"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_pod_without_peers_reports_unknown(tmp_path: Path, role: str) -> None:
    pod = PREFILL_POD if role == "prefill" else DECODE_POD
    outcome = summarize(config(tmp_path, role, pod, topology()), [], [])
    assert (outcome.status, outcome.reason) == ("Unknown", "NoPeers")


@pytest.mark.parametrize("connector_version", [15, 16])
def test_a_decoder_with_other_cache_groups_is_refused_without_layer_name_routing(
    tmp_path: Path, connector_version: int
) -> None:
    # Before connector version 16 a PP1 stage does not route by layer name: its regions pair with the
    # decoder's by index, so both must lay out the same KV cache groups (the producer's plan,
    # `routing.plan_transfer`, refuses otherwise). From 16 (vLLM 0.34) every stage pairs by layer name, so
    # the decoder's region order and group layout no longer decide the pairing.
    one_stage = [{"stage": 0, "startLayer": 0, "endLayer": 6}]
    doc = topology(stages=one_stage, connectorVersion=connector_version)
    prefill = config(tmp_path, "prefill", PREFILL_POD, doc, DISAGG_PP_RANK="0")
    decode = config(tmp_path, "decode", DECODE_POD, doc)
    with worker(prefill) as (local, _), worker(decode) as (remote, server):
        meta = remote.metadata()
        regrouped = msgspec.structs.replace(meta, region_group_ids=list(range(len(meta.kv_caches_base_addr))))
        payload = wire.encode_handshake_payload(regrouped, decode.compat_hash or "", connector_version)
        server.set_payload(decode.pp_rank, decode.tp_rank, payload)
        error = check_peer(prefill, local, peer_of(decode, DECODE_POD), timeout_s=2.0)
    assert local.layer_routing is (connector_version == 16)
    if connector_version == 16:
        assert error is None
        return
    assert error is not None
    assert error.reason == "RegionGeometryMismatch"
    assert "region group ids differ" in error.message
