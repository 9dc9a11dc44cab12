"""Connector versions are data (issue 21): a release whose agent metadata gains one field is one row of the
version table plus that field with its `Since`; the encoder, decoder, refusals, version check, field-set
lookup and hash factor keys follow. A fake vLLM 0.35 (connector version 17, one extra field), defined here
only, shows it without touching the product (the real 0.34, version 16, was added the same way: one row and
`layer_group_ids` with its `Since`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec
import pytest

from disagg.worker.kv import wire
from disagg.worker.kv.errors import WireFormatError

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
RELEASE_VECTORS = {
    13: GOLDEN / "vllm" / "0.31.0" / "agent_metadata_pp1_decode_hma.msgpack",
    14: GOLDEN / "vllm" / "0.32.0" / "agent_metadata_ple_packed.msgpack",
    15: GOLDEN / "vllm" / "0.33.0" / "agent_metadata_pp1_decode_hma.msgpack",
    16: GOLDEN / "vllm" / "0.34.0" / "agent_metadata_pp1_decode_hma.msgpack",
}
V12 = GOLDEN / "agent_metadata_pp1_decode_hma.msgpack"


class Metadata035(wire.NixlAgentMetadata, frozen=True):
    """The fake 0.35's metadata: today's, plus one field (a subclass appends it, as vLLM usually does)."""

    kv_offload_tier: Annotated[str | None, wire.Since(17, needed_by="an offloaded KV cache")] = None


class Factors035(wire.CompatFactors, frozen=True):
    """The fake 0.35's hash factors: today's, plus one."""

    offload_backend: Annotated[str | None, wire.Since(17)] = None


TABLE = (*wire.VERSIONS, wire.ConnectorVersion(17, "0.35.0"))
"""The one entry a new release adds."""
FAKE = wire.VersionedStruct(Metadata035, TABLE, what="agent metadata", noun="metadata")


def fake(**changes: Any) -> Metadata035:
    base = wire.decode_agent_metadata(RELEASE_VECTORS[16].read_bytes())
    return Metadata035(**{name: getattr(base, name) for name in base.__struct_fields__} | changes)


def test_the_new_version_is_spoken_and_has_one_more_field() -> None:
    assert FAKE.versions == (13, 14, 15, 16, 17) and FAKE.latest == 17
    assert FAKE.fields_at(17) == (*wire.metadata_fields(16), "kv_offload_tier")
    for version in (13, 14, 15, 16):
        assert FAKE.fields_at(version) == wire.metadata_fields(version)
    assert FAKE.struct_at(17) is Metadata035
    with pytest.raises(
        ValueError, match=r"version 18 is not one this worker speaks \(it speaks 13, 14, 15, 16, 17\)"
    ):
        FAKE.struct_at(18)
    # The product's table is untouched: it still refuses 17.
    with pytest.raises(ValueError, match="version 17 is not one this worker speaks"):
        wire.metadata_struct(17)


@pytest.mark.parametrize("version", sorted(RELEASE_VECTORS))
def test_every_released_vector_still_round_trips_byte_for_byte(version: int) -> None:
    data = RELEASE_VECTORS[version].read_bytes()
    decoded = FAKE.decode(data)
    assert decoded.kv_offload_tier is None
    assert FAKE.encode(decoded, version) == data
    assert FAKE.field_set_versions(data) == wire.field_set_versions(data)


def test_the_new_version_encodes_decodes_and_tells_its_field_set() -> None:
    message = fake(kv_offload_tier="dram")
    data = FAKE.encode(message, 17)
    assert data[:3] == b"\xde\x00" + bytes([len(FAKE.fields_at(17))])
    assert FAKE.decode(data) == message
    assert FAKE.field_set_versions(data) == (17,)
    assert FAKE.field_set_versions(RELEASE_VECTORS[15].read_bytes()) == (14, 15)
    assert FAKE.field_set_versions(RELEASE_VECTORS[16].read_bytes()) == (16,)
    assert FAKE.field_set_versions(V12.read_bytes()) == (12,)
    # A v17 peer's metadata is still what today's worker decodes (unknown keys ignored, as vLLM does).
    assert wire.decode_agent_metadata(data) == wire.decode_agent_metadata(RELEASE_VECTORS[16].read_bytes())
    # It travels in the handshake payload like any other.
    envelope = wire.decode_payload_envelope(wire.encode_handshake_payload(data, "h"))
    assert FAKE.decode(envelope.agent_metadata_bytes) == message
    # Written at 16 with the new field at its default, it is the 0.34 vector again.
    assert FAKE.encode(fake(), 16) == RELEASE_VECTORS[16].read_bytes()


def test_an_older_version_refuses_a_value_it_has_no_field_for() -> None:
    with pytest.raises(
        ValueError,
        match=r"^connector version 16 has no kv_offload_tier, but this metadata sets it to 'dram': "
        r"an offloaded KV cache needs vLLM 0\.35 \(connector version 17\) or later$",
    ):
        FAKE.encode(fake(kv_offload_tier="dram"), 16)
    with pytest.raises(ValueError, match=r"has no ple_block_len.*needs vLLM 0\.32 \(connector version 14\)"):
        FAKE.encode(fake(ple_block_len=8), 13)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xde\x00",
        b"\x91" * 5000,
        msgspec.msgpack.encode({"engine_id": 1}),
        msgspec.msgpack.encode(msgspec.structs.asdict(fake(kv_offload_tier="x")) | {"kv_offload_tier": 5}),
        b"\xc6\xff\xff\xff\xff",  # a bin that claims 4 GiB
    ],
)
def test_hostile_bytes_are_wire_format_errors_naming_the_new_versions(data: bytes) -> None:
    with pytest.raises(WireFormatError, match="connector versions 13-17"):
        FAKE.decode(data)


def test_only_a_known_field_set_names_versions() -> None:
    for data in (b"", b"\x91" * 5000, msgspec.msgpack.encode({"engine_id": 1}), b"\xc6\xff\xff\xff\xff"):
        assert FAKE.field_set_versions(data) == ()


def test_an_oversized_message_is_refused_before_it_is_read() -> None:
    data = b"\x00" * (wire.MAX_MESSAGE_BYTES + 1)
    with pytest.raises(WireFormatError, match=r"over the \d+-byte limit"):
        FAKE.decode(data)
    with pytest.raises(WireFormatError, match=r"over the \d+-byte limit"):
        FAKE.field_set_versions(data)


def test_the_hash_factor_keys_follow_the_table() -> None:
    factors = wire.VersionedStruct(Factors035, TABLE, what="factors", noun="factor set")
    assert factors.fields_present_at(16) == wire.COMPAT_FACTOR_KEYS == wire.compat_factor_keys(16)
    assert factors.fields_present_at(17) == (*wire.COMPAT_FACTOR_KEYS, "offload_backend")


def test_a_field_without_its_release_row_or_default_fails_at_definition() -> None:
    class Unlisted(wire.NixlAgentMetadata, frozen=True):
        extra: Annotated[int, wire.Since(17)] = 0

    with pytest.raises(
        ValueError, match=r"version 17, which the version table \(11, 12, 13, 14, 15, 16\) has no row for"
    ):
        wire.VersionedStruct(Unlisted, what="agent metadata", noun="metadata")

    class Required(msgspec.Struct, frozen=True):
        extra: Annotated[int, wire.Since(17)]

    with pytest.raises(TypeError, match="needs a default"):
        wire.VersionedStruct(Required, TABLE, what="x", noun="x")
    with pytest.raises(ValueError, match="strictly increase"):
        wire.VersionedStruct(Metadata035, (*TABLE, wire.ConnectorVersion(16, "0.36.0")), what="x", noun="x")


def test_a_field_can_leave_the_wire() -> None:
    class Dropped(msgspec.Struct, frozen=True):
        kept: int
        gone: Annotated[int, wire.Since(13, until=17, needed_by="it")] = 0

    dropped = wire.VersionedStruct(Dropped, TABLE, what="x", noun="message")
    assert dropped.fields_at(16) == ("kept", "gone") and dropped.fields_at(17) == ("kept",)
    assert dropped.encode(Dropped(1), 17) == msgspec.msgpack.encode({"kept": 1})
    with pytest.raises(ValueError, match="connector version 17 dropped it"):
        dropped.encode(Dropped(1, 2), 17)
