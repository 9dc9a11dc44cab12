"""The wire format against the v12 golden vectors of tests/golden (vLLM main between 0.30 and 0.31, never
released): they still decode, and their hash, request and notif vectors still hold in every release. Each
release's own vectors (v13-v15, byte for byte) are tests/unit/test_wire_releases.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from golden_values import from_golden, plain
from hypothesis import given
from hypothesis import strategies as st

from disagg.worker.kv import wire
from disagg.worker.kv.errors import CompatibilityHashMismatch, EngineIdMismatch, WireFormatError

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())
COMPAT_CASES = {c["id"]: c for c in json.loads((GOLDEN / "compat_hash_cases.json").read_text())["cases"]}
BEHAVIOR = json.loads((GOLDEN / "decoder_behavior.json").read_text())


def entries(kind: str) -> list[dict[str, Any]]:
    return [e for e in MANIFEST["files"] if e["kind"] == kind]


def describe(entry: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((GOLDEN / entry["description_file"]).read_text())
    return result


def raw(entry: dict[str, Any]) -> bytes:
    return (GOLDEN / str(entry["file"])).read_bytes()


def ids(kind: str) -> list[str]:
    return [e["file"] for e in entries(kind)]


def test_golden_copy_is_intact() -> None:
    assert len(MANIFEST["files"]) == 17
    for entry in MANIFEST["files"]:
        data = raw(entry)
        assert len(data) == entry["length"], entry["file"]
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], entry["file"]
        assert data.hex() == describe(entry)["hex"], entry["file"]


@pytest.mark.parametrize("entry", entries("NixlAgentMetadata"), ids=ids("NixlAgentMetadata"))
def test_agent_metadata_golden(entry: dict[str, Any]) -> None:
    data = raw(entry)
    expected = from_golden(describe(entry)["decoded"])
    decoded = wire.decode_agent_metadata(data)
    # v12 lacks the fields v13 and v14 added: the decoder fills their defaults, as vLLM's does.
    assert {k: v for k, v in plain(decoded).items() if k in expected} == expected
    assert (decoded.ple_block_len, decoded.packed_member_layouts) == (None, {})
    assert data[:3] == b"\xde\x00\x13"  # map16 of 19 entries: defaults are on the wire


def test_legacy_metadata_has_every_default_on_the_wire() -> None:
    meta = wire.NixlAgentMetadata(
        engine_id="e",
        agent_metadata=b"\x01",
        kv_caches_base_addr=[1],
        device_id=0,
        num_blocks=1,
        block_lens=[2],
        block_strides=[2],
        kv_cache_layout="HND",
        block_size=16,
        ssm_sizes=(0, 0),
        attn_backend_name="FLASH_ATTN",
        physical_blocks_per_logical_kv_block=1,
    )
    encoded = wire.encode_agent_metadata(meta, 13)
    assert encoded.endswith(b"\xaeregion_members\x90\xb5packed_member_layouts\x80")
    assert b"ple_block_len" not in encoded
    assert b"\xa8pcp_size\x01\xadple_block_len\xc0\xaeregion_members" in wire.encode_agent_metadata(meta, 15)
    assert b"\xa8dcp_size\x01\xa8pcp_size\x01" in encoded
    assert b"\xb0region_group_ids\xc0" in encoded


def test_struct_is_frozen_and_replace_keeps_the_encoding() -> None:
    entry = entries("NixlAgentMetadata")[0]
    meta = wire.decode_agent_metadata(raw(entry))
    with pytest.raises(AttributeError):
        meta.engine_id = "other"
    same = msgspec.structs.replace(meta, engine_id=meta.engine_id)
    assert wire.encode_agent_metadata(same) == wire.encode_agent_metadata(meta)
    assert msgspec.structs.replace(meta, dcp_size=3).dcp_size == 3


@pytest.mark.parametrize("entry", entries("NixlHandshakePayload"), ids=ids("NixlHandshakePayload"))
def test_handshake_payload_golden(entry: dict[str, Any]) -> None:
    data = raw(entry)
    described = describe(entry)["decoded"]
    case = COMPAT_CASES[described["compat_case"]]
    inner = (GOLDEN / described["agent_metadata_bytes"]["$is"]).read_bytes()

    envelope = wire.decode_payload_envelope(data)
    assert envelope.compatibility_hash == described["compatibility_hash"] == case["sha256_hex"]
    assert envelope.agent_metadata_bytes == inner
    assert wire.encode_handshake_payload(inner, case["sha256_hex"]) == data

    meta = wire.decode_handshake_payload(
        data, expected_hash=case["sha256_hex"], local_factors=case["factors"], expected_engine_id=None
    )
    assert meta == wire.decode_agent_metadata(inner)
    assert wire.decode_handshake_payload(data, expected_hash=None, expected_engine_id=meta.engine_id) == meta


@pytest.mark.parametrize("case_id", sorted(COMPAT_CASES))
def test_compat_hash_cases(case_id: str) -> None:
    case = COMPAT_CASES[case_id]
    assert wire.canonical_factors_json(case["factors"]) == case["canonical_json"]
    assert wire.canonical_factors_json(case["factors"]).encode().hex() == case["canonical_json_utf8_hex"]
    assert wire.compat_hash(case["factors"]) == case["sha256_hex"]
    built = wire.compat_factors(**case["factors"])
    assert built == case["factors"]
    assert tuple(built) == wire.COMPAT_FACTOR_KEYS


def test_compat_factors_spells_dtype_like_torch_and_hashes_tuples_as_lists() -> None:
    case = COMPAT_CASES["llama8b_pull_eagle3"]
    factors = dict(case["factors"])
    spec = dict(factors.pop("speculative_config"))
    spec["auxiliary_layer_ids"] = tuple(spec["auxiliary_layer_ids"])
    factors["dtype"] = "bfloat16"
    assert wire.compat_hash(wire.compat_factors(**factors, speculative_config=spec)) == case["sha256_hex"]
    assert wire.torch_dtype_name("fp16") == "torch.float16"
    with pytest.raises(ValueError, match="'auto'"):
        wire.torch_dtype_name("auto")
    with pytest.raises(ValueError, match="transfer_mode"):
        wire.compat_factors(**{**factors, "transfer_mode": "both"})


def test_differing_factors_names_the_keys() -> None:
    pull = COMPAT_CASES["llama8b_pull_hma"]["factors"]
    push_nohma = COMPAT_CASES["llama8b_push_nohma"]["factors"]
    assert wire.differing_factors(pull, push_nohma) == ["is_hma_enabled", "transfer_mode"]
    assert wire.differing_factors(pull, pull) == []
    assert wire.differing_factors({**pull, "extra": 1}, pull) == ["extra"]
    assert wire.differing_factors({"a": (1, 2)}, {"a": [1, 2]}) == []


# --- decoder behaviour (what the typed decoders accept and reject) ------------------------------------------


def behavior_ids(group: str) -> list[str]:
    return [c["case"] for c in BEHAVIOR[group]]


def expected_error_text(case: dict[str, Any]) -> str:
    # The golden text is "<msgspec exception class>: <message>"; ours wraps the message.
    return str(case["error"]).split(": ", 1)[1]


@pytest.mark.parametrize("case", BEHAVIOR["NixlAgentMetadata"], ids=behavior_ids("NixlAgentMetadata"))
def test_agent_metadata_decoder_behavior(case: dict[str, Any]) -> None:
    data = bytes.fromhex(case["input_hex"])
    if case["accepted"]:
        # Written by vLLM's v12 class: the decoder fills the defaults of the fields v13, v14 and v16 added.
        filled = {"ple_block_len": None, "layer_group_ids": {}, "packed_member_layouts": {}}
        assert plain(wire.decode_agent_metadata(data)) == {**from_golden(case["value"]), **filled}
    else:
        with pytest.raises(WireFormatError) as info:
            wire.decode_agent_metadata(data)
        assert expected_error_text(case) in str(info.value)
        assert info.value.reason == "ConnectorVersionMismatch"


@pytest.mark.parametrize("case", BEHAVIOR["NixlHandshakePayload"], ids=behavior_ids("NixlHandshakePayload"))
def test_payload_decoder_behavior(case: dict[str, Any]) -> None:
    data = bytes.fromhex(case["input_hex"])
    if case["accepted"]:
        assert plain(wire.decode_payload_envelope(data)) == from_golden(case["value"])
    else:
        with pytest.raises(WireFormatError, match="handshake payload") as info:
            wire.decode_handshake_payload(data, expected_hash=None)
        assert expected_error_text(case) in str(info.value)


@pytest.mark.parametrize(
    "case", BEHAVIOR["listener_untyped_request"], ids=behavior_ids("listener_untyped_request")
)
def test_listener_request_behavior(case: dict[str, Any]) -> None:
    _, pp_rank, tp_rank = case["decoded"]
    request = wire.decode_side_channel_request(bytes.fromhex(case["input_hex"]))
    assert request == wire.SideChannelRequest(pp_rank, tp_rank, str_msg=not case["msg_equals_GET_META_MSG"])


# --- refusals -----------------------------------------------------------------------------------------------


def golden_payload(name: str = "hybrid_ssm_dcp2") -> bytes:
    return (GOLDEN / f"handshake_payload_{name}.msgpack").read_bytes()


PULL_HASH = COMPAT_CASES["llama8b_pull_hma"]["sha256_hex"]


def test_payload_that_is_not_msgpack_is_refused() -> None:
    with pytest.raises(
        WireFormatError, match="handshake payload is not a vLLM NIXL NixlHandshakePayload"
    ) as info:
        wire.decode_handshake_payload(b"\xc1garbage", expected_hash=PULL_HASH)
    assert info.value.reason == "ConnectorVersionMismatch"


def test_oversized_message_is_refused_before_decoding() -> None:
    with pytest.raises(WireFormatError, match="over the 16777216-byte limit"):
        wire.decode_handshake_payload(b"\x00" * (wire.MAX_MESSAGE_BYTES + 1), expected_hash=None)
    with pytest.raises(WireFormatError, match="limit"):
        wire.parse_completion_notif(b"x:1" * wire.MAX_MESSAGE_BYTES)


def test_hash_mismatch_names_both_hashes() -> None:
    push_hash = COMPAT_CASES["llama8b_push_hma"]["sha256_hex"]
    with pytest.raises(CompatibilityHashMismatch) as info:
        wire.decode_handshake_payload(golden_payload(), expected_hash=push_hash)
    assert f"local {push_hash}" in str(info.value)
    assert f"remote {PULL_HASH}" in str(info.value)


def test_hash_mismatch_names_transfer_mode_from_local_factors() -> None:
    push = COMPAT_CASES["llama8b_push_hma"]
    with pytest.raises(
        CompatibilityHashMismatch, match="remote has transfer_mode='pull' where this side has 'push'"
    ):
        wire.decode_handshake_payload(
            golden_payload(), expected_hash=push["sha256_hex"], local_factors=push["factors"]
        )


def test_hash_mismatch_lists_every_differing_factor_when_remote_factors_are_known() -> None:
    local = COMPAT_CASES["qwen3_30b_push_flashinfer_fp8"]
    remote = COMPAT_CASES["llama8b_pull_hma"]["factors"]
    with pytest.raises(CompatibilityHashMismatch) as info:
        wire.decode_handshake_payload(
            golden_payload(),
            expected_hash=local["sha256_hex"],
            local_factors=local["factors"],
            remote_factors=remote,
        )
    message = str(info.value)
    for key in (
        "attn_backend_name",
        "cache_dtype",
        "model",
        "num_hidden_layers",
        "num_kv_heads",
        "transfer_mode",
    ):
        assert key in message
    assert "head_size" not in message


def test_version_11_peer_is_refused_as_connector_version_mismatch() -> None:
    local = COMPAT_CASES["llama8b_pull_hma"]["factors"]
    v11_hash = wire.compat_hash({**local, "nixl_connector_version": 11})
    v11_payload = wire.encode_handshake_payload(
        (GOLDEN / "agent_metadata_legacy_nonhma.msgpack").read_bytes(), v11_hash
    )
    with pytest.raises(WireFormatError, match="remote runs NIXL connector version 11, this side 12") as info:
        wire.decode_handshake_payload(v11_payload, expected_hash=PULL_HASH, local_factors=local)
    assert info.value.reason == "ConnectorVersionMismatch"
    assert not isinstance(info.value, CompatibilityHashMismatch)


def test_hash_is_checked_before_the_metadata_is_decoded() -> None:
    bogus = wire.encode_handshake_payload(b"not metadata", "0" * 64)
    with pytest.raises(CompatibilityHashMismatch):
        wire.decode_handshake_payload(bogus, expected_hash=PULL_HASH)
    with pytest.raises(WireFormatError, match="agent metadata is not a vLLM NIXL NixlAgentMetadata"):
        wire.decode_handshake_payload(bogus, expected_hash="0" * 64)


def test_engine_id_mismatch_is_refused() -> None:
    with pytest.raises(EngineIdMismatch, match=r"expected 'prefill-0'.*'hybrid-decode'"):
        wire.decode_handshake_payload(
            golden_payload(), expected_hash=PULL_HASH, expected_engine_id="prefill-0"
        )


def test_expected_hash_must_match_local_factors() -> None:
    with pytest.raises(ValueError, match="not the hash of local_factors"):
        wire.decode_handshake_payload(
            golden_payload(),
            expected_hash=PULL_HASH,
            local_factors=COMPAT_CASES["llama8b_push_hma"]["factors"],
        )


# --- side channel and notifications -------------------------------------------------------------------------


@pytest.mark.parametrize("entry", entries("side_channel_request"), ids=ids("side_channel_request"))
def test_side_channel_request_golden(entry: dict[str, Any]) -> None:
    decoded = describe(entry)["decoded"]
    assert wire.encode_side_channel_request(decoded["pp_rank"], decoded["tp_rank"]) == raw(entry)
    assert wire.decode_side_channel_request(raw(entry)) == wire.SideChannelRequest(
        decoded["pp_rank"], decoded["tp_rank"]
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ((b"get_meta_msg", 1), "must be the array"),
        ({"msg": b"get_meta_msg"}, "must be the array"),
        ((b"other", 0, 0), "tag must be b'get_meta_msg'"),
        (("other", 0, 0), "tag must be"),
        ((b"get_meta_msg", -1, 0), "pp_rank must be a non-negative int"),
        ((b"get_meta_msg", 0, True), "tp_rank must be a non-negative int"),
        ((b"get_meta_msg", 0, 1.0), "tp_rank"),
    ],
)
def test_malformed_side_channel_request_is_refused(value: object, message: str) -> None:
    with pytest.raises(WireFormatError, match=message):
        wire.decode_side_channel_request(msgspec.msgpack.encode(value))


def test_side_channel_request_that_is_not_msgpack_is_refused() -> None:
    with pytest.raises(WireFormatError, match="not msgpack"):
        wire.decode_side_channel_request(b"\x93\xc4")


def test_reply_timestamp_golden() -> None:
    (entry,) = entries("side_channel_reply_clock_frame")
    value = describe(entry)["decoded"]
    assert wire.decode_reply_timestamp(raw(entry)) == value
    assert wire.encode_reply_timestamp(value) == raw(entry)
    assert wire.encode_reply_timestamp(3) == msgspec.msgpack.encode(3.0)
    with pytest.raises(WireFormatError, match="not a msgpack float"):
        wire.decode_reply_timestamp(msgspec.msgpack.encode("now"))


def test_push_reg_notif_golden() -> None:
    (entry,) = entries("push_reg_notif")
    described = describe(entry)
    registration = wire.PushRegistration(**described["decoded"])
    assert wire.encode_push_reg_notif(registration) == raw(entry)
    decoded = wire.decode_push_reg_notif(raw(entry))
    assert plain(decoded) == described["decoded"]
    assert list(plain(decoded)) == list(described["fields"])
    assert wire.parse_notif(raw(entry)) == decoded


def test_push_reg_notif_refusals() -> None:
    (entry,) = entries("push_reg_notif")
    with pytest.raises(WireFormatError, match="must start with b'PUSH_REG:'"):
        wire.decode_push_reg_notif(raw(entry)[9:])
    with pytest.raises(WireFormatError, match="missing required field `decode_engine_id`"):
        wire.decode_push_reg_notif(wire.PUSH_REG_NOTIF_PREFIX + msgspec.msgpack.encode({"request_id": "r"}))


def test_heartbeat_notif_golden() -> None:
    (entry,) = entries("heartbeat_notif")
    req_ids = describe(entry)["decoded"]["req_ids"]
    assert wire.encode_heartbeat_notif(req_ids) == raw(entry)
    assert wire.parse_heartbeat_notif(raw(entry)) == wire.HeartbeatNotif(tuple(req_ids))
    assert wire.parse_notif(raw(entry)) == wire.HeartbeatNotif(tuple(req_ids))
    assert wire.parse_heartbeat_notif(b"HB:") == wire.HeartbeatNotif(())
    with pytest.raises(ValueError, match="contains ','"):
        wire.encode_heartbeat_notif(["a,b"])
    with pytest.raises(WireFormatError, match="not UTF-8"):
        wire.parse_heartbeat_notif(b"HB:\xff")


@pytest.mark.parametrize("entry", entries("completion_notif"), ids=ids("completion_notif"))
def test_completion_notif_golden(entry: dict[str, Any]) -> None:
    decoded = describe(entry)["decoded"]
    assert wire.encode_completion_notif(decoded["req_id"], decoded["tp_size"]) == raw(entry)
    expected = wire.CompletionNotif(decoded["req_id"], decoded["tp_size"])
    assert wire.parse_completion_notif(raw(entry)) == expected
    assert wire.parse_notif(raw(entry)) == expected


def test_completion_notif_splits_on_the_last_colon_and_refuses_malformed() -> None:
    assert wire.parse_completion_notif(b"a:b:c:8") == wire.CompletionNotif("a:b:c", 8)
    for bad in (b"no-colon", b":4", b"req:", b"req:0", b"req:-1", b"req:x"):
        with pytest.raises(WireFormatError, match="completion notif"):
            wire.parse_completion_notif(bad)


# --- property: anything we encode, we decode to the same value ----------------------------------------------

_u64 = st.integers(min_value=0, max_value=2**64 - 1)
_small = st.integers(min_value=-(2**31), max_value=2**31)
_names = st.lists(st.text(max_size=40), max_size=5)


@given(
    engine_id=st.text(max_size=40),
    blob=st.binary(max_size=400),
    addrs=st.lists(_u64, max_size=20),
    ints=st.tuples(_small, _small, _small, _small, _small, _small),
    group_ids=st.none() | st.lists(_small, max_size=20),
    names=st.none() | _names,
    members=st.lists(_names, max_size=5),
)
def test_round_trip_property(
    engine_id: str,
    blob: bytes,
    addrs: list[int],
    ints: tuple[int, int, int, int, int, int],
    group_ids: list[int] | None,
    names: list[str] | None,
    members: list[list[str]],
) -> None:
    meta = wire.NixlAgentMetadata(
        engine_id=engine_id,
        agent_metadata=blob,
        kv_caches_base_addr=addrs,
        device_id=ints[0],
        num_blocks=ints[1],
        block_lens=addrs,
        block_strides=addrs,
        kv_cache_layout="HND",
        block_size=ints[2],
        ssm_sizes=(ints[3], ints[4]),
        attn_backend_name="FLASH_ATTN",
        physical_blocks_per_logical_kv_block=ints[5],
        region_num_blocks=addrs,
        region_group_ids=group_ids,
        region_names=names,
        region_mem_types=names,
        region_members=members,
    )
    payload = wire.encode_handshake_payload(meta, "f" * 64)
    assert (
        wire.decode_handshake_payload(payload, expected_hash="f" * 64, expected_engine_id=engine_id) == meta
    )


def test_an_engine_id_matches_its_stable_prefix_plus_one_start_suffix() -> None:
    assert wire.engine_id_matches("dd-prefill-0", "dd-prefill-0")
    assert wire.engine_id_matches("dd-prefill-0", "dd-prefill-0-1a2b3c4d")
    for other in (
        "dd-prefill-0-1a2b3c4",
        "dd-prefill-0-1A2B3C4D",
        "dd-prefill-0-1a2b3c4d-00",
        "dd-prefill-01",
    ):
        assert not wire.engine_id_matches("dd-prefill-0", other), other
    # A full id is compared whole: a restarted engine (a new suffix) is another engine.
    assert not wire.engine_id_matches("dd-prefill-0-1a2b3c4d", "dd-prefill-0-deadbeef")
    payload = wire.encode_handshake_payload(
        msgspec.structs.replace(
            wire.decode_agent_metadata(golden_payload_metadata()), engine_id="e-0-0badf00d"
        ),
        PULL_HASH,
    )
    assert wire.decode_handshake_payload(
        payload, expected_hash=PULL_HASH, expected_engine_id="e-0"
    ).engine_id == ("e-0-0badf00d")
    with pytest.raises(EngineIdMismatch):
        wire.decode_handshake_payload(payload, expected_hash=PULL_HASH, expected_engine_id="e-1")


def golden_payload_metadata() -> bytes:
    return (GOLDEN / "agent_metadata_legacy_nonhma.msgpack").read_bytes()
