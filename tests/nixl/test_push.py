"""Byte-exact KV pushes between processes: PP2 + HMA layer-name routing, legacy paths, TP 2->1, the head
split of TP 1->2 and 1->4, MLA 1->2."""

from __future__ import annotations

from typing import Any

import pytest
from _procs import HOST, Cluster, check_push, layout_of, read_pool

from disagg.rig.local import free_port

HYBRID = {"num_layers": 12, "period": 4, "num_kv_heads": 4, "head_size": 16, "dtype_bytes": 2, "hma": True}
DENSE = {"num_layers": 6, "period": 1, "num_kv_heads": 4, "head_size": 16, "dtype_bytes": 2, "hma": False}


def remote(engine: dict[str, Any]) -> dict[str, Any]:
    return {
        "engine_id": engine["engine_id"],
        "host": HOST,
        "port": engine["port"],
        "tp_size": engine["tp_size"],
        "pp_size": engine["pp_size"],
    }


def push_once(
    procs: Cluster,
    prefill: list[dict[str, Any]],
    decode: dict[str, Any],
    p_blocks: list[list[int]],
    d_blocks: list[list[int]],
    req: str = "req-1",
) -> None:
    peers = procs.start_all([*prefill, decode])
    producers, consumer = peers[:-1], peers[-1]
    consumer.send(cmd="expect", req=req, blocks=d_blocks, remote=remote(prefill[0]))
    for producer in producers:
        producer.wait("registered", req)
        producer.send(cmd="finish", req=req, blocks=p_blocks)
    for producer in producers:
        producer.wait("sent", req)
    consumer.wait("finished", req)
    checked = check_push(decode, read_pool(decode), [(spec, p_blocks, d_blocks) for spec in prefill])
    assert checked > 0


def prefill_specs(
    procs: Cluster, model: dict[str, Any], pp: int = 1, tp: int = 1, **extra: Any
) -> list[dict[str, Any]]:
    port = free_port()
    return [
        procs.spec(
            "prefill",
            role="producer",
            serve_port=port,
            model=model,
            pp_rank=p,
            pp_size=pp,
            tp_rank=t,
            tp_size=tp,
            **extra,
        )
        for p in range(pp)
        for t in range(tp)
    ]


def test_pp2_hma_prefill_into_pp1_decoder_with_other_pooling_and_capacities(procs: Cluster) -> None:
    prefill = prefill_specs(procs, HYBRID, pp=2)
    decode = procs.spec(
        "decode", role="consumer", serve_port=free_port(), model=HYBRID, capacities=[64, 80, 72]
    )
    # Each stage pools its own layers: stage 1 shares slots among layers 6-9 and 10-11, the decoder among
    # 4-7 and 8-11, so region indices cannot be paired; only layer names can.
    stage_regions = {r.members for spec in prefill for r in layout_of(spec).regions}
    decode_regions = {r.members for r in layout_of(decode).regions}
    assert stage_regions - decode_regions and decode_regions - stage_regions
    assert len({r.num_blocks for r in layout_of(decode).regions}) > 1
    # Four KV cache groups (three sliding, one full); ids are unique across groups, as HMA allocates them.
    p_blocks = [[3, 4, 5], [10, 11], [20, 21, 22, 23], [30]]
    d_blocks = [[40, 7, 8], [60, 61], [1, 2, 3, 50], [63]]
    push_once(procs, prefill, decode, p_blocks, d_blocks)


def test_pp1_without_hma(procs: Cluster) -> None:
    prefill = prefill_specs(procs, DENSE)
    decode = procs.spec("decode", role="consumer", serve_port=free_port(), model=DENSE, num_blocks=48)
    push_once(procs, prefill, decode, [[5, 6, 7, 30]], [[0, 9, 10, 47]])


def test_pp2_without_hma(procs: Cluster) -> None:
    prefill = prefill_specs(procs, DENSE, pp=2)
    decode = procs.spec("decode", role="consumer", serve_port=free_port(), model=DENSE, num_blocks=40)
    push_once(procs, prefill, decode, [[1, 2, 3]], [[39, 20, 4]])


@pytest.mark.parametrize("model", [DENSE, HYBRID], ids=["dense", "hybrid"])
def test_tp2_prefill_into_tp1_decoder_per_head_slice(procs: Cluster, model: dict[str, Any]) -> None:
    prefill = prefill_specs(procs, model, tp=2)
    decode = procs.spec("decode", role="consumer", serve_port=free_port(), model=model)
    groups = len(layout_of(decode).groups)
    p_blocks = [[2 * g + 1, 2 * g + 2] for g in range(groups)]
    d_blocks = [[60 - 2 * g, 30 - g] for g in range(groups)]
    push_once(procs, prefill, decode, p_blocks, d_blocks)


