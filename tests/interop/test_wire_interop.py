"""The wire structs against each release's own NixlAgentMetadata / NixlHandshakePayload classes and msgspec
encoder and decoder, and the project's side-channel client against the release's real listener."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from _vllm_peer import RELEASES, PeerFactory, VllmPeer

from disagg.rig.local import free_port
from disagg.worker.connector.side_channel import handshake
from disagg.worker.kv import wire
from disagg.worker.kv.errors import CompatibilityHashMismatch

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def metadata(connector_version: int) -> wire.NixlAgentMetadata:
    """A packed metadata with every optional field away from its default (ple_block_len from v14,
    layer_group_ids from v16)."""
    return wire.NixlAgentMetadata(
        engine_id="prefill-7f3c2a-1a2b3c4d",
        agent_metadata=b"\x00\x01opaque-agent",
        kv_caches_base_addr=[0x7F3A40000000, 0x7F3A60000000],
        device_id=3,
        num_blocks=4096,
        block_lens=[65536, 16384],
        block_strides=[65536, 65536],
        kv_cache_layout="BLHNC",
        block_size=16,
        ssm_sizes=(0, 0),
        attn_backend_name="FLASH_ATTN",
        physical_blocks_per_logical_kv_block=2,
        region_num_blocks=[4096, 4096],
        region_group_ids=[0, 1],
        region_names=[LAYERS[0], "model.ple.conv"],
        region_mem_types=["VRAM", "VRAM"],
        dcp_size=2,
        pcp_size=1,
        ple_block_len=24576 if connector_version >= 14 else None,
        region_members=[LAYERS, ["model.ple.conv"]],
        layer_group_ids={**dict.fromkeys(LAYERS, 0), "model.ple.conv": 1} if connector_version >= 16 else {},
        packed_member_layouts={name: (i * 16384, 16384) for i, name in enumerate(LAYERS)},
    )


def fields(meta: wire.NixlAgentMetadata, connector_version: int) -> dict[str, object]:
    return {name: getattr(meta, name) for name in wire.metadata_fields(connector_version)}


@pytest.mark.parametrize("version", RELEASES)
def test_the_wire_struct_is_the_release_field_set(vllm_peers: PeerFactory, version: str) -> None:
    peer = vllm_peers(version)
    assert peer.connector_version in wire.CONNECTOR_VERSIONS
    assert list(wire.metadata_fields(peer.connector_version)) == peer.metadata_fields


@pytest.mark.parametrize("version", RELEASES)
def test_metadata_is_byte_for_byte_vllm_encoding(vllm_peers: PeerFactory, version: str) -> None:
    peer = vllm_peers(version)
    meta = metadata(peer.connector_version)
    ours = wire.encode_agent_metadata(meta, peer.connector_version)
    theirs = peer.call("metadata_encode", fields=fields(meta, peer.connector_version))
    assert ours == theirs
    # vLLM's typed decoder reads ours back and re-encodes the same bytes; ours does the same with vLLM's.
    decoded = peer.call("metadata_decode", data=ours)
    assert decoded["reencoded"] == ours
    assert decoded["fields"]["packed_member_layouts"] == {
        k: list(v) for k, v in meta.packed_member_layouts.items()
    }
    assert decoded["fields"].get("ple_block_len") == meta.ple_block_len
    assert decoded["fields"].get("layer_group_ids", {}) == meta.layer_group_ids
    assert wire.encode_agent_metadata(wire.decode_agent_metadata(theirs), peer.connector_version) == theirs


@pytest.mark.parametrize("version", RELEASES)
def test_a_default_metadata_is_vllm_encoding(vllm_peers: PeerFactory, version: str) -> None:
    peer = vllm_peers(version)
    required = {name: getattr(metadata(15), name) for name in wire.metadata_fields(13)[:12]}
    ours = wire.encode_agent_metadata(wire.NixlAgentMetadata(**required), peer.connector_version)
    assert ours == peer.call("metadata_encode", fields=required)


@pytest.mark.parametrize("version", RELEASES)
def test_handshake_payload_is_vllm_encoding(vllm_peers: PeerFactory, version: str) -> None:
    peer = vllm_peers(version)
    inner = wire.encode_agent_metadata(metadata(peer.connector_version), peer.connector_version)
    ours = wire.encode_handshake_payload(inner, "ab" * 32)
    assert ours == peer.call("payload_encode", compatibility_hash="ab" * 32, agent_metadata_bytes=inner)
    assert peer.call("payload_decode", data=ours)["reencoded"] == ours


@pytest.mark.parametrize("version", RELEASES)
def test_the_project_client_reads_vllm_listener(vllm_peers: PeerFactory, version: str) -> None:
    """vLLM's real side-channel server, serving a PP2 x TP2 engine's payloads made by vLLM's classes."""
    peer = vllm_peers(version)
    port = free_port()
    payloads = {}
    for pp in range(2):
        for tp in range(2):
            meta = msgspec.structs.replace(metadata(peer.connector_version), device_id=tp)
            inner = peer.call("metadata_encode", fields=fields(meta, peer.connector_version))
            payloads[f"{pp},{tp}"] = peer.call(
                "payload_encode", compatibility_hash="cd" * 32, agent_metadata_bytes=inner
            )
    listener = peer.call("listener_start", payloads=payloads, host="127.0.0.1", port=port)
    try:
        ranks = [(pp, tp) for pp in range(2) for tp in range(2)]
        got = handshake(
            "127.0.0.1", port, ranks, expected_hash="cd" * 32, expected_engine_id="prefill-7f3c2a-1a2b3c4d"
        )
        assert [(h.pp_rank, h.tp_rank, h.metadata.device_id) for h in got] == [(p, t, t) for p, t in ranks]
        assert got[0].metadata.packed_member_layouts == metadata(15).packed_member_layouts
        with pytest.raises(CompatibilityHashMismatch):
            handshake("127.0.0.1", port, [(1, 1)], expected_hash="ef" * 32, expected_engine_id=None)
        # Only served ranks were asked for: vLLM's listener is still alive.
        assert peer.call("listener_alive", handle=listener)
    finally:
        peer.call("listener_stop", handle=listener)


