"""Geometry of the tiny reference model, byte-level tokenisation and the pipeline-parallel layer split.

Pure: no torch, no I/O. The sidecar and the layout planner can read the geometry without loading the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.worker.kv.errors import CompatibilityError
from disagg.worker.kv.layout import (
    DEFAULT_LAYER_NAME_TEMPLATE,
    AttentionKind,
    ModelGeometry,
    StageLayout,
    build_stage_layout,
    kv_cache_groups,
    pp_partition,
)


@dataclass(frozen=True)
class TinyConfig:
    """A decoder-only transformer small enough to run everywhere, hybrid enough that HMA pooling is real.

    Layer `i` is full attention iff `(i + 1) % full_every == 0` (the Gemma-3 pattern), so layer 0 is sliding
    and the sliding bucket comes first when layers are grouped.
    """

    num_layers: int = 9
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 16
    intermediate_size: int = 128
    vocab_size: int = 256
    sliding_window: int = 32
    full_every: int = 3
    block_size: int = 16
    max_positions: int = 1024
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    seed: int = 1234

    def __post_init__(self) -> None:
        problems = []
        if self.num_heads % self.num_kv_heads:
            problems.append(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_size % 2:
            problems.append(f"head_size {self.head_size} must be even for rotary embeddings")
        if self.num_layers < 1 or self.full_every < 1 or self.block_size < 1 or self.sliding_window < 1:
            problems.append("num_layers, full_every, block_size and sliding_window must be positive")
        if self.vocab_size != 256:
            problems.append(f"vocab_size {self.vocab_size} must be 256: tokens are bytes")
        if problems:
            raise CompatibilityError("; ".join(problems), reason="InvalidModelConfig")

    @property
    def layer_names(self) -> tuple[str, ...]:
        return self.geometry.layer_names

    def window(self, layer: int) -> int | None:
        """Tokens a layer attends to (itself included), or None for full attention."""
        return self.sliding_window if self.geometry.kinds[layer] is AttentionKind.SLIDING_WINDOW else None

    @property
    def dtype_bytes(self) -> int:
        return 4  # float32 everywhere, so every process computes bit-identical values on CPU

    @property
    def geometry(self) -> ModelGeometry:
        return ModelGeometry.with_full_every(
            self.num_layers,
            self.full_every,
            other=AttentionKind.SLIDING_WINDOW,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype_bytes=self.dtype_bytes,
        )

    @property
    def num_kv_cache_groups(self) -> int:
        return len(kv_cache_groups(self.geometry))

    def stages(self, pp_size: int) -> list[range]:
        """Layers of each PP stage (vLLM's even split)."""
        return pp_partition(self.num_layers, pp_size)

    def stage_layout(self, num_blocks: int, *, pp_rank: int = 0, pp_size: int = 1) -> StageLayout:
        """The pooled KV layout of one PP stage (TP 1, layer-outer), as vLLM's HMA would plan it."""
        return build_stage_layout(
            self.geometry,
            pp_rank=pp_rank,
            pp_size=pp_size,
            tp_size=1,
            block_size=self.block_size,
            num_blocks=num_blocks,
        )


def layer_name(index: int) -> str:
    """vLLM's attention-layer prefix for decoder layer `index`."""
    return DEFAULT_LAYER_NAME_TEMPLATE.format(i=index)


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(token_ids: list[int]) -> str:
    return bytes(token_ids).decode("utf-8", errors="replace")
