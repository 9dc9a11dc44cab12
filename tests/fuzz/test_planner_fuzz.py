"""Seeded fuzz of what a pod's `/metrics` answer and an admitted autoscaling spec give the planner: broken and
hostile HTTP answers (lying lengths, bad chunks, huge headers, cut off, held open) never raise and end by
the scrape's deadline; values and targets at the float edges never raise, and every decision stays within
the role's bounds."""

from __future__ import annotations

import random
import socket
import threading
from collections import Counter

import pytest

from disagg.operator.api import DecodeAutoscaling, PrefillAutoscaling, Role
from disagg.operator.control import scaling
from disagg.operator.scaling import planner, signals
from disagg.operator.scaling.signals import Sample

pytestmark = pytest.mark.fuzz

SEED = 45
ROUNDS = 300
EDGES = (
    "0", "-0", "1", "5e-324", "-5e-324", "2.2250738585072014e-308", "1e-300", "1e308", "-1e308",
    "1.7976931348623157e308", "-1.7976931348623157e308", "NaN", "+Inf", "-Inf", "3", "0.5",
)  # fmt: skip
TARGETS = (5e-324, 2.2250738585072014e-308, 1e-300, 0.01, 1.0, 1e300, 1.7976931348623157e308)
BOUNDS = ("0.01", "0.1", "1.0", "1e308", "+Inf")
PAGES = 64


def _router_page(rng: random.Random) -> str:
    lines = [
        f'disagg_router_in_flight_requests{{role="decode"}} {rng.choice(EDGES)}',
        f'disagg_router_in_flight_requests{{role="prefill"}} {rng.choice(EDGES)}',
        f"disagg_router_queued_requests {rng.choice(EDGES)}",
    ]
    for histogram in (signals.TTFT, signals.ITL):
        lines += [f'{histogram}_bucket{{le="{bound}"}} {rng.choice(EDGES)}' for bound in BOUNDS]
    return "\n".join(lines) + "\n"


def _engine_page(rng: random.Random) -> str:
    return f"{signals.KV_USAGE} {rng.choice(EDGES)}\n{signals.PROMPT_TOKENS}_total {rng.choice(EDGES)}\n"


def test_float_edges_of_pages_and_targets_plan_within_the_bounds() -> None:
    rng = random.Random(SEED)
    for _ in range(ROUNDS):
        samples = [
            Sample(
                k * 5.0,
                {f"r{r}": signals.parse_router(_router_page(rng)) for r in range(rng.randint(0, 3))},
                {
                    (role, f"e{e}"): signals.parse_engine(_engine_page(rng))
                    for role in ("prefill", "decode")
                    for e in range(rng.randint(0, 2))
                },
            )
            for k in range(rng.randint(1, 4))
        ]
        low = rng.randint(1, 3)
        common = {"minReplicas": low, "maxReplicas": rng.randint(low, 256), "metricWindowSeconds": 60}
        decode_target = rng.choice(("interTokenLatencyP90Seconds", "kvCacheUsage", "runningRequests"))
        prefill_target = rng.choice(("ttftP90Seconds", "promptTokensPerSecond"))
        specs: list[tuple[Role, DecodeAutoscaling | PrefillAutoscaling]] = [
            (
                "decode",
                DecodeAutoscaling.model_validate(
                    {**common, "target": {decode_target: min(rng.choice(TARGETS), 1.0)}}
                ),
            ),
            (
                "prefill",
                PrefillAutoscaling.model_validate(
                    {**common, "target": {prefill_target: min(rng.choice(TARGETS), 3600.0)}}
                ),
            ),
        ]
        for role, autoscaling in specs:
            current = rng.randint(1, 256)
            history: planner.Recommendations = ((0.0, rng.randint(1, 256), False),)
            decision, _ = planner.plan(role, autoscaling, samples, current, history, samples[-1].at)
            low_bound, high_bound = autoscaling.bounds
            assert low_bound <= decision.desired <= high_bound, decision


def _response(rng: random.Random) -> tuple[bytes, bool]:
    """A seeded answer of a hostile or broken pod, and whether the peer then holds the connection open."""
    body = rng.choice((b"", b"queued 1\n", b"\xff\xfe\x00", b"#" * rng.randrange(1, 200_000)))
    status = rng.choice(
        (b"HTTP/1.1 200 OK", b"HTTP/1.0 200 OK", b"HTTP/1.1 500 No", b"garbage", b"HTTP/1.1 200")
    )
    length = rng.choice((len(body), len(body) + 10, max(len(body) - 1, 0), 2**40, -1))
    headers = rng.choice(
        (
            b"Content-Length: %d\r\n" % length,
            b"Transfer-Encoding: chunked\r\n",
            b"",
            b"Content-Length: x\r\n",
            b"X: " + b"y" * 70_000 + b"\r\n",
        )
    )
    if headers.startswith(b"Transfer") and rng.random() < 0.7:
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if rng.random() < 0.8 else b"zz\r\n" + body
    answer = status + b"\r\n" + headers + b"\r\n" + body
    if rng.random() < 0.2:
        answer = answer[: rng.randrange(len(answer) + 1)]
    return answer, rng.random() < 0.3


def test_hostile_http_answers_never_raise_and_end_by_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scaling, "SCRAPE_TIMEOUT_S", 0.3)
    rng = random.Random(SEED)
    answers = [_response(rng) for _ in range(PAGES)]
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        for answer, hold in answers:
            try:
                peer, _ = server.accept()
                peer.recv(4096)
                peer.sendall(answer)
            except OSError:
                continue
            if hold:
                held.append(peer)
            else:
                peer.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}/metrics"
    outcomes: Counter[str] = Counter()
    scraper = scaling.Scraper()
    try:
        for start in range(0, PAGES, 8):
            batch = scraper.submit([url] * min(8, PAGES - start))
            assert batch.wait(15.0), "the scraper did not end the batch within its bound"
            for page in batch.pages:
                assert page is None or len(page) <= scaling.MAX_SCRAPE_BYTES
                outcomes["page" if page is not None else "none"] += 1
    finally:
        server.close()
        thread.join(5)
        for sock in held:
            sock.close()
    print(f"hostile answers (seed {SEED}): {dict(outcomes)}")
    assert sum(outcomes.values()) == PAGES and outcomes["page"] > 0 and outcomes["none"] > 0