def test_the_probe_never_asks_a_pp1_vllm_engine_for_a_rank_it_does_not_serve(vllm_peer: VllmPeer) -> None:
    """Issue 22, finding 10: `disagg probe --pp 2` asked a PP1 engine for (1, 0), and vLLM's listener thread
    died of the KeyError. The head's payload (its regions hold all 4 layers) now refuses the claim first."""
    port = free_port()
    meta = metadata(vllm_peer.connector_version)
    inner = vllm_peer.call("metadata_encode", fields=fields(meta, vllm_peer.connector_version))
    payload = vllm_peer.call("payload_encode", compatibility_hash="cd" * 32, agent_metadata_bytes=inner)
    listener = vllm_peer.call("listener_start", payloads={"0,0": payload}, host="127.0.0.1", port=port)
    disagg = str(Path(sys.executable).with_name("disagg"))
    try:
        for claim, reason in (
            (["--pp", "2"], "RanksUnconfirmed"),
            (["--pp", "2", "--num-layers", "4"], "PipelineSizeMismatch"),
            # Stage 0 of 4 over 16 layers is layers 0-3, as the head holds; but no payload tells TP ranks.
            (["--pp", "4", "--tp", "2", "--num-layers", "16"], "RanksUnconfirmed"),
            (["--tp", "2"], "RanksUnconfirmed"),
        ):
            done = subprocess.run(
                [disagg, "probe", f"127.0.0.1:{port}", *claim],
                capture_output=True,
                text=True,
                timeout=120,
                env={**os.environ, "PYTHONSAFEPATH": "1"},
            )
            assert done.returncode == 1, done.stdout + done.stderr
            assert f"refused: {reason}: " in done.stdout and "asked for (pp 0, tp 0) only" in done.stdout
            assert vllm_peer.call("listener_alive", handle=listener), f"{claim} killed vLLM's listener"
        # And it still serves its head.
        (head,) = handshake("127.0.0.1", port, [(0, 0)], expected_hash="cd" * 32, expected_engine_id=None)
        assert head.metadata.engine_id == meta.engine_id
    finally:
        vllm_peer.call("listener_stop", handle=listener)
