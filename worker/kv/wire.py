"""vLLM's NIXL connector wire format, as the released vLLM speaks it (connector versions 13, 14 and 15).

The structs below re-declare vLLM's `NixlAgentMetadata` and `NixlHandshakePayload` field for field, so that
`msgspec.msgpack` produces and accepts exactly what a vLLM engine does: maps keyed by field name in
declaration order, defaults written out, `bytes` as msgpack bin. That is what lets a `disagg` worker or probe
handshake a real vLLM engine. The releases differ in the metadata's field set: 0.31 (v13) has 20 fields, 0.32
(v14) and 0.33 (v15) insert `ple_block_len` between `pcp_size` and `region_members`. In memory a metadata is
always the newest field set (`NixlAgentMetadata`); `encode_agent_metadata` writes the field set of the
connector version asked for (`metadata_struct`), and the decoder, like vLLM's, takes every field set (unknown
keys are ignored, missing defaulted ones filled). So a decoded metadata re-encodes byte for byte with the
version it came from. The golden vectors in `tests/golden/vllm/<release>/`, written by each release's own
classes, pin the encoding.

Version 12 (`region_members` without `packed_member_layouts`) was only ever on vLLM's main branch: it still
decodes, because the decoder fills the missing field for free, but nothing here writes it.

Everything read from the network goes through a size check and a typed (or explicitly validated untyped)
msgpack decode; nothing is ever unpickled. Refusals are typed (`disagg.worker.kv.errors`) and name the
difference. This module is pure: no I/O, no clock.

It runs to some 650 lines because it mirrors vLLM's structs and notif formats field for field, with the
bounds every decode entry point checks on what a peer names; split, it would part what the golden vectors pin
together.
"""

from __future__ import annotations

import hashlib
import json
import re
import reprlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar

import msgspec

from disagg.worker.kv.errors import (
    CompatibilityHashMismatch,
    EngineIdMismatch,
    InvalidRegistration,
    WireFormatError,
)

# The NIXL connector versions of the supported releases (`disagg.worker.kv.releases`), oldest first.
CONNECTOR_VERSIONS: Final = (13, 14, 15)
LATEST_CONNECTOR_VERSION: Final = CONNECTOR_VERSIONS[-1]
GET_META_MSG: Final = b"get_meta_msg"
PUSH_REG_NOTIF_PREFIX: Final = b"PUSH_REG:"
HB_NOTIF_PREFIX: Final = b"HB:"
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

TransferMode = Literal["pull", "push"]

# The exact keys of vLLM's compute_nixl_compatibility_hash, in vLLM's order (the same from version 9 to 15).
COMPAT_FACTOR_KEYS: Final = (
    "vllm_version",
    "nixl_connector_version",
    "model",
    "dtype",
    "num_kv_heads",
    "head_size",
    "num_hidden_layers",
    "attn_backend_name",
    "cache_dtype",
    "is_hma_enabled",
    "speculative_config",
    "transfer_mode",
)

_TORCH_DTYPE_ALIASES: Final = {
    "bfloat16": "torch.bfloat16",
    "bf16": "torch.bfloat16",
    "float16": "torch.float16",
    "fp16": "torch.float16",
    "half": "torch.float16",
    "float32": "torch.float32",
    "fp32": "torch.float32",
    "float": "torch.float32",
}


class NixlAgentMetadata(msgspec.Struct, frozen=True):
    """What one worker advertises at handshake (vLLM `nixl/metadata.py`), the field set of connector versions
    14 and 15 (vLLM 0.32, 0.33). Field order is wire order."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    dcp_size: int = 1
    pcp_size: int = 1
    # v14: the page length of a per-layer-embedding (PLE) state region, when the model has one.
    ple_block_len: int | None = None
    # Empty unless the peer tracks region layers (push + HMA or packed, no Mamba); routing decides whether
    # an empty list is acceptable.
    region_members: list[list[str]] = msgspec.field(default_factory=list)
    # v13: per member layer of a packed (block-outermost) region, its (offset, length) inside the block.
    packed_member_layouts: dict[str, tuple[int, int]] = msgspec.field(default_factory=dict)


class NixlAgentMetadataV13(msgspec.Struct, frozen=True):
    """The field set of connector version 13 (vLLM 0.31): `NixlAgentMetadata` without `ple_block_len`."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    dcp_size: int = 1
    pcp_size: int = 1
    region_members: list[list[str]] = msgspec.field(default_factory=list)
    packed_member_layouts: dict[str, tuple[int, int]] = msgspec.field(default_factory=dict)


WireMetadata = type[NixlAgentMetadata] | type[NixlAgentMetadataV13]
_METADATA_STRUCTS: Final[Mapping[int, WireMetadata]] = {
    13: NixlAgentMetadataV13,
    14: NixlAgentMetadata,
    15: NixlAgentMetadata,
}


