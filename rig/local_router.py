"""The router as a real process in front of `LocalEngines`, without an API server, and a bounded load run.

`disagg router run` learns its pairs from the API server; on a machine with only loopback engines (the
router's tests, the bench) the pairs are the ones those engines form, written to a file this module's process
reads: the same `Router` and server, fed a fixed routing instead of the pod watch.

    with LocalEngines(pp_size=2, decoders=2) as engines, LocalRouter(routing_for(engines)) as router:
        report = asyncio.run(load_run(router.url, engines.decode_urls[0], engines.model_name))
        assert report.failed == 0 and report.mismatched == 0

`load_run` sends `requests` requests (completions and chat, streamed and not) at `concurrency` through the
router, and compares every output, token for token, with the monolithic run of the same request on a decoder
(no kv_transfer_params: the engine computes it alone), measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from disagg.rig.local import HOST, free_port
from disagg.rig.local_engines import LocalEngines
from disagg.worker.contracts.pairing import DecodeTarget, Pair, PrefillTarget, Routing
from disagg.worker.router.cli import window_edge
from disagg.worker.router.config import RouterConfig

START_TIMEOUT_S = 60.0

PROMPTS = (
    "Hello!",
    "Disaggregated serving moves the KV cache from prefill to decode, layer by layer and block by block.",
    "A sliding window of 32 tokens hides the early tokens from most layers, while every third layer sees "
    "the whole prompt. " * 2,
    "Router, pick the least loaded pair.",
)


def routing_for(engines: LocalEngines) -> Routing:
    """The pairs `engines` form: its one prefill engine with every decoder (one topology, one hash)."""
    head = engines.prefill[0]
    prefill = PrefillTarget(
        engine_id=head.engine_id,
        head_pod=head.name,
        host=HOST,
        http_port=head.http_port,
        side_channel_port=head.worker.side_channel_port,
        tp_size=1,
        pp_size=engines.pp_size,
        stage_pods=tuple(w.name for w in engines.prefill),
        kv_hash="",
    )
    decodes = tuple(
        DecodeTarget(
            pod=w.name, engine_id=w.engine_id, host=HOST, http_port=w.http_port, tp_size=1, kv_hash=""
        )
        for w in engines.decode
    )
    return Routing((prefill,), decodes, tuple(Pair(prefill, d) for d in decodes), ())


def encode_routing(routing: Routing) -> str:
    return json.dumps(dataclasses.asdict(routing))


def decode_routing(text: str) -> Routing:
    raw = json.loads(text)

    def prefill(d: dict[str, Any]) -> PrefillTarget:
        return PrefillTarget(**{**d, "stage_pods": tuple(d["stage_pods"])})

    return Routing(
        tuple(prefill(p) for p in raw["prefills"]),
        tuple(DecodeTarget(**d) for d in raw["decodes"]),
        tuple(Pair(prefill(p["prefill"]), DecodeTarget(**p["decode"])) for p in raw["pairs"]),
        (),
    )


@dataclass
class LocalRouter:
    """`Router` in its own process on 127.0.0.1, routing over `routing`; with `canary`, a pair gets traffic
    only once the router's own canary request crossed it (so entering waits for that)."""

    routing: Routing
    port: int = field(default_factory=free_port)
    canary: bool = True
    # `disagg router run` arguments the local router honours: the operator's (`--recompute-window-edge`), and
    # `--decode-timeout` for a test to bound a decode leg that can never start.
    args: tuple[str, ...] = ()
    _proc: subprocess.Popen[bytes] | None = field(init=False, default=None)
    _dir: Path = field(init=False)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> LocalRouter:
        self._dir = Path(tempfile.mkdtemp(prefix="disagg-router-"))
        routing_file = self._dir / "routing.json"
        routing_file.write_text(encode_routing(self.routing))
        self._log = (self._dir / "router.log").open("wb")
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-P",
                "-m",
                "disagg.rig.local_router",
                "--port",
                str(self.port),
                *(() if self.canary else ("--no-kv-canary",)),
                *self.args,
                str(routing_file),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the router exited {self._proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"the router did not get ready: {self.log_tail()}")
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def log_tail(self, chars: int = 4000) -> str:
        return (self._dir / "router.log").read_text(errors="replace")[-chars:]


