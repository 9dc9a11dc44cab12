"""Producer leases: heartbeats over real NIXL notifications extend them; an expired lease frees the blocks.

Both agents live in this test's process (NIXL delivers notifications between them over UCX); the producer's
clock is a test-controlled value so expiry is decided by the lease rules, not by how loaded the machine is.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from disagg.worker.connector.producer import ProducerEvents, PushProducer
from disagg.worker.connector.push import LocalKV, PushConfig
from disagg.worker.connector.transport import NixlTransport
from disagg.worker.kv import wire
from disagg.worker.kv.layout import ModelGeometry, build_stage_layout
from disagg.worker.link.kv_pool import ShmPool

LEASE_S = 3.0  # heartbeats extend to now + 2 s


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def producer(tmp_path: Path) -> Iterator[tuple[PushProducer, Clock]]:
    model = ModelGeometry.with_full_every(4, 1, num_kv_heads=2, head_size=8, dtype_bytes=2, hma=False)
    layout = build_stage_layout(model, pp_rank=0, pp_size=1, tp_size=1, block_size=16, num_blocks=8)
    pool = ShmPool.create(Path("/dev/shm") / f"disagg-lease-{tmp_path.name}", layout.total_bytes)
    config = PushConfig(
        engine_id="prefill",
        model=model,
        side_channel_host="127.0.0.1",
        side_channel_port=1,
        compat_hash=None,
        kv_lease_duration_s=LEASE_S,
    )
    clock = Clock()
    transport = NixlTransport("prefill/pp0/tp0")
    connector = PushProducer(LocalKV(layout, transport, pool.addr, pool.nbytes, config), clock=clock)
    try:
        yield connector, clock
    finally:
        connector.close()
        transport.close()
        pool.close()
        pool.unlink()


def poll_until_registered(producer: PushProducer, sender: NixlTransport, marker: str) -> ProducerEvents:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        sender.notifs()  # without a progress thread, the sender's sends advance only when it polls
        events = producer.poll()
        if marker in events.registered:
            return events
        time.sleep(0.01)
    raise AssertionError(f"registration {marker} never arrived")


def test_heartbeat_extends_the_lease_and_expiry_frees_the_blocks(
    producer: tuple[PushProducer, Clock],
) -> None:
    connector, clock = producer
    connector.request_finished("req-a", [[1, 2]])
    connector.request_finished("req-b", [[3]])
    assert connector.poll().expired == []

    decoder = NixlTransport("decode/pp0/tp0")
    try:
        peer = decoder.add_peer(connector.transport.metadata())
        clock.now = 2.0
        decoder.send_notif(peer, wire.encode_heartbeat_notif(["req-a"]))
        # Notifications from one sender arrive in order: once the marker registration is seen, so was the HB.
        marker = wire.PushRegistration(
            "marker", "decode", "127.0.0.1", 1, 1, [[0]], "prefill", "127.0.0.1", 1, 1, 1
        )
        decoder.send_notif(peer, wire.encode_push_reg_notif(marker))
        poll_until_registered(connector, decoder, "marker")
    finally:
        decoder.close()

    clock.now = 3.5  # past req-b's lease; req-a's was extended to 2.0 + 2.0
    assert connector.poll().expired == ["req-b"]
    assert connector.held_requests == {"req-a"}
    clock.now = 4.5
    assert connector.poll().expired == ["req-a"]
    assert connector.held_requests == frozenset()
