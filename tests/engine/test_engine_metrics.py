"""The reference engine's vLLM-named metrics, scraped from its real server (in this process, without a
sidecar: `disagg.rig.engine_in_process`): names, types and labels as vLLM 0.33 defines them, and values that
follow the scheduler (waiting for KV or for blocks, running, KV usage) and the tokens served."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from disagg.rig.engine_in_process import MODEL_NAME, engine_in_process
from disagg.worker.engine.metrics import EngineMetrics

LABELS = {"model_name": MODEL_NAME, "engine": "0"}


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, tuple[str, float]]:
    """Each vLLM family's type and its one sample's value (with vLLM's labels)."""
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    found = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("vllm:") and not family.name.endswith("_created"):
            [sample] = [s for s in family.samples if not s.name.endswith("_created")]
            assert sample.labels == LABELS, sample
            found[family.name] = (family.type, sample.value)
    return found


def test_the_vllm_metrics_follow_the_scheduler_and_the_tokens(tmp_path: Path) -> None:
    async def go() -> None:
        async with (
            engine_in_process(tmp_path, num_blocks=33) as (engine, url),
            aiohttp.ClientSession() as session,
        ):
            m = await scrape(session, url)
            assert m == {
                "vllm:num_requests_running": ("gauge", 0),
                "vllm:num_requests_waiting": ("gauge", 0),
                "vllm:kv_cache_usage_perc": ("gauge", 0),
                "vllm:prompt_tokens": ("counter", 0),
                "vllm:generation_tokens": ("counter", 0),
            }
            # A decode leg holding blocks while its KV is on its way is waiting, as vLLM counts it.
            usable = engine.sched().usable_blocks
            await engine.admit("kv", 16 * 6, "awaiting_kv")
            m = await scrape(session, url)
            assert m["vllm:num_requests_waiting"][1] == 1
            assert m["vllm:kv_cache_usage_perc"][1] == 1 - engine.sched().free_blocks / usable > 0
            # One that finds too few free blocks (3 groups x 6 blocks each, 32 usable) waits for them.
            big = asyncio.ensure_future(engine.admit("big", 16 * 6, "running"))
            await until(lambda: engine.metrics.waiting_for_blocks == 1)
            assert (await scrape(session, url))["vllm:num_requests_waiting"][1] == 2
            engine.release("kv")
            await big
            m = await scrape(session, url)
            assert (m["vllm:num_requests_waiting"][1], m["vllm:num_requests_running"][1]) == (0, 1)
            engine.release("big")
            await until(lambda: engine.sched().free_blocks == usable)

            body = {"model": MODEL_NAME, "prompt": "Hello, metrics!", "max_tokens": 5, "stream": True}
            async with session.post(url + "/v1/completions", json=body) as response:
                assert response.status == 200
                await response.read()
            await until(lambda: engine.sched().free_blocks == usable)
            m = await scrape(session, url)
            assert m["vllm:prompt_tokens"][1] == len(b"Hello, metrics!")
            assert m["vllm:generation_tokens"][1] == 5
            assert m["vllm:kv_cache_usage_perc"][1] == 0
            assert m["vllm:num_requests_running"][1] == 0

    asyncio.run(asyncio.wait_for(go(), 60))


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.01)


def test_an_engine_without_a_scheduler_exports_no_scheduler_sample() -> None:
    # A PP engine's other stages (headless) schedule nothing: vLLM exports those gauges once per engine.
    text = EngineMetrics("m").render().decode()
    assert "# TYPE vllm:num_requests_waiting gauge" in text
    assert "\nvllm:num_requests_waiting{" not in text
    assert 'vllm:generation_tokens_total{engine="0",model_name="m"} 0.0' in text
