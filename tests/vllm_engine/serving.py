"""What every real-engine test asks of a deployment: requests through the project's router, the monolithic
run of the same prompts, and the decoder's own count of where its prompt tokens came from."""

from __future__ import annotations

import json
import threading
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
# The tiny deployments' `--max-num-seqs` (`vllm_engines.ENGINE_ARGS`): a decoder's sequence slots.
MAX_NUM_SEQS = 8
JSON = {"Content-Type": "application/json"}
SUCCESS = "vllm:request_success_total"
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


def answered(url: str) -> float:
    """The engine's finished requests (a prefill head counts each prefill leg it answered)."""
    return metric(engine_metrics(url), SUCCESS)


def running(url: str) -> float:
    return metric(engine_metrics(url), "vllm:num_requests_running")


class Pending:
    """A request sent from a thread while the test holds up or kills an engine."""

    def __init__(self, url: str, body: dict[str, Any], timeout_s: float = 180.0) -> None:
        self.result: tuple[int, bytes] | None = None
        self.timeout_s = timeout_s
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict[str, Any]) -> None:
        self.result = request(url, body, timeout_s=self.timeout_s)

    def wait(self) -> tuple[int, bytes]:
        self._thread.join(self.timeout_s + 30)
        assert self.result is not None, "no answer"
        return self.result


@contextmanager
def decoder_full(engines: VllmEngines) -> Iterator[None]:
    """Every sequence slot of the decoder (`--max-num-seqs`) taken by a long streamed request of its own, so
    that a request sent now waits in its queue without registering its blocks with the prefill; leaving
    closes them (vLLM aborts a stream whose client is gone) and the queued requests run."""
    decoder = engines.heads("decode")[0]
    model = engines.deployment.spec.model.name
    blocker = {"model": model, "prompt": PROMPTS[0], "max_tokens": 1900, "ignore_eos": True, "stream": True}
    opened = []
    try:
        for _ in range(MAX_NUM_SEQS):
            req = urllib.request.Request(
                decoder.url + "/v1/completions",
                json.dumps(blocker).encode(),
                {"Content-Type": "application/json"},
            )
            opened.append(urllib.request.urlopen(req, timeout=60))
            assert opened[-1].readline().startswith(b"data: "), "a blocker did not start"
        wait_until(lambda: running(decoder.url) == MAX_NUM_SEQS, 60, "the blockers are not all running")
        yield
        assert running(decoder.url) == MAX_NUM_SEQS, "a blocker ended before the case was set up"
    finally:
        for response in opened:
            response.close()


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