def push_to_decode_ranks(
    procs: Cluster,
    prefill: list[dict[str, Any]],
    decode: list[dict[str, Any]],
    p_blocks: list[list[int]],
    d_blocks: list[list[int]],
) -> list[int]:
    """One request from every prefill rank to every decode rank; the bytes each decode rank received."""
    peers = procs.start_all([*prefill, *decode])
    producers, consumers = peers[: len(prefill)], peers[len(prefill) :]
    # The scheduler names the same blocks on every decode TP rank; each rank registers with its prefill rank.
    for consumer in consumers:
        consumer.send(cmd="expect", req="req-1", blocks=d_blocks, remote=remote(prefill[0]))
    for producer in producers:
        producer.wait("registered", "req-1")
        producer.send(cmd="finish", req="req-1", blocks=p_blocks)
    for producer in producers:
        producer.wait("sent", "req-1")
    for consumer in consumers:
        consumer.wait("finished", "req-1")
    return [
        check_push(spec, read_pool(spec), [(stage, p_blocks, d_blocks) for stage in prefill])
        for spec in decode
    ]


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "heads"),
    [(1, 2, 4), (2, 4, 4), (1, 4, 2)],
    ids=["tp1-to-tp2", "tp2-to-tp4", "tp1-to-tp4-replicated-heads"],
)
def test_decoder_with_more_tp_ranks_gets_each_ranks_head_slice(
    procs: Cluster, p_tp: int, d_tp: int, heads: int
) -> None:
    """vLLM's head split: prefill rank p writes heads [h, h + n) of each block to the decode rank holding
    them, at offset 0 of that rank's (smaller) block; a decoder replicating heads gets its head on every
    replica. Every other decoder byte keeps its seed."""
    model = {**DENSE, "num_kv_heads": heads}
    prefill = prefill_specs(procs, model, tp=p_tp)
    port = free_port()
    decode = [
        procs.spec(
            "decode", role="consumer", serve_port=port, model=model, tp_rank=t, tp_size=d_tp, num_blocks=40
        )
        for t in range(d_tp)
    ]
    p_layout, d_layout = layout_of(prefill[0]), layout_of(decode[0])
    assert d_layout.regions[0].block_len < p_layout.regions[0].block_len
    p_blocks, d_blocks = [[1, 2, 3, 9]], [[39, 20, 4, 5]]
    received = push_to_decode_ranks(procs, prefill, decode, p_blocks, d_blocks)
    # Each decode rank's blocks were written whole (all its heads), and nothing else.
    assert received == [len(d_layout.regions) * d_layout.regions[0].block_len * 4] * d_tp


# All layers MLA: a period longer than the model leaves no full-attention layer. One latent "head", so the
# block is the same bytes on every TP rank.
MLA = {"num_layers": 6, "period": 7, "other": "mla", "num_kv_heads": 1, "head_size": 32, "dtype_bytes": 2}


@pytest.mark.parametrize(("pp", "hma"), [(1, False), (2, True)], ids=["pp1", "pp2-hma"])
def test_mla_tp1_prefill_into_tp2_decoder_writes_whole_blocks_to_every_rank(
    procs: Cluster, pp: int, hma: bool
) -> None:
    model = {**MLA, "hma": hma}
    prefill = prefill_specs(procs, model, pp=pp)
    port = free_port()
    decode = [
        procs.spec(
            "decode", role="consumer", serve_port=port, model=model, tp_rank=t, tp_size=2, num_blocks=40
        )
        for t in range(2)
    ]
    assert all(r.replicated for spec in [*prefill, *decode] for r in layout_of(spec).regions)
    groups = len(layout_of(decode[0]).groups)
    p_blocks = [[4 * g + 1, 4 * g + 2, 4 * g + 3] for g in range(groups)]
    d_blocks = [[39 - 3 * g, 9 + g, 20 + g] for g in range(groups)]
    peers = procs.start_all([*prefill, *decode])
    producers, consumers = peers[: len(prefill)], peers[len(prefill) :]
    # The scheduler names the same blocks on every decode TP rank; each rank registers with every stage.
    for consumer in consumers:
        consumer.send(cmd="expect", req="req-1", blocks=d_blocks, remote=remote(prefill[0]))
    for producer in producers:
        for _ in consumers:
            producer.wait("registered", "req-1")
        producer.send(cmd="finish", req="req-1", blocks=p_blocks)
    for producer in producers:
        producer.wait("sent", "req-1")
    # Each decode rank counts pp_size * max(1, P_tp // D_tp) = pp notifs: one WRITE per stage reached it.
    for consumer in consumers:
        consumer.wait("finished", "req-1")
    for spec in decode:
        whole = check_push(spec, read_pool(spec), [(stage, p_blocks, d_blocks) for stage in prefill])
        assert whole == sum(r.block_len * len(d_blocks[0]) * len(r.members) for r in layout_of(spec).regions)
