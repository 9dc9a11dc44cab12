"""`kv_transfer_params` as vLLM's NIXL push connector reads and writes them (0.30-0.33). Pure.

- Prefill leg: `{"do_remote_decode": true}` (vLLM's proxies also send `do_remote_prefill: false` and null
  `remote_*`). The response carries what vLLM's `NixlPushConnectorScheduler.request_finished` returns:
  `do_remote_prefill: true, do_remote_decode: false, remote_block_ids, remote_engine_id, remote_request_id,
  remote_host, remote_port, tp_size, dcp_size, pp_size, remote_num_tokens, transfer_mode: "push"`.
- Decode leg: `do_remote_prefill: true` with `remote_engine_id`, `remote_host`, `remote_port`, `tp_size`,
  `remote_request_id` (vLLM reads these without defaults) and `pp_size`. vLLM defaults a missing `pp_size`
  to 1, and a decoder told 1 by a PP2 prefill takes stage 0's layers for the whole KV; this engine refuses
  the request instead. `remote_block_ids` is ignored (push: the prefill learns the decoder's blocks from its
  registration); `remote_num_tokens`, `transfer_mode` and `dcp_size`, when given, are checked.
- Pairing is by request id: both legs' internal id is `cmpl-<X-Request-Id>` (completions) or
  `chatcmpl-<X-Request-Id>` (chat), so a router sends one `X-Request-Id` on both legs, to one endpoint family.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from disagg.worker.engine.api_errors import bad_request

Endpoint = Literal["completions", "chat"]
_ID_PREFIX = {"completions": "cmpl-", "chat": "chatcmpl-"}
# Ids travel in NIXL notifications ("HB:" + comma-joined ids, "<id>:<tp>"), logs and metrics: no commas,
# no spaces, nothing a log line or a notif could split on.
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,256}$")
MAX_PARALLEL = 1024


@dataclass(frozen=True)
class PrefillLeg:
    """The prefill leg: compute the prompt, hold its KV for the decoder that registers for it."""


@dataclass(frozen=True)
class DecodeLeg:
    """The decode leg: the prefill engine that will push this prompt's KV, named as vLLM names it."""

    remote_engine_id: str
    remote_host: str
    remote_port: int
    tp_size: int
    pp_size: int
    remote_request_id: str
    remote_num_tokens: int | None = None


Transfer = PrefillLeg | DecodeLeg | None


def internal_request_id(endpoint: Endpoint, x_request_id: str | None, generated: str) -> str:
    """vLLM's internal id: the endpoint's prefix and the `X-Request-Id` header, or `generated` without one."""
    base = generated if x_request_id is None else x_request_id
    if not _REQUEST_ID.match(base):
        raise bad_request(
            "X-Request-Id must be 1 to 256 characters of letters, digits and ._:@/+=-", "X-Request-Id"
        )
    return _ID_PREFIX[endpoint] + base


def _flag(params: dict[str, Any], key: str) -> bool:
    value = params.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"kv_transfer_params.{key} must be a boolean", f"kv_transfer_params.{key}")
    return value


def _required(params: dict[str, Any], key: str, kind: type, *, low: int = 1, high: int = 0) -> Any:
    param = f"kv_transfer_params.{key}"
    if key not in params or params[key] is None:
        raise bad_request(f"the decode leg needs {param}", param)
    value = params[key]
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise bad_request(f"{param} must be an integer in {low}..{high}", param)
    elif not isinstance(value, str) or not 0 < len(value) <= 1024:
        raise bad_request(f"{param} must be a non-empty string of at most 1024 characters", param)
    return value


def parse_kv_transfer_params(value: object) -> Transfer:
    """The leg a request's `kv_transfer_params` asks for: None for an ordinary (monolithic) request."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("kv_transfer_params must be an object", "kv_transfer_params")
    remote_decode, remote_prefill = _flag(value, "do_remote_decode"), _flag(value, "do_remote_prefill")
    if remote_decode and remote_prefill:
        raise bad_request(
            "kv_transfer_params asks for both do_remote_decode and do_remote_prefill", "kv_transfer_params"
        )
    if remote_decode:
        return PrefillLeg()
    if not remote_prefill:
        return None
    mode = value.get("transfer_mode")
    if mode is not None and mode != "push":
        raise bad_request(
            f"this engine speaks the push protocol; transfer_mode {mode!r} is not push",
            "kv_transfer_params.transfer_mode",
        )
    dcp = value.get("dcp_size")
    if dcp is not None and dcp != 1:
        raise bad_request(
            "decode context parallelism (dcp_size > 1) is not supported", "kv_transfer_params.dcp_size"
        )
    num_tokens = value.get("remote_num_tokens")
    if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int)):
        raise bad_request(
            "kv_transfer_params.remote_num_tokens must be an integer", "kv_transfer_params.remote_num_tokens"
        )
    return DecodeLeg(
        remote_engine_id=_required(value, "remote_engine_id", str),
        remote_host=_required(value, "remote_host", str),
        remote_port=_required(value, "remote_port", int, high=65535),
        tp_size=_required(value, "tp_size", int, high=MAX_PARALLEL),
        pp_size=_required(value, "pp_size", int, high=MAX_PARALLEL),
        remote_request_id=_required(value, "remote_request_id", str),
        remote_num_tokens=num_tokens,
    )


def prefill_response_params(
    *,
    block_ids: Sequence[Sequence[int]],
    engine_id: str,
    request_id: str,
    host: str,
    port: int,
    tp_size: int,
    pp_size: int,
    num_tokens: int,
) -> dict[str, Any]:
    """What vLLM's push `request_finished` returns for a prefill whose blocks it holds for a decoder."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(ids) for ids in block_ids],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
        "dcp_size": 1,
        "pp_size": pp_size,
        "remote_num_tokens": num_tokens,
        "transfer_mode": "push",
    }
