"""Benchmark: descriptor ids for one long request under layer-name routing, numpy against plain Python.

The case is the one layer-name routing exists for: a 64-layer 5:1 sliding/full model, prefill PP=2 pushing
into a PP=1 decoder, one 131,072-token request (block size 16, so 8,192 blocks in every group). For each
prefill stage the local and remote descriptor ids are computed by `producer_desc_ids`, the calls
`Producer._write` makes per decode rank (`expand_logical_blocks`, then `TransferPlan.desc_ids`), and by a
straightforward pure-Python implementation of the same formula, in the same run; both must agree exactly.

The producer holds every request's block ids as int64 arrays: `request_finished` and the registration
convert the engine's and the decoder's lists once, when they arrive. The timed numpy path starts from those
arrays; that conversion is timed on its own line, and once more together with the ids (`from lists`).
"""

from __future__ import annotations

import functools
import random
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from disagg.worker.connector.transport import merge_runs
from disagg.worker.kv.layout import ModelGeometry, build_stage_layout, transfer_group_index_by_layer
from disagg.worker.kv.routing import (
    BlockIds,
    IdArray,
    IdBuffer,
    RegionGeometry,
    TransferLayers,
    TransferPlan,
    expand_logical_blocks,
    expand_strided,
    group_arrays,
    local_strided,
    plan_transfer,
    remote_strided,
)

NUM_LAYERS = 64
TOKENS = 131_072
BLOCK_SIZE = 16
PREFILL_PP = 2
PREFILL_CAPACITY = 24_000
DECODE_CAPACITY = 16_384
REPEATS = 5
FAST_REPEATS = 25
"""The numpy paths take milliseconds: more samples keep one scheduling hiccup on a shared machine out of
their median."""


def python_desc_ids(
    block_ids: Sequence[Sequence[int]], capacities: Sequence[int], group_ids: Sequence[int]
) -> list[int]:
    """The baseline: `offset[k] + b` for every transfer layer k and every block b of its group, in Python."""
    offsets = []
    running = 0
    for capacity in capacities:
        offsets.append(running)
        running += capacity
    ids: list[int] = []
    for k, group in enumerate(group_ids):
        offset = offsets[k]
        ids.extend(offset + block for block in block_ids[group])
    return ids


def producer_desc_ids(
    plan: TransferPlan, local_blocks: BlockIds, remote_blocks: BlockIds, buffer: IdBuffer
) -> tuple[IdArray, IdArray]:
    """What `Producer._write` computes for one decode rank from the request's and the decoder's blocks,
    into the producer's id buffer."""
    local = expand_logical_blocks(local_blocks, plan.local.physical_blocks_per_logical_kv_block)
    remote = expand_logical_blocks(remote_blocks, plan.remote.physical_blocks_per_logical_kv_block)
    return plan.desc_ids(local, remote, buffer)


