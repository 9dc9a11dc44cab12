"""Differential testing of real P/D against the monolithic engine (issue 42): seeded prompts of token ids at
the lengths where a transfer can go wrong (block edges, window edges, the lengths that lose a window's first
key), each answered by the decoder alone and through the router, token for token.

`DISAGG_DIFF_PROMPTS` sets how many prompts each deployment gets (default `DEFAULT_PROMPTS`; `make
test-vllm-engine DIFF_PROMPTS=2000` runs a deeper sweep). A mismatch names the prompt's length, its place
relative to the block and the window, the monolithic tokens and the transferred ones.
"""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from serving import Serving, post

from disagg.rig.vllm_engines import SHAPES
from disagg.worker.contracts.releases import loses_window_edge

DEFAULT_PROMPTS = 48
MAX_PROMPT = 640
CONCURRENCY = 4
BLOCK = 32
MAX_TOKENS = 8
VOCAB = 2048


def prompt_count() -> int:
    return max(1, int(os.environ.get("DISAGG_DIFF_PROMPTS", DEFAULT_PROMPTS)))


def edge_lengths(shape: str, count: int, seed: int = 42) -> list[int]:
    """`count` prompt lengths: first every block and window edge (and every length that loses a key under
    HMA, `releases.loses_window_edge`) up to MAX_PROMPT, then seeded random lengths; in a seeded order."""
    window = SHAPES[shape].sliding_window
    edges: set[int] = {1, 2, 3}
    for k in range(1, MAX_PROMPT // BLOCK + 1):
        edges |= {k * BLOCK - 1, k * BLOCK, k * BLOCK + 1}
    if window:
        edges |= {window - 1, window, window + 1, window + BLOCK - 1, window + BLOCK}
        edges |= {n for n in range(1, MAX_PROMPT + 1) if loses_window_edge(n, window, BLOCK)}
    rng = random.Random(seed)
    lengths = sorted(n for n in edges if n <= MAX_PROMPT)
    rng.shuffle(lengths)
    if count <= len(lengths):
        # The lengths that lose a key first, so that a short run still has them.
        lost = [n for n in lengths if window and loses_window_edge(n, window, BLOCK)]
        return (lost + [n for n in lengths if n not in lost])[:count]
    return lengths + [rng.randrange(1, MAX_PROMPT + 1) for _ in range(count - len(lengths))]


@dataclass(frozen=True)
class Mismatch:
    length: int
    expected: list[int]
    got: list[int]
    window: int

    def __str__(self) -> str:
        place = f"L % {BLOCK} = {self.length % BLOCK}"
        if self.window:
            lost = loses_window_edge(self.length, self.window, BLOCK)
            place += f", (L - {self.window} + 1) % {BLOCK} = {(self.length - self.window + 1) % BLOCK}"
            place += " (loses a key under HMA)" if lost else ""
        return (
            f"{self.length}-token prompt ({place}): monolithic {self.expected}, through the router {self.got}"
        )


@dataclass(frozen=True)
class Report:
    prompts: int
    prompt_tokens: int
    mismatches: list[Mismatch]


def run(deployment: Serving, shape: str, count: int | None = None) -> Report:
    """Every prompt on the decoder alone, then every prompt through the router: greedy, `MAX_TOKENS` token ids
    each, `CONCURRENCY` at a time (the engines batch them; vLLM's greedy output on these prompts does not
    depend on the batch, which the monolithic side checks itself: each prompt is asked twice there)."""
    window = SHAPES[shape].sliding_window
    rng = random.Random(7)
    lengths = edge_lengths(shape, count or prompt_count())
    bodies = [
        {
            "model": deployment.model,
            "prompt": [rng.randrange(3, VOCAB) for _ in range(length)],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        }
        for length in lengths
    ]
    decoder = deployment.engines.heads("decode")[0].url

    def answers(url: str) -> list[list[int]]:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            return list(pool.map(lambda body: post(url, body)["choices"][0]["token_ids"], bodies))

    expected, again = answers(decoder), answers(decoder)
    assert expected == again, (
        "the monolithic engine's answers depend on the batch: no reference to compare with"
    )
    got = answers(deployment.router.url)
    mismatches = [
        Mismatch(length, want, have, window)
        for length, want, have in zip(lengths, expected, got, strict=True)
        if want != have
    ]
    return Report(len(lengths), sum(lengths), mismatches)
