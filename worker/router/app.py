"""The router's HTTP server (aiohttp): one OpenAI-compatible endpoint in front of a deployment's engines.

For each completion request the router picks a routable pair (`balance`), builds both legs (`protocol`) and
sends them at once over one pooled client session. The client gets the decode leg's answer (streamed as it
arrives when the client asked to stream) once the prefill leg has answered that it holds the KV; if either leg
fails or times out the other is closed (an engine aborts a request whose connection closes), and so does a
client that disconnects. Decode is never retried alone: its registration names one prefill's request.

Every engine answer is untrusted: bodies are read up to a bound, JSON and SSE are checked before they reach
the client (`upstream`), and reads that stall time out. Whatever an engine sends, the request fails with a
status that says whose fault it was, and the router keeps serving.

Clients are untrusted too. Their connections are capped and must send their headers in time (`server`),
their bodies are read with a size bound (content-length first, then while streaming) and a time bound, and
the bodies being read at once share a memory budget (`client_body`). A request waits for a decoder with room
(`admission`) rather than being sent into a queue where its KV would expire, and every request ends by its
deadline (`request_timeout_s`) with its completion or an error, both legs closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any, Final

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from disagg.worker.contracts.pairing import DecodeTarget, Exclusion, Pair, Routing
from disagg.worker.router.admission import Admission
from disagg.worker.router.balance import Balancer, Ticket
from disagg.worker.router.canary import KvCanary
from disagg.worker.router.client_body import ClientBodies
from disagg.worker.router.config import RouterConfig
from disagg.worker.router.decoder_load import DecoderLoad, parse_load, window
from disagg.worker.router.metrics import DISCONNECTED, RequestClock, RouterMetrics, RouterState, fault_outcome
from disagg.worker.router.outliers import EJECTED_REASON, Outliers
from disagg.worker.router.protocol import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    REQUEST_ID_HEADER,
    ClientRequest,
    Fault,
    Legs,
    PrefillAnswer,
    RouterError,
    build_legs,
    engine_error,
    error_body,
    loses_window_edge,
    parse_client_request,
    parse_prefill_answer,
)
from disagg.worker.router.server import ConnectionGate, Serving, serve
from disagg.worker.router.upstream import SseEvents, describe, read_bounded, unreachable_or, url_host

# Below vLLM's default keep-alive (5 s) with room for a loaded machine's delays.
ENGINE_KEEPALIVE_S: Final = 3.0
log = logging.getLogger("disagg.worker.router")

# Request body failures after which the connection cannot carry another request.
_BODY_UNREADABLE: Final = frozenset(
    {"RequestBodyTimeout", "RequestBodyTooSlow", "RequestBodyEvicted", "InvalidRequestBody"}
)
# A decoder's metrics page (vLLM's, histograms and all, is some hundreds of KiB).
MAX_METRICS_BYTES: Final = 8 * 1024 * 1024
# The canary's prompt: a few tokens of any tokenizer, so one block crosses the pair.
CANARY_PROMPT: Final = "KV canary: does the cache cross this pair?"


class Router:
    """The router's state: the current routing (replaced whole by discovery), the load, the client session."""

    def __init__(self, config: RouterConfig | None = None, *, watch_alive: Callable[[], bool] = lambda: True):
        self.config = config or RouterConfig()
        self.routing: Routing | None = None
        self.balancer = Balancer()
        self.admission = Admission(
            self.balancer,
            max_per_decoder=self.config.max_in_flight_per_decoder,
            max_queued=self.config.max_queued,
            queue_timeout_s=self.config.queue_timeout_s,
            retry_after_s=self.config.retry_after_s,
            window=self._window,
        )
        # The last sample of each decoder's load, by pod: its live engine id, when, and the load.
        self.loads: dict[str, tuple[str, float, DecoderLoad]] = {}
        self.gate = ConnectionGate(self.config.max_connections, retry_after_s=self.config.retry_after_s)
        self.bodies = ClientBodies(self.config)
        self.metrics = RouterMetrics(
            RouterState(self.balancer, self.admission, self.gate, lambda: self.routing)
        )
        self.watch_alive = watch_alive
        self.outliers = Outliers(
            self.config.eject_after_failures, self.config.eject_s, self.config.max_eject_s
        )
        self._readmissions: set[asyncio.TimerHandle] = set()
        self._session: aiohttp.ClientSession | None = None
        # What discovery found; `routing` is what clients are routed over (its canaried pairs only).
        self.discovered: Routing | None = None
        self.canary = (
            KvCanary(self._canary_probe, self._publish, retry_s=self.config.canary_retry_s)
            if self.config.kv_canary
            else None
        )

    def set_routing(self, routing: Routing) -> None:
        """Publish a new routing; requests already routed keep their pair. Call it on the router's loop."""
        self.discovered = routing
        self._publish()

    def _publish(self) -> None:
        routing = self.discovered
        if routing is not None:
            routing = self._without_ejected(routing)
        if routing is not None and self.canary is not None:
            routing = self.canary.admit(routing)
        self.routing = routing
        self.admission.wake_all()

    def _without_ejected(self, routing: Routing) -> Routing:
        """`routing` without the pairs of an engine ejected for its failures (`outliers`), as exclusions."""
        now = asyncio.get_running_loop().time()
        kept: list[Pair] = []
        ejected: list[Exclusion] = []
        for pair in routing.pairs:
            out = [
                e for e in (pair.prefill.engine_id, pair.decode.engine_id) if self.outliers.ejected(e, now)
            ]
            if not out:
                kept.append(pair)
                continue
            ejected.append(
                Exclusion(
                    prefill=pair.prefill.head_pod,
                    decode=pair.decode.pod,
                    reason=EJECTED_REASON,
                    message=f"{pair.prefill.head_pod} ↔ {pair.decode.pod}: "
                    + "; ".join(f"engine {e} {self.outliers.why(e)}" for e in out),
                )
            )
        if not ejected:
            return routing
        return replace(routing, pairs=tuple(kept), exclusions=(*routing.exclusions, *ejected))

    def _leg_failed(self, engine_id: str, leg: str, error: RouterError) -> None:
        """A client request's leg failed by its engine's fault: past the outlier bound the engine leaves the
        routing now, and comes back through the canary when its hold ends."""
        if error.fault not in (Fault.UPSTREAM, Fault.TIMEOUT):
            return
        loop = asyncio.get_running_loop()
        hold = self.outliers.failed(
            engine_id,
            f"failed {self.config.eject_after_failures} {leg} legs in a row (the last: {error.reason})",
            loop.time(),
        )
        if hold is None:
            return
        log.warning(
            "ejected the %s engine %s for %g s: %s", leg, engine_id, hold, self.outliers.why(engine_id)
        )
        if self.canary is not None:
            self.canary.forget(engine_id)
        handle = loop.call_later(hold, self._readmit)
        self._readmissions.add(handle)
        self._publish()

    def _readmit(self) -> None:
        now = asyncio.get_running_loop().time()
        self._readmissions = {h for h in self._readmissions if h.when() > now}
        self._publish()

    def _leg_served(self, engine_id: str) -> None:
        self.outliers.succeeded(engine_id, asyncio.get_running_loop().time())

    def _window(self, decode: DecodeTarget) -> int | None:
        """The decode legs `decode` can take now, by its last sample; None without a fresh one of it."""
        sample = self.loads.get(decode.pod)
        if sample is None or self.config.load_poll_s <= 0:
            return None
        engine_id, when, load = sample
        if engine_id != decode.engine_id or time.monotonic() - when > 4 * self.config.load_poll_s + 2.0:
            return None
        return window(
            load,
            headroom=self.config.decoder_headroom,
            headroom_fraction=self.config.decoder_headroom_fraction,
        )

    async def _poll_loads(self) -> None:
        """Every `load_poll_s`, each discovered decoder's load from its `/metrics`; a page that fails or
        says nothing usable leaves that decoder without a sample (the fixed cap alone bounds it)."""
        while True:
            routing = self.discovered
            decoders = (
                {}
                if routing is None
                else {d.pod: d for d in (*routing.decodes, *(p.decode for p in routing.pairs))}
            )
            samples = await asyncio.gather(*(self._load_of(d) for d in decoders.values()))
            now = time.monotonic()
            self.loads = {
                pod: (decode.engine_id, now, load)
                for (pod, decode), load in zip(decoders.items(), samples, strict=True)
                if load is not None
            }
            # Room may have grown.
            self.admission.wake_all()
            await asyncio.sleep(self.config.load_poll_s)

    async def _load_of(self, decode: DecodeTarget) -> DecoderLoad | None:
        url = f"http://{url_host(decode.host)}:{decode.http_port}/metrics"
        try:
            async with asyncio.timeout(max(1.0, 2 * self.config.load_poll_s)):
                async with self.session.get(url) as response:
                    raw = await read_bounded(response, MAX_METRICS_BYTES, "metrics")
            if response.status != 200:
                return None
            return parse_load(raw.decode("utf-8", "replace"))
        except Exception as exc:
            log.debug("the load of the decoder %s: %s", decode.pod, describe(exc))
            return None

    async def _canary_probe(self, pair: Pair) -> None:
        """One request of the router's own through `pair`, both legs as a client's go, one token long:
        raises unless the decoder answered a completion (so the KV crossed the pair)."""
        while self._session is None:
            # A routing can arrive before the app (and its client session) has started.
            await asyncio.sleep(0.05)
        async with asyncio.timeout(self.config.canary_timeout_s):
            model = await self._served_model(pair)
            body = {"model": model, "prompt": CANARY_PROMPT, "max_tokens": 1, "temperature": 0}
            request = parse_client_request(COMPLETIONS, json.dumps(body).encode())
            legs = build_legs(request, pair, f"canary-{uuid.uuid4().hex}")
            ticket = self.balancer.start(pair, request.prompt_weight)
            prefill = asyncio.create_task(self._prefill(pair, legs, ticket))
            decode = asyncio.create_task(self._decode_start(pair, legs, False))
            response: aiohttp.ClientResponse | None = None
            try:
                await prefill
                response, started = await decode
                answer = json.loads(await self._decode_body(response, legs, started))
                if not answer.get("choices"):
                    raise RouterError(Fault.UPSTREAM, "CanaryEmpty", "the decoder answered no completion")
            finally:
                for task in (prefill, decode):
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
                if response is not None:
                    response.close()
                self.balancer.decode_done(ticket)

    async def _served_model(self, pair: Pair) -> str:
        url = f"http://{url_host(pair.decode.host)}:{pair.decode.http_port}/v1/models"
        async with self.session.get(url) as response:
            raw = await read_bounded(response, self.config.max_error_bytes, "models")
        if response.status != 200:
            raise engine_error("decode", response.status, raw)
        models = json.loads(raw).get("data") or []
        if not models or not isinstance(models[0].get("id"), str):
            raise RouterError(Fault.UPSTREAM, "CanaryNoModel", f"{url} lists no model")
        return str(models[0]["id"])

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the router's client session opens with the app"
        return self._session

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_request_bytes)
        app.router.add_post(COMPLETIONS, self.complete)
        app.router.add_post(CHAT_COMPLETIONS, self.complete)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics_page)
        app.cleanup_ctx.append(self._client_session)
        return app

    async def _client_session(self, app: web.Application) -> AsyncIterator[None]:
        # One pool for every engine; no per-host cap (an engine's admission control is its own), and no total
        # timeout: each leg bounds itself. An idle connection is closed before the engine would close it:
        # vLLM's server drops one idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), and a leg sent on it as it
        # does fails with ServerDisconnectedError, a failed request the engine never saw.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=ENGINE_KEEPALIVE_S)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
        )
        loop = asyncio.get_running_loop()
        poller = loop.create_task(self._poll_loads()) if self.config.load_poll_s > 0 else None
        try:
            yield
        finally:
            if poller is not None:
                poller.cancel()
                with contextlib.suppress(BaseException):
                    await poller
            for handle in self._readmissions:
                handle.cancel()
            if self.canary is not None:
                await self.canary.close()
            await self._session.close()
            self._session = None

    # --- endpoints ------------------------------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        if not self.watch_alive():
            return web.Response(status=503, text="the pod watch has stopped\n")
        return web.Response(text="ok\n")

    async def readyz(self, request: web.Request) -> web.Response:
        routing = self.routing
        if routing is None:
            return web.Response(status=503, text="no pod list from the API server yet\n")
        if not routing.pairs:
            reasons = sorted({f"{e.reason}: {e.message}" for e in routing.exclusions})[:20]
            return web.Response(status=503, text="no routable pair\n" + "".join(f"{r}\n" for r in reasons))
        return web.Response(text=f"{len(routing.pairs)} routable pairs\n")

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        """The served models, as a routable decoder lists them (both sides of a pair serve the same model)."""
        routing = self.routing
        if routing is None or not routing.pairs:
            return _error_response(RouterError(Fault.UNAVAILABLE, "NoRoutablePair", "no routable pair"))
        decode = routing.pairs[0].decode
        url = f"http://{url_host(decode.host)}:{decode.http_port}/v1/models"
        try:
            async with asyncio.timeout(self.config.models_timeout_s):
                async with self.session.get(url) as response:
                    raw = await read_bounded(response, self.config.max_error_bytes, "models")
                    if response.status != 200:
                        raise engine_error("decode", response.status, raw)
                    body = json.loads(raw)
                    if not isinstance(body, dict):
                        raise ValueError("not an object")
        except RouterError as exc:
            return _error_response(exc)
        except TimeoutError:
            return _error_response(
                RouterError(Fault.TIMEOUT, "ModelsTimeout", f"{url} did not answer in time")
            )
        except Exception as exc:
            return _error_response(RouterError(Fault.UPSTREAM, "ModelsFailed", f"{url}: {describe(exc)}"))
        return web.Response(body=raw, content_type="application/json")

    async def complete(self, request: web.Request) -> web.StreamResponse:
        endpoint = request.path
        clock = self.metrics.clock(endpoint)
        loop = asyncio.get_running_loop()
        timeout = self.config.request_timeout_s
        deadline = loop.time() + timeout if timeout > 0 else None
        try:
            raw = await self.bodies.read(request)
            client_request = parse_client_request(endpoint, raw)
        except RouterError as exc:
            response = self._fail(clock, exc)
            if exc.reason in _BODY_UNREADABLE:
                # The rest of the body is not awaited (the client is too slow, or its framing broke): the
                # client hears so, then the connection closes, without aiohttp's lingering read of the rest.
                response.force_close()
                await response.prepare(request)
                await response.write_eof()
                request.protocol.force_close()
            return response
        try:
            pair = await self.admission.choose(
                self._pairs,
                None if deadline is None else deadline - loop.time(),
                coming=lambda: self.canary is not None and self.canary.in_flight(),
            )
        except RouterError as exc:
            return self._fail(clock, exc)
        except TimeoutError:
            return self._fail(clock, self._deadline_error())
        legs = build_legs(client_request, pair, uuid.uuid4().hex)
        ticket = self.balancer.start(pair, client_request.prompt_weight)
        try:
            return await self._serve(request, client_request, pair, legs, ticket, deadline, clock)
        except RouterError as exc:
            return self._fail(clock, exc, legs)
        except asyncio.CancelledError:
            self.metrics.failed(clock, "ClientDisconnected", DISCONNECTED)
            raise
        finally:
            self._decode_done(ticket)

    def _deadline_error(self) -> RouterError:
        return RouterError(
            Fault.TIMEOUT,
            "RequestTimeout",
            f"the request did not complete in {self.config.request_timeout_s:g} s (the router's "
            "--request-timeout-s); both legs are closed",
        )

    def _pairs(self) -> Sequence[Pair]:
        # Read at every look: a request waiting for room goes to the routing of the moment it gets some.
        routing = self.routing
        return () if routing is None else routing.pairs

    def _decode_done(self, ticket: Ticket) -> None:
        """Release everything `ticket` holds; its decoder's room goes to the next request waiting."""
        self.balancer.done(ticket)
        self.admission.release()

    # --- one request, two legs ------------------------------------------------------------------------------

    async def _serve(
        self,
        request: web.Request,
        client_request: ClientRequest,
        pair: Pair,
        legs: Legs,
        ticket: Ticket,
        deadline: float | None,
        clock: RequestClock,
    ) -> web.StreamResponse:
        self.metrics.dispatched(clock)
        prefill = asyncio.create_task(self._prefill(pair, legs, ticket, clock))
        decode = asyncio.create_task(self._decode_start(pair, legs, client_request.stream))
        response: aiohttp.ClientResponse | None = None
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    pending: set[asyncio.Task[Any]] = {prefill, decode}
                    while pending:
                        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                        for task in done:
                            # The first leg to fail decides the error; `finally` closes the other.
                            try:
                                task.result()
                            except RouterError as exc:
                                if task is prefill:
                                    self._leg_failed(pair.prefill.engine_id, "prefill", exc)
                                else:
                                    self._leg_failed(pair.decode.engine_id, "decode", exc)
                                raise
                            if task is prefill:
                                self._leg_served(pair.prefill.engine_id)
                    answer = prefill.result()
                    response, started = decode.result()
                    try:
                        if loses_window_edge(self.config.window_edges, answer.prompt_tokens):
                            legs, (response, started) = await self._serve_alone(
                                pair, client_request, legs, response, "WindowEdge", clock
                            )
                        if not client_request.stream:
                            body = await self._decode_body(response, legs, started, clock)
                    except RouterError as exc:
                        self._leg_failed(pair.decode.engine_id, "decode", exc)
                        raise
            except TimeoutError:
                # Every leg's own timeout is a RouterError by now: this is the request's deadline.
                raise self._deadline_error() from None
            if not client_request.stream:
                self._leg_served(pair.decode.engine_id)
                self.metrics.succeeded(clock)
                return web.Response(
                    body=body, content_type="application/json", headers={REQUEST_ID_HEADER: legs.request_id}
                )
            return await self._relay(request, response, pair, legs, started, deadline, clock)
        finally:
            for task in (prefill, decode):
                task.cancel()
            for task in (prefill, decode):
                with contextlib.suppress(BaseException):
                    await task
            if response is None and decode.done() and not decode.cancelled() and decode.exception() is None:
                response = decode.result()[0]
            if response is not None:
                # Closing (not releasing) the connection is what tells the engine to abort a leg not read to
                # its end; a fully read answer has already gone back to the pool.
                response.close()
            self.balancer.decode_done(ticket)
            self.admission.release()

    async def _serve_alone(
        self,
        pair: Pair,
        client_request: ClientRequest,
        legs: Legs,
        transferred: aiohttp.ClientResponse,
        reason: str,
        clock: RequestClock,
    ) -> tuple[Legs, tuple[aiohttp.ClientResponse, float]]:
        """The request again on the decoder alone, without the transfer, whose answer is known to be wrong
        (`reason`). The transferred decode leg is read until the decoder has answered (a stream's first data
        event, or the whole body) and only then closed: vLLM schedules a request once its KV has arrived, so
        no WRITE of the prefill can land in its blocks after the decoder frees them for another request."""
        try:
            async with asyncio.timeout(self.config.decode_timeout_s):
                if client_request.stream:
                    events = SseEvents(self.config.max_sse_event_bytes)
                    while events.data_events == 0:
                        chunk = await transferred.content.readany()
                        if not chunk or any(done for _, done, _ in events.feed(chunk)):
                            break
                else:
                    await read_bounded(transferred, self.config.max_response_bytes, "decode")
        except Exception as exc:
            # The discarded answer's failure is no reason to fail a request the decoder can serve alone.
            log.info(
                "%s %s: the transferred answer broke off: %s", legs.endpoint, legs.request_id, describe(exc)
            )
        finally:
            transferred.close()
        self.metrics.recomputed(clock, reason)
        log.info(
            "%s %s: %s: served by the decoder %s alone",
            legs.endpoint,
            legs.request_id,
            reason,
            pair.decode.pod,
        )
        alone = Legs(legs.endpoint, f"{legs.request_id}-alone", {}, dict(client_request.body))
        return alone, await self._decode_start(pair, alone, client_request.stream)

    async def _prefill(
        self, pair: Pair, legs: Legs, ticket: Ticket, clock: RequestClock | None = None
    ) -> PrefillAnswer:
        """The prefill leg to its checked answer; a client request's (`clock`) is timed, a canary's not."""
        target = pair.prefill
        url = f"http://{url_host(target.host)}:{target.http_port}{legs.endpoint}"
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.config.prefill_timeout_s):
                async with self.session.post(
                    url,
                    json=legs.prefill,
                    headers=legs.headers,
                    timeout=aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_s),
                ) as response:
                    raw = await read_bounded(response, self.config.max_prefill_response_bytes, "prefill")
                    result = parse_prefill_answer(response.status, raw, pair)
        except RouterError:
            raise
        except TimeoutError:
            raise RouterError(
                Fault.TIMEOUT,
                "PrefillTimeout",
                f"the prefill engine {target.engine_id} gave no answer in {self.config.prefill_timeout_s:g}s",
            ) from None
        except Exception as exc:
            raise RouterError(
                Fault.UPSTREAM,
                unreachable_or("Prefill", exc),
                f"the prefill engine {target.engine_id}: {describe(exc)}",
            ) from None
        finally:
            self.balancer.prefill_done(ticket)
        if clock is not None:
            self.metrics.prefill_answered(clock, started)
        return result

    async def _decode_start(
        self, pair: Pair, legs: Legs, stream: bool
    ) -> tuple[aiohttp.ClientResponse, float]:
        """The decode leg up to a 200 status; a non-200 answer is read (bounded) into the error."""
        target = pair.decode
        url = f"http://{url_host(target.host)}:{target.http_port}{legs.endpoint}"
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.config.decode_timeout_s):
                response = await self.session.post(
                    url,
                    json=legs.decode,
                    headers=legs.headers,
                    timeout=aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_s),
                )
                if response.status != 200:
                    try:
                        raw = await read_bounded(response, self.config.max_error_bytes, "decode")
                    finally:
                        response.close()
                    raise engine_error("decode", response.status, raw)
        except RouterError:
            raise
        except TimeoutError:
            raise RouterError(
                Fault.TIMEOUT,
                "DecodeTimeout",
                f"the decoder {target.pod} did not answer in {self.config.decode_timeout_s:g} s",
            ) from None
        except Exception as exc:
            raise RouterError(
                Fault.UPSTREAM, unreachable_or("Decode", exc), f"the decoder {target.pod}: {describe(exc)}"
            ) from None
        return response, started

    async def _decode_body(
        self, response: aiohttp.ClientResponse, legs: Legs, started: float, clock: RequestClock | None = None
    ) -> bytes:
        try:
            async with asyncio.timeout(self.config.decode_timeout_s):
                raw = await read_bounded(response, self.config.max_response_bytes, "decode")
        except RouterError:
            raise
        except TimeoutError:
            raise RouterError(
                Fault.TIMEOUT, "DecodeTimeout", "the decoder's answer did not complete in time"
            ) from None
        except Exception as exc:
            raise RouterError(
                Fault.UPSTREAM, "DecodeFailed", f"the decoder's answer broke off: {describe(exc)}"
            ) from None
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):
            raise RouterError(
                Fault.UPSTREAM, "DecodeInvalidResponse", "the decoder's answer is not a JSON object"
            )
        if "error" in body or body.get("object") == "error":
            raise engine_error("decode", 500, raw)
        if clock is not None:
            self.metrics.decode_complete(clock, started)
        return raw

    async def _relay(
        self,
        request: web.Request,
        response: aiohttp.ClientResponse,
        pair: Pair,
        legs: Legs,
        started: float,
        deadline: float | None,
        clock: RequestClock,
    ) -> web.StreamResponse:
        """The decoder's SSE events to the client, each checked and forwarded as it completes. The stall timer
        counts data events only: comments (keep-alives) are forwarded but do not show that the decode
        advances, so a decoder that sends nothing else is stalled."""
        out = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                REQUEST_ID_HEADER: legs.request_id,
            }
        )
        await out.prepare(request)
        events = SseEvents(self.config.max_sse_event_bytes)
        loop = asyncio.get_running_loop()
        # Until the first data event the decoder has the decode timeout; after, the stall timeout per event.
        wait_s = self.config.decode_timeout_s
        data_by = loop.time() + wait_s
        data_events = 0
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    while True:
                        try:
                            async with asyncio.timeout_at(data_by):
                                chunk = await response.content.readany()
                        except TimeoutError:
                            raise RouterError(
                                Fault.TIMEOUT,
                                "DecodeStalled",
                                f"the decoder sent no data event for {wait_s:g} s",
                            ) from None
                        except Exception as exc:
                            raise RouterError(
                                Fault.UPSTREAM,
                                "DecodeFailed",
                                f"the decoder's stream broke off: {describe(exc)}",
                            ) from None
                        if not chunk:
                            raise RouterError(
                                Fault.UPSTREAM, "DecodeTruncated", "the decoder's stream ended before [DONE]"
                            )
                        for event, done, token in events.feed(chunk):
                            await out.write(event)
                            if token:
                                self.metrics.token_event(clock)
                            if done:
                                self._leg_served(pair.decode.engine_id)
                                self.metrics.decode_complete(clock, started)
                                self.metrics.succeeded(clock)
                                await out.write_eof()
                                return out
                        if events.data_events > data_events:
                            data_events = events.data_events
                            wait_s = self.config.stall_timeout_s
                            data_by = loop.time() + wait_s
            except TimeoutError:
                raise self._deadline_error() from None
        except RouterError as exc:
            # The status has gone out: the error goes as an event, as vLLM sends one, then the stream ends. A
            # client that does not read gets a second to take it.
            if exc.reason != "RequestTimeout":
                self._leg_failed(pair.decode.engine_id, "decode", exc)
            self.metrics.failed(clock, exc.reason, fault_outcome(exc.fault))
            log.warning("%s %s: %s: %s", legs.endpoint, legs.request_id, exc.reason, exc.message)
            with contextlib.suppress(ConnectionError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await out.write(b"data: " + error_body(exc) + b"\n\ndata: [DONE]\n\n")
                    await out.write_eof()
            return out
        except ConnectionError:
            # The client went away mid-stream; `_serve` closes the decode leg.
            self.metrics.failed(clock, "ClientDisconnected", DISCONNECTED)
            return out

    def _fail(self, clock: RequestClock, error: RouterError, legs: Legs | None = None) -> web.Response:
        self.metrics.failed(clock, error.reason, fault_outcome(error.fault))
        level = logging.INFO if error.fault is Fault.CLIENT else logging.WARNING
        log.log(
            level,
            "%s %s: %s: %s",
            clock.endpoint,
            legs.request_id if legs else "-",
            error.reason,
            error.message,
        )
        return _error_response(error, legs.request_id if legs else None)


def _error_response(error: RouterError, request_id: str | None = None) -> web.Response:
    headers = {} if request_id is None else {REQUEST_ID_HEADER: request_id}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(error.retry_after_s)
    return web.Response(
        status=error.status, body=error_body(error), content_type="application/json", headers=headers
    )


async def start(router: Router, host: str, port: int) -> Serving:
    """Serve `router` on host:port, behind its connection cap and header timeout (`server`). A client that
    disconnects cancels its handler (aiohttp's handler_cancellation), which is what closes both legs of a
    non-streamed request."""
    return await serve(router.app(), router.gate, host, port, header_timeout_s=router.config.header_timeout_s)
