"""No body the router is sent produces a 500: a client's JSON nesting is bounded before it reaches code that
recurses."""

from __future__ import annotations

import json
from typing import Any

from router_rig import rig, run

from disagg.worker.router.protocol import MAX_JSON_DEPTH, parse_client_request


def test_a_deeply_nested_prompt_is_refused_as_the_clients_fault() -> None:
    # The body of issue 22: a prompt of lists nested 600 deep, 2.4 KB.
    raw = b'{"model": "tiny", "prompt": ' + b"[" * 600 + b"]" * 600 + b"}"

    async def go() -> None:
        async with rig() as r:
            async with r.client.post(r.url + "/v1/completions", data=raw) as response:
                assert response.status == 400
                error = (await response.json())["error"]
            assert f"deeper than {MAX_JSON_DEPTH}" in error["message"]
            assert r.prefill.received == []

    run(go())


def test_a_nested_prompt_within_the_bound_is_weighed() -> None:
    prompt: list[Any] = [1, "abc"]
    for _ in range(MAX_JSON_DEPTH - 2):
        prompt = [prompt, 2]
    request = parse_client_request("/v1/completions", json.dumps({"prompt": prompt}).encode())
    assert request.prompt_weight == 1 + 3 + (MAX_JSON_DEPTH - 2)
