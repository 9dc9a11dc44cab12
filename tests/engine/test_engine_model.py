"""The reference model: paged attention equals dense recompute, windows apply, PP stages compose exactly."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from disagg.worker.engine.config import TinyConfig, encode, layer_name
from disagg.worker.engine.kv_cache import BlockTables, PagedKVCache
from disagg.worker.engine.model import TinyModel

CONFIG = TinyConfig()
PROMPT = encode("Prefill here, decode there: the KV cache travels by layer name. ")  # 64 tokens, 4 blocks


@pytest.fixture(scope="module")
def model() -> TinyModel:
    return TinyModel(CONFIG)


@pytest.fixture(autouse=True)
def single_thread() -> Iterator[None]:
    # Worker processes run single-threaded; the in-process references must use the same kernels.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def prefilled(model: TinyModel, extra_tokens: int) -> tuple[PagedKVCache, BlockTables, int]:
    kv = PagedKVCache(model.kv_layout(48))
    tables = kv.allocate(len(PROMPT) + extra_tokens)
    first = int(torch.argmax(model.prefill(PROMPT, kv, tables)[-1]))
    return kv, tables, first


def test_weights_depend_only_on_the_seed() -> None:
    a, b, c = TinyModel(CONFIG), TinyModel(CONFIG), TinyModel(TinyConfig(seed=CONFIG.seed + 1))
    assert torch.equal(a.layers[4].wk, b.layers[4].wk) and torch.equal(a.lm_head, b.lm_head)
    assert not torch.equal(a.layers[4].wk, c.layers[4].wk)


def test_paged_decode_matches_dense_recomputation(model: TinyModel) -> None:
    kv, tables, first = prefilled(model, 8)
    tokens = [first]
    decoded = []
    for step in range(6):
        decoded.append(model.decode_step(tokens[-1], len(PROMPT) + step, kv, tables))
        tokens.append(int(torch.argmax(decoded[-1])))
    # Recompute every position from scratch in a fresh cache: the same logits, up to float rounding.
    fresh = PagedKVCache(model.kv_layout(48))
    full = model.prefill(PROMPT + tokens[:-1], fresh, fresh.allocate(len(PROMPT) + 6))
    for step, logits in enumerate(decoded):
        torch.testing.assert_close(logits, full[len(PROMPT) + step], rtol=1e-4, atol=1e-4)


def test_generate_is_independent_of_physical_block_ids(model: TinyModel) -> None:
    reference = model.generate(PROMPT, 12)
    kv = PagedKVCache(model.kv_layout(64))
    kv.allocate(200)  # another request holds the low block ids, so this one gets different ones
    assert model.generate(PROMPT, 12, kv) == reference
    assert len(set(reference)) > 3  # the model does not collapse onto one token


def corrupt(kv: PagedKVCache, name: str, block_id: int) -> None:
    gen = torch.Generator().manual_seed(7)
    noise = 50 * torch.randn(kv.layout.block_len // 4, generator=gen)
    kv.layer_block_view(name, block_id)[:] = noise.numpy().view("uint8")


def decode_logits(model: TinyModel, kv: PagedKVCache, tables: BlockTables, first: int) -> torch.Tensor:
    return model.decode_step(first, len(PROMPT), kv, tables)


def test_decode_reads_the_cache_and_sliding_layers_only_their_window(model: TinyModel) -> None:
    kv, tables, first = prefilled(model, 1)
    clean = decode_logits(model, kv, tables, first)
    sliding, full = layer_name(3), layer_name(5)
    assert CONFIG.window(3) == 32 and CONFIG.window(5) is None

    assert len(PROMPT) == 64
    # Decoding position 64 with a 32-token window sees tokens 33..64: block 0 (tokens 0..15) is out of it.
    snapshot = kv.buffer.clone()
    corrupt(kv, sliding, tables[kv.layout.group_of(sliding)][0])
    assert torch.equal(decode_logits(model, kv, tables, first), clean)

    kv.buffer.copy_(snapshot)
    corrupt(kv, sliding, tables[kv.layout.group_of(sliding)][2])
    assert not torch.allclose(decode_logits(model, kv, tables, first), clean)

    kv.buffer.copy_(snapshot)
    corrupt(kv, full, tables[kv.layout.group_of(full)][0])
    assert not torch.allclose(decode_logits(model, kv, tables, first), clean)

    kv.buffer.copy_(snapshot)
    assert torch.equal(decode_logits(model, kv, tables, first), clean)


def test_pipeline_stages_compose_to_the_monolithic_prefill_bit_for_bit(model: TinyModel) -> None:
    mono = PagedKVCache(model.kv_layout(16))
    mono_tables = mono.allocate(len(PROMPT))
    reference = model.prefill(PROMPT, mono, mono_tables)

    stages = CONFIG.stages(2)
    assert stages == [range(0, 5), range(5, 9)]
    caches = [PagedKVCache(model.kv_layout(16, pp_rank=r, pp_size=2)) for r in range(2)]
    tables = caches[0].allocate(len(PROMPT))  # one scheduler's block ids serve every stage
    hidden = model.prefill(PROMPT, caches[0], tables, layers=stages[0])
    assert hidden.shape == (len(PROMPT), CONFIG.hidden_size)
    logits = model.prefill(PROMPT, caches[1], tables, layers=stages[1], hidden_in=hidden)
    assert torch.equal(logits, reference)

    with pytest.raises(KeyError, match=r"model\.layers\.5\.self_attn\.attn has no KV cache in this process"):
        model.prefill(PROMPT, caches[0], tables, layers=range(0, 6))
    for rank, cache in enumerate(caches):
        for index in stages[rank]:
            name = layer_name(index)
            got = cache.gather(name, tables[cache.layout.group_of(name)], len(PROMPT))
            want = mono.gather(name, mono_tables[mono.layout.group_of(name)], len(PROMPT))
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name


@pytest.mark.parametrize("length", [1, 2, 17, 64, 300])
def test_recomputing_the_last_prompt_token_gives_the_prefill_bits(model: TinyModel, length: int) -> None:
    # A decoder that received a prompt's KV recomputes its last token (vLLM's rule for a full prompt hit)
    # to get the first token: it must get the prefill's logits and rewrite the same KV bytes.
    prompt = [(7 * i + 3) % 256 for i in range(length)]
    kv = PagedKVCache(model.kv_layout(128))
    tables = kv.allocate(length + 1)
    logits = model.prefill(prompt, kv, tables)
    pushed = kv.buffer.clone()
    recomputed = model.decode_step(prompt[-1], length - 1, kv, tables)
    assert torch.equal(recomputed, logits[-1])
    assert torch.equal(kv.buffer, pushed)
