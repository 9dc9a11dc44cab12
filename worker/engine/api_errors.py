"""The OpenAI error JSON the reference engine's server answers with, and the exception that carries it. Pure.

`{"error": {"message", "type", "param", "code"}}` as vLLM's server writes it: `type` names the HTTP status
class (`BadRequestError`, ...), `code` is the status, `param` the request field at fault (or null).
"""

from __future__ import annotations

from typing import Any

_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError"),
            "param": param,
            "code": status,
        }
    }


class ApiError(Exception):
    """A request the server answers with an OpenAI error: status, message and the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)
