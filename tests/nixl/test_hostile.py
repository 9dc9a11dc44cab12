"""Hostile peers (issue 15): crafted side-channel requests, `PUSH_REG`s, handshake metadata and completion
notifs. Each one fails that message or request with a typed reason; the connector keeps serving the next
valid peer.

The agents live in this test's process (NIXL delivers notifications between them over UCX), so each case
polls a real producer or consumer fed by real NIXL notifications and a real side channel.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from disagg.rig.local import free_port
from disagg.worker.connector.consumer import ConsumerEvents, PushConsumer
from disagg.worker.connector.producer import ProducerEvents, PushProducer
from disagg.worker.connector.push import LocalKV, PushConfig, RemoteEngine
from disagg.worker.connector.side_channel import SideChannelServer, fetch_payloads
from disagg.worker.connector.transport import NixlTransport
from disagg.worker.kv import wire
from disagg.worker.kv.layout import ModelGeometry, build_stage_layout
from disagg.worker.link.kv_pool import ShmPool

MODEL = ModelGeometry.with_full_every(4, 1, num_kv_heads=2, head_size=8, dtype_bytes=2, hma=False)
HOST = "127.0.0.1"


@dataclass
class Worker:
    local: LocalKV
    pool: ShmPool
    server: SideChannelServer

    @property
    def transport(self) -> NixlTransport:
        return self.local.transport

    def close(self) -> None:
        self.server.stop()
        self.transport.close()
        self.pool.close()
        self.pool.unlink()


@pytest.fixture
def make_worker() -> Iterator[Callable[..., Worker]]:
    made: list[Worker] = []

    def make(engine_id: str, *, tp_size: int = 1, tp_rank: int = 0, num_blocks: int = 8) -> Worker:
        layout = build_stage_layout(
            MODEL, pp_rank=0, pp_size=1, tp_size=tp_size, block_size=16, num_blocks=num_blocks
        )
        name = f"disagg-hostile-{uuid.uuid4().hex[:12]}"
        pool = ShmPool.create(Path("/dev/shm") / name, layout.total_bytes)
        port = free_port()
        config = PushConfig(
            engine_id=engine_id,
            model=MODEL,
            side_channel_host=HOST,
            side_channel_port=port,
            compat_hash=None,
            tp_rank=tp_rank,
            tp_size=tp_size,
            handshake_timeout_s=5.0,
        )
        transport = NixlTransport(f"{engine_id}/pp0/tp{tp_rank}")
        local = LocalKV(layout, transport, pool.addr, pool.nbytes, config)
        server = SideChannelServer(HOST, port, {(0, tp_rank): local.handshake_payload()}).start()
        worker = Worker(local, pool, server)
        made.append(worker)
        return worker

    yield make
    for worker in reversed(made):
        worker.close()


def registration(decoder: Worker, request_id: str, **changes: Any) -> wire.PushRegistration:
    config = decoder.local.config
    reg = wire.PushRegistration(
        request_id, config.engine_id, HOST, config.side_channel_port, config.tp_size, [[1, 2]],
        "prefill", HOST, 1, 1, 1,
    )  # fmt: skip
    return msgspec.structs.replace(reg, **changes)


def poll_producer(
    producer: PushProducer, senders: list[NixlTransport], done: Callable[[ProducerEvents], bool]
) -> list[ProducerEvents]:
    seen = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for sender in senders:
            sender.notifs()  # without a progress thread, a sender's notifs advance only when it polls
        seen.append(producer.poll())
        if done(seen[-1]):
            return seen
        time.sleep(0.005)
    raise AssertionError(f"the producer never reached the expected state: {seen[-5:]}")


def failed_reasons(events: list[ProducerEvents] | list[ConsumerEvents]) -> dict[str, str]:
    return {f.request_id: f.reason for e in events for f in e.failed}


def test_a_recursive_side_channel_request_is_refused_and_the_server_keeps_serving(
    make_worker: Callable[..., Worker],
) -> None:
    worker = make_worker("prefill")
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{HOST}:{worker.server.port}")
        sock.send(b"\x91" * 2000 + b"\x00")  # 2000 nested one-element arrays: RecursionError in msgpack
        payload, _ = sock.recv_multipart()
        assert payload == b""
    finally:
        ctx.destroy(linger=0)
    assert worker.server.alive
    assert worker.server.refusals["MalformedRequest"] == 1
    [reply] = fetch_payloads(HOST, worker.server.port, [(0, 0)])
    assert reply.payload == worker.local.handshake_payload()


@pytest.mark.parametrize(
    ("local_tp", "changes", "reason"),
    [
        (1, {"decode_tp_size": 0}, "InvalidRegistration"),
        (2, {"decode_tp_size": 3}, "InvalidRegistration"),
        (1, {"decode_tp_size": 2**40}, "InvalidRegistration"),
        (1, {"local_block_ids": [[2**63 + 5]]}, "InvalidRegistration"),
        (1, {"local_block_ids": [[1], [2]]}, "InvalidRegistration"),
        (1, {"decode_port": 0}, "InvalidRegistration"),
    ],
    ids=["decode-tp-0", "decode-tp-3-of-2", "decode-tp-2e40", "block-id-over-int64", "groups", "port"],
)
def test_a_crafted_push_reg_fails_only_its_request_and_the_producer_keeps_serving(
    make_worker: Callable[..., Worker], local_tp: int, changes: dict[str, Any], reason: str
) -> None:
    prefill = make_worker("prefill", tp_size=local_tp)
    decoder = make_worker("decode", tp_size=local_tp)
    producer = PushProducer(prefill.local)
    try:
        producer.request_finished("req-bad", [[3, 4]])
        producer.request_finished("req-good", [[5, 6]])
        peer = decoder.transport.add_peer(prefill.transport.metadata())
        bad = registration(decoder, "req-bad", **changes)
        decoder.transport.send_notif(peer, wire.encode_push_reg_notif(bad))
        decoder.transport.send_notif(peer, wire.encode_push_reg_notif(registration(decoder, "req-good")))
        seen = poll_producer(
            producer, [decoder.transport], lambda e: any(s.request_id == "req-good" for s in e.sent)
        )
        assert failed_reasons(seen) == {"req-bad": reason}
        assert producer.held_requests == {"req-bad"}  # its lease, not the bad registration, frees it
    finally:
        producer.close()


@pytest.mark.parametrize(
    ("num_blocks", "refusal"), [(10**11, "outside 0..2147483647"), (10**9, "descriptors")]
)
def test_a_decoder_advertising_huge_block_counts_is_refused_before_anything_is_allocated(
    make_worker: Callable[..., Worker], num_blocks: int, refusal: str
) -> None:
    prefill = make_worker("prefill")
    decoder = make_worker("decode")
    meta = decoder.local.metadata()
    huge = msgspec.structs.replace(
        meta, num_blocks=num_blocks, region_num_blocks=[num_blocks] * len(meta.kv_caches_base_addr)
    )
    decoder.server.set_payload(0, 0, wire.encode_handshake_payload(huge, ""))
    producer = PushProducer(prefill.local)
    try:
        producer.request_finished("req-1", [[3, 4]])
        peer = decoder.transport.add_peer(prefill.transport.metadata())
        decoder.transport.send_notif(peer, wire.encode_push_reg_notif(registration(decoder, "req-1")))
        seen = poll_producer(producer, [decoder.transport], lambda e: bool(e.failed))
        assert failed_reasons(seen) == {"req-1": "RegionGeometryMismatch"}
        assert refusal in seen[-1].failed[0].message
        assert prefill.transport.peers == frozenset()  # refused before its agent was added
    finally:
        producer.close()


def test_registrations_are_capped_by_count_and_bytes(make_worker: Callable[..., Worker]) -> None:
    prefill = make_worker("prefill", num_blocks=2048)
    decoder = make_worker("decode")
    producer = PushProducer(prefill.local, max_registrations=50, max_registration_bytes=64 * 1024)
    try:
        peer = decoder.transport.add_peer(prefill.transport.metadata())
        big = [list(range(8)) * 200]  # ~3 KiB each: the byte cap binds before the count cap
        for i in range(100):
            reg = registration(decoder, f"req-{i}", local_block_ids=big)
            decoder.transport.send_notif(peer, wire.encode_push_reg_notif(reg))
        registered: list[str] = []
        deadline = time.monotonic() + 30
        while len(registered) + producer.registrations.refused < 100 and time.monotonic() < deadline:
            decoder.transport.notifs()
            registered += producer.poll().registered
            time.sleep(0.005)
        assert 0 < len(registered) < 50
        assert producer.registrations.nbytes <= 64 * 1024
        assert producer.registrations.refused == 100 - len(registered)
    finally:
        producer.close()


def test_a_completion_from_an_agent_the_decoder_never_handshook_does_not_complete_the_request(
    make_worker: Callable[..., Worker],
) -> None:
    prefill = make_worker("prefill")
    decoder = make_worker("decode")
    consumer = PushConsumer(decoder.local)
    attacker = NixlTransport("attacker/pp0/tp0")
    try:
        remote = RemoteEngine("prefill", HOST, prefill.local.config.side_channel_port, 1, 1)
        consumer.expect("req-1", [[1, 2]], remote)
        to_decoder = prefill.transport.add_peer(decoder.transport.metadata())
        evil = attacker.add_peer(decoder.transport.metadata())
        # The registration arriving at the prefill agent proves the consumer handshook it.
        deadline = time.monotonic() + 30
        finished: list[str] = []
        while not any(isinstance(wire.parse_notif(m), wire.PushRegistration)
                      for ms in prefill.transport.notifs().values() for m in ms):  # fmt: skip
            finished += consumer.poll().finished
            assert time.monotonic() < deadline, "the consumer never registered"
            time.sleep(0.005)
        attacker.send_notif(evil, wire.encode_completion_notif("req-1", 1))
        attacker.send_notif(evil, wire.encode_completion_notif("req-1", 1))
        for _ in range(200):
            attacker.notifs()
            finished += consumer.poll().finished
            time.sleep(0.002)
        assert finished == []
        assert consumer.ignored_notifs >= 2
        prefill.transport.send_notif(to_decoder, wire.encode_completion_notif("req-1", 1))
        while not finished:
            prefill.transport.notifs()
            finished += consumer.poll().finished
            assert time.monotonic() < deadline, "the real completion never counted"
            time.sleep(0.005)
        assert finished == ["req-1"]
    finally:
        consumer.close()
        attacker.close()


@pytest.mark.parametrize(
    ("remote", "local_tp"),
    [
        (RemoteEngine("prefill", HOST, 1, tp_size=3, pp_size=1), 2),
        (RemoteEngine("prefill", HOST, 1, tp_size=2**40, pp_size=1), 1),
        (RemoteEngine("prefill", HOST, 1, tp_size=1, pp_size=2**40), 1),
        (RemoteEngine("prefill", HOST, 1, tp_size=0, pp_size=1), 1),
    ],
    ids=["tp-3-of-2", "tp-2e40", "pp-2e40", "tp-0"],
)
def test_an_expected_request_with_impossible_sizes_is_refused_at_once(
    make_worker: Callable[..., Worker], remote: RemoteEngine, local_tp: int
) -> None:
    decoder = make_worker("decode", tp_size=local_tp)
    consumer = PushConsumer(decoder.local)
    try:
        with pytest.raises(Exception) as caught:
            consumer.expect("req-1", [[1, 2]], remote)
        assert getattr(caught.value, "reason", None) == "UnsupportedPeerTopology", caught.value
        assert consumer.poll() == ConsumerEvents()
    finally:
        consumer.close()
