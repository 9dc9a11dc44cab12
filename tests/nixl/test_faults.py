"""Faults: a decoder that dies, comes back with the same identity, and a producer that never writes."""

from __future__ import annotations

from _procs import Cluster, check_push, free_port, read_pool
from test_push import DENSE, prefill_specs, remote


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
