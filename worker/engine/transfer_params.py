"""The reference engine's side of `kv_transfer_params` (`disagg.worker.contracts.kv_transfer_params`). Pure.

The contract's refusals reach the client as OpenAI 400s naming the field at fault (the prefill's answer is
the contract's `handoff(...).to_json()`, used as is).
"""

from __future__ import annotations

from disagg.worker.contracts import kv_transfer_params as kv_params
from disagg.worker.engine.api_errors import bad_request


def parse_kv_transfer_params(value: object) -> kv_params.Transfer:
    """The leg a request's `kv_transfer_params` asks for: None for an ordinary (monolithic) request."""
    try:
        return kv_params.parse_leg(value)
    except kv_params.InvalidTransferParams as exc:
        raise bad_request(exc.message, exc.param) from None


def internal_request_id(endpoint: kv_params.Endpoint, x_request_id: str | None, generated: str) -> str:
    """vLLM's internal id: the endpoint's prefix and the `X-Request-Id` header, or `generated` without one."""
    try:
        return kv_params.internal_request_id(endpoint, x_request_id, generated)
    except kv_params.InvalidTransferParams as exc:
        raise bad_request(exc.message, exc.param) from None
