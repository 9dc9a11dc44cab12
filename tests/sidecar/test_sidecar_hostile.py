"""Hostile engine-socket input against real sidecar processes (issue 15): impossible sizes are refused
before anything is allocated, replies come in order, logs stay bounded, and a seeded fuzz of 5,000 messages
leaves the sidecar serving with flat memory and descriptors."""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
from sidecar_procs import SidecarProcess, http_get
from test_sidecar_engine_socket import ENGINE_ID, NUM_BLOCKS, SHAPE

from disagg.rig.local import free_port
from disagg.worker.kv.errors import DisaggError, EngineProtocolError
from disagg.worker.link.engine_link import (
    MAX_FRAME_BYTES,
    EngineLink,
    Error,
    KVFailed,
    KVReady,
    KVSent,
    PrefillEngine,
    QueryRequest,
    RequestFinished,
    RequestStatus,
    decode_sidecar_message,
    encode_frame,
    read_frame,
)
from disagg.worker.link.kv_pool import ShmPool
from disagg.worker.sidecar.config import from_env
from disagg.worker.sidecar.transfer import Sidecar

FUZZ_MESSAGES = 5_000
SEED = 15


def proc_rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def next_reply(sock: socket.socket) -> Any:
    """The next reply on a raw connection, skipping events."""
    while True:
        body = read_frame(sock)
        assert body is not None, "the sidecar closed the connection"
        message = decode_sidecar_message(body)
        if not isinstance(message, KVReady | KVSent | KVFailed):
            return message


def started(workdir: Path, sidecars: list[SidecarProcess], role: str) -> tuple[SidecarProcess, ShmPool]:
    engine_id = ENGINE_ID if role == "prefill" else "hostile-decode"
    sidecar = SidecarProcess(
        workdir, role, SHAPE.topology(), DISAGG_ROLE=role, DISAGG_ENGINE_ID=engine_id, DISAGG_PP_RANK="0"
    )
    sidecars.append(sidecar)
    sidecar.wait_listening()
    pool = ShmPool.create(workdir / f"{role}.kv", SHAPE.stage_layout().total_bytes)
    message = SHAPE.registration(pool, engine_id, role)
    with EngineLink(sidecar.socket_path) as link:
        link.register_layout(message)
    return sidecar, pool


def test_an_expect_request_with_impossible_prefill_sizes_is_refused_and_the_sidecar_serves_on(
    workdir: Path, sidecars: list[SidecarProcess]
) -> None:
    sidecar, pool = started(workdir, sidecars, "decode")
    groups = len(SHAPE.stage_layout().groups)
    blocks = [[g + 1] for g in range(groups)]
    with EngineLink(sidecar.socket_path) as link:
        for i, (tp, pp) in enumerate([(2**40, 1), (1, 2**40), (0, 1), (1, 0)]):
            with pytest.raises(DisaggError) as caught:
                link.expect_request(f"r{i}", blocks, PrefillEngine("p", "127.0.0.1", 5600, tp, pp))
            assert caught.value.reason == "UnsupportedPeerTopology", caught.value
        with pytest.raises(DisaggError) as caught:
            link.expect_request("x" * 2_000_000, blocks, PrefillEngine("p", "127.0.0.1", 5600))
        assert caught.value.reason == "InvalidEngineMessage"
        with pytest.raises(DisaggError) as caught:
            link.query("r0")
        assert caught.value.reason == "UnknownRequest"  # refused before it was tracked
    assert sidecar.proc.poll() is None
    assert sidecar.get("/readyz") == (200, "ready\n")
    longest = max(len(line) for line in sidecar.log_path.read_text(errors="replace").splitlines())
    assert longest < 16_000, longest
    assert sidecar.terminate() == 0
    pool.close()


