"""The bounds every decode entry point checks before it reads a peer's bytes, the typed decode they share,
and the bounded quoting of a peer's values in messages and logs.

Everything read from the network goes through a size check and a typed (or explicitly validated untyped)
msgpack decode; nothing is ever unpickled, and every refusal is a `WireFormatError` naming the difference.
"""

from __future__ import annotations

import reprlib
from collections.abc import Sequence
from typing import Final, TypeVar

import msgspec

from disagg.worker.kv.errors import WireFormatError
from disagg.worker.kv.wire.versions import CONNECTOR_VERSIONS

# Real payloads are a few KiB (one entry per region); the cap only stops a peer from making us buffer and
# walk an arbitrarily large message.
MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024
# A side-channel request is three small values (some 20 bytes); the server's socket refuses anything longer
# before buffering it, so half-sent frames pin at most this much per connection.
MAX_SIDE_CHANNEL_REQUEST_BYTES: Final = 4096
# Bounds on what a peer's PUSH_REG may name, before anything is sized from it: real parallel sizes are a few
# dozen at most, NIXL descriptor ids are int32, and a request has at most a few KV cache groups.
MAX_PARALLEL_SIZE: Final = 1024
MAX_BLOCK_ID: Final = 2**31 - 1
MAX_KV_CACHE_GROUPS: Final = 64
MAX_ID_CHARS: Final = 1024
MAX_HOST_CHARS: Final = 255
MAX_HEARTBEAT_IDS: Final = 16_384
"""Request ids read from one heartbeat (vLLM sends one per request in flight to that prefill worker)."""
# What an error message quotes of a peer's bytes or values.
QUOTE_CHARS: Final = 120

_T = TypeVar("_T")
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxstring = 3, 8, 8, 8, 60


def clip(text: str, limit: int = 4 * QUOTE_CHARS) -> str:
    """`text`, cut to `limit` characters with the length it had."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """A bounded `repr(value)`: messages and logs never carry (or even render) a peer's whole payload."""
    if isinstance(value, str | bytes):
        head = repr(value[:limit])
        return head if len(value) <= limit else f"{head}... ({len(value)} long)"
    # reprlib bounds the walk itself (elements and depth), so a deep or long value is never fully rendered.
    text = _REPR.repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def check_size(data: bytes, what: str) -> None:
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireFormatError(f"{what} is {len(data)} bytes, over the {MAX_MESSAGE_BYTES}-byte limit")


def decode_typed(data: bytes, type_: type[_T], what: str, versions: Sequence[int] = CONNECTOR_VERSIONS) -> _T:
    """`data` as a `type_`, size-checked first; any decoder complaint, a too-deep nesting included, is a
    `WireFormatError` naming the connector versions (`versions`) whose `type_` was expected."""
    check_size(data, what)
    try:
        return msgspec.msgpack.decode(data, type=type_)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise WireFormatError(
            f"{what} is not a vLLM NIXL {type_.__name__} (connector versions "
            f"{versions[0]}-{versions[-1]}): {exc} "
            "(a peer running another vLLM NIXL connector version, or not a NIXL side channel)"
        ) from exc
