"""Idle remote engines are evicted (vLLM `engine_ttl`), busy ones are kept, and an evicted one is handshaken
again on its next request.

A producer and a consumer live in this test's process, each with its own NIXL agent, KV pool in /dev/shm and
side channel; NIXL moves the bytes between them over UCX. Each side's clock is a test-controlled value, so
whether an engine is idle is decided by the eviction rule, not by how loaded the machine is.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _procs import HOST, check_push, initial_pool, layout_of, model_of
from test_push import DENSE

from disagg.rig.local import free_port
from disagg.worker.connector.consumer import PushConsumer
from disagg.worker.connector.producer import PushProducer
from disagg.worker.connector.push import LocalKV, PushConfig, RemoteEngine, agent_name
from disagg.worker.connector.side_channel import SideChannelServer
from disagg.worker.connector.transport import LOCAL_AGENT, NixlTransport, PreppedList
from disagg.worker.link.kv_pool import ShmPool

TTL_S = 100.0
PROBE_S = 10.0
PROBE_TIMEOUT_S = 1.0
DECODE_AGENT = agent_name("decode", 0, 0)
PREFILL_AGENT = agent_name("prefill", 0, 0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TrackingTransport(NixlTransport):
    """A real transport that keeps the descriptor lists it prepared for peers until they are released."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.remote_lists: list[PreppedList] = []

    def prep(self, agent: str, descs: Any, mem_type: str = "DRAM") -> PreppedList:
        prepped = super().prep(agent, descs, mem_type)
        if agent != LOCAL_AGENT:
            self.remote_lists.append(prepped)
        return prepped

    def release_prepped(self, prepped: PreppedList) -> None:
        super().release_prepped(prepped)
        self.remote_lists = [p for p in self.remote_lists if p is not prepped]


class Worker:
    """One connector worker: seeded pool, NIXL agent, side channel serving its handshake payload."""

    def __init__(self, spec: dict[str, Any], stack: contextlib.ExitStack) -> None:
        self.spec = spec
        self.clock = Clock()
        layout = layout_of(spec)
        pool = ShmPool.create(spec["pool_path"], layout.total_bytes)
        stack.callback(pool.unlink)
        stack.callback(pool.close)
        pool.array[:] = initial_pool(spec, layout.total_bytes)
        self.pool = pool
        config = PushConfig(
            engine_id=spec["engine_id"],
            model=model_of(spec),
            side_channel_host=HOST,
            side_channel_port=spec["port"],
            compat_hash=spec["compat_hash"],
            kv_lease_duration_s=spec["lease_s"],
            push_registration_timeout_s=spec["registration_timeout_s"],
            engine_ttl_s=TTL_S,
            # Off unless a test turns them on: probes are handshakes, which the tests below count.
            peer_probe_interval_s=spec.get("probe_interval_s", 0.0),
            handshake_timeout_s=PROBE_TIMEOUT_S,
        )
        self.transport = TrackingTransport(agent_name(spec["engine_id"], 0, 0))
        stack.callback(self.transport.close)
        local = LocalKV(layout, self.transport, pool.addr, pool.nbytes, config)
        self.server = SideChannelServer(HOST, spec["port"]).start()
        stack.callback(self.server.stop)
        self.server.set_payload(0, 0, local.handshake_payload())
        self.connector: PushProducer | PushConsumer
        if spec["role"] == "producer":
            self.connector = PushProducer(local, clock=self.clock)
        else:
            self.connector = PushConsumer(local, clock=self.clock)
        stack.callback(self.connector.close)

    @property
    def producer(self) -> PushProducer:
        assert isinstance(self.connector, PushProducer)
        return self.connector

    @property
    def consumer(self) -> PushConsumer:
        assert isinstance(self.connector, PushConsumer)
        return self.connector

    def remote(self) -> RemoteEngine:
        return RemoteEngine(self.spec["engine_id"], HOST, self.spec["port"])


