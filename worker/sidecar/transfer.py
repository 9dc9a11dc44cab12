"""The KV worker sidecar: the process next to every engine that owns the NIXL agent and moves the engine's KV.

One process per worker (PP stage, TP rank). It
- takes the engine's calls on a Unix socket (`disagg.worker.sidecar.engine_socket`, the protocol in
  `disagg.worker.link.engine_link`): the engine registers the
  layout of its KV pool (a shared-memory file both processes map), then reports finished requests (prefill)
  or announces requests it expects (decode), and is told when each request's KV has been sent, has arrived,
  or has failed;
- checks the registered layout against its own configuration (`disagg.worker.sidecar.layout_checks`) and
  registers the pool with NIXL once;
- serves the side channel (vLLM framing); the engine's (pp 0, tp 0) worker also republishes the handshake
  payload of the engine's other workers (`disagg.worker.sidecar.republisher`), as vLLM's scheduler serves
  every worker of an engine;
- runs the push connector (`PushProducer` on prefill, `PushConsumer` on decode) with layer-name routing;
  its metrics and the engine's `KVSent` come from what the connector's events carry (bytes posted, when, to
  which peer; handshake start and end), not from watching the NIXL agent;
- serves `/healthz`, `/readyz` and Prometheus metrics, logs one JSON object per line
  (`disagg.worker.sidecar.logs`), and on SIGTERM stops
  serving, releases its NIXL agent and exits 0;
- once the engine has registered, starts the reporter it was given (`KVReporter`; in a pod, the layer above
  gives it the `reporting` package's, which checks the peers and writes the Pod's condition).

The process entry point (`disagg.worker.cli.transfer`) lives above `reporting`, which imports this package's
configuration and logs: so this package never imports `reporting`.

Threads: the main thread owns the NIXL agent (every NIXL call, every connector call, every reply and
event written to the engine); the engine socket's inbox is the one queue between the engine and the
connector. Socket readers, the side-channel server, the payload republisher, the peer
reporter and the HTTP server only decode, queue, serve bytes or read the registered layout. Whatever one
engine message or one connector poll raises fails only that message (`InternalError`); each acknowledged
request gets exactly one terminal event; `/readyz` reports a stopped side-channel or engine-socket thread.

It runs to some 430 lines: it is the one loop that owns the NIXL agent, and its steps share its state.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol

from disagg.worker.connector.consumer import PushConsumer
from disagg.worker.connector.producer import PushProducer, Sent
from disagg.worker.connector.push import Failure, Handshake, LocalKV, RemoteEngine, agent_name
from disagg.worker.connector.side_channel import SideChannelServer
from disagg.worker.connector.transport import NixlTransport
from disagg.worker.connector.ucx_log import UcxLog
from disagg.worker.kv.errors import (
    DisaggError,
    DuplicateRequest,
    EngineLayoutMismatch,
    EngineProtocolError,
    InternalError,
    KVPoolUnavailable,
    LayoutNotRegistered,
    LeaseExpired,
    UnknownRequest,
    WrongRole,
)
from disagg.worker.kv.layout import StageLayout
from disagg.worker.kv.wire import clip
from disagg.worker.link.engine_link import (
    MAX_ID_CHARS,
    Ack,
    CancelRequest,
    EngineMessage,
    Error,
    KVFailed,
    KVReady,
    KVSent,
    QueryRequest,
    RegisterLayout,
    RequestFinished,
    RequestState,
    RequestStatus,
    SidecarMessage,
)
from disagg.worker.link.kv_pool import ShmPool
from disagg.worker.sidecar.config import SidecarConfig
from disagg.worker.sidecar.engine_socket import EngineConnection, EngineSocketServer, Inbound, Refusal
from disagg.worker.sidecar.layout_checks import check_block_ids, expected_layout
from disagg.worker.sidecar.logs import event
from disagg.worker.sidecar.metrics import Health, HttpServer, SidecarMetrics
from disagg.worker.sidecar.pairs import PairLedger
from disagg.worker.sidecar.republisher import Republisher

log = logging.getLogger(__name__)

BUSY_POLL_S = 0.001
IDLE_POLL_S = 0.02
KEEP_FINISHED = 10_000
"""Finished requests remembered for `QueryRequest`."""


def _event(level: int, msg: str, **fields: Any) -> None:
    event(log, level, msg, **fields)


class KVReporter(Protocol):
    """Reports on this worker's KV transfer on a thread of its own, beside the main loop: started with the
    `LocalKV` the engine registered (it may plan against it but makes no NIXL call), stopped at shutdown."""

    def start(self, local: LocalKV) -> object: ...

    def stop(self) -> None: ...


@dataclass
class _Tracked:
    conn: EngineConnection
    state: RequestState
    started: float
    reason: str = ""
    message: str = ""


class Sidecar:
    def __init__(
        self,
        config: SidecarConfig,
        reporter: KVReporter | None = None,
        ucx_log: UcxLog | None = None,
        pairs: PairLedger | None = None,
    ) -> None:
        """`ucx_log` is this process's UCX log with protocol selection on (`connector.ucx_log.enable`): the
        transport report per pair reads it. The process entry point turns it on; without it, pairs' lanes
        are unknown. `pairs` is the ledger of each pair's transport and pushes (shared with the reporter)."""
        self.config = config
        self.peer_reporter = reporter
        self.metrics = SidecarMetrics(config.role, config.engine_id, config.pp_rank, config.tp_rank)
        self.health = Health()
        self.stopping = threading.Event()
        self._inbox: queue.Queue[Inbound] = queue.Queue()
        self._requests: OrderedDict[str, _Tracked] = OrderedDict()
        self._pending = 0
        self.layout: StageLayout | None = None
        self._registered: RegisterLayout | None = None
        self._pool: ShmPool | None = None
        self._connector: PushProducer | PushConsumer | None = None
        peer_role = "decode" if config.role == "prefill" else "prefill"
        self._handshake_latency = self.metrics.handshake_latency.labels(peer_role)
        self.pairs = pairs if pairs is not None else PairLedger()
        self._transport_labels: dict[str, tuple[str, str]] = {}
        self.transport = NixlTransport(
            agent_name(config.engine_id, config.pp_rank, config.tp_rank), ucx_log=ucx_log
        )
        self.http = HttpServer(config.metrics_host, config.metrics_port, self.metrics, self.health).start()
        self.side_channel = SideChannelServer(config.side_channel_host, config.side_channel_port).start()
        self.republisher = Republisher(config, self.side_channel).start()
        self.engine_socket = EngineSocketServer(config.engine_socket, self._inbox).start()
        _event(
            logging.INFO,
            "sidecar started",
            role=config.role,
            engine_id=config.engine_id,
            pp_rank=config.pp_rank,
            tp_rank=config.tp_rank,
            side_channel=f"{config.side_channel_host}:{config.side_channel_port}",
            engine_socket=config.engine_socket,
            metrics_port=self.http.port,
            compat_hash=config.compat_hash or "off",
        )

    # -- main loop (owns the NIXL agent) ---------------------------------------------------------------------

    def run(self) -> int:
        try:
            while not self.stopping.is_set():
                self.health.beat()
                self._update_readiness()
                timeout = BUSY_POLL_S if self._pending else IDLE_POLL_S
                try:
                    first: Inbound | None = self._inbox.get(timeout=timeout)
                except queue.Empty:
                    first = None
                while first is not None:
                    self._handle(*first)
                    try:
                        first = self._inbox.get_nowait()
                    except queue.Empty:
                        first = None
                if self._connector is not None:
                    self._poll_safely()
        finally:
            self.close()
        return 0

    def _update_readiness(self) -> None:
        dead = [
            name
            for name, alive in (
                ("side channel", self.side_channel.alive),
                ("engine socket", self.engine_socket.alive),
            )
            if not alive
        ]
        if dead:
            reason: str | None = f"the {' and '.join(dead)} serving thread stopped"
        elif self._registered is None:
            reason = "the engine has not registered its KV layout"
        elif missing := self.republisher.missing:
            reason = f"waiting for the handshake payloads of workers (pp, tp) {sorted(missing)}"
        else:
            reason = None
        self.health.set_ready(reason)
        self.metrics.ready.set(0 if reason else 1)

    def _handle(self, conn: EngineConnection, message: EngineMessage | Refusal) -> None:
        kind = "Undecodable" if isinstance(message, Refusal) else type(message).__name__
        try:
            if isinstance(message, Refusal):
                raise message.error
            self.metrics.engine_messages.labels(kind).inc()
            reply: SidecarMessage = self._dispatch(conn, message)
        except Exception as exc:
            # Whatever one message raises fails that message; the loop that owns the NIXL agent serves on.
            error = (
                exc
                if isinstance(exc, DisaggError)
                else InternalError(f"{type(exc).__name__}: {clip(str(exc))}")
            )
            self.metrics.engine_errors.labels(error.reason).inc()
            _event(
                logging.WARNING,
                "refused an engine message",
                type=kind,
                reason=error.reason,
                error=error.message,
            )
            reply = Error(error.reason, error.message)
        conn.send(reply)
        if isinstance(message, Refusal) and message.hang_up:
            conn.close()

    def _dispatch(self, conn: EngineConnection, message: EngineMessage) -> SidecarMessage:
        if isinstance(message, RegisterLayout):
            self._register(message)
            return Ack()
        if isinstance(message, QueryRequest):
            tracked = self._requests.get(message.request_id)
            if tracked is None:
                raise UnknownRequest(f"no request {message.request_id!r} was finished or expected here")
            return RequestStatus(message.request_id, tracked.state, tracked.reason, tracked.message)
        if isinstance(message, CancelRequest):
            return self._cancel(message.request_id)
        if self.layout is None or self._connector is None:
            raise LayoutNotRegistered(
                f"{type(message).__name__} before RegisterLayout: register the KV layout first"
            )
        if not 0 < len(message.request_id) <= MAX_ID_CHARS:
            raise EngineProtocolError(f"request_id must have 1 to {MAX_ID_CHARS} characters")
        existing = self._requests.get(message.request_id)
        if existing is not None and existing.state == "pending":
            raise DuplicateRequest(f"request {message.request_id!r} is already in flight")
        check_block_ids(self.layout, message.block_ids)
        if isinstance(message, RequestFinished):
            if not isinstance(self._connector, PushProducer):
                raise WrongRole("RequestFinished goes to a prefill sidecar; this one decodes")
            self._connector.request_finished(message.request_id, message.block_ids)
        else:
            if not isinstance(self._connector, PushConsumer):
                raise WrongRole("ExpectRequest goes to a decode sidecar; this one prefills")
            prefill = message.prefill
            if not 0 < prefill.port < 65536 or not 0 < len(prefill.host) <= 255:
                raise EngineProtocolError(
                    f"prefill engine {clip(repr(prefill))} has no usable side channel or sizes"
                )
            if not 0 < len(prefill.engine_id) <= MAX_ID_CHARS:
                raise EngineProtocolError(f"the prefill engine id must have 1 to {MAX_ID_CHARS} characters")
            self._connector.expect(
                message.request_id,
                message.block_ids,
                RemoteEngine(prefill.engine_id, prefill.host, prefill.port, prefill.tp_size, prefill.pp_size),
            )
        self._track(message.request_id, _Tracked(conn, "pending", time.monotonic()))
        return Ack()

    def _cancel(self, request_id: str) -> RequestStatus:
        """The engine gave up an expected request: a pending one is dropped from the consumer and gets no
        event (the reply is its end); one already ended keeps its state, whose event was sent."""
        if not 0 < len(request_id) <= MAX_ID_CHARS:
            raise EngineProtocolError(f"request_id must have 1 to {MAX_ID_CHARS} characters")
        if isinstance(self._connector, PushProducer):
            raise WrongRole("CancelRequest goes to a decode sidecar; this one prefills")
        tracked = self._requests.get(request_id)
        if tracked is None:
            raise UnknownRequest(f"no request {request_id!r} was expected here")
        registered = False
        if tracked.state == "pending":
            assert isinstance(self._connector, PushConsumer)  # a tracked request came after the layout
            registered = bool(self._connector.cancel(request_id))
            self._pending -= 1
            tracked.state = "cancelled"
            _event(logging.INFO, "expected request cancelled", request_id=request_id, registered=registered)
        return RequestStatus(request_id, tracked.state, tracked.reason, tracked.message, registered)

    def _track(self, request_id: str, tracked: _Tracked) -> None:
        self._requests.pop(request_id, None)
        self._requests[request_id] = tracked
        self._pending += 1
        while len(self._requests) > KEEP_FINISHED:
            oldest, entry = next(iter(self._requests.items()))
            if entry.state == "pending":
                break
            del self._requests[oldest]

    def _register(self, message: RegisterLayout) -> None:
        if self._registered is not None:
            if message == self._registered:
                return
            raise EngineLayoutMismatch(
                "the KV layout is already registered with NIXL and differs from this one; restart the pod "
                "to change it"
            )
        layout = expected_layout(self.config, message)
        try:
            pool = ShmPool(message.pool.path, message.pool.nbytes)
        except (OSError, ValueError) as exc:
            raise KVPoolUnavailable(f"cannot map the KV pool {message.pool.path}: {exc}") from None
        try:
            local = LocalKV(layout, self.transport, pool.addr, pool.nbytes, self.config.push_config())
            self.side_channel.set_payload(self.config.pp_rank, self.config.tp_rank, local.handshake_payload())
        except BaseException:
            pool.close()
            raise
        self._pool = pool
        self.layout = layout
        self._connector = PushProducer(local) if self.config.role == "prefill" else PushConsumer(local)
        self._registered = message
        self._update_readiness()
        if self.peer_reporter is not None:
            self.peer_reporter.start(local)
        _event(
            logging.INFO,
            "KV pool registered",
            pool=message.pool.path,
            nbytes=message.pool.nbytes,
            regions=len(layout.regions),
            groups=len(layout.groups),
            num_blocks=message.num_blocks,
            layer_name_routing=local.layer_routing,
        )

    def _poll_safely(self) -> None:
        try:
            self._poll()
        except Exception as exc:
            # The connector fails single requests itself; anything that escapes it is a bug, logged and
            # counted, and the loop polls again rather than taking every in-flight request down.
            self.metrics.engine_errors.labels("InternalError").inc()
            _event(
                logging.ERROR,
                "connector poll failed",
                reason="InternalError",
                error=f"{type(exc).__name__}: {clip(str(exc))}",
            )

    def _poll(self) -> None:
        connector = self._connector
        if isinstance(connector, PushProducer):
            produced = connector.poll()
            self._connected(produced.handshakes)
            for sent in produced.sent:
                self._sent(sent)
            for request_id in produced.expired:
                tracked = self._requests.get(request_id)
                if tracked is None or tracked.state == "pending":
                    self.metrics.lease_expiries.inc()
                self._fail(
                    Failure.of(
                        request_id, LeaseExpired("no decoder took the blocks before the lease expired")
                    )
                )
            for failure in produced.failed:
                self._fail(failure)
            for request_id in produced.registered:
                _event(logging.DEBUG, "decoder registered", request_id=request_id)
        elif isinstance(connector, PushConsumer):
            consumed = connector.poll()
            self._connected(consumed.handshakes)
            now = time.monotonic()
            for request_id in consumed.finished:
                tracked = self._requests.get(request_id)
                seconds = now - tracked.started if tracked else 0.0
                self.metrics.transfers.labels("received").inc()
                self._finish(request_id, "ready", KVReady(request_id, seconds))
                _event(logging.INFO, "KV ready", request_id=request_id, seconds=round(seconds, 6))
            for failure in consumed.failed:
                self._fail(failure)
        else:
            return
        for engine_id, reason in connector.take_evictions():
            self.metrics.peer_evictions.labels(reason).inc()
            self._forget_pair(engine_id)
            _event(logging.INFO, "peer engine evicted", engine_id=engine_id, reason=reason)
        self.metrics.peer_engines.set(len(connector.connected_engines))

    def _connected(self, handshakes: Sequence[Handshake]) -> None:
        for handshake in handshakes:
            seconds = handshake.done_at - handshake.started_at
            self._handshake_latency.observe(seconds)
            lanes = tuple(
                dict.fromkeys(lane for agent in handshake.agents for lane in self.transport.lanes(agent))
            )
            if self.config.role == "prefill":
                self._pair_transport(handshake.engine_id, lanes)
            _event(
                logging.INFO,
                "peer engine connected",
                engine_id=handshake.engine_id,
                agents=list(handshake.agents),
                seconds=round(seconds, 6),
                lanes=list(lanes),
            )

    def _pair_transport(self, decode_engine_id: str, lanes: tuple[str, ...]) -> None:
        """The pair's transport as UCX chose it, in the ledger the peer report reads and in the metric."""
        stats = self.pairs.connected(decode_engine_id, lanes)
        old = self._transport_labels.pop(decode_engine_id, None)
        if old is not None:
            self.metrics.transport_info.remove(self.config.engine_id, decode_engine_id, *old)
        labels = (stats.transport or "unknown", ",".join(lanes))
        self._transport_labels[decode_engine_id] = labels
        self.metrics.transport_info.labels(self.config.engine_id, decode_engine_id, *labels).set(1)

    def _forget_pair(self, engine_id: str) -> None:
        self.pairs.forget(engine_id)
        old = self._transport_labels.pop(engine_id, None)
        if old is None:
            return
        self.metrics.transport_info.remove(self.config.engine_id, engine_id, *old)
        for metric in (self.metrics.pair_bytes, self.metrics.pair_seconds, self.metrics.pair_bandwidth):
            with contextlib.suppress(KeyError):
                metric.remove(self.config.engine_id, engine_id)

    def _sent(self, sent: Sent) -> None:
        seconds = sent.done_at - sent.posted_at
        self.metrics.bytes_pushed.inc(sent.nbytes)
        stats = self.pairs.sent(sent.decode_engine_id, sent.nbytes, seconds)
        pair = (self.config.engine_id, sent.decode_engine_id)
        self.metrics.pair_bytes.labels(*pair).inc(sent.nbytes)
        self.metrics.pair_seconds.labels(*pair).inc(max(seconds, 0.0))
        self.metrics.pair_bandwidth.labels(*pair).set(stats.last_gbps)
        self.metrics.transfers.labels("sent").inc()
        self._finish(sent.request_id, "sent", KVSent(sent.request_id, sent.nbytes, seconds))
        _event(
            logging.INFO,
            "KV sent",
            request_id=sent.request_id,
            decode_engine_id=sent.decode_engine_id,
            decode_request_id=sent.decode_request_id,
            bytes=sent.nbytes,
            seconds=round(seconds, 6),
            transport=stats.transport,
            gbps=round(stats.last_gbps, 3),
        )

    def _fail(self, failure: Failure) -> None:
        tracked = self._requests.get(failure.request_id)
        if tracked is not None and tracked.state != "pending":
            # Its blocks' lease ending after the push failed: the engine was told once, already.
            _event(logging.DEBUG, "blocks released", request_id=failure.request_id, reason=failure.reason)
            return
        self.metrics.failures.labels(failure.reason).inc()
        _event(
            logging.WARNING,
            "KV transfer failed",
            request_id=failure.request_id,
            reason=failure.reason,
            error=failure.message,
        )
        if tracked is not None:
            tracked.reason, tracked.message = failure.reason, failure.message
        self._finish(
            failure.request_id, "failed", KVFailed(failure.request_id, failure.reason, failure.message)
        )

    def _finish(self, request_id: str, state: RequestState, event: KVReady | KVSent | KVFailed) -> None:
        """The request's one terminal event: a later outcome of the same request (a lease that expires after
        its push failed) is not told again."""
        tracked = self._requests.get(request_id)
        if tracked is None or tracked.state != "pending":
            return
        self._pending -= 1
        tracked.state = state
        tracked.conn.send(event)

    # -- shutdown --------------------------------------------------------------------------------------------

    def stop(self, signum: int | None = None, frame: FrameType | None = None) -> None:
        self.stopping.set()

    def close(self) -> None:
        _event(logging.INFO, "sidecar stopping", pending_requests=self._pending)
        if self.peer_reporter is not None:
            self.peer_reporter.stop()
        self.engine_socket.stop()
        self.republisher.stop()
        self.side_channel.stop()
        if self._connector is not None:
            self._connector.close()
        self.transport.close()
        if self._pool is not None:
            self._pool.close()
        self.http.stop()
        _event(logging.INFO, "sidecar stopped, NIXL agent released")
