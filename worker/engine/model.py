"""A tiny decoder-only transformer with seeded random weights, run over the paged KV cache.

Hybrid attention (sliding-window and full layers), grouped-query attention, rotary positions, RMSNorm and a
SwiGLU MLP, all float32 with deterministic CPU ops: the same tokens through the same layers give the same
bits in any process, so a disaggregated run (PP prefill stages, then a decoder fed the pushed KV) must match
the monolithic run token for token.

Every attention call first writes the new tokens' K/V into the layer's blocks, then reads the whole
context back from the cache by block table, so decode depends on the cached bytes and nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from disagg.worker.engine.config import TinyConfig, encode, layer_name
from disagg.worker.engine.kv_cache import BlockTables, KVCacheLayout, PagedKVCache


@dataclass(frozen=True)
class _LayerWeights:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


class TinyModel:
    """The reference model. Weights come from `config.seed` alone, so every process builds the same model."""

    def __init__(self, config: TinyConfig) -> None:
        self.config = config
        gen = torch.Generator().manual_seed(config.seed)
        c = config

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, generator=gen, dtype=torch.float32) / math.sqrt(cols)

        def norm(size: int) -> torch.Tensor:
            return 1.0 + 0.1 * torch.randn(size, generator=gen, dtype=torch.float32)

        q_width, kv_width = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
        self.embedding = torch.randn(c.vocab_size, c.hidden_size, generator=gen, dtype=torch.float32)
        self.layers = [
            _LayerWeights(
                attn_norm=norm(c.hidden_size),
                wq=weight(q_width, c.hidden_size),
                wk=weight(kv_width, c.hidden_size),
                wv=weight(kv_width, c.hidden_size),
                wo=weight(c.hidden_size, q_width),
                mlp_norm=norm(c.hidden_size),
                w_gate=weight(c.intermediate_size, c.hidden_size),
                w_up=weight(c.intermediate_size, c.hidden_size),
                w_down=weight(c.hidden_size, c.intermediate_size),
            )
            for _ in range(c.num_layers)
        ]
        self.final_norm = norm(c.hidden_size)
        self.lm_head = weight(c.vocab_size, c.hidden_size)
        # A fixed table indexed by position, so a position's rotation never depends on the batch it is in.
        half = c.head_size // 2
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
        angles = torch.arange(c.max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self._cos = angles.cos().to(torch.float32)
        self._sin = angles.sin().to(torch.float32)

    def kv_layout(self, num_blocks: int, *, pp_rank: int = 0, pp_size: int = 1) -> KVCacheLayout:
        """The KV layout of PP stage `pp_rank` of `pp_size` (the whole model when `pp_size == 1`)."""
        c = self.config
        stage = c.stage_layout(num_blocks, pp_rank=pp_rank, pp_size=pp_size)
        return KVCacheLayout.from_stage_layout(stage, num_kv_heads=c.num_kv_heads, head_size=c.head_size)

    def prefill(
        self,
        token_ids: Sequence[int],
        kv: PagedKVCache,
        block_tables: BlockTables,
        layers: range | None = None,
        hidden_in: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the prompt through `layers` (all by default), writing their K/V into `kv`.

        The first stage embeds `token_ids`; later stages take the previous stage's `hidden_in`
        (`[len(token_ids), hidden_size]`). Returns hidden states `[T, hidden_size]` unless `layers` ends with
        the last layer, in which case it returns logits `[T, vocab_size]`.
        """
        positions = torch.arange(len(token_ids))
        if len(token_ids) < 2:
            return self._forward(token_ids, positions, kv, block_tables, layers, hidden_in)
        # The last prompt token runs alone, exactly as a decode step runs it: a decoder that received this
        # prompt's KV recomputes that token (vLLM's rule for a full prompt hit) and must get these bits, and
        # CPU kernels round a one-row matmul differently from a many-row one.
        head_in = None if hidden_in is None else hidden_in[:-1]
        last_in = None if hidden_in is None else hidden_in[-1:].clone()
        head = self._forward(token_ids[:-1], positions[:-1], kv, block_tables, layers, head_in)
        last = self._forward(token_ids[-1:], positions[-1:], kv, block_tables, layers, last_in)
        return torch.cat((head, last))

    def decode_step(
        self, token_id: int, position: int, kv: PagedKVCache, block_tables: BlockTables
    ) -> torch.Tensor:
        """Logits `[vocab_size]` for the token after `token_id`, which sits at `position`; all layers."""
        positions = torch.tensor([position])
        return self._forward([token_id], positions, kv, block_tables, None, None)[0]

    def decode_greedy(
        self,
        first_token: int,
        num_prompt_tokens: int,
        kv: PagedKVCache,
        block_tables: BlockTables,
        max_new_tokens: int,
    ) -> list[int]:
        """Greedy continuation after prefill: `first_token` (prefill's output) plus `max_new_tokens - 1` more.

        `block_tables` must cover `num_prompt_tokens + max_new_tokens - 1` tokens.
        """
        tokens = [first_token]
        for step in range(max_new_tokens - 1):
            logits = self.decode_step(tokens[-1], num_prompt_tokens + step, kv, block_tables)
            tokens.append(int(torch.argmax(logits)))
        return tokens

    def generate(
        self, prompt: str | Sequence[int], max_new_tokens: int, kv: PagedKVCache | None = None
    ) -> list[int]:
        """The monolithic reference: prefill and greedy decode in this process. Returns the new tokens."""
        token_ids = encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids or max_new_tokens < 1:
            raise ValueError("generate needs a non-empty prompt and max_new_tokens >= 1")
        total = len(token_ids) + max_new_tokens - 1
        if kv is None:
            blocks_per_group = math.ceil(total / self.config.block_size)
            kv = PagedKVCache(self.kv_layout(1 + self.config.num_kv_cache_groups * blocks_per_group))
        tables = kv.allocate(total)
        try:
            logits = self.prefill(token_ids, kv, tables)
            return self.decode_greedy(
                int(torch.argmax(logits[-1])), len(token_ids), kv, tables, max_new_tokens
            )
        finally:
            kv.free(tables)

    def _forward(
        self,
        token_ids: Sequence[int],
        positions: torch.Tensor,
        kv: PagedKVCache,
        block_tables: BlockTables,
        layers: range | None,
        hidden_in: torch.Tensor | None,
    ) -> torch.Tensor:
        c = self.config
        layers = range(c.num_layers) if layers is None else layers
        if not (0 <= layers.start < layers.stop <= c.num_layers and layers.step == 1):
            raise ValueError(f"layers {layers} is not a contiguous slice of 0..{c.num_layers - 1}")
        if int(positions[-1]) >= c.max_positions:
            raise ValueError(f"position {int(positions[-1])} exceeds max_positions {c.max_positions}")
        if layers.start == 0:
            if hidden_in is not None:
                raise ValueError("the first stage embeds token ids; hidden_in must be None")
            x = self.embedding[torch.tensor(list(token_ids), dtype=torch.long)]
        else:
            if hidden_in is None or tuple(hidden_in.shape) != (len(positions), c.hidden_size):
                shape = None if hidden_in is None else tuple(hidden_in.shape)
                raise ValueError(
                    f"stage starting at layer {layers.start} needs hidden_in [{len(positions)}, "
                    f"{c.hidden_size}], got {shape}"
                )
            x = hidden_in
        with torch.no_grad():
            for index in layers:
                x = self._layer(index, x, positions, kv, block_tables)
            if layers.stop < c.num_layers:
                return x
            return _rms_norm(x, self.final_norm, c.rms_eps) @ self.lm_head.T

    def _layer(
        self,
        index: int,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv: PagedKVCache,
        block_tables: BlockTables,
    ) -> torch.Tensor:
        c, w, name = self.config, self.layers[index], layer_name(index)
        tokens = x.shape[0]
        h = _rms_norm(x, w.attn_norm, c.rms_eps)
        q = (h @ w.wq.T).view(tokens, c.num_heads, c.head_size).transpose(0, 1)
        k = (h @ w.wk.T).view(tokens, c.num_kv_heads, c.head_size).transpose(0, 1)
        v = (h @ w.wv.T).view(tokens, c.num_kv_heads, c.head_size).transpose(0, 1)
        q, k = self._rotate(q, positions), self._rotate(k, positions)

        table = block_tables[kv.layout.group_of(name)]
        kv.write(name, table, positions, k, v)
        context = int(positions[-1]) + 1
        keys, values = kv.gather(name, table, context)
        attended = _attention(q, keys, values, positions, torch.arange(context), c.window(index))
        x = x + attended.transpose(0, 1).reshape(tokens, c.num_heads * c.head_size) @ w.wo.T

        h = _rms_norm(x, w.mlp_norm, c.rms_eps)
        return x + (torch.nn.functional.silu(h @ w.w_gate.T) * (h @ w.w_up.T)) @ w.w_down.T

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        half = self.config.head_size // 2
        cos, sin = self._cos[positions], self._sin[positions]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """Causal GQA attention; a sliding-window layer sees only the last `window` positions (its own too)."""
    k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    v = v.repeat_interleave(q.shape[0] // v.shape[0], dim=0)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    visible = k_positions[None, :] <= q_positions[:, None]
    if window is not None:
        visible &= k_positions[None, :] > q_positions[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
