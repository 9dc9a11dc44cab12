"""`kv_transfer_params` as vLLM's NIXL push connector reads and writes them (0.30-0.33), typed once. Pure.

The router builds both legs' params and reads the prefill's answer; the reference engine reads the legs and
writes that answer. Both go through this module, so what one writes the other reads
(`/work/shared/reference/vllm-releases.md` section 4):

- Prefill leg (`PrefillLeg`): `{"do_remote_decode": true, "do_remote_prefill": false}` (vLLM's proxies may
  also send null `remote_*`).
- Decode leg (`DecodeLeg`): `do_remote_prefill: true` with `remote_engine_id`, `remote_host`, `remote_port`,
  `tp_size`, `remote_request_id` (vLLM reads these without defaults) and `pp_size`. vLLM defaults a missing
  `pp_size` to 1, and a decoder told 1 by a PP2 prefill takes stage 0's layers for the whole KV; so the router
  always sends it and the engine refuses a decode leg without it. `remote_block_ids` is ignored (push: the
  prefill learns the decoder's blocks from its registration); `remote_num_tokens`, `transfer_mode` and
  `dcp_size`, when given, are checked.
- The prefill's answer (`PrefillHandoff`): what vLLM's `NixlPushConnectorScheduler.request_finished`
  returns, `do_remote_prefill: true, do_remote_decode: false, remote_block_ids, remote_engine_id,
  remote_request_id, remote_host, remote_port, tp_size, dcp_size, pp_size, remote_num_tokens,
  transfer_mode: "push"`. A decoder takes it as its decode leg's params too (vLLM's toy proxy forwards it).
- Pairing is by request id: both legs' internal id is `cmpl-<X-Request-Id>` (completions) or
  `chatcmpl-<X-Request-Id>` (chat), so a router sends one `X-Request-Id` on both legs, to one endpoint family.

The parsers read JSON already parsed (and bounded) by their caller, look only at the keys named here, and
refuse with `InvalidTransferParams`: its message is what the client or the log sees, its `param` the field
at fault. The engine answers it as a 400; the router as the prefill engine's failure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

Endpoint = Literal["completions", "chat"]
REQUEST_ID_PREFIX: Final[Mapping[Endpoint, str]] = {"completions": "cmpl", "chat": "chatcmpl"}
"""vLLM's request id prefix per endpoint family (`serving_completion.py`, `serving_chat.py`)."""
# Ids travel in NIXL notifications ("HB:" + comma-joined ids, "<id>:<tp>"), logs and metrics: no commas,
# no spaces, nothing a log line or a notif could split on.
_X_REQUEST_ID: Final = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,256}$")
MAX_PARALLEL: Final = 1024
"""The largest TP or PP size a decode leg may name."""
MAX_STRING_CHARS: Final = 1024
"""The longest engine id, host or request id a decode leg may name."""

# Keys of the prefill's answer a decode could not do without (the ones vLLM's decode side reads without a
# default), with their JSON types. `pp_size` is optional in vLLM, but when present it must be an int.
_HANDOFF_KEYS: Final[Mapping[str, type]] = {
    "do_remote_prefill": bool,
    "remote_engine_id": str,
    "remote_host": str,
    "remote_port": int,
    "tp_size": int,
    "remote_request_id": str,
    "remote_block_ids": list,
}


