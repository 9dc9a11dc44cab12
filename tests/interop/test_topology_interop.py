"""One side channel per engine, on the head, against vLLM's own code: vLLM's real `_nixl_handshake` client
asks a disagg PP2 prefill for every `(pp, tp)` at one address (the head's transfer sidecar republishing
stage 1) and a disagg decoder; a watching sidecar faces vLLM's real listener serving payloads built by
vLLM's classes with vLLM's hash, and names the release when the decoder runs another one."""

from __future__ import annotations

import contextlib
import itertools
import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _vllm_peer import PeerFactory, VllmPeer

from disagg.rig.local import free_port
from disagg.rig.status_sidecar import registered_kv
from disagg.worker.connector.push import LocalKV
from disagg.worker.connector.side_channel import SideChannelServer
from disagg.worker.contracts.pod_contract import ROLE_LABEL, SIDE_CHANNEL_PORT_NAME, SIDECAR_CONTAINER
from disagg.worker.kv import wire
from disagg.worker.reporting.watch import watch_round
from disagg.worker.sidecar.config import SidecarConfig, from_env
from disagg.worker.sidecar.republisher import Republisher

HOST = "127.0.0.1"
MODEL = "google/gemma-3-1b-it"
HEAD_POD, STAGE1_POD, DECODE_POD = "tiny-prefill-0-0", "tiny-prefill-0-1", "tiny-decode-5d8f-x2k"
PREFILL_ENGINE = "tiny-prefill-0"
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(6)]


@dataclass(frozen=True)
class VllmHash:
    """vLLM's compatibility hash of a `vllm serve` argv on one release, and the factors it hashed."""

    digest: str
    factors: dict[str, Any]


def vllm_hash(peer: VllmPeer, role: str) -> VllmHash:
    kv = {"kv_connector": "NixlPushConnector", "kv_role": f"kv_{role}"}
    argv = ["--model", MODEL, "--block-size", "16", "--kv-transfer-config", json.dumps(kv)]
    found = peer.call("config_hash", argv=argv, attn_backend_name="FLASH_ATTN", transfer_mode="push")
    return VllmHash(found["hash"], found["factors"])


@pytest.fixture(scope="module")
def hash33(vllm_peer: VllmPeer) -> VllmHash:
    return vllm_hash(vllm_peer, "producer")


def topology(prefill_tp: int, decode_tp: int, prediction: VllmHash) -> dict[str, Any]:
    return {
        "transferMode": "push",
        "blockSize": 16,
        "prefillTensorParallelSize": prefill_tp,
        "decodeTensorParallelSize": decode_tp,
        "stages": [
            {"stage": 0, "startLayer": 0, "endLayer": 3},
            {"stage": 1, "startLayer": 3, "endLayer": 6},
        ],
        "model": {
            "layerKinds": ["sliding_window", "sliding_window", "full"] * 2,
            "numKVHeads": 2,
            "headSize": 16,
            "dtypeBytes": 2,
        },
        "compatibilityHashes": {"prefill": prediction.digest, "decode": prediction.digest},
        "compatibilityFactors": {"prefill": prediction.factors, "decode": prediction.factors},
    }


def config(tmp_path: Path, role: str, pod: str, doc: dict[str, Any], port: int, **env: str) -> SidecarConfig:
    path = tmp_path / f"{pod}-{secrets.token_hex(2)}.json"
    path.write_text(json.dumps(doc))
    return from_env(
        {
            "DISAGG_ROLE": role,
            "DISAGG_TOPOLOGY_FILE": str(path),
            "POD_NAME": pod,
            "POD_IP": HOST,
            "DISAGG_SIDE_CHANNEL_PORT": str(port),
            **env,
        }
    )


@contextlib.contextmanager
def disagg_worker(cfg: SidecarConfig) -> Iterator[tuple[LocalKV, SideChannelServer]]:
    """A disagg worker: a real LocalKV with a real NIXL agent, its payload on its own side channel."""
    pool = Path("/dev/shm") / f"disagg-test-interop-{secrets.token_hex(4)}"
    with registered_kv(cfg, 2, pool) as local:
        server = SideChannelServer(cfg.side_channel_host, cfg.side_channel_port)
        server.set_payload(cfg.pp_rank, cfg.tp_rank, local.handshake_payload())
        with server:
            yield local, server


def layers_of(metadata: dict[str, Any]) -> list[str]:
    return sorted(itertools.chain.from_iterable(metadata["region_members"]))


def test_vllm_handshakes_every_rank_of_a_disagg_pp2_prefill_at_its_head(
    vllm_peer: VllmPeer, hash33: VllmHash, tmp_path: Path
) -> None:
    doc = topology(1, 1, hash33)
    head_port, stage1_port = free_port(), free_port()
    stage_pods = json.dumps([{"ppRank": 1, "tpRank": 0, "host": HOST, "port": stage1_port}])
    head = config(tmp_path, "prefill", HEAD_POD, doc, head_port, DISAGG_ENGINE_WORKERS=stage_pods)
    stage1 = config(tmp_path, "prefill", STAGE1_POD, doc, stage1_port, DISAGG_ENGINE_WORKERS=stage_pods)
    assert stage1.republished_workers == ()
    with disagg_worker(head) as (_, head_server), disagg_worker(stage1):
        republisher = Republisher(head, head_server).start()
        try:
            deadline = time.monotonic() + 30
            while republisher.missing and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not republisher.missing
            full = vllm_peer.call(
                "handshake",
                host=HOST,
                port=head_port,
                compat_hash=hash33.digest,
                remote_tp_size=1,
                expected_engine_id=PREFILL_ENGINE,
                remote_pp_size=2,
            )
            notif = vllm_peer.call(
                "handshake",
                host=HOST,
                port=head_port,
                compat_hash=hash33.digest,
                remote_tp_size=1,
                expected_engine_id=PREFILL_ENGINE,
                remote_pp_size=2,
                notif_agents_only=True,
            )
        finally:
            republisher.stop()
        assert head_server.rejected == 0
    assert sorted(full["agents"]) == sorted(notif["agents"]) == ["0,0", "1,0"]
    # vLLM decoded each stage's metadata with its own typed decoder: stage 0 holds layers 0-2, stage 1 3-5.
    members = [layers_of(added["metadata"]) for added in full["added_full"]]
    assert members == [sorted(LAYERS[:3]), sorted(LAYERS[3:])]
    assert {added["metadata"]["engine_id"] for added in full["added_full"]} == {PREFILL_ENGINE}


