"""The kernel block sizes the operator decides before pods exist (`contracts.attention_backends`) are vLLM
0.34's: each backend of the table declares the same sizes in 0.34's own class, and 0.34's own
`select_common_block_size` picks, for every logical block size tried, the kernel block size the project
predicts (`kernel_blocks`)."""

from __future__ import annotations

import pytest
from _vllm_peer import PeerFactory

from disagg.worker.contracts.attention_backends import KERNEL_BLOCK_SIZES, kernel_blocks

BLOCK_SIZES = [8, 16, 32, 48, 64, 96, 128, 256]


@pytest.mark.parametrize("backend", sorted(KERNEL_BLOCK_SIZES))
def test_each_fixed_backend_is_vllm_034s(vllm_peers: PeerFactory, backend: str) -> None:
    got = vllm_peers("0.34.0").call("kernel_blocks", backend=backend, block_sizes=BLOCK_SIZES)
    table = KERNEL_BLOCK_SIZES[backend]
    declared = [*table.sizes, *([{"multiple_of": table.multiple_of}] if table.multiple_of else [])]
    assert sorted(map(str, got["declared"])) == sorted(map(str, declared))
    for block_size in BLOCK_SIZES:
        ours = kernel_blocks(backend, block_size)
        theirs = got["picked"][str(block_size)]
        assert (None if ours is None else ours[0]) == theirs, block_size
        if ours is not None:
            assert ours[0] * ours[1] == block_size
