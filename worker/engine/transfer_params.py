"""The reference engine's side of `kv_transfer_params` (`disagg.worker.contracts.kv_transfer_params`). Pure.

The contract's refusals reach the client as OpenAI 400s naming the field at fault; the prefill's answer is
the contract's `PrefillHandoff` as JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
    return kv_params.handoff(
        block_ids=block_ids,
        engine_id=engine_id,
        request_id=request_id,
        host=host,
        port=port,
        tp_size=tp_size,
        pp_size=pp_size,
        num_tokens=num_tokens,
    ).to_json()
