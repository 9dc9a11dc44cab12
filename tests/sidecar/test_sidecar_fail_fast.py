"""A decode sidecar fails a request as soon as its KV can no longer come (issue 22, findings 2 and 11a),
not at the registration timeout: real sidecar processes over NIXL, driven through the engine link.

- a request not registered with its prefill within `lease_wait_s` of being expected fails `LeaseExpired`
  (the prefill's lease on it has run out);
- every request waiting on a prefill engine found dead fails `PeerUnreachable`;
- `CancelRequest` drops an expected request (no event follows, a WRITE that still lands is ignored) and a
  cancel of an unknown request, or on a prefill sidecar, gets a typed error.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sidecar_procs import HOST, KVShape, SidecarProcess

from disagg.rig.local import free_port
from disagg.worker.contracts.topology import lease_wait_s
from disagg.worker.kv.errors import EngineProtocolError, UnknownRequest, WrongRole
from disagg.worker.kv.layout import ModelGeometry
from disagg.worker.link.engine_link import (
    EngineLink,
    KVFailed,
    KVReady,
    KVSent,
    PrefillEngine,
)
from disagg.worker.link.kv_pool import ShmPool

KV = KVShape(ModelGeometry.with_full_every(4, 1, num_kv_heads=2, head_size=8, dtype_bytes=2), 16, 64)
REGISTRATION_TIMEOUT_S = 120.0
"""Far past every bound below: a request that fails before it failed fast."""


def topology(lease_s: float) -> dict[str, Any]:
    return KV.topology(kvLeaseDurationSeconds=lease_s, pushRegistrationTimeoutSeconds=REGISTRATION_TIMEOUT_S)


def blocks(first: int) -> list[list[int]]:
    return [[first + g] for g in range(len(KV.stage_layout().groups))]


class Worker:
    """A sidecar with its engine's pool registered over the link."""

    def __init__(
        self, workdir: Path, sidecars: list[SidecarProcess], role: str, engine_id: str, lease_s: float
    ) -> None:
        folder = workdir / engine_id
        folder.mkdir()
        env = {
            "DISAGG_ROLE": role,
            "DISAGG_ENGINE_ID": engine_id,
            "DISAGG_PEER_PROBE_INTERVAL_S": "0.5",
            "DISAGG_PP_RANK": "0",
            "DISAGG_LOG_LEVEL": "debug",  # a prefill logs each registration it gets
        }
        self.sidecar = SidecarProcess(folder, role[0], topology(lease_s), **env)
        sidecars.append(self.sidecar)
        self.sidecar.wait_listening()
        self.pool = ShmPool.create(folder / "kv", KV.stage_layout().total_bytes)
        self.link = EngineLink(self.sidecar.socket_path)
        self.link.register_layout(KV.registration(self.pool, engine_id, role))
        self.engine = PrefillEngine(engine_id, HOST, self.sidecar.side_channel_port)

    def wait_registered(self, count: int) -> None:
        """Until this prefill has got `count` registrations."""
        deadline = time.monotonic() + 30
        while self.sidecar.log_path.read_text(errors="replace").count('"decoder registered"') < count:
            assert time.monotonic() < deadline, self.sidecar.log()
            time.sleep(0.05)

    def close(self) -> None:
        self.link.close()
        self.sidecar.kill()
        self.pool.close()
        self.pool.path.unlink(missing_ok=True)


@pytest.fixture
def workers(workdir: Path, sidecars: list[SidecarProcess]) -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.close()


def failure(link: EngineLink, request_id: str, timeout_s: float) -> KVFailed:
    event = link.next_event(timeout_s)
    assert isinstance(event, KVFailed), event
    assert event.request_id == request_id, event
    return event


def test_a_request_not_registered_within_the_lease_fails_lease_expired(
    workdir: Path, sidecars: list[SidecarProcess], workers: list[Worker]
) -> None:
    lease_s = 1.0
    decoder = Worker(workdir, sidecars, "decode", "ff-decoder", lease_s)
    workers.append(decoder)
    # A prefill side channel that takes the connection and never answers: the handshake waits out its
    # timeout (5 s), past the lease, and the request is never registered.
    with socket.create_server((HOST, free_port())) as silent:
        prefill = PrefillEngine("ff-silent-prefill", HOST, silent.getsockname()[1])
        started = time.monotonic()
        decoder.link.expect_request("r-lease", blocks(1), prefill)
        event = failure(decoder.link, "r-lease", timeout_s=60)
        waited = time.monotonic() - started
    assert event.reason == "LeaseExpired", event
    assert "lease" in event.message
    assert lease_wait_s(lease_s) <= waited < REGISTRATION_TIMEOUT_S / 4, waited
    assert decoder.link.query("r-lease").state == "failed"