class InvalidTransferParams(ValueError):
    """Refused `kv_transfer_params` (or `X-Request-Id`): why, and the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class PrefillLeg:
    """The prefill leg: compute the prompt, hold its KV for the decoder that registers for it."""

    def to_json(self) -> dict[str, Any]:
        return {"do_remote_decode": True, "do_remote_prefill": False}


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

    def to_json(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.remote_engine_id,
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "remote_request_id": self.remote_request_id,
        }
        if self.remote_num_tokens is not None:
            params["remote_num_tokens"] = self.remote_num_tokens
        return params


Transfer = PrefillLeg | DecodeLeg | None
"""The leg a request asks for; None for an ordinary (monolithic) request."""


@dataclass(frozen=True)
class PrefillHandoff:
    """The prefill's answer: it holds the request's KV for the decoder, under this engine and request id."""

    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    tp_size: int
    pp_size: int
    remote_block_ids: tuple[Any, ...]
    """One tuple of block ids per KV cache group. A push decoder ignores them, so a reader checks only that
    they are a list (vLLM's decoder reads the key without a default) and takes what is in it as it is."""
    remote_num_tokens: int | None = None

    def to_json(self) -> dict[str, Any]:
        """What vLLM's push `request_finished` returns, key for key."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(ids) for ids in self.remote_block_ids],
            "remote_engine_id": self.remote_engine_id,
            "remote_request_id": self.remote_request_id,
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
            "tp_size": self.tp_size,
            "dcp_size": 1,
            "pp_size": self.pp_size,
            "remote_num_tokens": self.remote_num_tokens,
            "transfer_mode": "push",
        }


def handoff(
    *,
    block_ids: Sequence[Sequence[int]],
    engine_id: str,
    request_id: str,
    host: str,
    port: int,
    tp_size: int,
    pp_size: int,
    num_tokens: int,
) -> PrefillHandoff:
    """The answer of a prefill that holds `block_ids` for a decoder."""
    return PrefillHandoff(
        remote_engine_id=engine_id,
        remote_request_id=request_id,
        remote_host=host,
        remote_port=port,
        tp_size=tp_size,
        pp_size=pp_size,
        remote_block_ids=tuple(tuple(ids) for ids in block_ids),
        remote_num_tokens=num_tokens,
    )


def request_id_for(endpoint: Endpoint, x_request_id: str) -> str:
    """The internal id vLLM gives a request that arrived with `X-Request-Id: x_request_id` on `endpoint`."""
    return f"{REQUEST_ID_PREFIX[endpoint]}-{x_request_id}"


def internal_request_id(endpoint: Endpoint, x_request_id: str | None, generated: str) -> str:
    """An engine's internal id for a request: `X-Request-Id`'s, or `generated`'s without one; an id that
    could not travel in a notification is refused."""
    base = generated if x_request_id is None else x_request_id
    if not _X_REQUEST_ID.match(base):
        raise InvalidTransferParams(
            "X-Request-Id must be 1 to 256 characters of letters, digits and ._:@/+=-", "X-Request-Id"
        )
    return request_id_for(endpoint, base)


def _flag(params: Mapping[str, Any], key: str) -> bool:
    value = params.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidTransferParams(
            f"kv_transfer_params.{key} must be a boolean", f"kv_transfer_params.{key}"
        )
    return value


def _int(params: Mapping[str, Any], key: str, high: int) -> int:
    value = _present(params, key)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        param = f"kv_transfer_params.{key}"
        raise InvalidTransferParams(f"{param} must be an integer in 1..{high}", param)
    return value


def _str(params: Mapping[str, Any], key: str) -> str:
    value = _present(params, key)
    if not isinstance(value, str) or not 0 < len(value) <= MAX_STRING_CHARS:
        param = f"kv_transfer_params.{key}"
        raise InvalidTransferParams(
            f"{param} must be a non-empty string of at most {MAX_STRING_CHARS} characters", param
        )
    return value


def _present(params: Mapping[str, Any], key: str) -> Any:
    if params.get(key) is None:
        param = f"kv_transfer_params.{key}"
        raise InvalidTransferParams(f"the decode leg needs {param}", param)
    return params[key]


def parse_leg(value: object) -> Transfer:
    """The leg a request's `kv_transfer_params` asks for (an engine reading a router's or proxy's request)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidTransferParams("kv_transfer_params must be an object", "kv_transfer_params")
    remote_decode, remote_prefill = _flag(value, "do_remote_decode"), _flag(value, "do_remote_prefill")
    if remote_decode and remote_prefill:
        raise InvalidTransferParams(
            "kv_transfer_params asks for both do_remote_decode and do_remote_prefill", "kv_transfer_params"
        )
    if remote_decode:
        return PrefillLeg()
    if not remote_prefill:
        return None
    mode = value.get("transfer_mode")
    if mode is not None and mode != "push":
        raise InvalidTransferParams(
            f"this engine speaks the push protocol; transfer_mode {mode!r} is not push",
            "kv_transfer_params.transfer_mode",
        )
    dcp = value.get("dcp_size")
    if dcp is not None and dcp != 1:
        raise InvalidTransferParams(
            "decode context parallelism (dcp_size > 1) is not supported", "kv_transfer_params.dcp_size"
        )
    num_tokens = value.get("remote_num_tokens")
    if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int)):
        raise InvalidTransferParams(
            "kv_transfer_params.remote_num_tokens must be an integer", "kv_transfer_params.remote_num_tokens"
        )
    return DecodeLeg(
        remote_engine_id=_str(value, "remote_engine_id"),
        remote_host=_str(value, "remote_host"),
        remote_port=_int(value, "remote_port", 65535),
        tp_size=_int(value, "tp_size", MAX_PARALLEL),
        pp_size=_int(value, "pp_size", MAX_PARALLEL),
        remote_request_id=_str(value, "remote_request_id"),
        remote_num_tokens=num_tokens,
    )


def parse_handoff(params: Mapping[str, Any]) -> PrefillHandoff:
    """A prefill's answer (a router reading a prefill response's `kv_transfer_params` object), accepted only
    when it hands the KV over with every key a decoder reads without a default."""
    for key, kind in _HANDOFF_KEYS.items():
        value = params.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InvalidTransferParams(
                f"the prefill engine's kv_transfer_params lack a valid {key!r}", f"kv_transfer_params.{key}"
            )
    pp_size = params.get("pp_size", 1)
    if not isinstance(pp_size, int) or isinstance(pp_size, bool):
        raise InvalidTransferParams(
            "the prefill engine's pp_size is not an int", "kv_transfer_params.pp_size"
        )
    if params["do_remote_prefill"] is not True:
        raise InvalidTransferParams(
            "the prefill engine's kv_transfer_params hand no KV over", "kv_transfer_params.do_remote_prefill"
        )
    num_tokens = params.get("remote_num_tokens")
    return PrefillHandoff(
        remote_engine_id=params["remote_engine_id"],
        remote_request_id=params["remote_request_id"],
        remote_host=params["remote_host"],
        remote_port=params["remote_port"],
        tp_size=params["tp_size"],
        pp_size=pp_size,
        remote_block_ids=tuple(
            tuple(ids) if isinstance(ids, list) else ids for ids in params["remote_block_ids"]
        ),
        # The router has no use for it (the decoder checks it), so an unusable one is left out, not refused.
        remote_num_tokens=num_tokens
        if isinstance(num_tokens, int) and not isinstance(num_tokens, bool)
        else None,
    )
