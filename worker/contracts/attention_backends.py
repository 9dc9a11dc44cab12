"""The kernel block sizes of vLLM's attention backends, where a spec alone decides them. Pure data.

vLLM 0.34's push connector requires equal `(kernel block size, kernel blocks per logical block)` on both sides
(`push_worker._validate_remote_parallel_config`: "NixlPushConnector requires identical P/D block sizes"). The
kernel block size is what `select_common_block_size(block_size, backends)` picks (`vllm/v1/worker/utils.py`):
the logical block size when the backend supports it, else the largest size the backend lists that divides
it. What a backend supports is its `get_supported_kernel_block_sizes()`. For some backends that is a
constant; for others it reads the GPU or the KV cache spec (FLASH_ATTN's FA4 paths for head size 256 or an
fp8 cache on Hopper, FLASHINFER's large pages on Blackwell), so only the running engine knows it.

`KERNEL_BLOCK_SIZES` holds the constant ones, as vLLM 0.34 declares them;
tests/interop/test_kernel_blocks_interop.py checks every row against 0.34's own backend classes and
`select_common_block_size`. A backend not in the table is undecided before pods exist: the live handshake
decides (reason `KernelBlockSizeMismatch`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final


@dataclass(frozen=True)
class KernelBlockSizes:
    """What a backend's `get_supported_kernel_block_sizes()` returns: explicit sizes, and `multiple_of` for a
    `MultipleOf(n)` entry (any multiple of n)."""

    sizes: tuple[int, ...] = ()
    multiple_of: int | None = None

    def supports(self, block_size: int) -> bool:
        return block_size in self.sizes or (
            self.multiple_of is not None and block_size % self.multiple_of == 0
        )


KERNEL_BLOCK_SIZES: Final[Mapping[str, KernelBlockSizes]] = MappingProxyType(
    {
        "TRITON_ATTN": KernelBlockSizes(multiple_of=16),
        "TRITON_MLA": KernelBlockSizes(multiple_of=16),
        "FLEX_ATTENTION": KernelBlockSizes(multiple_of=16),
        "FLASHMLA": KernelBlockSizes(sizes=(64,)),
        "CPU_ATTN": KernelBlockSizes(multiple_of=32),
        "CPU_MLA": KernelBlockSizes(sizes=(16,)),
    }
)
"""Backends whose kernel block sizes are constants in vLLM 0.34 (neither the GPU nor the KV spec changes
them), by the name `--attention-backend` takes."""


def kernel_blocks(backend: str, block_size: int) -> tuple[int, int] | None:
    """`(kernel block size, kernel blocks per logical block)` of an engine running `backend` with logical
    blocks of `block_size` tokens (vLLM's `select_common_block_size` for one backend); None when the spec
    cannot decide it (a backend whose sizes read the GPU or KV spec) or no size of the backend divides the
    block size (vLLM refuses to start then)."""
    table = KERNEL_BLOCK_SIZES.get(backend)
    if table is None or block_size < 1:
        return None
    if table.supports(block_size):
        return block_size, 1
    fitting = [size for size in table.sizes if block_size % size == 0 and table.supports(size)]
    if not fitting:
        return None
    kernel = max(fitting)
    return kernel, block_size // kernel
