"""Write a tiny model that a real vLLM engine can serve with no download: config, seeded weights, tokenizer.

Run with the engine venv's Python (it needs torch, safetensors and tokenizers, which vLLM brings):

    .venv-vllm-engine/bin/python hack/vllm/tiny_model.py DIR --kind dense|hybrid [--layers N --sliding-window W
        --full-every K]

`--load-format dummy` would give every layer the same weights, so outputs of different layers could not be
told apart (and a KV transfer that swapped two layers would go unnoticed); these weights are drawn from a
seeded generator, one tensor at a time in a fixed order, so the same command writes the same bytes. The
tokenizer is a byte-level BPE trained here on a fixed text, so nothing comes from a hub.

- dense: LlamaForCausalLM, 4 layers, hidden 128, 4 heads, 2 KV heads: one KV cache group.
- hybrid: Gemma3ForCausalLM (text only), by default 6 layers, sliding window 32, full attention every 3rd layer:
  sliding-window and full-attention layers, which vLLM's hybrid KV cache manager puts in separate groups.
  `--layers`, `--sliding-window` and `--full-every` give other shapes (8 layers, window 64, full every 4th
  makes 4 groups), which the differential suite runs to see what one shape alone would hide.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

VOCAB = 2048
SEED = 1234
# The other weights' standard deviation: small enough that activations stay in range over 6 layers.
_SCALE = 0.15
# Enough distinct text that the BPE learns its full vocabulary; deterministic.
_WORDS = (
    "disaggregated serving moves the kv cache from prefill to decode over nixl with layer name routing "
    "pipeline parallel stages hold contiguous slices of the layers and a decoder pools them differently "
    "the operator checks compatibility before any pod exists and the sidecar reports every handshake "
    "tokens blocks regions agents leases heartbeats registrations writes notifications completions"
).split()


def _corpus() -> list[str]:
    lines = []
    for i in range(4000):
        words = [_WORDS[(i * 7 + j * 13 + (i * j) % 11) % len(_WORDS)] for j in range(12)]
        lines.append(" ".join(words) + f" {i} {i * 31 % 997}.")
    return lines


def dense_config() -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def hybrid_config(layers: int = 6, sliding_window: int = 32, full_every: int = 3) -> dict[str, Any]:
    pattern = ["sliding_attention"] * (full_every - 1) + ["full_attention"]
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window": sliding_window,
        "sliding_window_pattern": full_every,
        "layer_types": [pattern[i % full_every] for i in range(layers)],
        "query_pre_attn_scalar": 32,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def _weights(config: dict[str, Any]) -> dict[str, Any]:
    """Build the model class on the meta device for its parameter names and shapes, then draw each one."""
    import torch
    import transformers

    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    generator = torch.Generator().manual_seed(SEED)
    tensors: dict[str, Any] = {}
    for name, param in sorted(model.state_dict().items()):
        if "norm" in name:
            # Norm weights near 1 (Gemma adds 1 itself, so near 0 there), so activations stay in range.
            base = 0.0 if config["model_type"].startswith("gemma") else 1.0
            value = base + 0.1 * torch.randn(param.shape, generator=generator)
        elif "embed_tokens" in name:
            # Token identity dominates the residual stream, so greedy output keeps depending on the prompt
            # (with every weight small, long prompts converge on one repeated token).
            # Gemma multiplies the embeddings by sqrt(hidden).
            std = 0.1 if config["model_type"].startswith("gemma") else 1.0
            value = std * torch.randn(param.shape, generator=generator)
        else:
            value = _SCALE * torch.randn(param.shape, generator=generator)
        tensors[name] = value.to(torch.float32).contiguous()
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    return tensors


def _tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "model_max_length": 4096,
                "add_bos_token": False,
            },
            indent=1,
        )
    )


def write(directory: Path, kind: str, **shape: int) -> None:
    from safetensors.torch import save_file

    config = dense_config() if kind == "dense" else hybrid_config(**shape)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    save_file(_weights(config), str(directory / "model.safetensors"), metadata={"format": "pt"})
    _tokenizer(directory)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--kind", choices=("dense", "hybrid"), default="dense")
    parser.add_argument("--layers", type=int, default=6, help="hybrid: number of layers")
    parser.add_argument("--sliding-window", type=int, default=32, help="hybrid: the sliding window in tokens")
    parser.add_argument("--full-every", type=int, default=3, help="hybrid: every K-th layer is full attention")
    args = parser.parse_args(argv)
    shape = {"layers": args.layers, "sliding_window": args.sliding_window, "full_every": args.full_every}
    write(args.directory, args.kind, **({} if args.kind == "dense" else shape))
    print(args.directory)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
