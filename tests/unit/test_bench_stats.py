"""`disagg bench vllm`'s and `disagg bench push`'s own arithmetic, on fixed inputs: percentiles, a level's
summary, ratios, histogram means between two scrapes, the hop-by-hop split, and where the push finds huge
pages. No timing is asserted: every input here is a constant."""

from __future__ import annotations

import math

from disagg.rig.bench_push import huge_page_dir
from disagg.rig.bench_stats import (
    Outcome,
    first_token_rest,
    histogram,
    hop_split,
    mean_between,
    percentile,
    ratio,
    summarize,
)


def test_percentiles_interpolate_between_ranks_and_are_nan_without_values() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == 4.6
    assert percentile([7.0], 90) == 7.0
    assert math.isnan(percentile([], 50))


def test_a_level_counts_failures_and_wrong_answers_apart_and_times_only_the_requests_that_succeeded() -> None:
    outcomes = [
        Outcome(ttft=0.1, gaps=[0.01, 0.03], matches=True),
        Outcome(ttft=0.3, gaps=[0.02], matches=False),
        Outcome(error="HTTP 502: PrefillFailed"),
        Outcome(ttft=0.2, gaps=[], matches=True),
    ]
    level = summarize("disagg router", 8, outcomes, 2.0, rss_mib=50.0, cpu_s=1.5)
    assert (level.requests, level.failed, level.wrong) == (4, 1, 1)
    assert level.ttft_p50 == 0.2
    assert math.isclose(level.itl_mean, 0.02)
    assert level.rate == 2.0
    assert level.first_error == "HTTP 502: PrefillFailed"
    everything_failed = summarize("peer", 1, [Outcome(error="x")], 1.0)
    assert math.isnan(everything_failed.ttft_p50) and math.isnan(everything_failed.itl_mean)


def test_ratios_are_nan_where_either_side_is_unknown() -> None:
    assert ratio(1.5, 1.0) == 1.5
    assert math.isnan(ratio(1.0, 0.0))
    assert math.isnan(ratio(math.nan, 1.0))
    assert math.isnan(ratio(1.0, math.nan))


def _router_scrape(dispatch: float, prefill: float, kv: float, ttft: float, itl: float, n: int) -> str:
    lines = []
    for name, total in [
        ("disagg_router_dispatch_seconds", dispatch),
        ("disagg_router_prefill_leg_seconds", prefill),
        ("disagg_router_kv_wait_seconds", kv),
        ("disagg_router_time_to_first_token_seconds", ttft),
        ("disagg_router_inter_token_latency_seconds", itl),
        ("disagg_router_decode_leg_seconds", ttft + itl),
    ]:
        lines += [
            f'{name}_bucket{{endpoint="/v1/completions",le="+Inf"}} {n}.0',
            f'{name}_sum{{endpoint="/v1/completions"}} {total}',
            f'{name}_count{{endpoint="/v1/completions"}} {n}.0',
        ]
    return "\n".join(lines)


def _engine_scrape(queue: float, prefill: float, n: int) -> str:
    labels = 'engine="0",model_name="tiny"'
    return "\n".join(
        [
            "# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.",
            f"vllm:request_queue_time_seconds_sum{{{labels}}} {queue}",
            f"vllm:request_queue_time_seconds_count{{{labels}}} {n}.0",
            f"vllm:request_prefill_time_seconds_sum{{{labels}}} {prefill}",
            f"vllm:request_prefill_time_seconds_count{{{labels}}} {n}.0",
            # A metric whose name starts like another's is not summed into it.
            f"vllm:request_queue_time_seconds_total_extra{{{labels}}} 99.0",
        ]
    )


def test_histogram_means_count_only_the_observations_between_two_scrapes() -> None:
    before = _engine_scrape(queue=1.0, prefill=2.0, n=10)
    after = _engine_scrape(queue=1.5, prefill=4.0, n=20)
    assert histogram(after, "vllm:request_queue_time_seconds", {"engine": "0"}) == (1.5, 20.0)
    assert histogram(after, "vllm:request_queue_time_seconds", {"engine": "1"}) == (0.0, 0.0)
    assert math.isclose(mean_between(before, after, "vllm:request_prefill_time_seconds"), 0.2)
    assert math.isnan(mean_between(before, before, "vllm:request_prefill_time_seconds"))


def test_the_hop_split_takes_each_hop_from_its_own_source_in_the_order_a_request_passes_them() -> None:
    before = {
        "router": _router_scrape(0.0, 0.0, 0.0, 0.0, 0.0, 0),
        "prefill": _engine_scrape(0.0, 0.0, 0),
        "decode": _engine_scrape(0.0, 0.0, 0),
    }
    # 4 requests: 1 ms dispatch, 100 ms prefill leg, 30 ms KV handoff, 135 ms TTFT each.
    after = {
        "router": _router_scrape(0.004, 0.4, 0.12, 0.54, 0.08, 4),
        "prefill": _engine_scrape(0.02, 0.32, 4),
        "decode": _engine_scrape(0.06, 0.04, 4),
    }
    split = dict(hop_split(before, after))
    labels = list(split)
    assert labels.index("prefill leg (sent to its answer checked)") < labels.index(
        "KV handoff and the decoder's first token"
    )
    assert math.isclose(split["router: arrival to both legs sent (parse, pick a pair)"], 0.001)
    assert math.isclose(split["prefill leg (sent to its answer checked)"], 0.1)
    assert math.isclose(split["  of which the prefill engine computed"], 0.08)
    assert math.isclose(split["  decoder waited for the KV (from its leg's arrival)"], 0.015)
    assert math.isclose(split["KV handoff and the decoder's first token"], 0.03)
    assert math.isclose(first_token_rest(before["router"], after["router"]), 0.135 - 0.001 - 0.1 - 0.03)


MOUNTS = """\
tmpfs /dev/shm tmpfs rw,relatime,size=24683772k 0 0
tmpfs /mnt/ro\\040huge tmpfs ro,relatime,huge=always 0 0
hugetlbfs /dev/hugepages hugetlbfs rw,relatime,pagesize=2M 0 0
tmpfs /mnt/kv\\040pool tmpfs rw,relatime,size=1048576k,huge=always 0 0
"""


def test_the_push_finds_a_writable_huge_page_mount_with_room_and_ignores_the_rest() -> None:
    need = 1 << 30
    # The read-only huge tmpfs is skipped; hugetlbfs without free pages too; the huge tmpfs is chosen.
    assert huge_page_dir(MOUNTS, hugetlb_free_bytes=0, need_bytes=need) == "/mnt/kv pool"
    assert huge_page_dir(MOUNTS, hugetlb_free_bytes=need, need_bytes=need) == "/dev/hugepages"
    assert huge_page_dir(MOUNTS.splitlines()[0], hugetlb_free_bytes=need, need_bytes=need) is None
