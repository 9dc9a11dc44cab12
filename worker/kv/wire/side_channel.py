"""The other frames of vLLM's NIXL side channel: the request (`(b"get_meta_msg", pp_rank, tp_rank)`) and
reply frame 1, the listener's timestamp. The request is decoded untyped, like vLLM's listener does, then
every element is checked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import msgspec

from disagg.worker.kv.errors import WireFormatError
from disagg.worker.kv.wire.limits import MAX_SIDE_CHANNEL_REQUEST_BYTES, check_size, quote

GET_META_MSG: Final = b"get_meta_msg"


@dataclass(frozen=True)
class SideChannelRequest:
    """A decoded side-channel request; `str_msg` marks a tag sent as str, which vLLM tolerates."""

    pp_rank: int
    tp_rank: int
    str_msg: bool = False


def encode_side_channel_request(pp_rank: int, tp_rank: int) -> bytes:
    return msgspec.msgpack.encode((GET_META_MSG, pp_rank, tp_rank))


def _rank(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WireFormatError(f"side-channel request {name} must be a non-negative int, got {quote(value)}")
    return value


def decode_side_channel_request(data: bytes) -> SideChannelRequest:
    """The listener's decode: untyped like vLLM's, then every element checked."""
    if len(data) > MAX_SIDE_CHANNEL_REQUEST_BYTES:
        raise WireFormatError(
            f"side-channel request is {len(data)} bytes, over the {MAX_SIDE_CHANNEL_REQUEST_BYTES}-byte limit"
        )
    try:
        decoded = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:
        # RecursionError: msgpack nested deeper than the decoder's stack (2 KB of b"\x91" does it).
        raise WireFormatError(f"side-channel request is not msgpack: {quote(str(exc))}") from exc
    if not isinstance(decoded, list) or len(decoded) != 3:
        raise WireFormatError(
            "side-channel request must be the array (b'get_meta_msg', pp_rank, tp_rank), "
            f"got {quote(decoded)}"
        )
    msg, pp_rank, tp_rank = decoded
    if msg == GET_META_MSG:
        str_msg = False
    elif msg == GET_META_MSG.decode():
        str_msg = True
    else:
        raise WireFormatError(f"side-channel request tag must be {GET_META_MSG!r}, got {quote(msg)}")
    return SideChannelRequest(_rank(pp_rank, "pp_rank"), _rank(tp_rank, "tp_rank"), str_msg)


def encode_reply_timestamp(timestamp: float) -> bytes:
    """Reply frame 1: the listener's perf_counter, always float64."""
    return msgspec.msgpack.encode(float(timestamp))


def decode_reply_timestamp(data: bytes) -> float:
    check_size(data, "side-channel reply timestamp")
    try:
        return msgspec.msgpack.decode(data, type=float)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireFormatError(f"side-channel reply timestamp is not a msgpack float: {exc}") from exc