class Pair:
    """A producer and a consumer, polled together; every event either reports is collected here."""

    def __init__(self, prefill: Worker, decode: Worker) -> None:
        self.prefill = prefill
        self.decode = decode
        self.sent: list[str] = []
        self.finished: list[str] = []
        self.registered: list[str] = []
        self.pushes: list[tuple[list[list[int]], list[list[int]]]] = []

    def poll(self) -> None:
        p_events = self.prefill.producer.poll()
        d_events = self.decode.consumer.poll()
        failed = [*p_events.failed, *d_events.failed]
        assert not failed, failed
        assert not p_events.expired, p_events.expired
        self.sent += [sent.request_id for sent in p_events.sent]
        self.registered += p_events.registered
        self.finished += d_events.finished

    def poll_until(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 60  # a bound for a broken run, not a measurement
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} never happened; sent {self.sent}, finished {self.finished}")
            self.poll()
            time.sleep(0.002)

    def expect(self, req: str, d_blocks: list[list[int]]) -> None:
        """The decoder registers `req`; the producer has seen the registration when this returns."""
        self.decode.consumer.expect(req, d_blocks, self.prefill.remote())
        self.poll_until(lambda: req in self.registered, f"registration of {req}")

    def finish(self, req: str, p_blocks: list[list[int]], d_blocks: list[list[int]]) -> None:
        """The producer's KV for `req` is ready; returns when it is pushed and the decoder has counted it."""
        self.prefill.producer.request_finished(req, p_blocks)
        self.poll_until(lambda: req in self.sent and req in self.finished, f"push of {req}")
        self.pushes.append((p_blocks, d_blocks))

    def push(self, req: str, p_blocks: list[list[int]], d_blocks: list[list[int]]) -> None:
        self.expect(req, d_blocks)
        self.finish(req, p_blocks, d_blocks)

    def check_bytes(self) -> None:
        """Every push so far landed byte-exact, and no other decoder byte changed."""
        decode_pool = np.array(self.decode.pool.array, copy=True)
        pushes = [(self.prefill.spec, p, d) for p, d in self.pushes]
        assert check_push(self.decode.spec, decode_pool, pushes) > 0


@pytest.fixture
def pair(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Pair]:
    def spec(engine_id: str, role: str) -> dict[str, Any]:
        return {
            "engine_id": engine_id,
            "role": role,
            "model": DENSE,
            "pp_rank": 0,
            "pp_size": 1,
            "tp_rank": 0,
            "tp_size": 1,
            "block_size": 16,
            "num_blocks": 32,
            "seed": len(engine_id),
            "port": free_port(),
            "pool_path": f"/dev/shm/disagg-evict-{os.getpid()}-{tmp_path.name}-{engine_id}",
            "compat_hash": "0" * 64,
            "lease_s": 10 * TTL_S,
            "registration_timeout_s": 10 * TTL_S,
            "probe_interval_s": request.param if hasattr(request, "param") else 0.0,
        }

    with contextlib.ExitStack() as stack:
        prefill = Worker(spec("prefill", "producer"), stack)
        decode = Worker(spec("decode", "consumer"), stack)
        yield Pair(prefill, decode)


def remote_lists(worker: Worker, agent: str) -> list[PreppedList]:
    return [p for p in worker.transport.remote_lists if p.agent == agent]


def test_producer_evicts_an_idle_decoder_and_handshakes_it_again(pair: Pair) -> None:
    prefill = pair.prefill
    pair.push("req-1", [[3, 4]], [[1, 2]])
    assert DECODE_AGENT in prefill.transport.peers
    assert len(remote_lists(prefill, DECODE_AGENT)) == 1
    assert pair.decode.server.served == 1

    prefill.clock.now = TTL_S / 2
    pair.poll()
    assert DECODE_AGENT in prefill.transport.peers, "evicted before its ttl"

    prefill.clock.now = TTL_S + 1
    pair.poll()
    assert DECODE_AGENT not in prefill.transport.peers
    assert remote_lists(prefill, DECODE_AGENT) == []

    # The decoder kept its own agent for the producer (its clock did not move) and registers again.
    pair.push("req-2", [[7, 9, 10]], [[20, 5, 6]])
    assert pair.decode.server.served == 2, "the producer did not handshake the evicted decoder again"
    assert DECODE_AGENT in prefill.transport.peers
    assert len(remote_lists(prefill, DECODE_AGENT)) == 1
    pair.check_bytes()


def test_producer_keeps_a_decoder_whose_registration_waits_for_kv(pair: Pair) -> None:
    prefill = pair.prefill
    pair.push("req-1", [[3, 4]], [[1, 2]])
    # The decoder registers req-2 long before the producer's KV for it is ready.
    pair.expect("req-2", [[11, 12]])

    prefill.clock.now = 3 * TTL_S
    pair.poll()
    assert DECODE_AGENT in prefill.transport.peers, "a decoder waiting on this producer was evicted"
    assert len(remote_lists(prefill, DECODE_AGENT)) == 1

    pair.finish("req-2", [[13, 14]], [[11, 12]])
    assert pair.decode.server.served == 1, "the kept decoder was handshaken again"
    pair.check_bytes()

    # Served and idle again: now it goes.
    prefill.clock.now = 5 * TTL_S
    pair.poll()
    assert DECODE_AGENT not in prefill.transport.peers
    assert remote_lists(prefill, DECODE_AGENT) == []


def test_consumer_keeps_a_prefill_engine_while_a_request_waits_and_evicts_it_once_idle(pair: Pair) -> None:
    decode = pair.decode
    pair.push("req-1", [[3, 4]], [[1, 2]])
    assert PREFILL_AGENT in decode.transport.peers
    assert pair.prefill.server.served == 1

    # req-2 is registered and waits for KV past the ttl: its prefill engine stays.
    pair.expect("req-2", [[8]])
    decode.clock.now = 3 * TTL_S
    pair.poll()
    assert PREFILL_AGENT in decode.transport.peers, "a prefill engine with a waiting request was evicted"
    pair.finish("req-2", [[5]], [[8]])
    assert pair.prefill.server.served == 1

    # Nothing waits on it and it stays quiet past the ttl: evicted, and handshaken again on the next request.
    decode.clock.now = 4 * TTL_S + 1
    pair.poll()
    assert PREFILL_AGENT not in decode.transport.peers
    pair.push("req-3", [[15, 16]], [[30, 31]])
    assert pair.prefill.server.served == 2, "the consumer did not handshake the evicted prefill engine again"
    assert PREFILL_AGENT in decode.transport.peers
    pair.check_bytes()


