"""`disagg wire decode` and `disagg compat hash` on the golden vectors and on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from disagg.operator.cli.main import main
from disagg.worker.kv import wire

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
MANIFEST: list[dict[str, Any]] = json.loads((GOLDEN / "manifest.json").read_text())["files"]
COMPAT_CASES: list[dict[str, Any]] = json.loads((GOLDEN / "compat_hash_cases.json").read_text())["cases"]
CASE_BY_ID = {c["id"]: c for c in COMPAT_CASES}


def describe(name: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((GOLDEN / name).read_text())
    return result


def decode_cli(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, Any, str]:
    rc = main(["wire", "decode", str(path), *extra])
    captured = capsys.readouterr()
    return rc, json.loads(captured.out) if rc == 0 else None, captured.err


# The v12 vectors lack the fields v13 and v14 added; the decoder fills their defaults.
V12_FILLED = {"ple_block_len": None, "layer_group_ids": {}, "packed_member_layouts": {}}


def expected_decoded(entry: dict[str, Any]) -> Any:
    """What the CLI prints as `decoded`, from the golden description (its stated values)."""
    decoded = describe(entry["description_file"])["decoded"]
    kind = entry["kind"]
    if kind == "NixlHandshakePayload":
        inner = decoded["agent_metadata_bytes"]
        return {
            "compatibility_hash": decoded["compatibility_hash"],
            "agent_metadata_bytes_len": inner["$len"],
            "agent_metadata": {
                **describe(inner["$is"].replace(".msgpack", ".json"))["decoded"],
                **V12_FILLED,
            },
        }
    if kind == "side_channel_request":
        return {"pp_rank": decoded["pp_rank"], "tp_rank": decoded["tp_rank"], "str_msg": False}
    if kind == "heartbeat_notif":
        return {"req_ids": decoded["req_ids"]}
    if kind == "NixlAgentMetadata":
        return {**decoded, **V12_FILLED}
    return decoded


@pytest.mark.parametrize("entry", MANIFEST, ids=[e["file"] for e in MANIFEST])
def test_decode_every_golden_file(entry: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = decode_cli(GOLDEN / entry["file"], capsys)
    assert rc == 0, err
    assert out["kind"] == entry["kind"]
    assert out["length"] == entry["length"]
    assert out["decoded"] == expected_decoded(entry)


def test_decode_raw_prints_untyped_msgpack(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = decode_cli(GOLDEN / "handshake_payload_legacy_nonhma.msgpack", capsys, "--raw")
    assert rc == 0
    inner = (GOLDEN / "agent_metadata_legacy_nonhma.msgpack").read_bytes()
    assert out == {
        "kind": "msgpack",
        "decoded": {
            "compatibility_hash": CASE_BY_ID["llama8b_pull_nohma"]["sha256_hex"],
            "agent_metadata_bytes": {"$bytes_hex": inner.hex(), "$len": len(inner)},
        },
    }


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xc1\xc1", "not msgpack: MessagePack data is malformed"),
        (msgspec.msgpack.encode({"a": 1}), "Object missing required field `compatibility_hash`"),
        (msgspec.msgpack.encode([1, 2]), "not side_channel_request: side-channel request must be the array"),
        (b"PUSH_REG:\x80", "Object missing required field `request_id`"),
        (
            wire.encode_handshake_payload(b"\x01", "a" * 64),
            f"handshake payload (hash {'a' * 64}): agent metadata is not a vLLM NIXL NixlAgentMetadata",
        ),
    ],
    ids=["not-msgpack", "unknown-map", "short-array", "empty-push-reg", "payload-with-bad-metadata"],
)
def test_decode_refuses_bad_input(
    content: bytes, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "input.bin"
    path.write_bytes(content)
    rc, _, err = decode_cli(path, capsys)
    assert rc == 1
    assert err.startswith(f"disagg wire decode: {path}: ")
    assert message in err


def test_decode_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = decode_cli(tmp_path / "absent", capsys)
    assert rc == 1
    assert "cannot read" in err


def hash_cli(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    rc = main(["compat", "hash", str(path), *extra])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_compat_hash_of_a_factor_dict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    case = COMPAT_CASES[-1]
    path = tmp_path / "factors.json"
    path.write_text(json.dumps(case["factors"], ensure_ascii=False))
    rc, out, _ = hash_cli(path, capsys, "--canonical")
    assert rc == 0
    assert out.splitlines() == [case["sha256_hex"], case["canonical_json"]]


def test_compat_hash_checks_every_case_of_the_cases_file(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = hash_cli(GOLDEN / "compat_hash_cases.json", capsys)
    assert rc == 0
    assert out.splitlines() == [f"{c['sha256_hex']}  {c['id']}" for c in COMPAT_CASES]


def test_compat_hash_reports_a_wrong_stated_digest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    case = {**COMPAT_CASES[0], "sha256_hex": "0" * 64}
    path = tmp_path / "case.json"
    path.write_text(json.dumps(case))
    rc, out, err = hash_cli(path, capsys)
    assert rc == 1
    assert out.split() == [COMPAT_CASES[0]["sha256_hex"], case["id"]]
    assert f"differs from stated {'0' * 64}" in err


def test_compat_hash_refuses_an_incomplete_factor_set_unless_loose(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    factors = {k: v for k, v in COMPAT_CASES[0]["factors"].items() if k != "transfer_mode"}
    factors["cross_layers_blocks"] = False
    path = tmp_path / "old.json"
    path.write_text(json.dumps(factors))
    rc, out, err = hash_cli(path, capsys)
    assert rc == 1
    assert out == ""
    assert "missing ['transfer_mode'], unknown ['cross_layers_blocks']" in err
    rc, out, _ = hash_cli(path, capsys, "--loose")
    assert rc == 0
    assert out.strip() == wire.compat_hash(factors)


@pytest.mark.parametrize(
    ("content", "message"), [("{not json", "not JSON"), ("[1, 2]", "expected a JSON object")]
)
def test_compat_hash_refuses_bad_json(
    content: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    rc, _, err = hash_cli(path, capsys)
    assert rc == 1
    assert message in err


def test_console_script(tmp_path: Path) -> None:
    disagg = Path(sys.executable).parent / "disagg"
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    done = subprocess.run(
        [str(disagg), "wire", "decode", str(GOLDEN / "push_reg_notif.bin")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["decoded"] == describe("push_reg_notif.json")["decoded"]
    bad = subprocess.run(
        [str(disagg), "compat", "hash", str(GOLDEN / "manifest.json")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 1
    assert "not a vLLM NIXL compatibility factor set" in bad.stderr