def metadata_struct(connector_version: int) -> WireMetadata:
    """The struct whose fields, in order, are the agent metadata of that connector version."""
    try:
        return _METADATA_STRUCTS[connector_version]
    except KeyError:
        raise ValueError(
            f"NIXL connector version {connector_version} is not one this worker speaks "
            f"(it speaks {', '.join(map(str, CONNECTOR_VERSIONS))})"
        ) from None


def metadata_fields(connector_version: int) -> tuple[str, ...]:
    """The agent metadata's field names in wire order at that connector version."""
    fields: tuple[str, ...] = metadata_struct(connector_version).__struct_fields__
    return fields


class NixlHandshakePayload(msgspec.Struct, frozen=True):
    """Reply frame 0 of the side channel: the hash travels outside the metadata so it can be checked first."""

    compatibility_hash: str
    agent_metadata_bytes: bytes


class PushRegistration(msgspec.Struct, frozen=True):
    """The body of a `PUSH_REG:` notif: vLLM push_scheduler's registration dict, field order = wire order."""

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
class SideChannelRequest:
    """A decoded side-channel request; `str_msg` marks a tag sent as str, which vLLM tolerates."""

    pp_rank: int
    tp_rank: int
    str_msg: bool = False


@dataclass(frozen=True)
class HeartbeatNotif:
    req_ids: tuple[str, ...]


@dataclass(frozen=True)
class CompletionNotif:
    req_id: str
    tp_size: int


Notif = PushRegistration | HeartbeatNotif | CompletionNotif

_T = TypeVar("_T")
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxstring = 3, 8, 8, 8, 60


# --- compatibility hash -------------------------------------------------------------------------------------


def torch_dtype_name(dtype: str) -> str:
    """The `str(torch.dtype)` spelling vLLM hashes (`"torch.bfloat16"`), from either spelling."""
    if dtype.startswith("torch."):
        return dtype
    try:
        return _TORCH_DTYPE_ALIASES[dtype.lower()]
    except KeyError:
        raise ValueError(
            f"unknown model dtype {dtype!r}: use a resolved torch dtype such as 'bfloat16' or 'torch.float16'"
            " ('auto' must be resolved to the model's dtype first, as vLLM does before hashing)"
        ) from None


def compat_factors(
    *,
    vllm_version: str,
    model: str,
    dtype: str,
    num_kv_heads: int,
    head_size: int,
    num_hidden_layers: int,
    attn_backend_name: str,
    is_hma_enabled: bool,
    transfer_mode: TransferMode,
    cache_dtype: str = "auto",
    nixl_connector_version: int,
    speculative_config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The factor dict of vLLM's compute_nixl_compatibility_hash, keys in vLLM's order.

    `vllm_version` and `nixl_connector_version` are the release's (`releases.Release`): both are hashed, so
    no two releases ever match. `num_hidden_layers` is the model total, not a PP stage's share; for MLA
    models `num_kv_heads` is the config's `num_key_value_heads` (vLLM's `get_total_num_kv_heads`), not 1;
    `speculative_config` is None unless the engine runs EAGLE/MTP-style drafting.
    """
    if transfer_mode not in ("pull", "push"):
        raise ValueError(f"transfer_mode must be 'pull' or 'push', got {transfer_mode!r}")
    return {
        "vllm_version": vllm_version,
        "nixl_connector_version": nixl_connector_version,
        "model": model,
        "dtype": torch_dtype_name(dtype),
        "num_kv_heads": num_kv_heads,
        "head_size": head_size,
        "num_hidden_layers": num_hidden_layers,
        "attn_backend_name": attn_backend_name,
        "cache_dtype": cache_dtype,
        "is_hma_enabled": is_hma_enabled,
        "speculative_config": dict(speculative_config) if speculative_config is not None else None,
        "transfer_mode": transfer_mode,
    }


def canonical_factors_json(factors: Mapping[str, Any]) -> str:
    """vLLM's `hash_factors` text: Python json defaults with sorted keys (ensure_ascii, ', ' and ': ')."""
    return json.dumps(dict(factors), sort_keys=True)


def compat_hash(factors: Mapping[str, Any]) -> str:
    """sha256 hex digest of the canonical JSON of the factors, as vLLM's `hash_factors`."""
    return hashlib.sha256(canonical_factors_json(factors).encode()).hexdigest()


def differing_factors(local: Mapping[str, Any], remote: Mapping[str, Any]) -> list[str]:
    """Sorted names of the factors whose values differ, or that only one side has.

    Values are compared by their canonical JSON, the way the hash sees them (a tuple equals a list).
    """
    differing = []
    for key in sorted(set(local) | set(remote)):
        missing = key not in local or key not in remote
        if missing or json.dumps(local[key], sort_keys=True) != json.dumps(remote[key], sort_keys=True):
            differing.append(key)
    return differing