def test_a_killed_decoder_gives_the_prefill_engine_exactly_one_terminal_event(
    workdir: Path, sidecars: list[SidecarProcess]
) -> None:
    short_lease = {**SHAPE.topology(), "kvLeaseDurationSeconds": 3}
    groups = len(SHAPE.stage_layout().groups)
    prefill = SidecarProcess(
        workdir, "p", short_lease, DISAGG_ROLE="prefill", DISAGG_ENGINE_ID=ENGINE_ID, DISAGG_PP_RANK="0"
    )
    decode = SidecarProcess(workdir, "d", short_lease, DISAGG_ROLE="decode", DISAGG_ENGINE_ID="hostile-d")
    sidecars += [prefill, decode]
    prefill.wait_listening()
    decode.wait_listening()
    p_pool = ShmPool.create(workdir / "p.kv", SHAPE.stage_layout().total_bytes)
    d_pool = ShmPool.create(workdir / "d.kv", SHAPE.stage_layout().total_bytes)
    source = PrefillEngine(ENGINE_ID, "127.0.0.1", prefill.side_channel_port)
    with EngineLink(prefill.socket_path) as p_link, EngineLink(decode.socket_path) as d_link:
        p_link.register_layout(SHAPE.registration(p_pool, ENGINE_ID, "prefill"))
        d_link.register_layout(SHAPE.registration(d_pool, "hostile-d", "decode"))
        # A first request connects the two, so the next registration reaches a prefill that knows the decoder.
        d_link.expect_request("r0", [[g + 1] for g in range(groups)], source)
        p_link.request_finished("r0", [[g + 2] for g in range(groups)])
        assert isinstance(p_link.wait("r0", timeout_s=60), KVSent)
        assert isinstance(d_link.wait("r0", timeout_s=60), KVReady)
        d_link.expect_request("r1", [[g + 3] for g in range(groups)], source)
        # The decoder's registration travels over loopback in milliseconds; then the decoder dies.
        time.sleep(2)
        decode.kill()
        p_link.request_finished("r1", [[g + 4] for g in range(groups)])
        first = p_link.next_event(timeout_s=60)
        assert isinstance(first, KVFailed) and first.request_id == "r1", first
        # Past the lease that frees r1's blocks: nothing more is told about r1.
        assert p_link.next_event(timeout_s=8) is None
        status = p_link.query("r1")
        assert (status.state, status.reason) == ("failed", first.reason)
    assert prefill.terminate() == 0
    p_pool.close()
    d_pool.close()


def test_readyz_reports_a_stopped_serving_thread(workdir: Path) -> None:
    topology_file = workdir / "topology.json"
    topology_file.write_text(json.dumps(SHAPE.topology()))
    env = {
        "DISAGG_ROLE": "prefill",
        "DISAGG_ENGINE_ID": ENGINE_ID,
        "DISAGG_PP_RANK": "0",
        "DISAGG_TOPOLOGY_FILE": str(topology_file),
        "DISAGG_ENGINE_SOCKET": str(workdir / "ready.sock"),
        "DISAGG_SIDE_CHANNEL_HOST": "127.0.0.1",
        "DISAGG_SIDE_CHANNEL_PORT": str(free_port()),
        "DISAGG_METRICS_HOST": "127.0.0.1",
        "DISAGG_METRICS_PORT": "0",
    }
    sidecar = Sidecar(from_env(env))
    loop = threading.Thread(target=sidecar.run, name="sidecar-main")
    loop.start()
    pool = ShmPool.create(workdir / "ready.kv", SHAPE.stage_layout().total_bytes)
    try:
        with EngineLink(env["DISAGG_ENGINE_SOCKET"]) as link:
            link.register_layout(SHAPE.registration(pool, ENGINE_ID, "prefill"))
        assert http_get(sidecar.http.port, "/readyz") == (200, "ready\n")
        sidecar.side_channel.stop()  # as if its thread had died
        deadline = time.monotonic() + 30
        while http_get(sidecar.http.port, "/readyz")[0] != 503:
            assert time.monotonic() < deadline, "readiness never noticed the stopped side channel"
            time.sleep(0.02)
        assert http_get(sidecar.http.port, "/readyz") == (503, "the side channel serving thread stopped\n")
    finally:
        sidecar.stop()
        loop.join(timeout=30)
        pool.close()


def test_pipelined_replies_come_in_order_even_for_undecodable_frames(
    workdir: Path, sidecars: list[SidecarProcess]
) -> None:
    sidecar, pool = started(workdir, sidecars, "prefill")
    groups = len(SHAPE.stage_layout().groups)
    with EngineLink(sidecar.socket_path) as link:
        link.request_finished("r1", [[g + 1] for g in range(groups)])
    garbage = b"\xc1 not msgpack"
    query = encode_frame(QueryRequest("r1"))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(sidecar.socket_path)
        for _ in range(20):
            raw.sendall(query + struct.pack(">I", len(garbage)) + garbage + query)
            replies = [next_reply(raw) for _ in range(3)]
            assert [type(r).__name__ for r in replies] == ["RequestStatus", "Error", "RequestStatus"]
        # A frame over the bound is refused after the replies before it, then that connection closes.
        raw.sendall(query + struct.pack(">I", MAX_FRAME_BYTES + 1))
        assert isinstance(next_reply(raw), RequestStatus)
        assert isinstance(next_reply(raw), Error)
        assert raw.recv(1) == b""
    assert sidecar.terminate() == 0
    pool.close()


