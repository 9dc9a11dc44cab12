"""vLLM's real `_nixl_handshake` client accepts what a disagg side channel serves: a PP2 x TP2 prefill engine
(every (pp, tp) from one address) and a TP1 decoder, with metadata in the release's field set and the hash the
operator predicts, which vLLM's own worker computes from the decode pod's argv."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from _engine_argv import engine_pods, example_spec, judged, kv_transfer_config
from _vllm_peer import RELEASES, PeerError, PeerFactory
from test_hash_interop import GEMMA
from test_wire_interop import metadata

from disagg.rig.local import free_port
from disagg.worker.connector.side_channel import SideChannelServer
from disagg.worker.contracts import releases
from disagg.worker.kv import rules, wire


@pytest.mark.parametrize("version", RELEASES)
def test_vllm_client_accepts_a_disagg_pp2_tp2_prefill(
    vllm_peers: PeerFactory, tmp_path: Path, version: str
) -> None:
    peer = vllm_peers(version)
    row = releases.release_of(version)
    assert row is not None and row.connector_version == peer.connector_version
    spec = example_spec({**GEMMA, "engine": {"version": version, "image": f"vllm/vllm-openai:v{version}"}})
    report = judged(spec)
    pods = engine_pods(spec, tmp_path)
    head = next(p for p in pods if p.pod.endswith("prefill-0-0"))
    decode = next(p for p in pods if p.role == "decode")
    engine_id = kv_transfer_config(head.argv)["engine_id"]
    # What vLLM's decode worker would compare against: its own hash, from its own VllmConfig.
    decoder_hash = peer.call("config_hash", argv=decode.argv)["hash"]
    assert decoder_hash == report.hashes["prefill"]
    payloads = {
        (pp, tp): wire.encode_handshake_payload(
            msgspec.structs.replace(metadata(row.connector_version), engine_id=engine_id, device_id=tp),
            report.hashes["prefill"],
            row.connector_version,
        )
        for pp in range(2)
        for tp in range(2)
    }
    port = free_port()
    with SideChannelServer("127.0.0.1", port, payloads):
        # A TP2 decoder: each of its ranks asks every stage for the prefill rank it pairs with.
        asked = {
            tp_rank: sorted(
                peer.call(
                    "handshake",
                    host="127.0.0.1",
                    port=port,
                    compat_hash=decoder_hash,
                    remote_tp_size=2,
                    expected_engine_id=engine_id,
                    remote_pp_size=2,
                    tp_rank=tp_rank,
                    tp_size=2,
                    notif_agents_only=True,
                    physical_blocks_per_logical=2,
                )["agents"]
            )
            for tp_rank in range(2)
        }
        assert asked == {0: ["0,0", "1,0"], 1: ["0,1", "1,1"]}
        # The full path (a prefill worker handshaking for WRITEs) decodes the metadata with every field kept.
        full = peer.call(
            "handshake",
            host="127.0.0.1",
            port=port,
            compat_hash=decoder_hash,
            remote_tp_size=2,
            expected_engine_id=engine_id,
            remote_pp_size=2,
            physical_blocks_per_logical=2,
        )
        (added,) = full["added_full"][:1]
        assert added["metadata"]["packed_member_layouts"]["model.layers.1.self_attn.attn"] == [16384, 16384]
        if peer.connector_version >= 16:
            # 0.34's push refuses other kernel blocks per logical block (16, 1) against the served (16, 2),
            # as the project's decode checks do (KernelBlockSizeMismatch).
            with pytest.raises(PeerError, match="requires identical P/D block sizes"):
                peer.call(
                    "handshake",
                    host="127.0.0.1",
                    port=port,
                    compat_hash=decoder_hash,
                    remote_tp_size=2,
                    expected_engine_id=engine_id,
                    remote_pp_size=2,
                )
            assert rules.kernel_block_mismatch((16, 1), (16, 2)) is not None
        # Another release's engine (or a stale prediction) is refused by vLLM itself.
        with pytest.raises(PeerError, match="compatibility hash mismatch"):
            peer.call(
                "handshake",
                host="127.0.0.1",
                port=port,
                compat_hash="0" * 64,
                remote_tp_size=2,
                expected_engine_id=engine_id,
                remote_pp_size=2,
            )


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_vllm_prefill_worker_accepts_a_disagg_decoder(
    vllm_peers: PeerFactory, tmp_path: Path, version: str
) -> None:
    peer = vllm_peers(version)
    row = releases.release_of(version)
    assert row is not None
    engine = {"version": version, "image": f"vllm/vllm-openai:v{version}"}
    spec = example_spec({**GEMMA, "engine": engine, "decode": {"tensorParallelSize": 1}})
    report = judged(spec)
    decode = next(p for p in engine_pods(spec, tmp_path) if p.role == "decode")
    engine_id = kv_transfer_config(decode.argv)["engine_id"]
    prefill_hash = peer.call("config_hash", argv=next(p for p in engine_pods(spec, tmp_path)).argv)["hash"]
    payload = wire.encode_handshake_payload(
        msgspec.structs.replace(metadata(row.connector_version), engine_id=engine_id),
        report.hashes["decode"],
        row.connector_version,
    )
    port = free_port()
    with SideChannelServer("127.0.0.1", port, {(0, 0): payload}):
        got = peer.call(
            "handshake",
            host="127.0.0.1",
            port=port,
            compat_hash=prefill_hash,
            remote_tp_size=1,
            expected_engine_id=engine_id,
            tp_rank=1,
            tp_size=2,
            physical_blocks_per_logical=2,
        )
    assert got["agents"] == {"0,0": "full-agent-0"}
    assert got["added_full"][0]["metadata"]["engine_id"] == engine_id
