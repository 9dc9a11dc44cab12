"""vLLM 0.34's own `_pair_regions` (connector version 16: regions always pair by layer name) against what the
project's sidecar advertises, and the project's pairing against the same inputs.

A vLLM 0.34 prefill worker (a PP1 engine, or stage 1 of a PP2 one) pairs its regions with a disagg decoder's
metadata, encoded by the project at the connector version the decoder speaks and decoded by vLLM's typed
decoder. What vLLM pairs each of its layers with is checked against the decoder's own layout (which region
holds which layer), and against the project's `routing.pair_layers`, which the disagg prefill sidecar runs
on the same metadata. Each of 0.34's refusals of a bad decoder is also the project's.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from _vllm_peer import PeerError, PeerFactory, VllmPeer

from disagg.worker.connector.push import PushConfig, advertised_metadata
from disagg.worker.kv import rules, wire
from disagg.worker.kv.errors import MissingLayers
from disagg.worker.kv.layout import ModelGeometry, StageLayout, build_stage_layout
from disagg.worker.kv.routing import RegionGeometry, TransferLayers, pair_layers

DENSE = ModelGeometry.with_full_every(8, 1, num_kv_heads=8, head_size=128, dtype_bytes=2)
# Gemma-3-like: sliding-window layers with a full-attention layer every 6th, pooled by the HMA.
HYBRID = ModelGeometry.with_full_every(26, 6, num_kv_heads=1, head_size=256, dtype_bytes=2)
CASES = {"dense-pp1": (DENSE, 1), "hybrid-pp2-stage1": (HYBRID, 2)}


def layout_of(model: ModelGeometry, pp_rank: int, pp_size: int) -> StageLayout:
    return build_stage_layout(
        model, pp_rank=pp_rank, pp_size=pp_size, tp_size=1, block_size=16, num_blocks=64
    )


def sidecar_metadata(model: ModelGeometry, connector_version: int) -> wire.NixlAgentMetadata:
    """What a disagg decode sidecar speaking `connector_version` advertises (`push.LocalKV`'s rule and
    `push.advertised_metadata`)."""
    layout = layout_of(model, 0, 1)
    tracks = rules.tracks_region_layers(
        rules.PUSH, model.hma_required, False, model.has_mamba, connector_version=connector_version
    )
    geometry = RegionGeometry.from_layout(
        layout, base_addr=1 << 44, device_id=0, mem_type="VRAM", advertise_members=tracks
    )
    config = PushConfig(
        engine_id="disagg-decode-0",
        model=model,
        side_channel_host="127.0.0.1",
        side_channel_port=1,
        compat_hash=None,
        connector_version=connector_version,
    )
    return advertised_metadata(layout, geometry, config, b"agent")


def vllm_pairs(peer: VllmPeer, model: ModelGeometry, pp_size: int, meta: wire.NixlAgentMetadata) -> Any:
    """vLLM's `_pair_regions` on a prefill worker holding the last stage's layers (the whole model at PP1)."""
    stage = layout_of(model, pp_size - 1, pp_size)
    return peer.call(
        "pair_regions",
        data=wire.encode_agent_metadata(meta, 16),
        local_members=stage.region_members,
        group_by_layer=dict(stage.group_index_by_layer),
        block_lens=stage.block_lens,
        pp_size=pp_size,
    )


@pytest.fixture(scope="module")
def peer(vllm_peers: PeerFactory) -> VllmPeer:
    return vllm_peers("0.34.0")


@pytest.mark.parametrize("case", sorted(CASES))
def test_vllm_034_pairs_a_v16_disagg_decoder_by_layer_name_as_the_project_does(
    peer: VllmPeer, case: str
) -> None:
    model, pp_size = CASES[case]
    meta = sidecar_metadata(model, 16)
    assert meta.region_members and set(meta.layer_group_ids) == {n for m in meta.region_members for n in m}
    pairs = vllm_pairs(peer, model, pp_size, meta)
    assert pairs["groups_match"]
    stage = layout_of(model, pp_size - 1, pp_size)
    decoder = layout_of(model, 0, 1)
    holder = {name: r for r, region in enumerate(decoder.regions) for name in region.members}
    local_of = {name: r for r, region in enumerate(stage.regions) for name in region.members}
    # Every (decoder region, local region) vLLM pairs is one of a layer both hold, and every layer of the
    # stage is paired: from the two layouts, not from either pairing code.
    paired = {
        (pairs["remote_regions"][remote], local)
        for remote, local in zip(pairs["remote"], pairs["local"], strict=True)
    }
    assert paired == {(holder[name], local_of[name]) for name in stage.layer_names}
    # The project's prefill sidecar pairs the same layers with the same decoder regions.
    layers = TransferLayers.from_layout(stage)
    ours = pair_layers(meta, layers.names, whole_model=pp_size == 1)
    assert {(r, local) for r, local in zip(ours, layers.region_indices, strict=True)} == paired


def test_vllm_034_refuses_the_dense_decoder_a_v15_sidecar_advertises(peer: VllmPeer) -> None:
    """The issue's finding: a dense decoder advertising its layers only under HMA, as 0.31-0.33 and this
    project's sidecar before v16 do, is refused by 0.34, and by the project's v16 prefill the same way."""
    meta = sidecar_metadata(DENSE, 15)
    assert meta.region_members == []
    with pytest.raises(PeerError, match="did not advertise the layers of its KV regions"):
        vllm_pairs(peer, DENSE, 1, meta)
    with pytest.raises(MissingLayers, match="did not advertise the layers of its KV regions"):
        pair_layers(meta, layout_of(DENSE, 0, 1).layer_names, whole_model=True)


def _with_members(meta: wire.NixlAgentMetadata, members: list[list[str]]) -> wire.NixlAgentMetadata:
    groups = {name: 0 for region in members for name in region}
    return msgspec.structs.replace(meta, region_members=members, layer_group_ids=groups)


def test_each_refusal_of_a_bad_decoder_is_vllm_034s_and_the_projects(peer: VllmPeer) -> None:
    meta = sidecar_metadata(DENSE, 16)
    names = layout_of(DENSE, 0, 1).layer_names
    first, second = names[0], names[1]
    members = [list(m) for m in meta.region_members]
    # Region 3 lists no layer: the decoder does not hold model.layers.3.
    lacking = _with_members(meta, [*members[:3], [], *members[4:]])
    spanning = _with_members(meta, [members[0], [*members[1], first], *members[2:]])
    cases = [
        (
            lacking,
            r"does not hold the KV layers \['model.layers.3.self_attn.attn'\]",
            "local transfer layers",
        ),
        (spanning, f"KV layer '{first}' spans 2 NIXL regions", f"KV layer '{first}' spans 2 NIXL regions"),
        (
            _with_members(meta, [*members[:1], [second, "model.layers.99.self_attn.attn"], *members[2:]]),
            "holds KV layer 'model.layers.99.self_attn.attn', which has no counterpart here",
            "which have no counterpart here",
        ),
    ]
    for bad, theirs, ours in cases:
        with pytest.raises(PeerError, match=theirs):
            vllm_pairs(peer, DENSE, 1, bad)
        with pytest.raises(MissingLayers, match=ours):
            pair_layers(bad, names, whole_model=True)