def hostile_int(rng: random.Random) -> Any:
    return rng.choice([0, -1, 1, 3, NUM_BLOCKS, 2**31, 2**40, 2**63 - 1, -(2**63), 2**64 - 1, 1.5, None, "1"])


def hostile_message(rng: random.Random, groups: int) -> bytes:
    kind = rng.randrange(8)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 300))
    if kind == 1:
        return bytes([0x91]) * rng.randrange(100, 5000) + b"\x00"
    if kind == 2:
        ids = [
            [hostile_int(rng) for _ in range(rng.randrange(4))] for _ in range(rng.choice([0, 1, groups, 9]))
        ]
        return msgspec.msgpack.encode(
            {"type": "request_finished", "request_id": f"f{rng.random()}", "block_ids": ids}
        )
    if kind == 3:
        prefill = {"engine_id": "p", "host": "127.0.0.1", "port": hostile_int(rng)}
        prefill.update(tp_size=hostile_int(rng), pp_size=hostile_int(rng))
        return msgspec.msgpack.encode(
            {"type": "expect_request", "request_id": "e", "block_ids": [[1]] * groups, "prefill": prefill}
        )
    if kind == 4:
        return msgspec.msgpack.encode({"type": rng.choice(["register_layout", "query_request", "nope", 7])})
    if kind == 5:
        return msgspec.msgpack.encode(
            {
                "type": "request_finished",
                "request_id": "y" * rng.choice([0, 2000, 60_000]),
                "block_ids": [[1]],
            }
        )
    if kind == 6:
        body = bytearray(encode_frame(RequestFinished(f"m{rng.random()}", [[1]] * groups))[4:])
        body[rng.randrange(len(body))] = rng.randrange(256)
        return bytes(body)
    return msgspec.msgpack.encode({"type": "query_request", "request_id": hostile_int(rng)})


@pytest.mark.fuzz
def test_engine_socket_fuzz_5000_messages_no_crash_flat_memory_every_refusal_with_a_reason(
    workdir: Path, sidecars: list[SidecarProcess]
) -> None:
    sidecar, pool = started(workdir, sidecars, "prefill")
    groups = len(SHAPE.stage_layout().groups)
    rng = random.Random(SEED)
    pid = sidecar.proc.pid
    replies = Counter[str]()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(sidecar.socket_path)
        raw.sendall(encode_frame(RequestFinished("valid-0", [[g + 1] for g in range(groups)])))
        next_reply(raw)
        rss0, fds0 = proc_rss(pid), proc_fds(pid)
        for i in range(FUZZ_MESSAGES):
            body = hostile_message(rng, groups)
            raw.sendall(struct.pack(">I", len(body)) + body)
            reply = next_reply(raw)
            if isinstance(reply, Error):
                assert reply.reason and reply.message, reply
                assert reply.reason != "InternalError", reply
                replies[reply.reason] += 1
            else:
                replies[type(reply).__name__] += 1
            if i % 250 == 0:  # a valid request between the bad ones is served
                raw.sendall(encode_frame(QueryRequest("valid-0")))
                status = next_reply(raw)
                assert isinstance(status, RequestStatus) and status.request_id == "valid-0", status
        rss1, fds1 = proc_rss(pid), proc_fds(pid)
    assert sidecar.proc.poll() is None
    assert sidecar.get("/readyz") == (200, "ready\n")
    print(
        f"\nengine-socket fuzz: {FUZZ_MESSAGES} messages, replies {dict(replies)}, 0 crashes; sidecar RSS "
        f"{rss0 >> 20} -> {rss1 >> 20} MiB, fds {fds0} -> {fds1}"
    )
    assert sum(replies.values()) == FUZZ_MESSAGES
    assert rss1 - rss0 < 64 << 20
    assert fds1 - fds0 < 16
    assert sidecar.terminate() == 0
    pool.close()


def test_a_half_sent_frame_times_out_instead_of_pinning_the_reader() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(struct.pack(">I", 1 << 20) + b"x" * 1000)  # a 1 MiB frame, 1,000 bytes of it sent
        with pytest.raises(EngineProtocolError, match="stalled after 1000 of 1048576 bytes"):
            read_frame(ours, frame_timeout_s=0.2)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"\x00\x00")  # half a header
        with pytest.raises(EngineProtocolError, match="stalled after 1 of 3 bytes"):
            read_frame(ours, frame_timeout_s=0.2)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        frame = encode_frame(QueryRequest("q"))
        theirs.sendall(frame)
        assert read_frame(ours, frame_timeout_s=5) == frame[4:]
