"""The wire's guards on hostile bytes (issue 15): every decode entry point refuses with a typed, bounded
message instead of raising whatever the decoder hit."""

from __future__ import annotations

import msgspec
import pytest

from disagg.worker.kv import wire
from disagg.worker.kv.errors import InvalidRegistration, WireFormatError

VALID = wire.PushRegistration("r", "d", "127.0.0.1", 1, 1, [[1, 2]], "p", "127.0.0.1", 2, 1, 1)


def test_deeply_nested_side_channel_request_is_a_wire_format_error() -> None:
    with pytest.raises(WireFormatError):
        wire.decode_side_channel_request(b"\x91" * 2000 + b"\x00")


def test_a_long_side_channel_request_is_refused_unread_and_the_message_is_bounded() -> None:
    with pytest.raises(WireFormatError, match="over the 4096-byte limit"):
        wire.decode_side_channel_request(msgspec.msgpack.encode(["x" * 10_000, 0, 0]))
    with pytest.raises(WireFormatError) as caught:
        wire.decode_side_channel_request(msgspec.msgpack.encode([list(range(1000)), 0]))
    assert len(caught.value.message) < 400


@pytest.mark.parametrize(
    "changes",
    [
        {"decode_tp_size": 0},
        {"decode_tp_size": 2**40},
        {"remote_pp_size": 2**40},
        {"local_block_ids": [[2**40]]},
        {"local_block_ids": [[2**63 + 5]]},  # past int64: msgpack's uint64
        {"local_block_ids": [[-1]]},
        {"local_block_ids": []},
        {"local_block_ids": [[1]] * 65},
        {"decode_port": 70_000},
        {"decode_host": "h" * 256},
        {"request_id": ""},
        {"request_id": "r" * 1025},
    ],
)
def test_a_push_reg_out_of_bounds_is_an_invalid_registration(changes: dict[str, object]) -> None:
    message = wire.encode_push_reg_notif(msgspec.structs.replace(VALID, **changes))
    with pytest.raises(InvalidRegistration) as caught:
        wire.parse_notif(message)
    assert caught.value.request_id == (None if "request_id" in changes else "r")
    assert len(caught.value.message) < 400


def test_a_heartbeat_of_commas_yields_a_bounded_number_of_ids() -> None:
    notif = wire.parse_heartbeat_notif(wire.HB_NOTIF_PREFIX + b"," * 1_000_000)
    assert len(notif.req_ids) == wire.MAX_HEARTBEAT_IDS


def test_a_completion_with_a_huge_tp_is_refused() -> None:
    with pytest.raises(WireFormatError):
        wire.parse_completion_notif(b"req:" + b"9" * 5000)


def test_quote_never_renders_a_whole_value() -> None:
    assert len(wire.quote(b"x" * 10_000_000)) < 200
    assert len(wire.quote(list(range(10_000_000)))) < 200
    nested: list[object] = []
    for _ in range(10_000):
        nested = [nested]
    assert len(wire.quote(nested)) < 200