def _median_seconds(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _plans(geometry: ModelGeometry) -> list[TransferPlan]:
    decode = build_stage_layout(
        geometry, pp_rank=0, pp_size=1, tp_size=1, block_size=BLOCK_SIZE, num_blocks=DECODE_CAPACITY
    )
    remote = RegionGeometry.from_layout(
        decode, base_addr=1 << 44, device_id=0, mem_type="VRAM", advertise_members=True
    )
    plans = []
    for rank in range(PREFILL_PP):
        stage = build_stage_layout(
            geometry,
            pp_rank=rank,
            pp_size=PREFILL_PP,
            tp_size=1,
            block_size=BLOCK_SIZE,
            num_blocks=PREFILL_CAPACITY,
        )
        local = RegionGeometry.from_layout(
            stage, base_addr=1 << 40, device_id=0, mem_type="VRAM", advertise_members=True
        )
        plan, _ = plan_transfer(local, remote, transfer_layers=TransferLayers.from_layout(stage))
        plans.append(plan)
    return plans


def main() -> int:
    geometry = ModelGeometry.with_full_every(NUM_LAYERS, 6, num_kv_heads=8, head_size=128, dtype_bytes=2)
    plans = _plans(geometry)
    num_groups = max(transfer_group_index_by_layer(geometry).values()) + 1
    rng = random.Random(0)
    blocks_per_group = TOKENS // BLOCK_SIZE
    local_blocks = [rng.sample(range(1, DECODE_CAPACITY), blocks_per_group) for _ in range(num_groups)]
    remote_blocks = [rng.sample(range(1, DECODE_CAPACITY), blocks_per_group) for _ in range(num_groups)]

    local_arrays, remote_arrays = group_arrays(local_blocks), group_arrays(remote_blocks)
    # Each prefill stage is its own process, with its own producer and id buffer.
    buffers = [IdBuffer() for _ in plans]

    def with_numpy() -> None:
        for p, buffer in zip(plans, buffers, strict=True):
            producer_desc_ids(p, local_arrays, remote_arrays, buffer)

    def converting() -> None:
        for _ in plans:
            group_arrays(local_blocks), group_arrays(remote_blocks)

    def from_lists() -> None:
        for p, buffer in zip(plans, buffers, strict=True):
            producer_desc_ids(p, group_arrays(local_blocks), group_arrays(remote_blocks), buffer)

    def with_python() -> list[tuple[list[int], list[int]]]:
        out = []
        for p in plans:
            groups = p.group_ids or ()
            out.append(
                (
                    python_desc_ids(local_blocks, p.local_capacities(), groups),
                    python_desc_ids(remote_blocks, list(p.remote.region_num_blocks or []), groups),
                )
            )
        return out

    tables = [
        (
            local_strided(p.local, regions=p.local_regions),
            remote_strided(p.remote, p.local, local_regions=p.local_regions),
        )
        for p in plans
    ]
    expanded = [(expand_strided(a), expand_strided(b)) for a, b in tables]

    def gathered(local: BlockIds, remote: BlockIds) -> None:
        """The straightforward path: gather a descriptor row per id on both sides, then merge runs."""
        for p, buffer, (src, dst) in zip(plans, buffers, expanded, strict=True):
            local_ids, remote_ids = producer_desc_ids(p, local, remote, buffer)
            merge_runs(src[local_ids], dst[remote_ids])

    def vectorised(local: BlockIds, remote: BlockIds, stages: Sequence[int] = range(PREFILL_PP)) -> None:
        """`PushProducer._post`: runs from the ids and the strided lists; ids only when nothing merges."""
        for stage in stages:
            p, buffer, (src, dst) = plans[stage], buffers[stage], tables[stage]
            local_kernel = expand_logical_blocks(local, p.local.physical_blocks_per_logical_kv_block)
            remote_kernel = expand_logical_blocks(remote, p.remote.physical_blocks_per_logical_kv_block)
            runs = p.runs(local_kernel, remote_kernel, src, dst)
            if runs is not None and runs.count < runs.num_descs:
                runs.descriptors()
            else:
                p.desc_ids(local_kernel, remote_kernel, buffer)

    # One run per group: what merging is for (ids past the decoder's capacity would be refused).
    contiguous = [np.arange(1, 1 + blocks_per_group, dtype=np.int64) for _ in range(num_groups)]
    write_cases = []
    cases = [("random", local_arrays, remote_arrays), ("contiguous", contiguous, contiguous)]
    for label, local, remote in cases:
        gathered_s = _median_seconds(functools.partial(gathered, local, remote), REPEATS)
        vectorised_s = _median_seconds(functools.partial(vectorised, local, remote), FAST_REPEATS)
        write_cases.append((label, gathered_s, vectorised_s))
    lists_vectorised_s = _median_seconds(
        lambda: vectorised(group_arrays(local_blocks), group_arrays(remote_blocks)), FAST_REPEATS
    )

    def one_producer(stage: int) -> None:
        """What one producer pays: each stage is its own process and converts the lists it receives."""
        vectorised(group_arrays(local_blocks), group_arrays(remote_blocks), [stage])

    per_producer_s = max(
        _median_seconds(functools.partial(one_producer, stage), FAST_REPEATS) for stage in range(len(plans))
    )

    computed = [
        tuple(ids.tolist() for ids in producer_desc_ids(p, local_arrays, remote_arrays, buffer))
        for p, buffer in zip(plans, buffers, strict=True)
    ]
    if computed != with_python():
        print("bench_routing: numpy and pure-Python descriptor ids differ")
        return 1
    numpy_s = _median_seconds(with_numpy, FAST_REPEATS)
    convert_s = _median_seconds(converting, FAST_REPEATS)
    lists_s = _median_seconds(from_lists, FAST_REPEATS)
    python_s = _median_seconds(with_python)
    total_ids = sum(2 * len(p.local_regions) * blocks_per_group for p in plans)
    print(
        f"descriptor ids, {NUM_LAYERS}-layer 5:1 model, PP{PREFILL_PP} -> PP1, {TOKENS} tokens "
        f"({blocks_per_group} blocks/group, {total_ids} ids): numpy {numpy_s * 1e3:.2f} ms, "
        f"pure Python {python_s * 1e3:.2f} ms, speedup x{python_s / numpy_s:.1f} "
        f"(medians of {FAST_REPEATS} and {REPEATS})"
    )
    print(
        f"  block lists to int64 arrays (once per request, on arrival) {convert_s * 1e3:.2f} ms; "
        f"ids from lists {lists_s * 1e3:.2f} ms, speedup x{python_s / lists_s:.1f}"
    )
    for label, gathered_s, vectorised_s in write_cases:
        print(
            f"  before the first WRITE, {label} block tables (ids, descriptor rows, runs): gathered rows and "
            f"merge_runs {gathered_s * 1e3:.2f} ms, from ids and strided lists {vectorised_s * 1e3:.2f} ms, "
            f"speedup x{gathered_s / vectorised_s:.1f}"
        )
    print(
        f"  everything before the first WRITE from the block lists (arrays, ids, descriptor rows, runs), "
        f"random tables: {lists_vectorised_s * 1e3:.2f} ms for both stages one after the other, "
        f"x{python_s / lists_vectorised_s:.1f} against pure-Python ids alone; "
        f"per producer (one stage's process, the slower) {per_producer_s * 1e3:.2f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