def test_every_request_waiting_on_a_dead_prefill_fails_peer_unreachable(
    workdir: Path, sidecars: list[SidecarProcess], workers: list[Worker]
) -> None:
    # A long lease: heartbeats are rare, so the probes of the busy prefill are what find it dead.
    lease_s = 120.0
    prefill = Worker(workdir, sidecars, "prefill", "ff-prefill", lease_s)
    decoder = Worker(workdir, sidecars, "decode", "ff-decoder", lease_s)
    workers += [prefill, decoder]
    # A first transfer: the decoder is connected to the prefill engine.
    decoder.link.expect_request("r-0", blocks(1), prefill.engine)
    prefill.link.request_finished("r-0", blocks(1))
    assert isinstance(prefill.link.wait("r-0", timeout_s=60), KVSent)
    assert isinstance(decoder.link.wait("r-0", timeout_s=60), KVReady)
    # Two requests wait on it, registered (its KV not finished yet), and the prefill dies.
    for n, request_id in enumerate(("r-1", "r-2")):
        decoder.link.expect_request(request_id, blocks(10 + 10 * n), prefill.engine)
    prefill.wait_registered(3)
    prefill.sidecar.kill()
    killed = time.monotonic()
    events = [decoder.link.next_event(60) for _ in range(2)]
    waited = time.monotonic() - killed
    assert all(isinstance(e, KVFailed) for e in events), events
    assert {e.request_id for e in events} == {"r-1", "r-2"}  # type: ignore[union-attr]
    assert {e.reason for e in events} == {"PeerUnreachable"}, events  # type: ignore[union-attr]
    assert "ff-prefill" in events[0].message  # type: ignore[union-attr]
    assert waited < REGISTRATION_TIMEOUT_S / 4, waited


def test_a_cancelled_request_is_dropped_and_a_late_write_is_ignored(
    workdir: Path, sidecars: list[SidecarProcess], workers: list[Worker]
) -> None:
    prefill = Worker(workdir, sidecars, "prefill", "ff-prefill", 30.0)
    decoder = Worker(workdir, sidecars, "decode", "ff-decoder", 30.0)
    workers += [prefill, decoder]
    decoder.link.expect_request("r-gone", blocks(1), prefill.engine)
    prefill.wait_registered(1)
    status = decoder.link.cancel_request("r-gone")
    # Registered: the prefill was told the blocks, so the engine keeps them until its lease surely ended.
    assert (status.request_id, status.state, status.registered) == ("r-gone", "cancelled", True)
    # Cancelling again tells the same; it is no longer pending, so nothing else happens.
    assert decoder.link.cancel_request("r-gone").state == "cancelled"
    assert decoder.link.query("r-gone").state == "cancelled"
    with pytest.raises(UnknownRequest):
        decoder.link.cancel_request("never-expected")
    with pytest.raises(WrongRole):
        prefill.link.cancel_request("r-gone")
    with pytest.raises(EngineProtocolError):
        decoder.link.cancel_request("")

    # The prefill still had the registration: its WRITE lands, and the decoder ignores its completion.
    prefill.link.request_finished("r-gone", blocks(2))
    assert isinstance(prefill.link.wait("r-gone", timeout_s=60), KVSent)
    # The decoder serves on, and the cancelled request got no event.
    decoder.link.expect_request("r-next", blocks(20), prefill.engine)
    prefill.link.request_finished("r-next", blocks(20))
    assert isinstance(prefill.link.wait("r-next", timeout_s=60), KVSent)
    event = decoder.link.next_event(60)
    assert isinstance(event, KVReady) and event.request_id == "r-next", event
    assert decoder.sidecar.proc.poll() is None


def test_after_a_cancel_no_write_lands_once_the_decoder_freed_the_blocks(
    workdir: Path, sidecars: list[SidecarProcess], workers: list[Worker]
) -> None:
    """A cancelled request's registration that already reached its prefill: the decoder sends no more
    heartbeats for it, so the prefill drops it after a lease of silence, and a prefill request that finishes
    later writes nothing. The engine holds the blocks for `lease_wait_s`, past that drop, so the blocks it
    then gives to another request are never written for the cancelled one."""
    lease = 2.0
    prefill = Worker(workdir, sidecars, "prefill", "late-prefill", lease)
    decoder = Worker(workdir, sidecars, "decode", "late-decoder", lease)
    workers += [prefill, decoder]
    decoder.pool.array[:] = 0
    decoder.link.expect_request("r-cancelled", blocks(1), prefill.engine)
    prefill.wait_registered(1)
    status = decoder.link.cancel_request("r-cancelled")
    assert status.registered
    # The engine frees the blocks `lease_wait_s` after the cancel; the prefill finishes its request later.
    time.sleep(lease_wait_s(lease) + 0.5)
    log = prefill.sidecar.log_path.read_text(errors="replace")
    assert "its decoder sent no heartbeat for it" in log, prefill.sidecar.log()
    prefill.pool.array[:] = 7
    prefill.link.request_finished("r-cancelled", blocks(2))
    # No decoder takes it now: the lease frees the prefill's blocks, unwritten.
    assert failure(prefill.link, "r-cancelled", lease * 4).reason == "LeaseExpired"
    assert not decoder.pool.array.any(), (
        "a WRITE for the cancelled request landed after its blocks were freed"
    )
