"""Seeded fuzz of what the network reaches without credentials: side-channel frames against a real
`SideChannelServer` and NIXL notif bytes through the notif parser. Bounded in count; counts are printed."""

from __future__ import annotations

import os
import random
import resource
from collections import Counter
from typing import Any

import msgspec
import pytest
import zmq

from disagg.rig.local import free_port
from disagg.worker.connector.side_channel import SideChannelServer, fetch_payloads
from disagg.worker.kv import wire
from disagg.worker.kv.errors import DisaggError

pytestmark = pytest.mark.fuzz

HOST = "127.0.0.1"
FRAMES = 10_000
NOTIFS = 20_000
SEED = 15


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def hostile_value(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(9)
    if choice == 0 or depth > 3:
        return rng.choice([0, -1, 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 1.5, True, None])
    if choice == 1:
        return "x" * rng.choice([0, 1, 100, 5000])
    if choice == 2:
        return rng.randbytes(rng.randrange(64))
    if choice == 3:
        return [hostile_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    if choice == 4:
        return {str(i): hostile_value(rng, depth + 1) for i in range(rng.randrange(4))}
    return rng.randrange(-5, 300)


def hostile_request(rng: random.Random) -> bytes:
    # Within the request bound: a longer frame is refused by ZMQ itself (the "oversized" case below).
    return _hostile_request(rng)[: wire.MAX_SIDE_CHANNEL_REQUEST_BYTES]


def _hostile_request(rng: random.Random) -> bytes:
    kind = rng.randrange(7)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 200))
    if kind == 1:  # nesting deeper than any decoder's stack
        return bytes([0x91]) * rng.randrange(100, 3000) + b"\x00"
    if kind == 2:
        return msgspec.msgpack.encode([wire.GET_META_MSG, hostile_value(rng), hostile_value(rng)])
    if kind == 3:
        return msgspec.msgpack.encode([hostile_value(rng) for _ in range(rng.randrange(6))])
    if kind == 4:  # a valid request for a rank nobody serves
        return wire.encode_side_channel_request(rng.randrange(1, 99), rng.randrange(99))
    if kind == 5:  # a valid request, cut short or with bytes flipped
        data = bytearray(wire.encode_side_channel_request(0, 0))
        data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data[: rng.randrange(1, len(data) + 1)])
    return msgspec.msgpack.encode(hostile_value(rng))


def test_side_channel_survives_10000_hostile_frames_and_serves_valid_peers_between_them() -> None:
    rng = random.Random(SEED)
    port = free_port()
    payload = b"the handshake payload of (pp 0, tp 0)"
    ctx: zmq.Context[Any] = zmq.Context()
    with SideChannelServer(HOST, port, {(0, 0): payload}) as server:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        dealer.connect(f"tcp://{HOST}:{port}")
        sent = Counter[str]()
        replies = valid_served = 0

        def exchange(frames: list[bytes], expect_reply: bool) -> None:
            nonlocal replies
            dealer.send_multipart(frames)
            if expect_reply:
                reply = dealer.recv_multipart()
                assert len(reply) == 3 and reply[0] == b"", reply[:1]
                wire.decode_reply_timestamp(reply[2])
                replies += 1

        exchange([b"", hostile_request(rng)], True)  # warm up before measuring
        rss0, fds0 = rss_bytes(), open_fds()
        for i in range(FRAMES):
            shape = rng.randrange(20)
            if shape == 0:  # no empty delimiter, or extra frames: no REQ could take a reply
                exchange([hostile_request(rng)] * rng.choice([1, 2]), False)
                sent["malformed frames"] += 1
            elif shape == 1:  # over the request bound: ZMQ drops the connection before buffering it
                other = ctx.socket(zmq.DEALER)
                other.setsockopt(zmq.LINGER, 0)
                other.connect(f"tcp://{HOST}:{port}")
                other.send_multipart([b"", rng.randbytes(wire.MAX_SIDE_CHANNEL_REQUEST_BYTES + 1)])
                other.close()
                sent["oversized"] += 1
            else:
                exchange([b"", hostile_request(rng)], True)
                sent["requests"] += 1
            if i % 500 == 0:
                [valid] = fetch_payloads(HOST, port, [(0, 0)], timeout_s=10)
                assert valid.payload == payload
                valid_served += 1
        assert server.alive
        answered = sent["requests"] + 1
        assert replies == answered
        # Every answered request was served (a flipped byte can still spell a valid request) or refused
        # with a reason; nothing was refused for an internal error.
        assert server.served - valid_served + sum(server.refusals.values()) >= answered
        assert server.refusals["InternalError"] == 0
        assert set(server.refusals) <= {"MalformedFrame", "MalformedRequest", "UnknownRank"}
        rss1, fds1 = rss_bytes(), open_fds()
    ctx.destroy(linger=0)
    print(
        f"\nside-channel fuzz: {FRAMES} frames ({dict(sent)}), {replies} replies, {valid_served} valid "
        f"handshakes between them, refusals {dict(server.refusals)}, 0 crashes; RSS {rss0 >> 20} -> "
        f"{rss1 >> 20} MiB, fds {fds0} -> {fds1}"
    )
    assert rss1 - rss0 < 64 << 20
    assert fds1 - fds0 < 16


def test_notif_parser_refuses_20000_hostile_notifs_with_typed_reasons() -> None:
    rng = random.Random(SEED + 1)
    valid = wire.PushRegistration("r", "d", HOST, 1, 1, [[1, 2]], "p", HOST, 2, 1, 1)
    reasons = Counter[str]()
    parsed = Counter[str]()
    for _ in range(NOTIFS):
        kind = rng.randrange(5)
        if kind == 0:
            msg = wire.PUSH_REG_NOTIF_PREFIX + msgspec.msgpack.encode(hostile_value(rng))
        elif kind == 1:
            fields = msgspec.structs.asdict(valid)
            key = rng.choice(list(fields))
            fields[key] = hostile_value(rng)
            msg = wire.PUSH_REG_NOTIF_PREFIX + msgspec.msgpack.encode(fields)
        elif kind == 2:
            msg = wire.HB_NOTIF_PREFIX + rng.randbytes(rng.randrange(100))
        elif kind == 3:
            msg = rng.randbytes(rng.randrange(1, 100)) + b":" + str(rng.choice([0, 1, 10**30])).encode()
        else:
            msg = rng.randbytes(rng.randrange(1, 300))
        try:
            notif = wire.parse_notif(msg)
        except DisaggError as exc:
            assert exc.reason and exc.message
            assert len(exc.message) < 2000, exc.message[:200]
            reasons[exc.reason] += 1
        else:
            parsed[type(notif).__name__] += 1
    print(f"\nnotif fuzz: {NOTIFS} notifs, parsed {dict(parsed)}, refused {dict(reasons)}, 0 crashes")
    assert sum(reasons.values()) + sum(parsed.values()) == NOTIFS
