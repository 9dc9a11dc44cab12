"""`disagg probe` against live side channels: a real PP2 prefill engine, and peers it must refuse."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from _procs import HOST, Cluster
from test_push import HYBRID, prefill_specs

from disagg.rig.local import free_port
from disagg.worker.connector.side_channel import SideChannelServer
from disagg.worker.kv import wire

DISAGG = str(Path(sys.executable).with_name("disagg"))


def probe(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    return subprocess.run([DISAGG, "probe", *args], capture_output=True, text=True, timeout=120, env=env)


def test_probe_prints_every_rank_of_a_pp2_engine(procs: Cluster) -> None:
    prefill = prefill_specs(procs, HYBRID, pp=2, compat_hash="c" * 64)
    procs.start_all(prefill)
    done = probe(f"{HOST}:{prefill[0]['port']}", "--pp", "2", "--num-layers", "12")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "rank (pp 0, tp 0): engine prefill" in out and "rank (pp 1, tp 0): engine prefill" in out
    assert out.count("c" * 64) == 2
    assert "connector version: 16 (by the metadata's field set)" in out
    # Stage 1 pools layers 6-9 and 10-11; every layer of the model appears exactly once across both stages.
    assert "model.layers.6.self_attn.attn, model.layers.7.self_attn.attn" in out
    for layer in range(12):
        assert out.count(f"model.layers.{layer}.self_attn.attn") == 1


def test_probe_fails_with_the_reason() -> None:
    garbage = SideChannelServer(HOST, free_port(), {(0, 0): b"\x00 not a payload"}).start()
    try:
        done = probe(f"{HOST}:{garbage.port}")
        assert done.returncode == 1
        assert "ConnectorVersionMismatch" in done.stdout
    finally:
        garbage.stop()
    done = probe(f"{HOST}:{free_port()}", "--timeout", "0.5")
    assert done.returncode == 1 and "PeerUnreachable" in done.stdout


def test_probe_names_a_rank_the_engine_does_not_have(tmp_path: Path) -> None:
    doc = {
        "transferMode": "push",
        "blockSize": 16,
        "prefillTensorParallelSize": 2,
        "stages": [{"startLayer": 0, "endLayer": 4}],
        "model": {"layerKinds": ["full"] * 4, "numKVHeads": 2, "headSize": 16, "dtypeBytes": 2},
    }
    path = tmp_path / "topology.json"
    path.write_text(json.dumps(doc))
    server = SideChannelServer(HOST, free_port(), {(0, 0): pp1_payload([PP1_LAYERS])}).start()
    try:
        done = probe(f"{HOST}:{server.port}", "--topology", str(path))
        assert done.returncode == 1
        assert "HandshakeFailed" in done.stdout and "(pp 0, tp 1)" in done.stdout, done.stdout
    finally:
        server.stop()


GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "vllm" / "0.33.0"


def test_probe_asks_only_for_rank_0_unless_told_and_reports_what_the_fields_show(tmp_path: Path) -> None:
    """vLLM 0.33's own payload bytes: the probe reads the connector version from their fields and keeps
    ple_block_len and packed_member_layouts; without sizes it asks for (pp 0, tp 0) alone, so an engine is
    never asked for a rank it does not serve."""
    payload = (GOLDEN / "handshake_payload_ple_packed.msgpack").read_bytes()
    server = SideChannelServer(HOST, free_port(), {(0, 0): payload}).start()
    try:
        done = probe(f"{HOST}:{server.port}")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "ranks: none given: (pp 0, tp 0) only" in done.stdout
        assert "connector version: 14 or 15 (by the metadata's field set)" in done.stdout
        assert "  ple_block_len: " in done.stdout and "  packed_member_layouts: " in done.stdout
        assert server.rejected == 0
    finally:
        server.stop()


def test_probe_takes_the_ranks_from_the_topology(tmp_path: Path) -> None:
    # Stage 0 of the topology below holds layer 0 alone; the head's payload must say so.
    payload = pp1_payload([["model.layers.0.self_attn.attn"]])
    served = {(pp, tp): payload for pp in range(2) for tp in range(2)}
    doc = {
        "transferMode": "push",
        "blockSize": 16,
        "prefillTensorParallelSize": 2,
        "stages": [{"startLayer": 0, "endLayer": 1}, {"startLayer": 1, "endLayer": 2}],
        "model": {"layerKinds": ["full"] * 2, "numKVHeads": 2, "headSize": 16, "dtypeBytes": 2},
    }
    path = tmp_path / "topology.json"
    path.write_text(json.dumps(doc))
    server = SideChannelServer(HOST, free_port(), served).start()
    try:
        done = probe(f"{HOST}:{server.port}", "--topology", str(path))
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"ranks: the topology {path} (prefill: PP 2 x TP 2)" in done.stdout
        assert done.stdout.count("connector version: 16") == 4
        assert (server.served, server.rejected) == (4, 0)
        decode = probe(f"{HOST}:{server.port}", "--topology", str(path), "--role", "decode")
        assert "(decode: PP 1 x TP 1)" in decode.stdout and server.served == 5
    finally:
        server.stop()


# A PP1 engine's head: its regions hold every one of the model's 4 layers.
PP1_LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def pp1_payload(members: list[list[str]]) -> bytes:
    meta = wire.NixlAgentMetadata(
        engine_id="prefill-pp1",
        agent_metadata=b"agent",
        kv_caches_base_addr=[0x1000 * (i + 1) for i in range(len(members) or 1)],
        device_id=0,
        num_blocks=64,
        block_lens=[16384] * (len(members) or 1),
        block_strides=[16384] * (len(members) or 1),
        kv_cache_layout="LBHNC",
        block_size=16,
        ssm_sizes=(0, 0),
        attn_backend_name="FLASH_ATTN",
        physical_blocks_per_logical_kv_block=1,
        region_members=members,
    )
    return wire.encode_handshake_payload(wire.encode_agent_metadata(meta), "e" * 64)


def test_probe_refuses_a_pipeline_the_heads_payload_contradicts_and_asks_nothing_more(tmp_path: Path) -> None:
    """Issue 22, finding 10: `--pp 2` against a PP1 engine asked for (1, 0), which kills vLLM's listener."""
    server = SideChannelServer(HOST, free_port(), {(0, 0): pp1_payload([PP1_LAYERS])}).start()
    try:
        told = probe(f"{HOST}:{server.port}", "--pp", "2", "--num-layers", "4")
        assert told.returncode == 1
        assert "refused: PipelineSizeMismatch: the head (pp 0) holds every layer, so the engine is PP 1" in (
            told.stdout
        ), told.stdout
        assert "rank (pp 0, tp 0): engine prefill-pp1" in told.stdout
        # Without the layer count nothing confirms stage 0 is a stage of two: refused, not guessed.
        unconfirmed = probe(f"{HOST}:{server.port}", "--pp", "2")
        assert unconfirmed.returncode == 1
        assert "refused: RanksUnconfirmed: the head (pp 0) holds layers 0-3" in unconfirmed.stdout
        assert "asked for (pp 0, tp 0) only" in unconfirmed.stdout
        # Nor does any payload tell the TP ranks: only the topology may name them.
        tp = probe(f"{HOST}:{server.port}", "--tp", "2")
        assert tp.returncode == 1 and "refused: RanksUnconfirmed: nothing in the head's payload" in tp.stdout
        assert (server.served, server.rejected) == (3, 0)
    finally:
        server.stop()


def test_probe_refuses_a_topology_the_heads_payload_contradicts(tmp_path: Path) -> None:
    doc = {
        "transferMode": "push",
        "blockSize": 16,
        "stages": [{"startLayer": 0, "endLayer": 2}, {"startLayer": 2, "endLayer": 4}],
        "model": {"layerKinds": ["full"] * 4, "numKVHeads": 2, "headSize": 16, "dtypeBytes": 2},
    }
    path = tmp_path / "topology.json"
    path.write_text(json.dumps(doc))
    server = SideChannelServer(HOST, free_port(), {(0, 0): pp1_payload([PP1_LAYERS])}).start()
    try:
        done = probe(f"{HOST}:{server.port}", "--topology", str(path))
        assert done.returncode == 1
        assert "PipelineSizeMismatch" in done.stdout and "puts layers 0-1 on stage 0" in done.stdout
        assert (server.served, server.rejected) == (1, 0)
    finally:
        server.stop()