def _single_factor_variants(local: Mapping[str, Any]) -> Iterable[tuple[str, Any]]:
    """The one-factor changes that explain most real mismatches: connector version, transfer mode, HMA."""
    for version in range(1, LATEST_CONNECTOR_VERSION + 4):
        if version != local.get("nixl_connector_version"):
            yield "nixl_connector_version", version
    for mode in ("pull", "push"):
        if mode != local.get("transfer_mode"):
            yield "transfer_mode", mode
    if isinstance(local.get("is_hma_enabled"), bool):
        yield "is_hma_enabled", not local["is_hma_enabled"]


def explain_hash_mismatch(local: Mapping[str, Any], remote_hash: str) -> tuple[str, Any] | None:
    """The single well-known factor change to the local factors that yields the remote hash, if one does.

    vLLM peers send only the digest, not their factors, so this is how a version-11 peer or a push/pull mix-up
    is told apart from an unexplained difference.
    """
    for key, value in _single_factor_variants(local):
        if compat_hash({**local, key: value}) == remote_hash:
            return key, value
    return None


def _hash_mismatch_error(
    local_hash: str,
    remote_hash: str,
    local_factors: Mapping[str, Any] | None,
    remote_factors: Mapping[str, Any] | None,
) -> WireFormatError | CompatibilityHashMismatch:
    head = f"NIXL compatibility hash mismatch: local {local_hash}, remote {remote_hash}"
    if local_factors is not None and remote_factors is not None:
        keys = differing_factors(local_factors, remote_factors)
        detail = ", ".join(
            f"{k} (local {local_factors.get(k)!r}, remote {remote_factors.get(k)!r})" for k in keys
        )
        return CompatibilityHashMismatch(
            f"{head}; differing factors: {detail or 'none (hash inputs differ)'}"
        )
    if local_factors is not None:
        explained = explain_hash_mismatch(local_factors, remote_hash)
        if explained is not None:
            key, value = explained
            local_value = local_factors.get(key)
            if key == "nixl_connector_version":
                return WireFormatError(
                    f"{head}: the remote runs NIXL connector version {value}, this side {local_value}; "
                    "upgrade the older engine so both speak the same connector version"
                )
            return CompatibilityHashMismatch(
                f"{head}: the remote has {key}={value!r} where this side has {local_value!r}"
            )
    return CompatibilityHashMismatch(
        f"{head}; the peer differs in at least one of {', '.join(COMPAT_FACTOR_KEYS)}"
    )


# --- agent metadata and handshake payload -------------------------------------------------------------------

_ENGINE_ID_SUFFIX: Final = re.compile(r"-[0-9a-f]{8}")


def engine_id_matches(expected: str, actual: str) -> bool:
    """Whether an engine id is the expected one: equal, or the expected stable prefix plus the per-start
    `-<8 hex>` suffix the operator's engine launcher draws (`builders_engine.DECODE_LAUNCHER` and its
    siblings). A watcher knows only the prefix; whoever holds a full id (a router, a decoder) compares it
    whole, so a restarted engine, which has a new suffix, is another engine."""
    if actual == expected:
        return True
    return actual.startswith(expected) and _ENGINE_ID_SUFFIX.fullmatch(actual[len(expected) :]) is not None


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


def _check_size(data: bytes, what: str) -> None:
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireFormatError(f"{what} is {len(data)} bytes, over the {MAX_MESSAGE_BYTES}-byte limit")


def _decode_typed(data: bytes, type_: type[_T], what: str) -> _T:
    _check_size(data, what)
    try:
        return msgspec.msgpack.decode(data, type=type_)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise WireFormatError(
            f"{what} is not a vLLM NIXL {type_.__name__} (connector versions "
            f"{CONNECTOR_VERSIONS[0]}-{LATEST_CONNECTOR_VERSION}): {exc} "
            "(a peer running another vLLM NIXL connector version, or not a NIXL side channel)"
        ) from exc


def encode_agent_metadata(
    metadata: NixlAgentMetadata, connector_version: int = LATEST_CONNECTOR_VERSION
) -> bytes:
    """The metadata as that connector version's vLLM encodes it: its field set, in its order."""
    struct = metadata_struct(connector_version)
    if struct is NixlAgentMetadata:
        return msgspec.msgpack.encode(metadata)
    if metadata.ple_block_len is not None:
        raise ValueError(
            f"connector version {connector_version} has no ple_block_len, but this metadata sets it to "
            f"{metadata.ple_block_len}: a PLE model needs vLLM 0.32 (connector version 14) or later"
        )
    return msgspec.msgpack.encode(
        struct(**{name: getattr(metadata, name) for name in struct.__struct_fields__})
    )


