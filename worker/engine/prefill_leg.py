"""The prefill leg (vLLM's `do_remote_decode`): prefill the prompt, hand its KV to the sidecars, answer with
the first token and the `kv_transfer_params` a decoder needs.

The head prefills the prompt on every stage (`stages`), each stage tells its sidecar `RequestFinished` for
its own layers, and the response carries the first token (one token, whatever `max_tokens` asks: vLLM's
routers send 1). The blocks stay held until every stage's sidecar reports the push done or the lease over
(`scheduler`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from disagg.worker.contracts.kv_transfer_params import handoff
from disagg.worker.engine import stages
from disagg.worker.engine.api_errors import ApiError, bad_request
from disagg.worker.engine.core import Engine
from disagg.worker.engine.openai_api import GenerationRequest
from disagg.worker.kv.errors import DisaggError


async def prefill_leg(e: Engine, req: GenerationRequest, request_id: str) -> tuple[int, dict[str, Any]]:
    """The first token and the `kv_transfer_params` for the decoder; the blocks stay held."""
    s = e.settings
    if s.role != "prefill":
        raise bad_request("this engine decodes: a prefill leg goes to a prefill engine", "kv_transfer_params")
    n = len(req.prompt)
    tables = await e.admit(request_id, n, "prefilling", waiting_on=range(s.pp_size))
    e.on_terminal(request_id, lambda event: e.stage_done(request_id, 0))
    blocks = stages.prompt_block_ids(tables, n, e.config.block_size)

    def job() -> int:
        if e.pipeline is not None:
            first = e.pipeline.prefill(request_id, req.prompt, tables)
        else:
            try:
                first = e.prefill_first(req.prompt, tables)
            except Exception:
                e.forget_terminal(request_id)
                e.release(request_id)
                raise
        try:
            assert e.link is not None
            e.link.request_finished(request_id, blocks)
        except DisaggError:
            e.forget_terminal(request_id)
            if e.sched().stage_done(request_id, 0):
                e.freed_blocks()
            raise
        e.sched().set_state(request_id, "held_for_push")
        return first

    future = e.model_thread.submit(job)
    try:
        first = await asyncio.shield(asyncio.wrap_future(future))
    except DisaggError as exc:
        raise ApiError(
            502, f"the sidecar refused the finished prefill ({exc.reason}): {exc.message}"
        ) from None
    except RuntimeError as exc:
        if e.pipeline is None:
            raise
        # A gloo exchange failed: a stage is gone, and the group with it.
        e.fail(f"the pipeline broke: {exc}")
        raise ApiError(503, f"the pipeline broke: {exc}") from None
    e.metrics.tokens.inc()
    params = handoff(
        block_ids=blocks,
        engine_id=s.engine_id,
        request_id=request_id,
        host=s.advertised_host,
        port=s.advertised_port,
        tp_size=s.tp_size,
        pp_size=s.pp_size,
        num_tokens=n,
    ).to_json()
    return first, params