def test_vllm_handshakes_a_disagg_decoder(vllm_peer: VllmPeer, hash33: VllmHash, tmp_path: Path) -> None:
    decode = config(tmp_path, "decode", DECODE_POD, topology(1, 1, hash33), free_port())
    with disagg_worker(decode):
        found = vllm_peer.call(
            "handshake",
            host=HOST,
            port=decode.side_channel_port,
            compat_hash=hash33.digest,
            remote_tp_size=1,
            expected_engine_id=DECODE_POD,
        )
    assert list(found["agents"]) == ["0,0"]
    assert layers_of(found["added_full"][0]["metadata"]) == sorted(LAYERS)


def vllm_payloads(
    peer: VllmPeer, engine_id: str, ranks: list[tuple[int, int]], digest: str
) -> dict[str, bytes]:
    """Each rank's payload built by the release's own NixlAgentMetadata and NixlHandshakePayload."""
    out = {}
    for pp, tp in ranks:
        meta = wire.NixlAgentMetadata(
            engine_id=engine_id,
            agent_metadata=f"agent-{pp}-{tp}".encode(),
            kv_caches_base_addr=[0x7F0000000000 + tp * 0x1000000],
            device_id=tp,
            num_blocks=64,
            block_lens=[16384],
            block_strides=[16384],
            kv_cache_layout="LBHNC",
            block_size=16,
            ssm_sizes=(0, 0),
            attn_backend_name="FLASH_ATTN",
            physical_blocks_per_logical_kv_block=1,
        )
        fields = {name: getattr(meta, name) for name in wire.metadata_fields(peer.connector_version)}
        inner = peer.call("metadata_encode", fields=fields)
        out[f"{pp},{tp}"] = peer.call("payload_encode", compatibility_hash=digest, agent_metadata_bytes=inner)
    return out


@contextlib.contextmanager
def vllm_listener(peer: VllmPeer, payloads: dict[str, bytes], port: int) -> Iterator[int]:
    handle = peer.call("listener_start", payloads=payloads, host=HOST, port=port)
    try:
        yield handle
    finally:
        peer.call("listener_stop", handle=handle)


def pod(name: str, role: str, ip: str, port: int) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {ROLE_LABEL: role}},
        "spec": {
            "containers": [
                {"name": "engine", "ports": [{"name": SIDE_CHANNEL_PORT_NAME, "containerPort": port}]},
                {"name": SIDECAR_CONTAINER},
            ]
        },
        "status": {"podIP": ip},
    }


PREFILL_RANKS = [(pp, tp) for pp in range(2) for tp in range(2)]
DECODE_RANKS = [(0, 0), (0, 1)]


@pytest.mark.parametrize("decode_release", ["0.33.0", "0.32.0"])
def test_a_decode_watcher_checks_a_pp2_tp2_vllm_prefill_through_its_head(
    vllm_peers: PeerFactory, hash33: VllmHash, tmp_path: Path, decode_release: str
) -> None:
    prefill_peer, decode_peer = vllm_peers("0.33.0"), vllm_peers(decode_release)
    decode_hash = vllm_hash(decode_peer, "consumer")
    prefill_port, decode_port = free_port(), free_port()
    watcher = config(tmp_path, "decode", DECODE_POD, topology(2, 2, hash33), decode_port)
    prefill = vllm_payloads(prefill_peer, PREFILL_ENGINE, PREFILL_RANKS, hash33.digest)
    decode = vllm_payloads(decode_peer, DECODE_POD, DECODE_RANKS, decode_hash.digest)
    # Stage 1's pod has its own IP but no side channel: it must be asked for through the head.
    pods = [pod(HEAD_POD, "prefill", HOST, prefill_port), pod(STAGE1_POD, "prefill", "127.0.0.2", 1)]
    with (
        vllm_listener(prefill_peer, prefill, prefill_port) as p,
        vllm_listener(decode_peer, decode, decode_port),
    ):
        outcome = watch_round(watcher, DECODE_POD, pods, timeout_s=3.0)
        # Only served ranks were asked for: vLLM's listeners are alive.
        assert prefill_peer.call("listener_alive", handle=p)
    if decode_release == "0.33.0":
        assert (outcome.status, outcome.reason) == ("True", "HandshakesSucceeded"), outcome.message
        assert f"prefill stage 0 (pod {HEAD_POD})" in outcome.message
        assert f"prefill stage 1 (pod {STAGE1_POD})" in outcome.message
        return
    assert decode_hash.digest != hash33.digest
    assert (outcome.status, outcome.reason) == ("False", "CompatibilityHashMismatch"), outcome.message
    assert "this engine runs vLLM 0.32.0, the peer vLLM 0.33.0" in outcome.message
    assert f"this pod's own engine {DECODE_POD}" in outcome.message and PREFILL_ENGINE in outcome.message
    assert [r.error.reason for r in outcome.refusals if r.error] == ["CompatibilityHashMismatch"] * 2
