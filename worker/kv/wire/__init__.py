"""vLLM's NIXL connector wire format, as the released vLLM speaks it (the connector versions of
`versions.VERSIONS`): the public face of the package, `from disagg.worker.kv import wire; wire.X`.

The structs re-declare vLLM's `NixlAgentMetadata`, `NixlHandshakePayload` and push registration field for
field, so that `msgspec.msgpack` produces and accepts exactly what a vLLM engine does: maps keyed by field
name in declaration order, defaults written out, `bytes` as msgpack bin. That is what lets a `disagg` worker
or probe handshake a real vLLM engine. Connector versions are data: the version table (`versions`) and, on
each struct field that some version lacks, the version it joined (`Since`); the encoders, decoder, version
check, field-set lookup and hash factors derive from them (`versioned`). The golden vectors in
`tests/golden/vllm/<release>/`, written by each release's own classes, pin the encoding.

Everything read from the network goes through a size check and a typed (or explicitly validated untyped)
msgpack decode (`limits`); nothing is ever unpickled. Refusals are typed (`disagg.worker.kv.errors`) and
name the difference. The package is pure: no I/O, no clock.
"""

from disagg.worker.kv.wire.compat_hash import (
    COMPAT_FACTOR_KEYS,
    CompatFactors,
    TransferMode,
    canonical_factors_json,
    compat_factor_keys,
    compat_factors,
    compat_hash,
    differing_factors,
    explain_hash_mismatch,
    torch_dtype_name,
)
from disagg.worker.kv.wire.handshake import (
    NixlHandshakePayload,
    decode_handshake_payload,
    decode_payload_envelope,
    encode_handshake_payload,
    engine_id_matches,
)
from disagg.worker.kv.wire.limits import (
    MAX_BLOCK_ID,
    MAX_HEARTBEAT_IDS,
    MAX_HOST_CHARS,
    MAX_ID_CHARS,
    MAX_KV_CACHE_GROUPS,
    MAX_MESSAGE_BYTES,
    MAX_PARALLEL_SIZE,
    MAX_SIDE_CHANNEL_REQUEST_BYTES,
    QUOTE_CHARS,
    clip,
    quote,
)
from disagg.worker.kv.wire.metadata import (
    METADATA,
    NixlAgentMetadata,
    WireMetadata,
    decode_agent_metadata,
    encode_agent_metadata,
    field_set_versions,
    metadata_fields,
    metadata_struct,
)
from disagg.worker.kv.wire.notifications import (
    HB_NOTIF_PREFIX,
    PUSH_REG_NOTIF_PREFIX,
    CompletionNotif,
    HeartbeatNotif,
    Notif,
    PushRegistration,
    check_push_registration,
    decode_push_reg_notif,
    encode_completion_notif,
    encode_heartbeat_notif,
    encode_push_reg_notif,
    parse_completion_notif,
    parse_heartbeat_notif,
    parse_notif,
)
from disagg.worker.kv.wire.side_channel import (
    GET_META_MSG,
    SideChannelRequest,
    decode_reply_timestamp,
    decode_side_channel_request,
    encode_reply_timestamp,
    encode_side_channel_request,
)
from disagg.worker.kv.wire.versioned import VersionedStruct
from disagg.worker.kv.wire.versions import (
    CONNECTOR_VERSIONS,
    LATEST_CONNECTOR_VERSION,
    VERSIONS,
    ConnectorVersion,
    Since,
    pairs_by_layer_name,
)

__all__ = [
    "COMPAT_FACTOR_KEYS",
    "CONNECTOR_VERSIONS",
    "GET_META_MSG",
    "HB_NOTIF_PREFIX",
    "LATEST_CONNECTOR_VERSION",
    "MAX_BLOCK_ID",
    "MAX_HEARTBEAT_IDS",
    "MAX_HOST_CHARS",
    "MAX_ID_CHARS",
    "MAX_KV_CACHE_GROUPS",
    "MAX_MESSAGE_BYTES",
    "MAX_PARALLEL_SIZE",
    "MAX_SIDE_CHANNEL_REQUEST_BYTES",
    "METADATA",
    "PUSH_REG_NOTIF_PREFIX",
    "QUOTE_CHARS",
    "VERSIONS",
    "CompatFactors",
    "CompletionNotif",
    "ConnectorVersion",
    "HeartbeatNotif",
    "NixlAgentMetadata",
    "NixlHandshakePayload",
    "Notif",
    "PushRegistration",
    "SideChannelRequest",
    "Since",
    "TransferMode",
    "VersionedStruct",
    "WireMetadata",
    "canonical_factors_json",
    "check_push_registration",
    "clip",
    "compat_factor_keys",
    "compat_factors",
    "compat_hash",
    "decode_agent_metadata",
    "decode_handshake_payload",
    "decode_payload_envelope",
    "decode_push_reg_notif",
    "decode_reply_timestamp",
    "decode_side_channel_request",
    "differing_factors",
    "encode_agent_metadata",
    "encode_completion_notif",
    "encode_handshake_payload",
    "encode_heartbeat_notif",
    "encode_push_reg_notif",
    "encode_reply_timestamp",
    "encode_side_channel_request",
    "engine_id_matches",
    "explain_hash_mismatch",
    "field_set_versions",
    "metadata_fields",
    "metadata_struct",
    "pairs_by_layer_name",
    "parse_completion_notif",
    "parse_heartbeat_notif",
    "parse_notif",
    "quote",
    "torch_dtype_name",
]
