"""Requests through a served deployment's router, from a thread of their own while the caller changes the
deployment: `LoadThread` is the loop (workers on one HTTP session until stopped), `Load` the checked load
(every answer compared with the reference model run whole), `Case` and `ask` one request and its text."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

KEEPALIVE_S = 4.0


class LoadThread:
    """`send(session, index)` from `workers` coroutines on one aiohttp session, in a thread of its own, until
    stopped: worker k sends index k, then k + workers, and so on. Only the workers below `concurrency` send;
    a step load changes it while the load runs."""

    def __init__(self, send: Callable[[aiohttp.ClientSession, int], Awaitable[None]], workers: int) -> None:
        self.send = send
        self.workers = workers
        self.concurrency = workers
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LoadThread:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        return self

    async def _run(self) -> None:
        # The router closes a connection idle for its header timeout (10 s by default); aiohttp keeps one
        # 15 s and reuses the oldest first, so after a step down from many workers to few, a reused
        # connection can race the router's close and fail a request no server refused. Clients of a
        # keep-alive server let idle connections go first.
        connector = aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=120)
        ) as session:

            async def worker(slot: int) -> None:
                index = slot
                while not self._stop.is_set():
                    if slot >= self.concurrency:
                        await asyncio.sleep(0.1)
                        continue
                    await self.send(session, index)
                    index += self.workers

            await asyncio.gather(*(worker(k) for k in range(self.workers)))

    def stop(self) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=180)


@dataclass(frozen=True)
class Case:
    """One request: an OpenAI endpoint (`completions` or `chat_completions`), streamed or not."""

    endpoint: str
    stream: bool
    prompt: str
    max_tokens: int

    def body(self, model: str) -> dict[str, Any]:
        common = {"model": model, "max_tokens": self.max_tokens, "stream": self.stream}
        if self.endpoint == "completions":
            return {**common, "prompt": self.prompt}
        return {**common, "messages": [{"role": "user", "content": self.prompt}]}


def monolithic(case: Case) -> str:
    """What the reference model run whole writes for `case` (the engine's chat template for chat)."""
    import torch

    from disagg.worker.engine.config import TinyConfig, decode, encode
    from disagg.worker.engine.model import TinyModel
    from disagg.worker.engine.openai_api import chat_prompt

    prompt = (
        case.prompt
        if case.endpoint == "completions"
        else chat_prompt([{"role": "user", "content": case.prompt}])
    )
    torch.set_num_threads(1)
    text: str = decode(TinyModel(TinyConfig()).generate(encode(prompt), case.max_tokens))
    return text


async def ask(session: aiohttp.ClientSession, url: str, case: Case, model: str) -> str:
    """The text of one answer through `url`, streamed (SSE events in order) or not."""
    async with session.post(f"{url}/v1/{case.endpoint.replace('_', '/')}", json=case.body(model)) as response:
        raw = await response.read()
        if response.status != 200:
            raise AssertionError(f"{case}: {response.status} {raw[:500]!r}")
    chat = case.endpoint != "completions"
    if not case.stream:
        choice = json.loads(raw)["choices"][0]
        return str(choice["message"]["content"] if chat else choice["text"])
    parts = []
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line.removeprefix("data: "))
        assert "error" not in event, f"{case}: {event}"
        for choice in event.get("choices") or ():
            parts.append((choice.get("delta") or {}).get("content") or "" if chat else choice.get("text", ""))
    return "".join(parts)


@dataclass
class Load:
    """`cases` in turn through `url` at a fixed concurrency until stopped; every answer compared with
    `expected`. A request that failed is in `failures`, one that answered otherwise in `mismatches`."""

    url: str
    model: str
    cases: Sequence[Case]
    expected: dict[Case, str]
    concurrency: int
    sent: int = 0
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    _thread: LoadThread | None = None

    def start(self) -> Load:
        self._thread = LoadThread(self._send, self.concurrency).start()
        return self

    async def _send(self, session: aiohttp.ClientSession, index: int) -> None:
        case = self.cases[index % len(self.cases)]
        self.sent += 1
        try:
            got = await ask(session, self.url, case, self.model)
        except Exception as exc:  # every failure is counted and reported
            self.failures.append(f"{case}: {type(exc).__name__}: {exc}")
            return
        self.ok += 1
        if got != self.expected[case]:
            self.mismatches.append(f"{case}: {got!r} != {self.expected[case]!r}")

    def stop(self) -> None:
        assert self._thread is not None
        self._thread.stop()
