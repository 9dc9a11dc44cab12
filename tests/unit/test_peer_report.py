"""The peer report annotation: camelCase JSON, versioned, and decoded under bounds as untrusted input."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg.worker.contracts.peer_report import (
    MAX_PEER_REPORT_BYTES,
    MAX_PEERS,
    PEER_REPORT_VERSION,
    InFlight,
    PeerReport,
    PeerReportError,
    PeerVerdict,
    decode_peer_report,
    encode_peer_report,
)

HASH = "ab" * 32


def verdict(pod: str, *, ok: bool = True, reason: str = "HandshakesSucceeded") -> PeerVerdict:
    return PeerVerdict(pod=pod, engine_id=f"{pod}-1a2b3c4d", ok=ok, reason=reason, kv_hash=HASH)


def report(*peers: PeerVerdict) -> PeerReport:
    return PeerReport(
        version=PEER_REPORT_VERSION, engine_id="gemma-prefill-0-0a0b0c0d", kv_hash=HASH, peers=peers
    )


def test_a_report_is_camel_case_json_with_its_version_and_round_trips() -> None:
    original = report(verdict("d-1"), verdict("d-2", ok=False, reason="CompatibilityHashMismatch"))
    text = encode_peer_report(original)
    assert json.loads(text) == {
        "version": 1,
        "engineId": "gemma-prefill-0-0a0b0c0d",
        "kvHash": HASH,
        "peers": [
            {
                "pod": "d-1",
                "engineId": "d-1-1a2b3c4d",
                "ok": True,
                "reason": "HandshakesSucceeded",
                "kvHash": HASH,
            },
            {
                "pod": "d-2",
                "engineId": "d-2-1a2b3c4d",
                "ok": False,
                "reason": "CompatibilityHashMismatch",
                "kvHash": HASH,
            },
        ],
    }
    assert decode_peer_report(text) == original
    assert decode_peer_report(text).verdict("d-2") == original.peers[1]


def test_a_draining_pods_in_flight_count_round_trips_and_is_absent_from_other_reports() -> None:
    assert "inFlight" not in json.loads(encode_peer_report(report(verdict("d-1"))))
    at = datetime(2026, 12, 2, 9, 0, 1, 250000, tzinfo=UTC)
    draining = PeerReport(
        version=PEER_REPORT_VERSION, engine_id="e", kv_hash=HASH, in_flight=InFlight(requests=0, at=at)
    )
    text = encode_peer_report(draining)
    assert json.loads(text)["inFlight"] == {"requests": 0, "at": "2026-12-02T09:00:01.250000Z"}
    assert decode_peer_report(text) == draining
    # A count below 0, or a time without its zone (whose clock?), is no report.
    for bad in ({"requests": -1, "at": "2026-12-02T09:00:01Z"}, {"requests": 0, "at": "2026-12-02T09:00:01"}):
        with pytest.raises(PeerReportError):
            decode_peer_report(json.dumps({**json.loads(text), "inFlight": bad}))
    assert decode_peer_report(text).verdict("d-3") is None


def test_fields_a_newer_writer_adds_are_ignored_but_another_version_is_refused() -> None:
    body = json.loads(encode_peer_report(report(verdict("d-1"))))
    newer = {**body, "checkedAt": "later", "peers": [{**body["peers"][0], "latencyMs": 3}]}
    assert decode_peer_report(json.dumps(newer)) == report(verdict("d-1"))
    with pytest.raises(PeerReportError, match="version 2"):
        decode_peer_report(json.dumps({**body, "version": 2}))
    with pytest.raises(PeerReportError, match="version"):
        decode_peer_report(json.dumps({key: value for key, value in body.items() if key != "version"}))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json",
        "null",
        "[]",
        '"a string"',
        '{"version": true, "engineId": "e", "kvHash": ""}',
        '{"version": 1, "engineId": "", "kvHash": ""}',
        '{"version": 1, "engineId": "e", "kvHash": 7}',
        '{"version": 1, "engineId": "e", "kvHash": "", "peers": {}}',
        '{"version": 1, "engineId": "e", "kvHash": "", "peers": [{"pod": "p"}]}',
        '{"version": 1, "engineId": "e", "kvHash": "", "peers": [{"pod": "p", "engineId": "x", "ok": "yes",'
        ' "reason": "A", "kvHash": ""}]}',
        # A reason is copied into messages and metrics: CamelCase only.
        '{"version": 1, "engineId": "e", "kvHash": "", "peers": [{"pod": "p", "engineId": "x", "ok": false,'
        ' "reason": "no\\nway", "kvHash": ""}]}',
        '{"version": 1, "engineId": "e", "kvHash": "' + "h" * 200 + '"}',
        '{"version": 1, "engineId": "e", "kvHash": "", "x": ' + "[" * 20_000 + "]" * 20_000 + "}",
        "\ud800",
    ],
)
def test_junk_is_a_typed_error(text: str) -> None:
    with pytest.raises(PeerReportError) as caught:
        decode_peer_report(text)
    assert caught.value.reason == "InvalidPeerReport"
    assert isinstance(caught.value, ValueError)
    assert len(caught.value.message) < 400


def test_a_pod_named_twice_is_refused_and_never_written() -> None:
    twice = report(verdict("d"), verdict("d"))
    with pytest.raises(PeerReportError, match="more than once"):
        encode_peer_report(twice)
    body = json.loads(encode_peer_report(report(verdict("d"))))
    body["peers"] *= 2
    with pytest.raises(PeerReportError, match="more than once"):
        decode_peer_report(json.dumps(body))


def test_an_oversize_report_is_refused_before_it_is_parsed() -> None:
    # Not even JSON: only the size check can refuse it with this message.
    with pytest.raises(PeerReportError, match="exceeds"):
        decode_peer_report("[" * (MAX_PEER_REPORT_BYTES + 1))
    # Under the limit in characters, over it in bytes.
    with pytest.raises(PeerReportError, match="bytes exceeds"):
        decode_peer_report("\u00e9" * (MAX_PEER_REPORT_BYTES // 2 + 1))


def test_the_number_of_peers_is_bounded_on_both_sides() -> None:
    many = report(*(verdict(f"d-{i}") for i in range(MAX_PEERS + 1)))
    with pytest.raises(PeerReportError, match=f"length <= {MAX_PEERS}"):
        encode_peer_report(many)
    compact = {"version": 1, "engineId": "e", "kvHash": "", "peers": []}
    compact["peers"] = [
        {"pod": f"p{i}", "engineId": "", "ok": True, "reason": "A", "kvHash": ""}
        for i in range(MAX_PEERS + 1)
    ]
    text = json.dumps(compact, separators=(",", ":"))
    assert len(text) < MAX_PEER_REPORT_BYTES
    with pytest.raises(PeerReportError, match=f"length <= {MAX_PEERS}"):
        decode_peer_report(text)
    assert len(decode_peer_report(encode_peer_report(report(*many.peers[:MAX_PEERS]))).peers) == MAX_PEERS


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=30,
)
report_like = st.fixed_dictionaries(
    {},
    optional={
        "version": json_values | st.just(1),
        "engineId": json_values | st.text(min_size=1, max_size=30),
        "kvHash": json_values | st.just(HASH),
        "peers": json_values
        | st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "pod": json_values | st.text(max_size=30),
                    "engineId": json_values,
                    "ok": json_values,
                    "reason": json_values | st.sampled_from(["HandshakesSucceeded", "A1", "bad reason"]),
                    "kvHash": json_values,
                },
            ),
            max_size=4,
        ),
    },
)


@given(st.text(max_size=200) | report_like.map(json.dumps) | json_values.map(json.dumps))
def test_any_text_decodes_to_a_report_or_a_typed_error(text: str) -> None:
    try:
        decoded = decode_peer_report(text)
    except PeerReportError:
        return
    assert decoded.version == PEER_REPORT_VERSION
    assert decode_peer_report(encode_peer_report(decoded)) == decoded
