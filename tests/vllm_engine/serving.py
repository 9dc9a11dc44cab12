"""What every real-engine test asks of a deployment: requests through the project's router, the monolithic
run of the same prompts, and the decoder's own count of where its prompt tokens came from."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from disagg.rig.local_router import LocalRouter
from disagg.rig.vllm_engines import VllmEngines, metric

# Greedy prompts of 2 to about 600 tokens with the tiny tokenizer; the longest spans more than 8 blocks of 32.
_WORDS = "disaggregated serving moves the kv cache from prefill to decode over nixl with layer name routing"


def _prompt(words: int) -> str:
    vocabulary = _WORDS.split()
    return " ".join(vocabulary[(i * 5) % len(vocabulary)] + str(i % 7) for i in range(words))


PROMPTS: tuple[str, ...] = tuple(_prompt(n) for n in (1, 8, 40, 120, 300, 5, 60))
MAX_TOKENS = 16
TOKENS_SOURCE = "vllm:prompt_tokens_by_source_total"
# What an engine holds for requests: none running or waiting, and no KV block in use.
RUNNING = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def post(url: str, body: dict[str, Any], timeout_s: float = 180.0) -> dict[str, Any]:
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        answer: dict[str, Any] = json.load(response)
    return answer


def request(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout_s: float = 180.0
) -> tuple[int, bytes]:
    """A completion's status and body, an error status included."""
    headers = headers or {"Content-Type": "application/json"}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def engine_metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        return response.read().decode()


def holds_nothing(url: str) -> bool:
    text = engine_metrics(url)
    return all(metric(text, name) == 0 for name in RUNNING) and metric(text, "vllm:kv_cache_usage_perc") == 0


def wait_until(probe: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


@dataclass
class Serving:
    engines: VllmEngines
    router: LocalRouter

    @property
    def model(self) -> str:
        return self.engines.deployment.spec.model.name

    def body(self, prompt: str) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}

    def through_router(self, prompt: str) -> tuple[str, dict[str, Any]]:
        try:
            answer = post(self.router.url, self.body(prompt))
        except urllib.error.HTTPError as exc:
            # The router's error names the leg and the engine's answer; the logs say what the engines saw.
            answered = f"the router answered {exc.code}: {exc.read()[:2000]!r}"
            raise AssertionError(f"{answered}\n{self.logs()}") from exc
        return answer["choices"][0]["text"], answer["usage"]

    def logs(self, chars: int = 3000) -> str:
        tails = [f"--- router ---\n{self.router.log_tail(chars)}"]
        tails += [f"--- {pod.name} ---\n{self.engines.log_tail(pod, chars)}" for pod in self.engines.pods]
        return "\n".join(tails)

    def monolithic(self, prompts: Sequence[str] = PROMPTS) -> list[str]:
        """Each prompt computed by a decode engine alone (no kv_transfer_params): vLLM's monolithic run of
        the same model, on the same build and kernels."""
        url = self.engines.heads("decode")[0].url
        return [post(url, self.body(p))["choices"][0]["text"] for p in prompts]

    def prompt_tokens(self, source: str) -> float:
        """The decoders' count of prompt tokens by source: `external_kv_transfer` arrived by KV transfer,
        `local_compute` the engine computed itself."""
        total = 0.0
        for pod in self.engines.heads("decode"):
            with urllib.request.urlopen(pod.url + "/metrics", timeout=10) as response:
                total += metric(response.read().decode(), TOKENS_SOURCE, {"source": source})
        return total


@contextmanager
def serving(document: dict[str, Any], run_refused: frozenset[str] = frozenset()) -> Iterator[Serving]:
    with (
        VllmEngines(document, run_refused=run_refused) as engines,
        LocalRouter(engines.routing(), args=engines.router_args) as router,
    ):
        yield Serving(engines, router)
