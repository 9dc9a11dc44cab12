"""The OpenAI-compatible subset the reference engine serves: request parsing and response building. Pure.

Requests (`/v1/completions`, `/v1/chat/completions`); fields this subset does not know are ignored:
- `prompt` (completions): a string, or a list of token ids (bytes, 0..255). One prompt per request.
- `messages` (chat): `[{"role", "content"}]`, content a string or a list of `{"type": "text", "text"}`
  parts, rendered with the fixed template `CHAT_TEMPLATE` describes.
- `max_tokens` (chat also `max_completion_tokens`): default 16; prompt plus `max_tokens` must fit the
  model's `max_model_len`.
- `temperature`: absent, null or 0 (greedy decoding is all the reference engine does; any other value is
  refused rather than silently served greedily). `n` 1, `echo` false, `logprobs` absent.
- `stop`: a string or a list of up to 16 strings; the output ends before the first one and does not include
  it (`finish_reason: "stop"`, `stop_reason` the string).
- `stream` (SSE `data: {...}` chunks, then `data: [DONE]`), `stream_options.include_usage`.
- `return_token_ids` (vLLM's): each choice carries `token_ids`, the generated tokens.
- `kv_transfer_params` (vLLM's, `disagg.worker.contracts.kv_transfer_params`).

Tokens are bytes: text is the UTF-8 of the prompt, and the output's bytes decoded as UTF-8 with
replacement; a stream decodes incrementally, so its deltas join to the same text.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from disagg.worker.contracts.kv_transfer_params import Endpoint, Transfer
from disagg.worker.engine.api_errors import ApiError, bad_request
from disagg.worker.engine.config import encode
from disagg.worker.engine.transfer_params import parse_kv_transfer_params

DEFAULT_MAX_TOKENS = 16
MAX_STOPS = 16
MAX_STOP_BYTES = 256
CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
"""Each message as `<|role|>`, a newline, its content and a newline; then `<|assistant|>` and a newline,
where the reply starts. Roles: system, developer, user, assistant, tool."""
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class GenerationRequest:
    endpoint: Endpoint
    prompt: tuple[int, ...]
    max_tokens: int
    stop: tuple[bytes, ...] = ()
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    transfer: Transfer = None


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise bad_request(f"the body is not JSON: {str(exc)[:200]}") from None
    if not isinstance(value, dict):
        raise bad_request("the body must be a JSON object")
    return value


def _int_field(body: dict[str, Any], key: str, default: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{key} must be an integer", key)
    return value


def _completion_prompt(body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return encode(prompt)
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 256 for t in prompt
    ):
        return list(prompt)
    raise bad_request("prompt must be a string or a list of token ids (0..255), one prompt", "prompt")


def _content(message: dict[str, Any], index: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise bad_request(
                    f"messages[{index}].content parts must be {{'type': 'text', 'text': str}}",
                    f"messages[{index}].content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(
        f"messages[{index}].content must be a string or a list of text parts", f"messages[{index}].content"
    )


def chat_prompt(messages: object) -> str:
    """The prompt text of a conversation, by `CHAT_TEMPLATE`."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    rendered = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise bad_request(
                f"messages[{index}] must be an object whose role is one of {', '.join(CHAT_ROLES)}",
                f"messages[{index}]",
            )
        rendered.append(CHAT_TEMPLATE.format(role=message["role"], content=_content(message, index)))
    return "".join(rendered) + "<|assistant|>\n"


def _stops(value: object) -> tuple[bytes, ...]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return ()
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"stop must be a string or a list of at most {MAX_STOPS} strings", "stop")
    encoded = tuple(s.encode() for s in stops if s)
    if any(len(s) > MAX_STOP_BYTES for s in encoded):
        raise bad_request(f"each stop string must be at most {MAX_STOP_BYTES} bytes", "stop")
    return encoded


def _refuse_sampling(body: dict[str, Any]) -> None:
    temperature = body.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool) or not isinstance(temperature, int | float) or temperature != 0
    ):
        raise bad_request(
            "the reference engine decodes greedily: temperature must be 0 (or absent)", "temperature"
        )
    if _int_field(body, "n", 1) != 1:
        raise bad_request("n must be 1", "n")
    if body.get("echo") not in (None, False):
        raise bad_request("echo is not supported", "echo")
    if body.get("logprobs") not in (None, False):
        raise bad_request("logprobs are not supported", "logprobs")


