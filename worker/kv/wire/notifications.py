"""The NIXL notifs of vLLM's push connector: the decoder's registration (`PUSH_REG:` + msgpack), its
heartbeat (`HB:` + comma-separated request ids) and the prefill's completion (`<request id>:<tp size>`),
routed the way vLLM's push worker routes them. Every size a registration names is bounded before anything
is sized from it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

import msgspec

from disagg.worker.kv.errors import InvalidRegistration, WireFormatError
from disagg.worker.kv.wire.limits import (
    MAX_BLOCK_ID,
    MAX_HEARTBEAT_IDS,
    MAX_HOST_CHARS,
    MAX_ID_CHARS,
    MAX_KV_CACHE_GROUPS,
    MAX_PARALLEL_SIZE,
    check_size,
    decode_typed,
    quote,
)

PUSH_REG_NOTIF_PREFIX: Final = b"PUSH_REG:"
HB_NOTIF_PREFIX: Final = b"HB:"


class PushRegistration(msgspec.Struct, frozen=True):
    """The body of a `PUSH_REG:` notif: vLLM push_scheduler's registration dict, field order = wire order
    (the same at every connector version)."""

    request_id: str
    decode_engine_id: str
    decode_host: str
    decode_port: int
    decode_tp_size: int
    local_block_ids: list[list[int]]
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int
    remote_pp_size: int


@dataclass(frozen=True)
class HeartbeatNotif:
    req_ids: tuple[str, ...]


@dataclass(frozen=True)
class CompletionNotif:
    req_id: str
    tp_size: int


Notif = PushRegistration | HeartbeatNotif | CompletionNotif


def encode_push_reg_notif(registration: PushRegistration) -> bytes:
    return PUSH_REG_NOTIF_PREFIX + msgspec.msgpack.encode(registration)


def decode_push_reg_notif(msg: bytes) -> PushRegistration:
    if not msg.startswith(PUSH_REG_NOTIF_PREFIX):
        raise WireFormatError(f"PUSH_REG notif must start with {PUSH_REG_NOTIF_PREFIX!r}, got {msg[:16]!r}")
    registration = decode_typed(msg[len(PUSH_REG_NOTIF_PREFIX) :], PushRegistration, "PUSH_REG registration")
    check_push_registration(registration)
    return registration


def check_push_registration(reg: PushRegistration) -> None:
    """Every size a registration names, bounded before anything is sized from it (the local layout's checks
    come after, in the producer); raises InvalidRegistration naming the request where it can."""
    request_id = reg.request_id if 0 < len(reg.request_id) <= MAX_ID_CHARS else None

    def refuse(what: str) -> InvalidRegistration:
        return InvalidRegistration(
            f"PUSH_REG for decode request {quote(reg.request_id)}: {what}", request_id=request_id
        )

    if request_id is None:
        raise refuse(f"the request id must have 1 to {MAX_ID_CHARS} characters")
    for name in ("decode_engine_id", "remote_engine_id"):
        if not 0 < len(getattr(reg, name)) <= MAX_ID_CHARS:
            raise refuse(f"{name} must have 1 to {MAX_ID_CHARS} characters")
    for name in ("decode_host", "remote_host"):
        if not 0 < len(getattr(reg, name)) <= MAX_HOST_CHARS:
            raise refuse(f"{name} must have 1 to {MAX_HOST_CHARS} characters")
    for name in ("decode_port", "remote_port"):
        if not 0 < getattr(reg, name) < 65536:
            raise refuse(f"{name} {getattr(reg, name)} is not a TCP port")
    for name in ("decode_tp_size", "remote_tp_size", "remote_pp_size"):
        if not 0 < getattr(reg, name) <= MAX_PARALLEL_SIZE:
            raise refuse(f"{name} {quote(getattr(reg, name))} is outside 1..{MAX_PARALLEL_SIZE}")
    if not 0 < len(reg.local_block_ids) <= MAX_KV_CACHE_GROUPS:
        raise refuse(f"names {len(reg.local_block_ids)} KV cache groups, not 1..{MAX_KV_CACHE_GROUPS}")
    for g, ids in enumerate(reg.local_block_ids):
        bad = [b for b in ids if not 0 <= b <= MAX_BLOCK_ID]
        if bad:
            raise refuse(f"group {g}: block ids {quote(bad)} are outside 0..{MAX_BLOCK_ID}")


def encode_heartbeat_notif(req_ids: Iterable[str]) -> bytes:
    ids = list(req_ids)
    for req_id in ids:
        # vLLM splits on ',' without escaping, so such an id would arrive as two.
        if "," in req_id:
            raise ValueError(f"request id {req_id!r} contains ',' and cannot travel in a heartbeat")
    return HB_NOTIF_PREFIX + ",".join(ids).encode()


def _text(msg: bytes, what: str) -> str:
    check_size(msg, what)
    try:
        return msg.decode()
    except UnicodeDecodeError as exc:
        raise WireFormatError(f"{what} is not UTF-8 text: {exc}") from exc


def parse_heartbeat_notif(msg: bytes) -> HeartbeatNotif:
    if not msg.startswith(HB_NOTIF_PREFIX):
        raise WireFormatError(f"heartbeat notif must start with {HB_NOTIF_PREFIX!r}, got {msg[:16]!r}")
    body = _text(msg[len(HB_NOTIF_PREFIX) :], "heartbeat notif")
    # Split at most MAX_HEARTBEAT_IDS times: 16 MiB of commas must not become millions of strings.
    ids = body.split(",", MAX_HEARTBEAT_IDS)[:MAX_HEARTBEAT_IDS] if body else []
    return HeartbeatNotif(tuple(ids))


def encode_completion_notif(req_id: str, tp_size: int) -> bytes:
    return f"{req_id}:{tp_size}".encode()


def parse_completion_notif(msg: bytes) -> CompletionNotif:
    """`<request id>:<sender tp size>`; split on the last ':' because request ids may contain ':'."""
    text = _text(msg, "completion notif")
    req_id, sep, tp_text = text.rpartition(":")
    if not sep or not req_id:
        raise WireFormatError(f"completion notif must be '<request id>:<tp size>', got {quote(text)}")
    if not tp_text.isdigit() or len(tp_text) > 6 or int(tp_text) < 1:
        raise WireFormatError(f"completion notif tp size must be a positive integer, got {tp_text[:20]!r}")
    return CompletionNotif(req_id, int(tp_text))


def parse_notif(msg: bytes) -> Notif:
    """Route a NIXL notif the way vLLM's push worker does: PUSH_REG, then HB, else a completion."""
    if msg.startswith(PUSH_REG_NOTIF_PREFIX):
        return decode_push_reg_notif(msg)
    if msg.startswith(HB_NOTIF_PREFIX):
        return parse_heartbeat_notif(msg)
    return parse_completion_notif(msg)