def test_producer_drops_a_registration_it_never_serves_and_then_evicts_its_decoder(pair: Pair) -> None:
    prefill = pair.prefill
    pair.push("req-1", [[3, 4]], [[1, 2]])
    # The decoder registers req-2, but this producer never finishes a request of that id.
    pair.expect("req-2", [[11, 12]])
    timeout = prefill.spec["registration_timeout_s"]

    prefill.clock.now = timeout - 1
    pair.poll()
    assert DECODE_AGENT in prefill.transport.peers, "a decoder with a live registration was evicted"

    # Past the registration timeout (the decoder's own watchdog has failed req-2 by then) the registration is
    # dropped, so the decoder is idle and goes at the next eviction check.
    prefill.clock.now = timeout + 1
    pair.poll()
    pair.poll()
    assert DECODE_AGENT not in prefill.transport.peers
    assert remote_lists(prefill, DECODE_AGENT) == []

    # A late request of that id finds no registration: it is held for a decoder, not pushed to this one.
    prefill.producer.request_finished("req-2", [[13, 14]])
    pair.poll()
    assert "req-2" in prefill.producer.held_requests and "req-2" not in pair.sent


def poll_until_probed(pair: Pair, worker: Worker, served: int) -> None:
    """Poll both sides until `worker`'s side channel has answered `served` requests (probes included)."""
    pair.poll_until(
        lambda: worker.server.served >= served, f"{served} answers from {worker.spec['engine_id']}"
    )


def poll_for_eviction(pair: Pair, side: PushProducer | PushConsumer, clock: Clock) -> list[tuple[str, str]]:
    """Step `clock` one probe interval at a time, each step polled for longer than a probe can take, until
    `side` evicts a peer (well before the TTL); what it evicted."""
    for _ in range(int(TTL_S / PROBE_S) - 2):
        clock.now += PROBE_S
        waited = time.monotonic() + 2 * PROBE_TIMEOUT_S
        while time.monotonic() < waited:
            pair.poll()
            evicted = side.take_evictions()
            if evicted:
                return evicted
            time.sleep(0.02)
    raise AssertionError("no eviction before the TTL")


@pytest.mark.parametrize("pair", [PROBE_S], indirect=True)
def test_a_probe_keeps_a_live_idle_decoder_and_evicts_one_gone_from_its_side_channel(pair: Pair) -> None:
    prefill = pair.prefill
    pair.push("req-1", [[3, 4]], [[1, 2]])
    assert pair.decode.server.served == 1
    # Idle for a probe interval: the producer asks the decoder's side channel, which answers as before.
    prefill.clock.now = PROBE_S + 1
    pair.poll()
    poll_until_probed(pair, pair.decode, 2)
    for _ in range(3):
        pair.poll()
    assert prefill.producer.take_evictions() == []
    assert prefill.producer.connected_engines == {"decode"}
    # The decoder's side channel goes away (its pod is gone): two unanswered probes, then eviction.
    pair.decode.server.stop()
    assert poll_for_eviction(pair, prefill.producer, prefill.clock) == [("decode", "PeerUnreachable")]
    assert DECODE_AGENT not in prefill.transport.peers
    assert remote_lists(prefill, DECODE_AGENT) == []


@pytest.mark.parametrize("pair", [PROBE_S], indirect=True)
def test_a_probe_evicts_a_peer_restarted_under_its_engine_id(pair: Pair, tmp_path: Path) -> None:
    decode = pair.decode
    pair.push("req-1", [[3, 4]], [[1, 2]])
    # The prefill engine restarts under the same id and address: a new NIXL agent answers its side channel.
    restarted = NixlTransport(PREFILL_AGENT)
    try:
        layout = layout_of(pair.prefill.spec)
        pool = ShmPool.create(Path("/dev/shm") / f"disagg-evict-restart-{tmp_path.name}", layout.total_bytes)
        try:
            config = pair.prefill.producer.config
            payload = LocalKV(layout, restarted, pool.addr, pool.nbytes, config).handshake_payload()
            pair.prefill.server.set_payload(0, 0, payload)
            decode.clock.now = PROBE_S + 1
            assert poll_for_eviction(pair, decode.consumer, decode.clock) == [("prefill", "PeerRestarted")]
            assert PREFILL_AGENT not in decode.transport.peers
        finally:
            pool.close()
            pool.unlink()
    finally:
        restarted.close()
