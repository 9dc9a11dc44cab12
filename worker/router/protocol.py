"""vLLM's push P/D request protocol, as the router speaks it. Pure: no I/O, no clock.

`/work/shared/reference/vllm-releases.md` section 4 (0.30–0.33, unchanged):

- Both legs go to the same endpoint family with one `X-Request-Id`: vLLM's internal id is
  `cmpl-<X-Request-Id>` (completions) or `chatcmpl-<X-Request-Id>` (chat), and the prefill pairs a decoder's
  registration with its own request by that id.
- The prefill leg is the client's body with `max_tokens: 1`, not streamed, `do_remote_decode`.
- The decode leg is the client's body untouched but for `kv_transfer_params`, which carries the prefill's
  identity (engine id, side-channel host and port, TP, PP) up front: the decoder registers with every prefill
  worker at once, so both legs can be sent concurrently. `pp_size` is optional in vLLM and defaults to 1,
  which for a PP prefill means stages past 0 are never written: the router always sends it.
- The prefill response's `kv_transfer_params` (vLLM's `request_finished`) say the prefill holds the KV for the
  lease; a response without them means vLLM finished the request in a state it does not push from.

The params themselves are typed in `disagg.worker.contracts.kv_transfer_params`, which the reference engine
reads and writes too.

Errors reach the client as OpenAI's error JSON; the status says whose fault it was (`RouterError.status`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final

from disagg.worker.contracts import kv_transfer_params as kv_params
from disagg.worker.contracts import releases
from disagg.worker.contracts.pairing import Pair

COMPLETIONS: Final = "/v1/completions"
CHAT_COMPLETIONS: Final = "/v1/chat/completions"
# The endpoint family of each path the router serves (it picks vLLM's request id prefix).
ENDPOINT_FAMILY: Final[Mapping[str, kv_params.Endpoint]] = {
    COMPLETIONS: "completions",
    CHAT_COMPLETIONS: "chat",
}
REQUEST_ID_HEADER: Final = "X-Request-Id"
# How deep a client's JSON may nest. OpenAI bodies nest a few levels (a JSON schema in `response_format` or a
# tool a few dozen at most); a deeper one is refused here, since re-encoding it for the legs runs into
# Python's recursion limit, which no client's body may reach.
MAX_JSON_DEPTH: Final = 128


class Fault(Enum):
    """Whose fault a failed request is, and the HTTP status that says so."""

    CLIENT = 400
    UPSTREAM = 502
    UNAVAILABLE = 503
    TIMEOUT = 504


_ERROR_TYPE: Final[Mapping[Fault, str]] = {
    Fault.CLIENT: "invalid_request_error",
    Fault.UPSTREAM: "upstream_error",
    Fault.UNAVAILABLE: "service_unavailable",
    Fault.TIMEOUT: "timeout",
}


class RouterError(Exception):
    """A request the router could not serve. `reason` is CamelCase and stable (metrics label, logs)."""

    def __init__(
        self,
        fault: Fault,
        reason: str,
        message: str,
        *,
        status: int | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.fault = fault
        self.reason = reason
        self.message = message
        # An engine's own 4xx verdict on the client's request keeps the engine's status (404 for an unknown
        # model, 422 for a field it rejects); every other error has its fault's status.
        self.status = fault.value if status is None else status
        # Set when the router sheds load: the client may try again after this many seconds (Retry-After).
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        """OpenAI's error object (what vLLM's `ErrorResponse` serialises to)."""
        return {
            "error": {
                "message": self.message,
                "type": _ERROR_TYPE[self.fault],
                "param": None,
                "code": self.status,
            }
        }


def error_body(error: RouterError) -> bytes:
    return json.dumps(error.body()).encode()


@dataclass(frozen=True)
class ClientRequest:
    """A client's request, checked: the endpoint, its JSON object, whether it streams, its prompt weight."""

    endpoint: str
    body: Mapping[str, Any]
    stream: bool
    prompt_weight: int


