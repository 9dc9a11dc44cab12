"""What a handshake payload itself shows about the engine that sent it, beyond the typed metadata. Pure.

vLLM sends only the digest of its compatibility factors, never the factors, so a hash mismatch by itself says
nothing about why. But the payload tells two of the factors outright: the connector version, by the field set
of the encoded `NixlAgentMetadata` (vLLM's encoder writes every field, defaults included, in declaration
order), and the attention backend, in `attn_backend_name`. Everything else hashed (the vLLM version string,
the raw `--model` string, dtype, cache dtype, HMA, speculative config) is invisible on the wire.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from disagg.worker.kv import wire
from disagg.worker.kv.errors import WireFormatError
from disagg.worker.kv.releases import RELEASES

# Hash factors a payload cannot show; named when what it shows does not explain a mismatch.
_UNSEEN_FACTORS: Final = (
    "vllm_version (the exact release string)",
    "model (the raw --model string: a repo id and a local path differ)",
    "dtype",
    "cache_dtype",
    "is_hma_enabled",
    "speculative_config",
)


@dataclass(frozen=True)
class PayloadFacts:
    """What one payload shows: its hash, its metadata's field names, its backend and engine id."""

    compatibility_hash: str
    fields: tuple[str, ...]
    attn_backend_name: str | None
    engine_id: str | None
    ple_block_len: int | None = None
    packed_member_layouts: Mapping[str, Any] | None = None
    field_versions: tuple[int, ...] = ()

    @property
    def connector_versions(self) -> tuple[int, ...]:
        """The NIXL connector versions whose metadata field set this is (`wire.field_set_versions`); empty
        for a field set no release writes."""
        return self.field_versions

    @property
    def connector_version(self) -> str:
        """`13`, or `14 or 15` where the field set cannot tell them apart, or `unknown`."""
        return " or ".join(str(v) for v in self.field_versions) or "unknown"


def payload_facts(payload: bytes) -> PayloadFacts:
    """The facts of one side-channel reply (frame 0); `WireFormatError` on bytes that are not a payload."""
    envelope = wire.decode_payload_envelope(payload)
    try:
        raw = msgspec.msgpack.decode(envelope.agent_metadata_bytes)
    except msgspec.DecodeError as exc:
        raise WireFormatError(f"agent metadata is not msgpack: {exc}") from None
    if not isinstance(raw, dict):
        raise WireFormatError(f"agent metadata is a {type(raw).__name__}, not a map")
    backend, engine, ple = raw.get("attn_backend_name"), raw.get("engine_id"), raw.get("ple_block_len")
    packed = raw.get("packed_member_layouts")
    return PayloadFacts(
        compatibility_hash=envelope.compatibility_hash,
        fields=tuple(str(key) for key in raw),
        attn_backend_name=backend if isinstance(backend, str) else None,
        engine_id=engine if isinstance(engine, str) else None,
        ple_block_len=ple if isinstance(ple, int) and not isinstance(ple, bool) else None,
        packed_member_layouts=packed if isinstance(packed, dict) else None,
        field_versions=wire.field_set_versions(envelope.agent_metadata_bytes),
    )


# The releases a hash is tried against, each with the connector version it speaks: the release table's rows.
KNOWN_RELEASES: Final = tuple((release.tested, release.connector_version) for release in RELEASES)


def identify_release(
    predicted: Mapping[str, Any] | None,
    live_hash: str,
    releases: Sequence[tuple[str, int]] = KNOWN_RELEASES,
) -> str | None:
    """The release whose version string and connector version, put into the predicted factors, give
    `live_hash`: how a hash names the vLLM an engine runs when everything else was predicted right."""
    if predicted is None:
        return None
    for version, connector in releases:
        variant = {**predicted, "vllm_version": version, "nixl_connector_version": connector}
        if wire.compat_hash(variant) == live_hash:
            return version
    return None


def _same(a: object, b: object) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def prediction_differences(predicted: Mapping[str, Any] | None, live: PayloadFacts) -> list[str]:
    """The factors where the spec's prediction and what the live payload shows differ, each with both values;
    the unseen factors when the payload shows no difference. Pure."""
    told = []
    release = identify_release(predicted, live.compatibility_hash)
    if predicted is not None and release is not None and release != predicted.get("vllm_version"):
        told.append(
            f"vllm_version (the engine's hash is the prediction's with vLLM {release}; the prediction has "
            f"{predicted.get('vllm_version')!r})"
        )
    if predicted is not None:
        version = predicted.get("nixl_connector_version")
        if live.connector_versions and version not in live.connector_versions:
            told.append(
                f"nixl_connector_version (the engine speaks {live.connector_version}, by its metadata's "
                f"fields; the prediction has {version!r})"
            )
        backend = predicted.get("attn_backend_name")
        if live.attn_backend_name is not None and not _same(backend, live.attn_backend_name):
            told.append(
                f"attn_backend_name (the engine runs {live.attn_backend_name!r}, "
                f"the prediction has {backend!r})"
            )
    return told or [f"one the payload does not show: {', '.join(_UNSEEN_FACTORS)}"]


def live_differences(
    local: PayloadFacts, remote: PayloadFacts, predicted: Mapping[str, Any] | None = None
) -> list[str]:
    """What two live payloads with different hashes show of why: connector version, backend, and with the
    spec's `predicted` factors, the release each hash is of. Pure."""
    told = []
    here, there = (
        identify_release(predicted, local.compatibility_hash),
        identify_release(predicted, remote.compatibility_hash),
    )
    if here is not None and there is not None and here != there:
        told.append(f"vLLM version: this engine runs vLLM {here}, the peer vLLM {there} (by their hashes)")
    elif there is not None and here is None:
        told.append(f"vLLM version: the peer's hash is vLLM {there}'s, this engine's is no known release's")
    elif here is not None and there is None:
        told.append(f"vLLM version: this engine's hash is vLLM {here}'s, the peer's is no known release's")
    versions = (local.connector_versions, remote.connector_versions)
    if all(versions) and not set(versions[0]) & set(versions[1]):
        told.append(
            f"NIXL connector version {local.connector_version} here, {remote.connector_version} there "
            "(by the metadata's fields): the engines run different vLLM releases"
        )
    if (
        local.attn_backend_name is not None
        and remote.attn_backend_name is not None
        and local.attn_backend_name != remote.attn_backend_name
    ):
        told.append(f"attention backend {local.attn_backend_name!r} here, {remote.attn_backend_name!r} there")
    return told or [f"a factor the payloads do not show: {', '.join(_UNSEEN_FACTORS)}"]
