"""The demo scenario, smaller: 2 PP prefill stages and a decoder, each with its sidecar, NIXL on loopback.

Decode output must equal the monolithic run; every stage's sidecar must report exactly the bytes its layers
hold for the prompt blocks; SIGTERM ends every sidecar with exit code 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
from sidecar_procs import metric

from disagg.rig.demo import DemoCluster, RequestResult, format_table, reference_tokens, summary
from disagg.worker.engine.config import TinyConfig, encode

CONFIG = TinyConfig()
PROMPTS = [encode("Short prompt."), encode("A longer prompt that runs past the sliding window of 32 tokens.")]
MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def run() -> Iterator[tuple[DemoCluster, list[RequestResult]]]:
    references = reference_tokens(CONFIG, PROMPTS, MAX_NEW_TOKENS)
    cluster = DemoCluster(CONFIG, num_blocks=48)
    with cluster:
        results = [
            cluster.run_request(f"req-{i}", prompt, MAX_NEW_TOKENS, reference)
            for i, (prompt, reference) in enumerate(zip(PROMPTS, references, strict=True))
        ]
        yield cluster, results


def stage_bytes(stage: int) -> int:
    """Independent of the connector: each layer of the stage moves its group's prompt blocks, whole."""
    block_len = 2 * CONFIG.num_kv_heads * CONFIG.block_size * CONFIG.head_size * 4
    layers = len(CONFIG.stages(2)[stage])
    return sum(layers * math.ceil(len(p) / CONFIG.block_size) * block_len for p in PROMPTS)


def test_decode_after_disaggregated_prefill_equals_the_monolithic_run(
    run: tuple[DemoCluster, list[RequestResult]],
) -> None:
    _, results = run
    assert [r.prompt_tokens for r in results] == [len(p) for p in PROMPTS]
    for result in results:
        assert len(result.tokens) == MAX_NEW_TOKENS
        assert result.tokens == result.reference, result.request_id
    assert sum(r.bytes_moved for r in results) == stage_bytes(0) + stage_bytes(1)


def test_health_and_metrics_after_the_transfers(run: tuple[DemoCluster, list[RequestResult]]) -> None:
    cluster, _ = run
    prefill, decode = cluster.workers[:2], cluster.workers[2]
    for worker in cluster.workers:
        assert cluster.http_get(worker, "/healthz") == (200, "ok\n")
        assert cluster.http_get(worker, "/readyz") == (200, "ready\n")
    for stage, worker in enumerate(prefill):
        code, text = cluster.http_get(worker, "/metrics")
        assert code == 200
        assert metric(text, "disagg_kv_bytes_pushed_total") == stage_bytes(stage) > 0
        assert metric(text, "disagg_kv_transfers_total", direction="sent") == len(PROMPTS)
        assert metric(text, "disagg_handshake_latency_seconds_count", peer_role="decode") == 1
        assert metric(text, "disagg_kv_lease_expiries_total") == 0
        assert "disagg_kv_transfer_failures_total{" not in text
    _, text = cluster.http_get(decode, "/metrics")
    assert metric(text, "disagg_kv_transfers_total", direction="received") == len(PROMPTS)
    assert metric(text, "disagg_kv_bytes_pushed_total") == 0
    assert metric(text, "disagg_handshake_latency_seconds_count", peer_role="prefill") == 1
    assert (
        metric(text, "disagg_sidecar_info", role="decode", engine_id="demo-decode", pp_rank="0", tp_rank="0")
        == 1
    )


def test_each_stage_reports_the_transport_ucx_chose_for_its_pair_and_the_bytes_it_moved(
    run: tuple[DemoCluster, list[RequestResult]],
) -> None:
    """On loopback, UCX's default moves a WRITE with CMA: the report says so from UCX's own selection."""
    cluster, _ = run
    for stage, worker in enumerate(cluster.workers[:2]):
        _, text = cluster.http_get(worker, "/metrics")
        pair = {"prefill": "demo-prefill", "decode": "demo-decode"}
        info = metric(text, "disagg_kv_transport_info", transport="shm", lanes="cma/memory", **pair)
        assert info == 1, text
        assert metric(text, "disagg_kv_pair_bytes_total", **pair) == stage_bytes(stage)
        seconds = metric(text, "disagg_kv_pair_transfer_seconds_total", **pair)
        assert seconds is not None and seconds > 0
        assert (metric(text, "disagg_kv_pair_bandwidth_gbps", **pair) or 0) > 0
    _, text = cluster.http_get(cluster.workers[2], "/metrics")
    assert "disagg_kv_transport_info{" not in text


def test_sigterm_stops_every_sidecar_with_exit_code_0(run: tuple[DemoCluster, list[RequestResult]]) -> None:
    cluster, _ = run
    processes = [proc.popen for proc in cluster.sidecars]
    cluster.close()
    assert cluster.sidecar_exit_codes == {f"sidecar {w.name}": 0 for w in cluster.workers}
    assert all(p is not None and p.poll() == 0 for p in processes)


def test_the_summary_claims_identical_only_when_every_request_is() -> None:
    same = RequestResult("a", 5, 3, 100, 0.001, 0.01, [1, 2], [1, 2])
    other = RequestResult("b", 5, 3, 100, 0.001, 0.01, [1, 3], [1, 2])
    assert summary([same, same]) == "all 2 requests identical to the monolithic run"
    assert summary([same, other]) == "1 of 2 requests differ from the monolithic run: b"
    assert format_table([same, other]).splitlines()[-1].split()[-1] == "NO"