def parse_request(endpoint: Endpoint, body: dict[str, Any], *, max_model_len: int) -> GenerationRequest:
    """The request a parsed JSON body asks for, or an `ApiError` (400) naming the field at fault."""
    _refuse_sampling(body)
    if endpoint == "completions":
        prompt = _completion_prompt(body)
        max_tokens = _int_field(body, "max_tokens", DEFAULT_MAX_TOKENS)
        max_key = "max_tokens"
    else:
        prompt = encode(chat_prompt(body.get("messages")))
        max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _int_field(body, max_key, DEFAULT_MAX_TOKENS)
    if not prompt:
        raise bad_request("the prompt is empty", "prompt")
    if max_tokens < 1:
        raise bad_request(f"{max_key} must be at least 1", max_key)
    if len(prompt) + max_tokens > max_model_len:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens; the request has "
            f"{len(prompt)} prompt tokens and asks for {max_tokens} more",
            max_key if len(prompt) < max_model_len else "prompt",
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    include_usage = bool(options and options.get("include_usage") is True)
    return GenerationRequest(
        endpoint=endpoint,
        prompt=tuple(prompt),
        max_tokens=max_tokens,
        stop=_stops(body.get("stop")),
        stream=stream,
        include_usage=include_usage,
        return_token_ids=body.get("return_token_ids") is True,
        transfer=parse_kv_transfer_params(body.get("kv_transfer_params")),
    )


# ---- output --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: tuple[int, ...]


@dataclass
class Output:
    """Generated tokens as a client sees them: stop strings cut, text decoded incrementally.

    Tokens that could begin a stop string are held back until they cannot, so nothing that ends up inside
    a stop string is ever streamed."""

    stop: tuple[bytes, ...]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    """Every token emitted so far (what the client gets)."""
    generated: int = 0
    finish_reason: str | None = None
    stop_reason: str | None = None
    _held: list[int] = field(default_factory=list)
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int) -> Delta:
        """Take the next generated token; what may be sent now (possibly nothing)."""
        if self.finished:
            raise ValueError("the output is finished")
        self.generated += 1
        pending = [*self._held, token]
        tail = bytes(pending)
        for stop in self.stop:
            if tail.endswith(stop):
                self.finish_reason, self.stop_reason = "stop", stop.decode()
                self._held = []
                return self._emit(pending[: len(pending) - len(stop)], final=True)
        keep = max(
            (n for n in range(1, len(pending) + 1) if any(s.startswith(tail[-n:]) for s in self.stop)),
            default=0,
        )
        if self.generated >= self.max_tokens:
            self.finish_reason = "length"
            self._held = []
            return self._emit(pending, final=True)
        self._held = pending[len(pending) - keep :]
        return self._emit(pending[: len(pending) - keep], final=False)

    def _emit(self, tokens: Sequence[int], *, final: bool) -> Delta:
        self.tokens.extend(tokens)
        return Delta(self._decoder.decode(bytes(tokens), final=final), tuple(tokens))

    @property
    def text(self) -> str:
        return bytes(self.tokens).decode("utf-8", errors="replace")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(frozen=True)
class ResponseHead:
    """What every response and chunk of one request repeats."""

    request: GenerationRequest
    request_id: str
    model: str
    created: int

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def response(self, output: Output, kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
        """The whole (not streamed) response."""
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": output.finish_reason,
            "stop_reason": output.stop_reason,
        }
        if self.request.endpoint == "completions":
            choice["text"] = output.text
            body = self._base("text_completion")
        else:
            choice["message"] = {"role": "assistant", "content": output.text}
            body = self._base("chat.completion")
        if self.request.return_token_ids:
            choice["token_ids"] = list(output.tokens)
        body["choices"] = [choice]
        body["usage"] = usage(len(self.request.prompt), output.generated)
        body["kv_transfer_params"] = kv_transfer_params
        return body

    def chunk(
        self,
        delta: Delta,
        *,
        first: bool = False,
        output: Output | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One stream chunk; `output` on the last one, which carries the finish reason (and the params)."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None}
        if self.request.endpoint == "completions":
            choice["text"] = delta.text
            body = self._base("text_completion")
        else:
            message: dict[str, str] = {"role": "assistant"} if first else {}
            if delta.text or not first:
                message["content"] = delta.text
            choice["delta"] = message
            body = self._base("chat.completion.chunk")
        choice["finish_reason"] = None if output is None else output.finish_reason
        choice["stop_reason"] = None if output is None else output.stop_reason
        if self.request.return_token_ids:
            choice["token_ids"] = list(delta.token_ids)
        body["choices"] = [choice]
        if output is not None and kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return body

    def usage_chunk(self, output: Output) -> dict[str, Any]:
        obj = "text_completion" if self.request.endpoint == "completions" else "chat.completion.chunk"
        body = self._base(obj)
        body["choices"] = []
        body["usage"] = usage(len(self.request.prompt), output.generated)
        return body


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def models_response(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "disagg",
                "root": model,
                "parent": None,
                "max_model_len": max_model_len,
            }
        ],
    }


def api_error_of(exc: BaseException) -> ApiError:
    """An `ApiError` as is; anything else as a 500 naming its type (never a traceback)."""
    if isinstance(exc, ApiError):
        return exc
    return ApiError(500, f"internal error: {type(exc).__name__}: {str(exc)[:300]}")
