"""The wire format against each released vLLM's own vectors (tests/golden/vllm/<release>, written by that
release's classes): every metadata decodes and re-encodes byte for byte at the release's connector version."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from golden_values import from_golden, plain

from disagg.worker.contracts import releases
from disagg.worker.kv import wire

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "vllm"
# Every supported release has its golden vectors: a new row of the version table is tested here unasked.
RELEASES = tuple(row.tested for row in releases.RELEASES)
MANIFESTS = {v: json.loads((GOLDEN / v / "manifest.json").read_text()) for v in RELEASES}


def entries(kind: str) -> list[tuple[str, dict[str, Any]]]:
    return [(v, e) for v in RELEASES for e in MANIFESTS[v]["files"] if e["kind"] == kind]


def ids(kind: str) -> list[str]:
    return [f"{v}/{e['file']}" for v, e in entries(kind)]


def describe(version: str, entry: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((GOLDEN / version / entry["description_file"]).read_text())
    return result


def raw(version: str, name: str) -> bytes:
    return (GOLDEN / version / name).read_bytes()


def compat_cases(version: str) -> dict[str, dict[str, Any]]:
    cases = json.loads((GOLDEN / version / "compat_hash_cases.json").read_text())["cases"]
    return {c["id"]: c for c in cases}


@pytest.mark.parametrize("version", RELEASES)
def test_golden_files_are_intact_and_name_their_release(version: str) -> None:
    manifest = MANIFESTS[version]
    assert manifest["vllm_version"] == version
    for entry in manifest["files"]:
        data = raw(version, entry["file"])
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], entry["file"]


@pytest.mark.parametrize("version", RELEASES)
def test_each_release_field_set_is_the_wire_struct(version: str) -> None:
    manifest = MANIFESTS[version]
    assert wire.metadata_fields(manifest["nixl_connector_version"]) == tuple(
        manifest["NixlAgentMetadata_field_order"]
    )
    assert manifest["nixl_connector_version"] in wire.CONNECTOR_VERSIONS


@pytest.mark.parametrize(("version", "entry"), entries("NixlAgentMetadata"), ids=ids("NixlAgentMetadata"))
def test_agent_metadata_round_trips_byte_for_byte(version: str, entry: dict[str, Any]) -> None:
    data = raw(version, entry["file"])
    connector = MANIFESTS[version]["nixl_connector_version"]
    expected = from_golden(describe(version, entry)["decoded"])
    decoded = wire.decode_agent_metadata(data)
    assert {k: v for k, v in plain(decoded).items() if k in expected} == expected
    assert wire.encode_agent_metadata(decoded, connector) == data
    # Built from the stated values alone, the struct must produce the release's bytes.
    assert wire.encode_agent_metadata(wire.NixlAgentMetadata(**expected), connector) == data
    fields = len(wire.metadata_fields(connector))
    assert data[:3] == b"\xde\x00" + bytes([fields])


def test_non_default_ple_block_len_and_packed_layouts_are_kept() -> None:
    for version in ("0.32.0", "0.33.0"):
        data = raw(version, "agent_metadata_ple_packed.msgpack")
        decoded = wire.decode_agent_metadata(data)
        assert decoded.ple_block_len == 24576
        assert decoded.packed_member_layouts["model.layers.1.self_attn.attn"] == (16384, 16384)
        assert wire.encode_agent_metadata(decoded, 14) == data
        with pytest.raises(ValueError, match="has no ple_block_len"):
            wire.encode_agent_metadata(decoded, 13)
    packed = wire.decode_agent_metadata(raw("0.31.0", "agent_metadata_packed_mla.msgpack"))
    assert len(packed.packed_member_layouts) == 27 and packed.ple_block_len is None


def test_a_metadata_of_one_release_is_written_in_another_release_field_set() -> None:
    v13 = raw("0.31.0", "agent_metadata_pp1_decode_hma.msgpack")
    v15 = raw("0.33.0", "agent_metadata_pp1_decode_hma.msgpack")
    assert wire.encode_agent_metadata(wire.decode_agent_metadata(v13), 15) == v15
    assert wire.encode_agent_metadata(wire.decode_agent_metadata(v15), 13) == v13
    with pytest.raises(ValueError, match="connector version 12 is not one this worker speaks"):
        wire.encode_agent_metadata(wire.decode_agent_metadata(v13), 12)


@pytest.mark.parametrize(
    ("version", "entry"), entries("NixlHandshakePayload"), ids=ids("NixlHandshakePayload")
)
def test_handshake_payload_round_trips(version: str, entry: dict[str, Any]) -> None:
    data = raw(version, entry["file"])
    connector = MANIFESTS[version]["nixl_connector_version"]
    described = describe(version, entry)["decoded"]
    case = compat_cases(version)[described["compat_case"]]
    inner = raw(version, described["agent_metadata_bytes"]["$is"])
    assert described["compatibility_hash"] == case["sha256"]
    assert wire.encode_handshake_payload(inner, case["sha256"]) == data
    metadata = wire.decode_handshake_payload(
        data, expected_hash=case["sha256"], local_factors=case["factors"]
    )
    assert wire.encode_handshake_payload(metadata, case["sha256"], connector) == data


@pytest.mark.parametrize("version", RELEASES)
def test_compat_hash_cases(version: str) -> None:
    for case in compat_cases(version).values():
        assert wire.compat_hash(case["factors"]) == case["sha256"], case["id"]
        assert wire.compat_factors(**case["factors"]) == case["factors"], case["id"]
        assert case["factors"]["nixl_connector_version"] == MANIFESTS[version]["nixl_connector_version"]


@pytest.mark.parametrize(
    ("version", "entry"), entries("side_channel_request"), ids=ids("side_channel_request")
)
def test_side_channel_request(version: str, entry: dict[str, Any]) -> None:
    decoded = describe(version, entry)["decoded"]
    data = raw(version, entry["file"])
    assert wire.encode_side_channel_request(decoded["pp_rank"], decoded["tp_rank"]) == data
    assert wire.decode_side_channel_request(data) == wire.SideChannelRequest(
        decoded["pp_rank"], decoded["tp_rank"]
    )


@pytest.mark.parametrize("version", RELEASES)
def test_notifs(version: str) -> None:
    (reg,) = [e for v, e in entries("push_reg_notif") if v == version]
    described = describe(version, reg)["decoded"]
    assert wire.encode_push_reg_notif(wire.PushRegistration(**described)) == raw(version, reg["file"])
    assert plain(wire.decode_push_reg_notif(raw(version, reg["file"]))) == described
    (hb,) = [e for v, e in entries("heartbeat_notif") if v == version]
    req_ids = describe(version, hb)["decoded"]["req_ids"]
    assert wire.encode_heartbeat_notif(req_ids) == raw(version, hb["file"])
    (done,) = [e for v, e in entries("completion_notif") if v == version]
    value = describe(version, done)["decoded"]
    assert wire.encode_completion_notif(value["request_id"], value["tp_size"]) == raw(version, done["file"])
    assert wire.parse_notif(raw(version, done["file"])) == wire.CompletionNotif(
        value["request_id"], value["tp_size"]
    )


@pytest.mark.parametrize(("version", "entry"), entries("NixlAgentMetadata"), ids=ids("NixlAgentMetadata"))
def test_the_field_set_tells_the_connector_version(version: str, entry: dict[str, Any]) -> None:
    connector = MANIFESTS[version]["nixl_connector_version"]
    found = wire.field_set_versions(raw(version, entry["file"]))
    fields = MANIFESTS[version]["NixlAgentMetadata_field_order"]
    same = tuple(
        MANIFESTS[v]["nixl_connector_version"]
        for v in RELEASES
        if MANIFESTS[v]["NixlAgentMetadata_field_order"] == fields
    )
    assert connector in found and found == same
    v12 = (GOLDEN.parent / "agent_metadata_pp1_decode_hma.msgpack").read_bytes()
    assert wire.field_set_versions(v12) == (12,)
    assert wire.field_set_versions(b"\x01") == ()
