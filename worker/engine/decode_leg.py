"""The decode leg (vLLM's `do_remote_prefill`): wait for the prompt's KV from the prefill engine, then decode.

The decoder allocates blocks for the prompt and the output, sends `ExpectRequest` naming the prefill
engine, and waits for `KVReady`. Then it recomputes the last prompt token from the received KV, as vLLM does
after a full prompt hit, which yields the first token (the model computes a prompt's last token alone so
these are the prefill's bits), and decodes greedily.

A leg fails as soon as its KV can no longer come: one still waiting for blocks (the KV cache is full)
`lease_wait_s` after it arrived fails with `LeaseExpired` (the prefill's lease on the KV has run out), as does
one its sidecar reports so. A client that goes away while the KV is still expected makes the engine send
`CancelRequest`; the blocks are freed once the sidecar answers (it no longer waits for the KV), or, when the
prefill was already told them, once its lease on the KV has surely ended (`Engine.cancel_expected`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from disagg.worker.contracts.kv_transfer_params import DecodeLeg
from disagg.worker.contracts.topology import lease_wait_s
from disagg.worker.engine import stages
from disagg.worker.engine.api_errors import ApiError, bad_request
from disagg.worker.engine.core import Engine
from disagg.worker.engine.openai_api import GenerationRequest
from disagg.worker.kv.errors import (
    BlockIdOutOfRange,
    DisaggError,
    DuplicateRequest,
    EngineProtocolError,
    UnsupportedPeerTopology,
)
from disagg.worker.link.engine_link import Event, KVFailed, PrefillEngine

KV_WAIT_GRACE_S = 30.0
"""Past the registration timeout, how long a decode leg still waits for its sidecar's verdict."""
# The sidecar refused the decode leg's parameters (the client's fault), rather than failing to serve them.
_CLIENT_REASONS = {
    EngineProtocolError.reason,
    UnsupportedPeerTopology.reason,
    DuplicateRequest.reason,
    BlockIdOutOfRange.reason,
}
# The KV waited for too long: a gateway timeout, not a broken transfer.
_TIMEOUT_REASONS = {"RegistrationTimeout", "LeaseExpired"}


async def decode_leg(
    e: Engine, req: GenerationRequest, request_id: str, leg: DecodeLeg
) -> AsyncIterator[int]:
    s = e.settings
    if s.role != "decode":
        raise bad_request("this engine prefills: a decode leg goes to a decode engine", "kv_transfer_params")
    arrived = time.monotonic()
    n = len(req.prompt)
    if leg.remote_num_tokens is not None and leg.remote_num_tokens != n:
        raise bad_request(
            f"the prefill computed {leg.remote_num_tokens} prompt tokens, this request's prompt has {n}",
            "kv_transfer_params.remote_num_tokens",
        )
    lease = s.topology.kv_lease_duration_s
    try:
        async with asyncio.timeout_at(_loop_time(arrived + lease_wait_s(lease))):
            tables = await e.admit(request_id, n + req.max_tokens - 1, "awaiting_kv")
    except TimeoutError:
        raise ApiError(
            504,
            f"the KV transfer failed (LeaseExpired): request {request_id} waited "
            f"{time.monotonic() - arrived:.0f} s for KV blocks on this decoder, past the prefill's lease of "
            f"{lease:g} s on its KV",
        ) from None
    ready: asyncio.Future[Event] = asyncio.get_running_loop().create_future()

    def on_event(event: Event) -> None:
        if ready.done():  # nobody decodes it any more
            e.release(request_id)
        else:
            ready.set_result(event)

    e.on_terminal(request_id, on_event)
    prefill = PrefillEngine(leg.remote_engine_id, leg.remote_host, leg.remote_port, leg.tp_size, leg.pp_size)
    blocks = stages.prompt_block_ids(tables, n, e.config.block_size)
    assert e.link is not None
    call = asyncio.ensure_future(asyncio.to_thread(e.link.expect_request, request_id, blocks, prefill))
    try:
        await asyncio.shield(call)
    except asyncio.CancelledError:
        ready.cancel()
        call.add_done_callback(
            lambda c: _expect_refused(e, request_id) if c.exception() else e.cancel_expected(request_id)
        )
        raise
    except DisaggError as exc:
        _expect_refused(e, request_id)
        status = 400 if exc.reason in _CLIENT_REASONS else 502
        raise ApiError(status, f"the sidecar refused the decode leg ({exc.reason}): {exc.message}") from None
    try:
        timeout = s.topology.push_registration_timeout_s + KV_WAIT_GRACE_S
        event = await asyncio.wait_for(asyncio.shield(ready), timeout)
    except TimeoutError:
        e.forget_terminal(request_id)
        e.release(request_id)
        raise ApiError(504, f"no verdict from the sidecar on request {request_id}'s KV") from None
    except asyncio.CancelledError:
        if ready.done() and not ready.cancelled():
            e.release(request_id)  # the KV came, but nobody decodes it
        else:
            ready.cancel()  # an event that still comes frees the blocks
            e.cancel_expected(request_id)
        raise
    if isinstance(event, KVFailed):
        e.release(request_id)
        status = 504 if event.reason in _TIMEOUT_REASONS else 502
        raise ApiError(status, f"the KV transfer failed ({event.reason}): {event.message}")
    try:
        await e.model_thread.run(lambda: e.sched().set_state(request_id, "decoding"))
        # The first token: the last prompt token recomputed from the pushed KV (vLLM's full-hit rule).
        first = await e.model_thread.run(lambda: e.step(req.prompt[-1], n - 1, tables))
        e.metrics.tokens.inc()
        async for token in e.decode_from(first, n, tables, req.max_tokens):
            yield token
    finally:
        e.release(request_id)


def _loop_time(monotonic: float) -> float:
    """A `time.monotonic()` instant on the event loop's clock."""
    return asyncio.get_running_loop().time() + monotonic - time.monotonic()


def _expect_refused(e: Engine, request_id: str) -> None:
    e.forget_terminal(request_id)
    e.release(request_id)
