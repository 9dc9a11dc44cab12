"""The vLLM peer process itself, and the pure core's vLLM arithmetic against vLLM's own functions."""

from __future__ import annotations

import json

import pytest
from _vllm_peer import RELEASES, PeerError, PeerFactory, VllmPeer

from disagg.worker.kv.layout import pp_partition

CASES = [(26, 2, None), (27, 2, None), (61, 4, None), (32, 4, None), (26, 2, "10,16"), (61, 3, "20,20,21")]


@pytest.mark.parametrize("version", RELEASES)
def test_each_release_peer_imports_that_release(vllm_peers: PeerFactory, version: str) -> None:
    peer = vllm_peers(version)
    assert peer.call("version")["vllm_version"] == version
    assert peer.metadata_fields[:2] == ["engine_id", "agent_metadata"]


@pytest.mark.parametrize(("num_layers", "pp_size", "partition"), CASES)
def test_pp_partition_is_get_pp_indices(
    vllm_peer: VllmPeer, num_layers: int, pp_size: int, partition: str | None
) -> None:
    sizes = None if partition is None else [int(x) for x in partition.split(",")]
    ours = [[r.start, r.stop] for r in pp_partition(num_layers, pp_size, sizes)]
    assert ours == vllm_peer.call("pp_indices", num_layers=num_layers, pp_size=pp_size, partition=partition)


def test_a_vllm_error_comes_back_as_vllm_raised_it(vllm_peer: VllmPeer) -> None:
    with pytest.raises(PeerError) as raised:
        vllm_peer.call("metadata_decode", data=json.dumps({"not": "msgpack"}).encode())
    assert raised.value.kind in ("DecodeError", "ValidationError")
