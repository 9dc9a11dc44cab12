"""Refused peers: each with a typed reason, no NIXL agent left behind, and the side channels keep serving."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from _procs import HOST, Cluster, check_push, read_pool
from test_push import HYBRID, prefill_specs, remote

from disagg.rig.local import free_port
from disagg.worker.connector.side_channel import SideChannelServer
from disagg.worker.kv import wire

FACTORS = wire.compat_factors(
    vllm_version="0.33.0",
    model="tiny-hybrid",
    dtype="bfloat16",
    num_kv_heads=4,
    head_size=16,
    num_hidden_layers=12,
    attn_backend_name="FLASH_ATTN",
    is_hma_enabled=True,
    transfer_mode="push",
    nixl_connector_version=15,
)
HASH = wire.compat_hash(FACTORS)


def fake_metadata(engine_id: str, **changes: Any) -> bytes:
    """A well-formed v12 metadata whose agent blob is not NIXL's: it must never reach add_remote_agent."""
    meta = wire.NixlAgentMetadata(
        engine_id=engine_id,
        agent_metadata=b"\x00not-a-nixl-agent",
        kv_caches_base_addr=[4096],
        device_id=0,
        num_blocks=8,
        block_lens=[4096],
        block_strides=[4096],
        kv_cache_layout="LBHNC",
        block_size=16,
        ssm_sizes=(0, 0),
        attn_backend_name="FLASH_ATTN",
        physical_blocks_per_logical_kv_block=1,
    )
    return wire.encode_agent_metadata(msgspec.structs.replace(meta, **changes))


@pytest.fixture
def fake_engines() -> Iterator[dict[str, SideChannelServer]]:
    """Side channels of peers that must be refused, each serving one crafted payload at (0, 0)."""
    v11 = wire.compat_hash({**FACTORS, "nixl_connector_version": 11})
    other_model = wire.compat_hash({**FACTORS, "model": "another-model"})
    payloads = {
        "garbage": b"\xc1\x00garbage bytes, not msgpack",
        "v11": wire.encode_handshake_payload(fake_metadata("v11"), v11),
        "other-model": wire.encode_handshake_payload(fake_metadata("other-model"), other_model),
        "wrong-engine": wire.encode_handshake_payload(fake_metadata("someone-else"), HASH),
        # What the decoder cannot receive, whatever the hash says: heads and tokens in the other order,
        # Mamba state, a context split over prefill context-parallel ranks.
        "nhd": wire.encode_handshake_payload(fake_metadata("nhd", kv_cache_layout="NHD"), HASH),
        "mamba": wire.encode_handshake_payload(fake_metadata("mamba", ssm_sizes=(4096, 65536)), HASH),
        "pcp": wire.encode_handshake_payload(fake_metadata("pcp", pcp_size=2), HASH),
    }
    servers = {
        name: SideChannelServer(HOST, free_port(), {(0, 0): p}).start() for name, p in payloads.items()
    }
    try:
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def test_decoder_refuses_bad_prefill_peers_then_pushes(
    procs: Cluster, fake_engines: dict[str, SideChannelServer]
) -> None:
    prefill = prefill_specs(procs, HYBRID, pp=2, compat_hash=HASH, compat_factors=FACTORS)
    decode = procs.spec(
        "decode",
        role="consumer",
        serve_port=free_port(),
        model=HYBRID,
        compat_hash=HASH,
        compat_factors=FACTORS,
    )
    *producers, consumer = procs.start_all([*prefill, decode])
    blocks = [[1], [2], [3], [4]]
    reasons = {
        "garbage": "ConnectorVersionMismatch",
        "v11": "ConnectorVersionMismatch",
        "other-model": "CompatibilityHashMismatch",
        "wrong-engine": "EngineIdMismatch",
        "nhd": "KVCacheLayoutMismatch",
        "mamba": "MambaStateNotSupported",
        "pcp": "PrefillContextParallel",
    }
    for name, server in fake_engines.items():
        engine = {"engine_id": name, "host": HOST, "port": server.port, "tp_size": 1, "pp_size": 1}
        consumer.send(cmd="expect", req=f"req-{name}", blocks=blocks, remote=engine)
        failed = consumer.wait("failed", f"req-{name}")
        assert failed["reason"] == reasons[name], failed
        assert failed["peers"] == [], failed
        if name == "v11":
            assert "version 11" in failed["message"], failed

    # Garbage straight into the prefill engine's side channel: the server answers with a refusal and goes on.
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.connect(f"tcp://{HOST}:{prefill[0]['port']}")
        for junk in (
            b"",
            b"\xff\xfe",
            msgspec.msgpack.encode(("get_meta_msg", "x", 0)),
            b"\x93\xc4\x00\x00\x00",
        ):
            sock.send(junk)
            payload, stamp = sock.recv_multipart()
            assert payload == b""
            assert isinstance(wire.decode_reply_timestamp(stamp), float)
    finally:
        ctx.destroy(linger=0)

    consumer.send(cmd="expect", req="req-ok", blocks=blocks, remote=remote(prefill[0]))
    for producer in producers:
        producer.wait("registered", "req-ok")
        producer.send(cmd="finish", req="req-ok", blocks=[[5], [6], [7], [8]])
    consumer.wait("finished", "req-ok")
    check_push(decode, read_pool(decode), [(spec, [[5], [6], [7], [8]], blocks) for spec in prefill])


