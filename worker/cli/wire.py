"""`disagg wire decode` and `disagg compat hash`: read vLLM NIXL handshake bytes, hash factor sets."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

KIND_PAYLOAD = "NixlHandshakePayload"
KIND_METADATA = "NixlAgentMetadata"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    wire_parser = subparsers.add_parser("wire", help="inspect vLLM NIXL connector wire messages")
    wire_commands = wire_parser.add_subparsers(dest="wire_command", metavar="COMMAND", required=True)
    decode = wire_commands.add_parser(
        "decode",
        help="print a handshake payload, agent metadata, side-channel frame or notif file as JSON",
        description="Auto-detects, in this order: handshake payload, agent metadata, side-channel request, "
        "reply timestamp, PUSH_REG / HB / completion notif. Bytes print as {$bytes_hex, $len}.",
    )
    decode.add_argument("file", type=Path)
    decode.add_argument("--raw", action="store_true", help="print the untyped msgpack content only")
    decode.set_defaults(func=run_decode)

    compat_parser = subparsers.add_parser("compat", help="NIXL compatibility hash tools")
    compat_commands = compat_parser.add_subparsers(dest="compat_command", metavar="COMMAND", required=True)
    hash_parser = compat_commands.add_parser(
        "hash",
        help="print the vLLM compatibility hash of a factor set (JSON file)",
        description="FILE holds a factor dict, a {'factors': {...}} case, or a {'cases': [...]} list of "
        "cases. A case's stated sha256_hex is checked.",
    )
    hash_parser.add_argument("file", type=Path)
    hash_parser.add_argument("--loose", action="store_true", help="hash dicts that lack or add factor keys")
    hash_parser.add_argument("--canonical", action="store_true", help="also print the hashed JSON text")
    hash_parser.set_defaults(func=run_compat_hash)


def _fail(command: str, message: str) -> int:
    print(f"disagg {command}: {message}", file=sys.stderr)
    return 1


def _jsonable(value: Any) -> Any:
    """Builtins with bytes spelled the way the golden vectors spell them."""
    if isinstance(value, bytes):
        return {"$bytes_hex": value.hex(), "$len": len(value)}
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, bytes) else k.hex(): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def _builtins(obj: object) -> Any:
    import msgspec

    return _jsonable(msgspec.to_builtins(obj, builtin_types=(bytes,)))


def detect(data: bytes) -> tuple[str, Any]:
    """The kind of message and its decoded value; WireFormatError listing why each kind did not fit."""
    import msgspec

    from disagg.worker.kv import wire
    from disagg.worker.kv.errors import WireFormatError

    reasons: list[str] = []

    def attempt(kind: str, decoder: Callable[[bytes], object]) -> tuple[str, Any] | None:
        try:
            return kind, decoder(data)
        except WireFormatError as exc:
            reasons.append(f"not {kind}: {exc.message}")
            return None

    if data.startswith(wire.PUSH_REG_NOTIF_PREFIX):
        return "push_reg_notif", _builtins(wire.decode_push_reg_notif(data))
    if data.startswith(wire.HB_NOTIF_PREFIX):
        return "heartbeat_notif", {"req_ids": list(wire.parse_heartbeat_notif(data).req_ids)}
    try:
        untyped = msgspec.msgpack.decode(data)
    except msgspec.DecodeError as exc:
        reasons.append(f"not msgpack: {exc}")
    else:
        envelope = attempt(KIND_PAYLOAD, wire.decode_payload_envelope)
        if envelope is not None:
            payload: wire.NixlHandshakePayload = envelope[1]
            try:
                metadata = wire.decode_agent_metadata(payload.agent_metadata_bytes)
            except WireFormatError as exc:
                raise WireFormatError(
                    f"handshake payload (hash {payload.compatibility_hash}): {exc}"
                ) from exc
            return KIND_PAYLOAD, {
                "compatibility_hash": payload.compatibility_hash,
                "agent_metadata_bytes_len": len(payload.agent_metadata_bytes),
                "agent_metadata": _builtins(metadata),
            }
        found = attempt(KIND_METADATA, wire.decode_agent_metadata) or attempt(
            "side_channel_request", wire.decode_side_channel_request
        )
        if found is not None:
            return found[0], _builtins(found[1])
        if isinstance(untyped, float):
            return "side_channel_reply_clock_frame", untyped
    completion = attempt("completion_notif", wire.parse_completion_notif)
    if completion is not None:
        return completion[0], _builtins(completion[1])
    raise WireFormatError("; ".join(reasons))


def run_decode(args: argparse.Namespace) -> int:
    import msgspec

    from disagg.worker.kv import wire
    from disagg.worker.kv.errors import WireFormatError

    try:
        data = args.file.read_bytes()
    except OSError as exc:
        return _fail("wire decode", f"cannot read {args.file}: {exc.strerror}")
    if len(data) > wire.MAX_MESSAGE_BYTES:
        return _fail(
            "wire decode", f"{args.file}: {len(data)} bytes, over the {wire.MAX_MESSAGE_BYTES}-byte limit"
        )
    if args.raw:
        try:
            result: dict[str, Any] = {"kind": "msgpack", "decoded": _jsonable(msgspec.msgpack.decode(data))}
        except msgspec.DecodeError as exc:
            return _fail("wire decode", f"{args.file}: not msgpack: {exc}")
    else:
        try:
            kind, decoded = detect(data)
        except WireFormatError as exc:
            return _fail("wire decode", f"{args.file}: {exc.message}")
        result = {"kind": kind, "length": len(data), "decoded": decoded}
    print(json.dumps(result, indent=2))
    return 0


def _cases(document: object) -> list[tuple[str | None, dict[str, Any], str | None]]:
    """(name, factors, stated digest) for each factor set the document holds."""
    if isinstance(document, dict) and isinstance(document.get("cases"), list):
        return [case for item in document["cases"] for case in _cases(item)]
    if isinstance(document, dict) and isinstance(document.get("factors"), dict):
        stated = document.get("sha256_hex")
        return [(str(document.get("id", "")) or None, document["factors"], str(stated) if stated else None)]
    if isinstance(document, dict):
        return [(None, document, None)]
    raise ValueError(f"expected a JSON object of compatibility factors, got {type(document).__name__}")


def run_compat_hash(args: argparse.Namespace) -> int:
    from disagg.worker.kv import wire

    try:
        document = json.loads(args.file.read_text())
    except OSError as exc:
        return _fail("compat hash", f"cannot read {args.file}: {exc.strerror}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return _fail("compat hash", f"{args.file}: not JSON: {exc}")
    try:
        cases = _cases(document)
    except ValueError as exc:
        return _fail("compat hash", f"{args.file}: {exc}")
    status = 0
    for name, factors, stated in cases:
        label = f" ({name})" if name else ""
        missing = [k for k in wire.COMPAT_FACTOR_KEYS if k not in factors]
        unknown = sorted(set(factors) - set(wire.COMPAT_FACTOR_KEYS))
        if (missing or unknown) and not args.loose:
            status = _fail(
                "compat hash",
                f"{args.file}{label}: not a vLLM NIXL compatibility factor set: "
                f"missing {missing}, unknown {unknown} (--loose hashes it anyway)",
            )
            continue
        digest = wire.compat_hash(factors)
        print(f"{digest}  {name}" if name else digest)
        if args.canonical:
            print(wire.canonical_factors_json(factors))
        if stated is not None and stated != digest:
            status = _fail("compat hash", f"{args.file}{label}: digest {digest} differs from stated {stated}")
    return status