# What the field sets of the metadata say about the connector version (v12 was never released; v11 has no
# region_members). v14 and v15 write the same fields: only the hash tells them apart.
_FIELD_SET_VERSIONS: Final = {
    metadata_fields(13): (13,),
    metadata_fields(14): (14, 15),
    tuple(name for name in metadata_fields(13) if name != "packed_member_layouts"): (12,),
    tuple(name for name in metadata_fields(13) if name not in ("packed_member_layouts", "region_members")): (
        11,
    ),
}


def field_set_versions(data: bytes) -> tuple[int, ...]:
    """The connector versions whose metadata field set, in order, is exactly the keys of the encoded map
    (empty when it is no known field set, e.g. a metadata re-encoded by another release's class)."""
    _check_size(data, "agent metadata")
    try:
        keys = tuple(msgspec.msgpack.decode(data, type=dict[str, Any]))
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ()
    return _FIELD_SET_VERSIONS.get(keys, ())


def decode_agent_metadata(data: bytes) -> NixlAgentMetadata:
    return _decode_typed(data, NixlAgentMetadata, "agent metadata")


def encode_handshake_payload(
    metadata: NixlAgentMetadata | bytes,
    compatibility_hash: str,
    connector_version: int = LATEST_CONNECTOR_VERSION,
) -> bytes:
    """Reply frame 0: the hash and the (already, or here at `connector_version`) encoded agent metadata."""
    metadata_bytes = (
        metadata if isinstance(metadata, bytes) else encode_agent_metadata(metadata, connector_version)
    )
    return msgspec.msgpack.encode(NixlHandshakePayload(compatibility_hash, metadata_bytes))


def decode_payload_envelope(data: bytes) -> NixlHandshakePayload:
    """Phase one only: the hash and the still-encoded metadata."""
    return _decode_typed(data, NixlHandshakePayload, "handshake payload")


def decode_handshake_payload(
    data: bytes,
    *,
    expected_hash: str | None,
    local_factors: Mapping[str, Any] | None = None,
    remote_factors: Mapping[str, Any] | None = None,
    expected_engine_id: str | None = None,
) -> NixlAgentMetadata:
    """vLLM's two-phase decode: the envelope, then the hash, and only then the agent metadata.

    `expected_hash=None` skips the hash check (vLLM's `enforce_handshake_compat=false`). `local_factors`, when
    given, makes the mismatch message name the differing factor where one well-known change explains it (a
    connector-version difference is refused as `WireFormatError`, reason ConnectorVersionMismatch);
    `remote_factors`, when known out of band (e.g. from the other role's spec), names every differing factor.
    `expected_engine_id` may be the stable prefix of a per-start id (`engine_id_matches`).
    """
    if (
        expected_hash is not None
        and local_factors is not None
        and compat_hash(local_factors) != expected_hash
    ):
        raise ValueError("expected_hash is not the hash of local_factors")
    payload = decode_payload_envelope(data)
    if expected_hash is not None and payload.compatibility_hash != expected_hash:
        raise _hash_mismatch_error(expected_hash, payload.compatibility_hash, local_factors, remote_factors)
    metadata = decode_agent_metadata(payload.agent_metadata_bytes)
    if expected_engine_id is not None and not engine_id_matches(expected_engine_id, metadata.engine_id):
        raise EngineIdMismatch(
            f"remote NIXL agent engine id mismatch: expected {expected_engine_id!r}, the side channel "
            f"answered for {metadata.engine_id!r} (one bound to localhost answers for the local engine)"
        )
    return metadata


# --- side channel frames ------------------------------------------------------------------------------------


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
    _check_size(data, "side-channel reply timestamp")
    try:
        return msgspec.msgpack.decode(data, type=float)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireFormatError(f"side-channel reply timestamp is not a msgpack float: {exc}") from exc


# --- notifications ------------------------------------------------------------------------------------------


def encode_push_reg_notif(registration: PushRegistration) -> bytes:
    return PUSH_REG_NOTIF_PREFIX + msgspec.msgpack.encode(registration)


def decode_push_reg_notif(msg: bytes) -> PushRegistration:
    if not msg.startswith(PUSH_REG_NOTIF_PREFIX):
        raise WireFormatError(f"PUSH_REG notif must start with {PUSH_REG_NOTIF_PREFIX!r}, got {msg[:16]!r}")
    registration = _decode_typed(msg[len(PUSH_REG_NOTIF_PREFIX) :], PushRegistration, "PUSH_REG registration")
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
    _check_size(msg, what)
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