@pytest.mark.parametrize(
    ("decoder", "reason"),
    [
        ({"model": {**HYBRID, "num_layers": 11}}, "MissingLayers"),
        ({"block_size": 32}, "BlockSizeMismatch"),
        ({"tp_size": 2}, "DecodeTPExceedsPrefillTP"),
    ],
    ids=["layer-missing", "block-size", "decode-tp-above-prefill-tp"],
)
def test_prefill_refuses_bad_decoder_then_serves_a_good_one(
    procs: Cluster, decoder: dict[str, Any], reason: str
) -> None:
    prefill = prefill_specs(procs, HYBRID, pp=2)
    bad_port = free_port()
    fields = {"model": HYBRID, **decoder}
    bad = [
        procs.spec("bad-decode", role="consumer", serve_port=bad_port, tp_rank=t, **fields)
        for t in range(fields.get("tp_size", 1))
    ]
    good = procs.spec("decode", role="consumer", serve_port=free_port(), model=HYBRID)
    peers = procs.start_all([*prefill, *bad, good])
    producers, bad_consumer, good_consumer = peers[: len(prefill)], peers[len(prefill)], peers[-1]
    bad_consumer.send(cmd="expect", req="req-bad", blocks=[[1], [2], [3], [4]], remote=remote(prefill[0]))
    for producer in producers:
        producer.wait("registered", "req-bad")
        producer.send(cmd="finish", req="req-bad", blocks=[[9], [10], [11], [12]])
    refused_somewhere = False
    for producer in producers:
        # Stage 0 owns layers 0-5, which an 11-layer decoder still has: only stage 1 must refuse it.
        if reason == "MissingLayers" and producer.spec["pp_rank"] == 0:
            continue
        failed = producer.wait("failed", "req-bad")
        assert failed["reason"] == reason, failed
        assert failed["peers"] == [], failed
        refused_somewhere = True
    assert refused_somewhere

    blocks = [[20], [21], [22], [23]]
    good_consumer.send(cmd="expect", req="req-good", blocks=blocks, remote=remote(prefill[0]))
    for producer in producers:
        producer.wait("registered", "req-good")
        producer.send(cmd="finish", req="req-good", blocks=[[30], [31], [32], [33]])
    good_consumer.wait("finished", "req-good")
    check_push(good, read_pool(good), [(spec, [[30], [31], [32], [33]], blocks) for spec in prefill])