def parse_client_request(endpoint: str, raw: bytes) -> ClientRequest:
    """The client's body, refused (400) when it is not a JSON object the router can route.

    Everything else about the request is the engine's to judge: the router passes any other field through."""
    if endpoint not in ENDPOINT_FAMILY:
        raise RouterError(Fault.CLIENT, "UnknownEndpoint", f"the router serves no endpoint {endpoint}")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise RouterError(Fault.CLIENT, "InvalidJSON", f"the request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RouterError(Fault.CLIENT, "InvalidRequest", "the request body must be a JSON object")
    if _depth_exceeds(body, MAX_JSON_DEPTH):
        raise RouterError(
            Fault.CLIENT, "InvalidRequest", f"the request body nests deeper than {MAX_JSON_DEPTH} levels"
        )
    if "kv_transfer_params" in body:
        # The router alone decides where the KV comes from; a client's params could point a decoder anywhere.
        raise RouterError(
            Fault.CLIENT, "InvalidRequest", "kv_transfer_params is set by the router, not by the client"
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RouterError(Fault.CLIENT, "InvalidRequest", "stream must be true or false")
    if endpoint == CHAT_COMPLETIONS:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RouterError(Fault.CLIENT, "InvalidRequest", "messages must be a non-empty list")
        weight = sum(_chat_message_weight(m) for m in messages)
    else:
        if "prompt" not in body:
            raise RouterError(Fault.CLIENT, "InvalidRequest", "prompt is required")
        weight = _prompt_weight(body["prompt"])
    return ClientRequest(endpoint, body, stream, max(1, weight))


def _prompt_weight(prompt: Any) -> int:
    """A prompt's length in characters, or in tokens where the client sent token ids (the prefill cost the
    balancer weighs; the router has no tokenizer). Iterative: a prompt's nesting is the client's to choose,
    and must not reach the recursion limit."""
    if not isinstance(prompt, list):
        return len(prompt) if isinstance(prompt, str) else 1
    weight = 0
    stack: list[list[Any]] = [prompt]
    while stack:
        for item in stack.pop():
            if isinstance(item, str):
                weight += len(item)
            elif isinstance(item, list):
                stack.append(item)
            else:
                weight += 1
    return weight


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether `value` (parsed JSON) nests more than `limit` containers deep (iterative, as above)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def _chat_message_weight(message: Any) -> int:
    if not isinstance(message, dict):
        return 1
    content = message.get("content")
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(
            len(part["text"])
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return 1


def request_id_for(endpoint: str, unique: str) -> str:
    """The internal id vLLM gives a request that arrived with `X-Request-Id: unique` on `endpoint`."""
    return kv_params.request_id_for(ENDPOINT_FAMILY[endpoint], unique)


@dataclass(frozen=True)
class Legs:
    """The two requests of one client request: same endpoint, same `X-Request-Id`."""

    endpoint: str
    request_id: str
    prefill: dict[str, Any]
    decode: dict[str, Any]

    @property
    def headers(self) -> dict[str, str]:
        return {REQUEST_ID_HEADER: self.request_id, "Content-Type": "application/json"}


def build_legs(request: ClientRequest, pair: Pair, request_id: str) -> Legs:
    """The prefill-leg and decode-leg bodies for `request` on `pair`, sent with `X-Request-Id: request_id`."""
    prefill = dict(request.body)
    prefill["max_tokens"] = 1
    if request.endpoint == CHAT_COMPLETIONS and "max_completion_tokens" in prefill:
        # vLLM's chat endpoint prefers max_completion_tokens over max_tokens.
        prefill["max_completion_tokens"] = 1
    prefill["stream"] = False
    prefill.pop("stream_options", None)
    prefill["kv_transfer_params"] = kv_params.PrefillLeg().to_json()

    target = pair.prefill
    decode = dict(request.body)
    decode["kv_transfer_params"] = kv_params.DecodeLeg(
        remote_engine_id=target.engine_id,
        remote_host=target.host,
        remote_port=target.side_channel_port,
        tp_size=target.tp_size,
        pp_size=target.pp_size,
        remote_request_id=request_id_for(request.endpoint, request_id),
    ).to_json()
    return Legs(request.endpoint, request_id, prefill, decode)


@dataclass(frozen=True)
class PrefillAnswer:
    """The prefill leg's checked answer: the KV handoff, and the prompt's length in tokens where the engine
    said it (`usage.prompt_tokens`; None otherwise)."""

    handoff: kv_params.PrefillHandoff
    prompt_tokens: int | None


def parse_prefill_response(status: int, raw: bytes, pair: Pair) -> kv_params.PrefillHandoff:
    """The prefill leg's KV handoff (`parse_prefill_answer`)."""
    return parse_prefill_answer(status, raw, pair).handoff


def parse_prefill_answer(status: int, raw: bytes, pair: Pair) -> PrefillAnswer:
    """The prefill leg's answer, accepted only when it is what vLLM's `request_finished` returns for a request
    whose KV it holds for the decoder. Anything else is a prefill failure (`RouterError`), which closes the
    decode leg: a decoder waiting for KV that no prefill holds would wait out its registration timeout."""
    if status != 200:
        raise engine_error("prefill", status, raw)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError, UnicodeDecodeError):
        raise RouterError(
            Fault.UPSTREAM, "PrefillInvalidResponse", "the prefill engine's response is not JSON"
        ) from None
    if not isinstance(body, dict):
        raise RouterError(
            Fault.UPSTREAM, "PrefillInvalidResponse", "the prefill engine's response is not an object"
        )
    if "error" in body or body.get("object") == "error":
        raise RouterError(
            Fault.UPSTREAM, "PrefillFailed", f"the prefill engine answered an error: {_error_message(body)}"
        )
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict):
        # vLLM returns none when the request did not finish length-capped or stopped (aborted, errored).
        raise RouterError(
            Fault.UPSTREAM, "PrefillHoldsNoKV", "the prefill engine's response carries no kv_transfer_params"
        )
    try:
        handoff = kv_params.parse_handoff(params)
    except kv_params.InvalidTransferParams as exc:
        raise RouterError(Fault.UPSTREAM, "PrefillInvalidKVParams", exc.message) from None
    if handoff.remote_engine_id != pair.prefill.engine_id:
        # The decoder registered with the engine id the router sent; a prefill answering with another one
        # restarted since its report, and no registration it will ever see names it.
        raise RouterError(
            Fault.UPSTREAM,
            "PrefillEngineIdChanged",
            f"the prefill engine answered as {handoff.remote_engine_id!r}, "
            f"the decode leg was sent to {pair.prefill.engine_id!r}",
        )
    usage = body.get("usage")
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    valid = isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0
    return PrefillAnswer(handoff, tokens if valid else None)


def loses_window_edge(window_edges: Sequence[tuple[int, int]], prompt_tokens: int | None) -> bool:
    """Whether a prompt of `prompt_tokens` tokens reaches its decoder without a window's first key on engines
    with these (sliding window, block size) pairs (`releases.loses_window_edge`). A prompt whose length the
    prefill did not say is taken to, where there are any: the decoder alone answers it right either way."""
    if not window_edges:
        return False
    if prompt_tokens is None:
        return True
    return any(releases.loses_window_edge(prompt_tokens, window, block) for window, block in window_edges)


def engine_error(leg: str, status: int, raw: bytes) -> RouterError:
    """An engine's non-200 answer. A 4xx is the engine's verdict on the client's request (both legs carry the
    client's fields), so it reaches the client with the engine's status and message; any other status is the
    engine's failure."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError, UnicodeDecodeError):
        body = None
    message = _error_message(body) if isinstance(body, dict) else f"HTTP {status}"
    if 400 <= status < 500 and status not in (408, 429):
        return RouterError(Fault.CLIENT, "EngineRefusedRequest", message, status=status)
    return RouterError(
        Fault.UPSTREAM, f"{leg.capitalize()}Failed", f"the {leg} engine answered HTTP {status}: {message}"
    )


def _error_message(body: Mapping[str, Any]) -> str:
    error = body.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return _bounded(error["message"])
    if isinstance(error, str):
        return _bounded(error)
    if isinstance(body.get("message"), str):
        return _bounded(body["message"])
    return "no message"


def _bounded(text: str, limit: int = 1000) -> str:
    return text if len(text) <= limit else text[:limit] + "…"
