"""Faults: a decoder that dies (before or during the WRITE), comes back with the same identity, and a producer
that never writes."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from _procs import Cluster, check_push, read_pool, written_bytes
from test_push import DENSE, prefill_specs, remote

from disagg.rig.local import free_port
from disagg.worker.link.kv_pool import ShmPool

# DENSE blocks are 4 KiB per layer, 6 layers: 21 000 blocks are 126 000 descriptors, ~490 MiB. On the 2-core
# CPU machines one such WRITE takes ~0.45 s, of which ~0.33 s is copying; the kill below lands within a few
# milliseconds of the first copied block.
MID_WRITE_BLOCKS = 21_000


def test_dead_decoder_fails_the_push_lease_frees_blocks_and_a_restarted_decoder_is_served(
    procs: Cluster,
) -> None:
    [prefill] = prefill_specs(procs, DENSE, lease_s=5.0)
    decode = procs.spec("decode", role="consumer", serve_port=free_port(), model=DENSE)
    producer, consumer = procs.start_all([prefill, decode])

    consumer.send(cmd="expect", req="req-1", blocks=[[1, 2]], remote=remote(prefill))
    producer.wait("registered", "req-1")
    producer.send(cmd="finish", req="req-1", blocks=[[3, 4]])
    producer.wait("sent", "req-1")
    consumer.wait("finished", "req-1")

    # The decoder registers its next request, then dies before the producer has the KV to push.
    consumer.send(cmd="expect", req="req-2", blocks=[[5, 6]], remote=remote(prefill))
    producer.wait("registered", "req-2")
    consumer.kill()
    producer.send(cmd="finish", req="req-2", blocks=[[7, 8]])
    failed = producer.wait("failed", "req-2")
    assert failed["reason"] == "TransferFailed", failed
    assert failed["peers"] == [], failed  # the dead decoder's agent is evicted
    producer.wait("expired", "req-2")

    # Same engine id, agent names, host and port: the producer handshakes it again.
    restarted = procs.start(decode)
    restarted.wait("ready")
    restarted.send(cmd="expect", req="req-3", blocks=[[9, 10]], remote=remote(prefill))
    producer.wait("registered", "req-3")
    producer.send(cmd="finish", req="req-3", blocks=[[11, 12]])
    producer.wait("sent", "req-3")
    restarted.wait("finished", "req-3")
    check_push(decode, read_pool(decode), [(prefill, [[11, 12]], [[9, 10]])])


def test_consumer_watchdog_fails_a_registration_nobody_completes(procs: Cluster) -> None:
    [prefill] = prefill_specs(procs, DENSE)
    decode = procs.spec(
        "decode", role="consumer", serve_port=free_port(), model=DENSE, registration_timeout_s=3.0
    )
    producer, consumer = procs.start_all([prefill, decode])
    consumer.send(cmd="expect", req="req-1", blocks=[[1, 2]], remote=remote(prefill))
    producer.wait("registered", "req-1")
    failed = consumer.wait("failed", "req-1")
    assert failed["reason"] == "RegistrationTimeout", failed
    assert "0 of 1 completion notifs" in failed["message"]
    # Nothing arrived: the decoder's pool is exactly as it started.
    check_push(decode, read_pool(decode), [])


def landed(pool: np.ndarray, source: np.ndarray, ranges: list[tuple[int, int, int]]) -> int:
    """How many of the (decoder offset, producer offset, length) ranges hold the producer's bytes."""
    return sum(np.array_equal(pool[d : d + n], source[p : p + n]) for d, p, n in ranges)


def wait_for_first_bytes(
    decode: dict[str, Any], source: np.ndarray, ranges: list[tuple[int, int, int]]
) -> None:
    """Return as soon as any of `ranges` has landed in the decoder's pool: the WRITE is under way."""
    pool = ShmPool(decode["pool_path"])
    try:
        deadline = time.monotonic() + 60
        while not landed(pool.array, source, ranges):
            assert time.monotonic() < deadline, "no pushed byte reached the decoder"
            time.sleep(0.001)
    finally:
        pool.close()


def test_decoder_killed_mid_write_fails_the_push_evicts_it_and_the_lease_frees_the_blocks(
    procs: Cluster,
) -> None:
    n = MID_WRITE_BLOCKS
    [prefill] = prefill_specs(procs, DENSE, lease_s=5.0, num_blocks=n + 2)
    decode = procs.spec("decode", role="consumer", serve_port=free_port(), model=DENSE, num_blocks=n + 4)
    producer, consumer = procs.start_all([prefill, decode])

    # A first push connects the decoder, so the poll right after the next `finish` posts the WRITE itself.
    consumer.send(cmd="expect", req="req-1", blocks=[[1, 2]], remote=remote(prefill))
    producer.wait("registered", "req-1")
    producer.send(cmd="finish", req="req-1", blocks=[[3, 4]])
    producer.wait("sent", "req-1")
    consumer.wait("finished", "req-1")

    p_blocks = [list(range(2, 2 + n))]
    # Descending on the decoder: no two neighbours are adjacent in both pools, so nothing merges and every
    # 4 KiB block is its own descriptor.
    d_blocks = [list(range(3 + n, 3, -1))]
    ranges = written_bytes(prefill, decode, p_blocks, d_blocks)
    source = read_pool(prefill)
    assert landed(read_pool(decode), source, ranges) == 0

    consumer.send(cmd="expect", req="req-2", blocks=d_blocks, remote=remote(prefill))
    producer.wait("registered", "req-2")
    producer.send(cmd="finish", req="req-2", blocks=p_blocks, announce=True)
    producer.wait("posting", "req-2", timeout=30)
    wait_for_first_bytes(decode, source, ranges[::500])
    consumer.kill()

    failed = producer.wait("failed", "req-2", timeout=30)
    assert not [e for e in producer.seen if e["event"] == "sent"], "the WRITE completed before the kill"
    assert failed["reason"] == "TransferFailed", failed
    assert "RemoteDisconnect" in failed["message"], failed
    assert failed["peers"] == [], failed  # the dead decoder's agent is evicted
    # The kill landed inside the WRITE: part of the blocks arrived, not all.
    arrived = landed(read_pool(decode), source, ranges)
    assert 0 < arrived < len(ranges), f"{arrived} of {len(ranges)} blocks arrived"
    # The blocks stay held after the failure (the decoder may have been reading them) until the lease ends.
    producer.wait("expired", "req-2", timeout=30)
    producer.send(cmd="peers")
    assert producer.wait("peers", timeout=30)["peers"] == []
