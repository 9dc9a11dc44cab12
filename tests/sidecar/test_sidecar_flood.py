"""A flood of decoders' registrations against a real prefill sidecar (issue 22, finding 11a): what the
unmatched ones hold is capped by the bytes they really take, and once they have expired the process's
memory comes back to within a stated bound of what it was before the flood.

The decoder is a NIXL agent in this test's process that loaded the sidecar's agent from its side channel,
so every registration travels as a real `PUSH_REG` notif; memory is the sidecar's RSS from /proc.
"""

from __future__ import annotations

import time
from pathlib import Path

from sidecar_procs import HOST, KVShape, SidecarProcess
from test_sidecar_engine_socket import BLOCK_SIZE, ENGINE_ID, GEOMETRY
from test_sidecar_hostile import proc_rss

from disagg.worker.connector.heap import TRIM_AFTER_BYTES, TRIM_INTERVAL_S
from disagg.worker.connector.registrations import MAX_REGISTRATION_BYTES
from disagg.worker.connector.side_channel import fetch_payloads
from disagg.worker.connector.transport import NixlTransport
from disagg.worker.kv import wire
from disagg.worker.link.engine_link import EngineLink
from disagg.worker.link.kv_pool import ShmPool

NUM_BLOCKS = 8192
"""A request may name up to this many blocks per group: each registration holds 3 arrays of 64 KiB."""
SHAPE = KVShape(GEOMETRY, BLOCK_SIZE, NUM_BLOCKS)
TIMEOUT_S = 4.0
FLOOD = 3000
"""Registrations in the flood: many more than the byte cap lets the sidecar hold at once."""
SETTLED_BYTES = TRIM_AFTER_BYTES + (16 << 20)
"""How far above its pre-flood RSS the sidecar may stay once the flood has expired: what was freed since the
last trim (under `TRIM_AFTER_BYTES`), plus 16 MiB for what the C heap and Python's allocator keep of their
own (free lists, partly used pages)."""
PEAK_BYTES = MAX_REGISTRATION_BYTES + (96 << 20)
"""How far above it the sidecar may go during the flood: the registrations it holds, plus the notifs being
read and decoded."""


def registration(request_id: str, block_ids: list[list[int]]) -> bytes:
    reg = wire.PushRegistration(
        request_id, "flood-decode", HOST, 5999, 1, block_ids, ENGINE_ID, HOST, 1, 1, 1
    )  # fmt: skip
    return wire.encode_push_reg_notif(reg)


def dropped_or_refused(sidecar: SidecarProcess) -> int:
    log = sidecar.log_path.read_text(errors="replace")
    return log.count("Dropping the registration of decode request") + log.count("refused a registration")


def test_a_registration_flood_is_capped_by_what_it_holds_and_its_memory_comes_back_after_expiry(
    workdir: Path, sidecars: list[SidecarProcess]
) -> None:
    sidecar = SidecarProcess(
        workdir,
        "p",
        SHAPE.topology(pushRegistrationTimeoutSeconds=TIMEOUT_S),
        DISAGG_ROLE="prefill",
        DISAGG_ENGINE_ID=ENGINE_ID,
        DISAGG_PP_RANK="0",
    )
    sidecars.append(sidecar)
    sidecar.wait_listening()
    stage = SHAPE.stage_layout()
    pool = ShmPool.create(workdir / "p.kv", stage.total_bytes)
    decoder = NixlTransport("flood-decode/pp0/tp0")
    try:
        with EngineLink(sidecar.socket_path) as link:
            link.register_layout(SHAPE.registration(pool, ENGINE_ID, "prefill"))
        [reply] = fetch_payloads(HOST, sidecar.side_channel_port, [(0, 0)])
        meta = wire.decode_handshake_payload(reply.payload, expected_hash=None)
        peer = decoder.add_peer(meta.agent_metadata)
        # One id a byte on the wire, 8 in the array it is kept as: the registration that holds most per byte.
        block_ids = [[1] * NUM_BLOCKS for _ in stage.groups]
        pid = sidecar.proc.pid

        def send(prefix: str, count: int) -> int:
            """Send `count` registrations and wait until each was refused or has expired; the peak RSS."""
            peak, sent, start = 0, 0, dropped_or_refused(sidecar)
            deadline = time.monotonic() + 120
            while dropped_or_refused(sidecar) < start + count:
                if sent < count:
                    for i in range(sent, min(count, sent + 50)):
                        decoder.send_notif(peer, registration(f"{prefix}-{i}", block_ids))
                    sent = min(count, sent + 50)
                decoder.notifs()  # without a progress thread, the sends advance only when the sender polls
                peak = max(peak, proc_rss(pid))
                assert sidecar.proc.poll() is None, sidecar.log()
                assert time.monotonic() < deadline, f"{dropped_or_refused(sidecar) - start} of {count} seen"
                time.sleep(0.01)
            return peak

        # A first, small flood brings in whatever the first registrations allocate once (UCX's buffers, the
        # log's handlers): the baseline is the sidecar as it runs, not as it started.
        send("warm", 20)
        time.sleep(TRIM_INTERVAL_S)
        rss0 = proc_rss(pid)
        peak = send("flood", FLOOD)
        # Every registration is refused or dropped: the next trim is at most an interval and a poll away.
        deadline = time.monotonic() + TRIM_INTERVAL_S + 5
        rss1 = proc_rss(pid)
        while rss1 - rss0 >= SETTLED_BYTES and time.monotonic() < deadline:
            time.sleep(0.1)
            rss1 = proc_rss(pid)
        log = sidecar.log_path.read_text(errors="replace")
        held = log.count("Dropping the registration of decode request 'flood-")
        print(
            f"\nregistration flood: {FLOOD} registrations of {len(registration('flood-0', block_ids))} bytes "
            f"({held} held, the rest refused); sidecar RSS {rss0 >> 20} MiB before, {peak >> 20} MiB at the "
            f"peak, {rss1 >> 20} MiB after expiry (bounds: +{PEAK_BYTES >> 20} MiB at the peak, "
            f"+{SETTLED_BYTES >> 20} MiB after)"
        )
        assert 0 < held < FLOOD
        assert peak - rss0 < PEAK_BYTES
        assert rss1 - rss0 < SETTLED_BYTES
        assert sidecar.get("/readyz") == (200, "ready\n")
    finally:
        decoder.close()
    assert sidecar.terminate() == 0
    pool.close()
