"""Real vLLM engines as the operator generates them, P/D through the project's router against the monolithic
engine, prompt for prompt (issue 42): a dense model and hybrids of 4 and 5 KV cache groups, PP1 and PP2
prefills (one process per stage, `--nnodes 2 --node-rank k`, stage 1 `--headless`, the side channel at the
head), uneven PP splits, and lengths at every block and window edge (`differential`).

The 8-layer window-64 hybrid is the shape of the 1-in-50 wrong answer: under vLLM's hybrid KV cache manager a
decoder that loads a whole prompt loses a window's first key for the lengths `releases.loses_window_edge`
names (docs/vllm-sliding-window-load.md). With the operator's default it runs without HMA and every length is
right; with `spec.model.slidingWindow` HMA stays on and the router serves those lengths on the decoder alone,
and every answer is right again. No test here may see a wrong answer come back with a 200.
"""

from __future__ import annotations

import json
import re
import urllib.request

import differential
from serving import PROMPTS, Pending, Serving, answered, decoder_full, serving, wait_until

from disagg.rig.vllm_engines import SHAPES, metric, tiny_deployment
from disagg.worker.contracts.releases import loses_window_edge


def decoder_log(deployment: Serving) -> str:
    return deployment.engines.log_text(deployment.engines.heads("decode")[0])


def kv_cache_groups(deployment: Serving) -> int:
    """How many KV cache groups vLLM's hybrid KV cache manager made on the decoder (its log's `kv cache group
    sizes` tuple)."""
    lines = [line for line in decoder_log(deployment).splitlines() if "group sizes" in line]
    assert lines, "the decoder logged no KV cache groups"
    sizes = re.search(r"\(([\d, ]+)\)", lines[-1])
    assert sizes is not None, lines[-1]
    return len([size for size in sizes.group(1).split(",") if size.strip()])


def tokens_by_source(deployment: Serving) -> tuple[float, float]:
    """The decoder's prompt tokens (arrived by KV transfer, computed there)."""
    return deployment.prompt_tokens("external_kv_transfer"), deployment.prompt_tokens("local_compute")


def recomputed(deployment: Serving) -> float:
    with urllib.request.urlopen(deployment.router.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return metric(text, "disagg_router_recomputed_requests_total", {"reason": "WindowEdge"})


def assert_every_answer_right(deployment: Serving, shape: str, *, lost_served_alone: bool) -> None:
    """The differential run: no mismatch, and the decoder's own counts say which prompts crossed the pair."""
    external, local = tokens_by_source(deployment)
    report = differential.run(deployment, shape)
    assert report.mismatches == [], "\n".join(map(str, report.mismatches))
    window = SHAPES[shape].sliding_window
    lengths = differential.edge_lengths(shape, report.prompts)
    lost = [n for n in lengths if window and loses_window_edge(n, window, differential.BLOCK)]
    after_external, after_local = tokens_by_source(deployment)
    # Every prompt crossed the pair; the monolithic runs (twice) and any prompt served alone were computed
    # there. vLLM counts a 1-token prompt's token as computed: the decoder recomputes a loaded prompt's last
    # token, here all of it.
    single = lengths.count(1)
    assert after_external - external == report.prompt_tokens - single
    alone = sum(lost) if lost_served_alone else 0
    assert after_local - local == 2 * report.prompt_tokens + alone + single
    assert recomputed(deployment) == (len(lost) if lost_served_alone else 0)


def assert_late_registrations_answer_right(deployment: Serving) -> None:
    """Requests whose decode legs wait in a full decoder's queue register their blocks with the prefill only
    after it has answered them (as a router that sends the legs one after the other makes every request do):
    the prefill holds the KV within its lease and writes it when the registration comes; every answer is
    still the decoder-alone one."""
    engines = deployment.engines
    prefill = engines.heads("prefill")[0]
    want = deployment.monolithic(PROMPTS)
    before = answered(prefill.url)
    with decoder_full(engines):
        pending = [Pending(deployment.router.url, deployment.body(prompt)) for prompt in PROMPTS]
        wait_until(lambda: answered(prefill.url) >= before + len(PROMPTS), 120, "the prefill did not answer")
    for prompt, expected, waiting in zip(PROMPTS, want, pending, strict=True):
        status, raw = waiting.wait()
        assert status == 200, raw
        assert json.loads(raw)["choices"][0]["text"] == expected, (prompt, raw)


def test_a_dense_pp2_prefill_with_an_uneven_split_into_a_pp1_decoder() -> None:
    with serving(tiny_deployment("tiny-dense-pp2", "dense", prefill_pp=2, layer_partition=[3, 1])) as d:
        stages = [pod for pod in d.engines.pods if pod.role == "prefill"]
        assert [(pod.ordinal, pod.serves_http) for pod in stages] == [(0, True), (1, False)]
        assert "--headless" in stages[1].argv[2], "the generated stage launcher runs rank 1 headless"
        routing = d.engines.routing()
        assert routing.prefills[0].pp_size == 2
        assert routing.prefills[0].kv_hash == d.engines.hashes["prefill"]
        assert_every_answer_right(d, "dense", lost_served_alone=False)
        assert_late_registrations_answer_right(d)


def test_the_wrong_answer_shape_runs_without_hma_by_default_and_every_length_is_right() -> None:
    with serving(tiny_deployment("tiny-4g", "hybrid-4g")) as d:
        assert all("--disable-hybrid-kv-cache-manager" in pod.argv for pod in d.engines.pods)
        assert "'disable_hybrid_kv_cache_manager': True" in decoder_log(d), "vLLM read the flag"
        assert_every_answer_right(d, "hybrid-4g", lost_served_alone=False)


def test_with_its_window_named_hma_stays_on_and_the_router_serves_the_lost_lengths_alone() -> None:
    with serving(tiny_deployment("tiny-4g-hma", "hybrid-4g", sliding_window=True)) as d:
        assert not any("--disable-hybrid-kv-cache-manager" in pod.argv for pod in d.engines.pods)
        assert kv_cache_groups(d) == 4
        assert d.engines.router_args == ("--recompute-window-edge=64:32",)
        assert_every_answer_right(d, "hybrid-4g", lost_served_alone=True)


def test_a_pp2_hma_prefill_with_an_uneven_split_into_a_pp1_decoder_by_layer_name() -> None:
    # Five KV cache groups; stage 0 holds 6 layers, stage 1 the other 4, and each pools them otherwise than
    # the decoder does: layer-name routing pairs them.
    document = tiny_deployment(
        "tiny-5g-pp2", "hybrid-5g", prefill_pp=2, layer_partition=[6, 4], sliding_window=True
    )
    with serving(document) as d:
        assert kv_cache_groups(d) == 5
        assert d.engines.routing().prefills[0].pp_size == 2
        assert_every_answer_right(d, "hybrid-5g", lost_served_alone=True)
        assert_late_registrations_answer_right(d)
