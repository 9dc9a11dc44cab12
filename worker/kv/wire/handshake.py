"""The handshake payload, reply frame 0 of vLLM's NIXL side channel (`NixlHandshakePayload`), and its
two-phase decode: the envelope, then the compatibility hash, and only then the agent metadata, whose engine
id must be the one asked for."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from disagg.worker.kv.errors import EngineIdMismatch
from disagg.worker.kv.wire.compat_hash import compat_hash, hash_mismatch_error
from disagg.worker.kv.wire.limits import decode_typed
from disagg.worker.kv.wire.metadata import NixlAgentMetadata, decode_agent_metadata, encode_agent_metadata
from disagg.worker.kv.wire.versions import LATEST_CONNECTOR_VERSION


class NixlHandshakePayload(msgspec.Struct, frozen=True):
    """Reply frame 0 of the side channel: the hash travels outside the metadata so it can be checked first."""

    compatibility_hash: str
    agent_metadata_bytes: bytes


_ENGINE_ID_SUFFIX: Final = re.compile(r"-[0-9a-f]{8}")


def engine_id_matches(expected: str, actual: str) -> bool:
    """Whether an engine id is the expected one: equal, or the expected stable prefix plus the per-start
    `-<8 hex>` suffix the operator's engine launcher draws (`builders_engine.DECODE_LAUNCHER` and its
    siblings). A watcher knows only the prefix; whoever holds a full id (a router, a decoder) compares it
    whole, so a restarted engine, which has a new suffix, is another engine."""
    if actual == expected:
        return True
    return actual.startswith(expected) and _ENGINE_ID_SUFFIX.fullmatch(actual[len(expected) :]) is not None


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
    return decode_typed(data, NixlHandshakePayload, "handshake payload")


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
        raise hash_mismatch_error(expected_hash, payload.compatibility_hash, local_factors, remote_factors)
    metadata = decode_agent_metadata(payload.agent_metadata_bytes)
    if expected_engine_id is not None and not engine_id_matches(expected_engine_id, metadata.engine_id):
        raise EngineIdMismatch(
            f"remote NIXL agent engine id mismatch: expected {expected_engine_id!r}, the side channel "
            f"answered for {metadata.engine_id!r} (one bound to localhost answers for the local engine)"
        )
    return metadata