# --- the bounded load run --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    endpoint: str
    prompt: str
    stream: bool
    max_tokens: int

    def body(self, model: str) -> dict[str, Any]:
        common: dict[str, Any] = {
            "model": model,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
        if self.stream:
            common["stream"] = True
        if self.endpoint == "/v1/chat/completions":
            return {**common, "messages": [{"role": "user", "content": self.prompt}]}
        return {**common, "prompt": self.prompt}


@dataclass
class LoadReport:
    requests: int
    concurrency: int
    failed: int = 0
    mismatched: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return (
            f"{self.requests} requests at concurrency {self.concurrency} in {self.seconds:.1f} s: "
            f"{self.failed} failed, {self.mismatched} differ from the monolithic run"
        )


def cases(max_tokens: int = 8) -> list[Case]:
    return [
        Case(endpoint, prompt, stream, max_tokens)
        for endpoint in ("/v1/completions", "/v1/chat/completions")
        for stream in (False, True)
        for prompt in PROMPTS
    ]


async def tokens_of(session: aiohttp.ClientSession, url: str, case: Case, model: str) -> list[int]:
    """The token ids one request answers (streamed or not); raises on any failure."""
    async with session.post(url + case.endpoint, json=case.body(model)) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.read())[:300]!r}")
        if not case.stream:
            answer = await response.json()
            return list(answer["choices"][0]["token_ids"])
        ids: list[int] = []
        done = False
        async for raw in response.content:
            line = raw.decode().strip()
            if not line:
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk["choices"]:
                ids += choice.get("token_ids") or []
        if not done:
            raise RuntimeError("the stream ended without [DONE]")
        return ids


async def load_run(
    router_url: str,
    monolithic_url: str,
    model: str,
    *,
    requests: int = 500,
    concurrency: int = 32,
    workload: Sequence[Case] | None = None,
) -> LoadReport:
    """`requests` requests through the router at `concurrency`, each compared with the monolithic run."""
    workload = list(workload or cases())
    report = LoadReport(requests, concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        expected = {case: await tokens_of(session, monolithic_url, case, model) for case in workload}
        queue = list(range(requests))
        started = time.monotonic()

        async def worker() -> None:
            while queue:
                case = workload[queue.pop() % len(workload)]
                try:
                    got = await tokens_of(session, router_url, case, model)
                except Exception as exc:
                    report.failed += 1
                    report.failures.append(f"{case}: {type(exc).__name__}: {exc}")
                    continue
                if got != expected[case]:
                    report.mismatched += 1
                    report.failures.append(f"{case}: {got} != {expected[case]}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        report.seconds = time.monotonic() - started
    return report


async def _serve(port: int, routing: Routing, config: RouterConfig) -> None:
    from disagg.worker.router.app import Router, start

    router = Router(config)
    router.set_routing(routing)
    runner = await start(router, HOST, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the router on a fixed routing (the local rig's)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--no-kv-canary", dest="canary", action="store_false")
    # As `disagg router run` reads it, from the operator's router arguments (`VllmEngines.router_args`).
    parser.add_argument(
        "--recompute-window-edge", dest="window_edges", action="append", type=window_edge, default=[]
    )
    parser.add_argument("--decode-timeout", type=float, default=RouterConfig.decode_timeout_s)
    parser.add_argument("routing_file", type=Path)
    args = parser.parse_args(argv)
    routing = decode_routing(args.routing_file.read_text())
    config = RouterConfig(
        kv_canary=args.canary, window_edges=tuple(args.window_edges), decode_timeout_s=args.decode_timeout
    )
    asyncio.run(_serve(args.port, routing, config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
