"""Seeded fuzz of what a client can send the router: hostile bodies (deep nesting, huge numbers, wrong types,
invalid UTF-8, broken framing and encodings) posted to the real router app in front of fake engines. No body
may produce a 500, every refusal is OpenAI's error JSON with its status, and the router keeps serving.
Bounded in count; counts are printed."""

from __future__ import annotations

import gzip
import json
import random
import zlib
from collections import Counter
from typing import Any

import pytest
from router_rig import COMPLETION, rig, run

from disagg.worker.router.app import RouterConfig

pytestmark = pytest.mark.fuzz

SEED = 22
CASES = 600
MAX_REQUEST_BYTES = 256 * 1024

Case = tuple[str, str, bytes, dict[str, str]]  # (kind, path, body, extra headers)


def nested(rng: random.Random, depth: int, leaf: str = "1") -> str:
    """`leaf` inside `depth` lists and objects, mixed."""
    lists = [rng.random() < 0.5 for _ in range(depth)]
    opens = "".join("[" if is_list else '{"k":' for is_list in lists)
    return opens + leaf + "".join("]" if is_list else "}" for is_list in reversed(lists))


def hostile_value(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(10)
    if choice == 0 or depth > 3:
        return rng.choice([0, -1, 2**63, -(2**64), 1.5, True, False, None, "", "\x00", "\ud800"])
    if choice == 1:
        return "x" * rng.choice([0, 1, 1000, 20_000])
    if choice == 2:
        return [hostile_value(rng, depth + 1) for _ in range(rng.randrange(6))]
    if choice == 3:
        return {rng.choice(["role", "content", "text", "type", "k"]): hostile_value(rng, depth + 1)}
    if choice == 4:
        return float(rng.choice(["inf", "-inf", "nan"]))
    return rng.randrange(-5, 50_000)


def json_text(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def hostile_case(rng: random.Random) -> Case:
    path = rng.choice(["/v1/completions", "/v1/chat/completions"])
    kind = rng.choice(
        [
            "deep prompt",
            "deep field",
            "deep message",
            "huge number",
            "wrong types",
            "invalid utf-8",
            "lone surrogates",
            "not json",
            "json scalar",
            "many keys",
            "bad encoding",
            "gzip bomb",
            "nul and bom",
            "duplicate keys",
        ]
    )
    headers: dict[str, str] = {"Content-Type": "application/json"}
    if kind == "deep prompt":
        body = b'{"model": "tiny", "prompt": ' + nested(rng, rng.randrange(60, 20_000)).encode() + b"}"
    elif kind == "deep field":
        field = rng.choice(["response_format", "tools", "logit_bias", "stop", "stream_options"])
        deep = nested(rng, rng.randrange(60, 5000))
        body = json.dumps({**COMPLETION, "messages": [{"role": "user", "content": "hi"}]})[:-1].encode()
        body += f', "{field}": {deep}}}'.encode()
    elif kind == "deep message":
        deep = nested(rng, rng.randrange(60, 5000), '"text"')
        body = b'{"model": "tiny", "prompt": "p", "messages": [{"role": "user", "content": ' + deep.encode()
        body += b"}]}"
    elif kind == "huge number":
        number = rng.choice(["9" * 5000, "1e99999", "-1e99999", "NaN", "Infinity", "1" + "0" * 400])
        field = rng.choice(["max_tokens", "temperature", "seed", "n", "prompt"])
        body = json_text({**COMPLETION, "messages": [{"role": "user", "content": "x"}]})
        body = body[:-1] + f', "{field}": {number}}}'.encode()
    elif kind == "wrong types":
        fields = {
            name: hostile_value(rng)
            for name in rng.sample(
                ["prompt", "messages", "stream", "max_tokens", "model", "stream_options", "n"], k=3
            )
        }
        body = json_text({"model": "tiny", "prompt": "p", "messages": [{"content": "c"}], **fields})
    elif kind == "invalid utf-8":
        body = b'{"model": "tiny", "prompt": "' + rng.randbytes(rng.randrange(1, 200)) + b'"}'
    elif kind == "lone surrogates":
        body = b'{"model": "tiny", "prompt": "\\ud800\\udfff\\udc00", "messages": [{"content": "\\ud834"}]}'
    elif kind == "not json":
        body = rng.choice(
            [b"", b"{", b"null", rng.randbytes(rng.randrange(1, 2000)), json_text(COMPLETION)[:-3]]
        )
    elif kind == "json scalar":
        body = rng.choice([b"1", b'"prompt"', b"[]", b"[{}]", b"true", b"1e400"])
    elif kind == "many keys":
        body = json_text({**COMPLETION, **{f"k{i}": i for i in range(rng.randrange(1000, 10_000))}})
    elif kind == "bad encoding":
        headers["Content-Encoding"] = rng.choice(["gzip", "deflate", "br", "x-unknown"])
        body = rng.choice([json_text(COMPLETION), rng.randbytes(100), zlib.compress(b"{")])
    elif kind == "gzip bomb":
        headers["Content-Encoding"] = "gzip"
        body = gzip.compress(b" " * (MAX_REQUEST_BYTES * rng.choice([2, 40])))
    elif kind == "nul and bom":
        prefix, suffix = rng.choice([b"\xef\xbb\xbf", b"\x00", b""]), rng.choice([b"\x00", b""])
        body = prefix + json_text(COMPLETION) + suffix
    else:
        body = b'{"model": "tiny", "prompt": "a", "prompt": ["b"], "stream": false, "stream": 1}'
    return kind, path, body, headers


def test_no_hostile_body_gets_a_500_and_the_router_keeps_serving() -> None:
    rng = random.Random(SEED)
    cases = [hostile_case(rng) for _ in range(CASES)]
    statuses: Counter[int] = Counter()
    kinds: Counter[str] = Counter()
    http_refusals: Counter[str] = Counter()
    server_errors: list[str] = []

    async def go() -> None:
        async with rig(RouterConfig(max_request_bytes=MAX_REQUEST_BYTES, stall_timeout_s=5)) as r:
            for kind, path, body, headers in cases:
                kinds[kind] += 1
                async with r.client.post(r.url + path, data=body, headers=headers) as response:
                    raw = await response.read()
                    statuses[response.status] += 1
                    if response.status >= 500 and response.status not in (502, 503, 504):
                        server_errors.append(f"{kind} {path}: {response.status} {raw[:200]!r}")
                    if response.status == 200:
                        continue
                    if response.content_type != "application/json":
                        # Refused by aiohttp's HTTP parser before any handler runs (an encoding it cannot
                        # decode): its own plain 400, which must still be a client error.
                        assert response.status == 400, (kind, response.status, raw[:200])
                        http_refusals[kind] += 1
                        continue
                    error = json.loads(raw)["error"]
                    assert error["code"] == response.status and error["message"], (kind, raw[:200])
            async with r.client.get(r.url + "/healthz") as health:
                assert health.status == 200
            status, _, raw = await r.post("/v1/completions", COMPLETION)
            assert status == 200, raw
            assert not r.router.balancer.decode_legs and not r.router.balancer.prefill_legs
            assert r.router.bodies.buffered == 0

    run(go())
    print(f"router body fuzz (seed {SEED}): {CASES} cases by kind {dict(sorted(kinds.items()))}")
    print(f"statuses {dict(sorted(statuses.items()))}; refused by the HTTP parser {dict(http_refusals)}")
    assert server_errors == []
    assert statuses[500] == 0
