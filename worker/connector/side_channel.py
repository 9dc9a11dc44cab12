"""The handshake side channel, framed exactly like vLLM's NIXL connector.

Server (vLLM's `_nixl_handshake_listener`): one ZMQ ROUTER socket per engine serves the pre-encoded handshake
payload of every worker of the engine, keyed by `(pp_rank, tp_rank)`. A request is
`msgpack((b"get_meta_msg", pp_rank, tp_rank))`; the reply is
`[identity, b"", payload, msgpack(perf_counter)]`.

Client (vLLM's `_nixl_handshake`): one REQ socket asks for each target `(pp_rank, tp_rank)` in turn and
estimates the clock offset of the peer from the reply's timestamp. Decoding follows vLLM's two phases (hash,
then metadata) in `disagg.worker.kv.wire`; nothing here touches NIXL, so every refusal happens before an agent
could be added.

What vLLM leaves undefined is made explicit: a request for a rank the engine does not have, or a malformed
request, gets an empty payload frame (so a REQ client is never left hanging, and sees a typed refusal), and
the server keeps serving: no exception from one message ends the serving thread. The server's socket refuses
a request frame over `wire.MAX_SIDE_CHANNEL_REQUEST_BYTES` before buffering it (ZMQ drops that connection),
so a half-sent frame pins at most that much.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from disagg.worker.kv import wire
from disagg.worker.kv.errors import HandshakeError, PeerUnreachable, WireFormatError

log = logging.getLogger(__name__)

DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0
_SERVER_POLL_MS = 200


def handshake_target_tp_ranks(local_tp_size: int, local_tp_rank: int, remote_tp_size: int) -> list[int]:
    """The remote TP ranks a local rank talks to (vLLM's `TransferTopology.handshake_target_ranks`)."""
    if local_tp_size < 1 or remote_tp_size < 1 or not 0 <= local_tp_rank < local_tp_size:
        raise ValueError(f"bad TP sizes/rank: local {local_tp_rank}/{local_tp_size}, remote {remote_tp_size}")
    big, small = max(local_tp_size, remote_tp_size), min(local_tp_size, remote_tp_size)
    if big % small:
        raise ValueError(f"TP sizes {local_tp_size} and {remote_tp_size} must divide one another")
    if local_tp_size >= remote_tp_size:
        return [local_tp_rank // (local_tp_size // remote_tp_size)]
    ratio = remote_tp_size // local_tp_size
    return [local_tp_rank * ratio + i for i in range(ratio)]


def handshake_targets(
    local_tp_size: int, local_tp_rank: int, remote_tp_size: int, remote_pp_size: int
) -> list[tuple[int, int]]:
    """Every remote `(pp_rank, tp_rank)` to handshake: all PP stages times the TP ranks the ratio selects."""
    tp_ranks = handshake_target_tp_ranks(local_tp_size, local_tp_rank, remote_tp_size)
    return [(pp, tp) for pp in range(remote_pp_size) for tp in tp_ranks]


def _socket_options(sock: zmq.Socket[Any], max_message_bytes: int = wire.MAX_MESSAGE_BYTES) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)


class SideChannelServer:
    """A ROUTER thread serving pre-encoded handshake payloads by `(pp_rank, tp_rank)`."""

    def __init__(self, host: str, port: int, payloads: Mapping[tuple[int, int], bytes] | None = None) -> None:
        self.host = host
        self.port = port
        self._payloads: dict[tuple[int, int], bytes] = dict(payloads or {})
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name=f"side-channel-{port}", daemon=True)
        self.served = 0
        self.rejected = 0
        self.refusals: Counter[str] = Counter()
        """Refused messages by reason: MalformedFrame, MalformedRequest, UnknownRank, InternalError."""

    @property
    def alive(self) -> bool:
        """The serving thread runs (readiness reports a dead one)."""
        return self._thread.is_alive() and not self._stop.is_set()

    def set_payload(self, pp_rank: int, tp_rank: int, payload: bytes) -> None:
        if len(payload) > wire.MAX_MESSAGE_BYTES:
            raise ValueError(
                f"payload of {len(payload)} bytes is over the {wire.MAX_MESSAGE_BYTES}-byte limit"
            )
        with self._lock:
            self._payloads[(pp_rank, tp_rank)] = payload

    def start(self, timeout_s: float = 10.0) -> SideChannelServer:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise PeerUnreachable(f"side channel on {self.host}:{self.port} did not start in {timeout_s} s")
        if self._error is not None:
            raise PeerUnreachable(f"side channel cannot bind {self.host}:{self.port}: {self._error}")
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def __enter__(self) -> SideChannelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self) -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            sock = ctx.socket(zmq.ROUTER)
            _socket_options(sock, wire.MAX_SIDE_CHANNEL_REQUEST_BYTES)
            try:
                sock.bind(f"tcp://{self.host}:{self.port}")
            except zmq.ZMQError as exc:
                self._error = exc
                return
            finally:
                self._ready.set()
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            while not self._stop.is_set():
                if not poller.poll(_SERVER_POLL_MS):
                    continue
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                try:
                    reply = self._answer(frames)
                except Exception as exc:
                    # A bug or an exhausted resource while answering one message: refuse that one, serve on.
                    reply = (
                        None if len(frames) != 3 else [frames[0], b"", b"", wire.encode_reply_timestamp(0.0)]
                    )
                    self._refuse("InternalError", f"{type(exc).__name__}: {wire.clip(str(exc))}")
                if reply is not None:
                    try:
                        sock.send_multipart(reply, zmq.NOBLOCK)
                    except zmq.ZMQError as exc:
                        # The client went away (or its queue is full): the reply is lost, not the server.
                        log.debug("side channel: reply not sent: %s", exc)
        finally:
            ctx.destroy(linger=0)

    def _answer(self, frames: list[bytes]) -> list[bytes] | None:
        # A REQ client sends [identity, b"", request]; anything else has no return path a REQ would accept.
        if len(frames) != 3 or frames[1] != b"":
            self._refuse("MalformedFrame", f"dropped a {len(frames)}-frame message")
            return None
        identity, _, request = frames
        payload = b""
        try:
            decoded = wire.decode_side_channel_request(request)
        except WireFormatError as exc:
            self._refuse("MalformedRequest", f"refused a request: {exc}")
        else:
            if decoded.str_msg:
                log.warning("side channel: request tag sent as str, answering anyway as vLLM does")
            with self._lock:
                found = self._payloads.get((decoded.pp_rank, decoded.tp_rank))
            if found is None:
                self._refuse("UnknownRank", f"no worker (pp {decoded.pp_rank}, tp {decoded.tp_rank}) here")
            else:
                payload = found
                self.served += 1
        return [identity, b"", payload, wire.encode_reply_timestamp(time.perf_counter())]

    def _refuse(self, reason: str, message: str) -> None:
        self.rejected += 1
        self.refusals[reason] += 1
        # A flood of garbage must not flood the log: the first of each reason, then every 1000th.
        if self.refusals[reason] % 1000 == 1:
            log.warning(
                "side channel %s:%d: %s (%s; %d so far)",
                self.host,
                self.port,
                wire.clip(message),
                reason,
                self.refusals[reason],
            )


@dataclass(frozen=True)
class RankReply:
    """The raw reply of one remote worker and the estimated offset of its clock from ours."""

    pp_rank: int
    tp_rank: int
    payload: bytes
    clock_offset_s: float


def fetch_payloads(
    host: str,
    port: int,
    targets: Iterable[tuple[int, int]],
    *,
    timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
) -> list[RankReply]:
    """Ask a side channel for each target's payload; raises PeerUnreachable or HandshakeError, never hangs."""
    replies = []
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        _socket_options(sock)
        timeout_ms = max(1, int(timeout_s * 1000))
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
        sock.connect(f"tcp://{host}:{port}")
        for pp_rank, tp_rank in targets:
            t_send = time.perf_counter()
            try:
                sock.send(wire.encode_side_channel_request(pp_rank, tp_rank))
                frames = sock.recv_multipart()
            except zmq.Again:
                raise PeerUnreachable(
                    f"side channel {host}:{port} did not answer for (pp {pp_rank}, tp {tp_rank}) "
                    f"within {timeout_s} s"
                ) from None
            t_recv = time.perf_counter()
            if len(frames) != 2:
                raise WireFormatError(f"side channel {host}:{port} replied with {len(frames)} frames, not 2")
            payload, ts_frame = frames
            if not payload:
                raise HandshakeError(
                    f"side channel {host}:{port} has no worker (pp {pp_rank}, tp {tp_rank}) "
                    "or refused the request"
                )
            remote_ts = wire.decode_reply_timestamp(ts_frame)
            replies.append(RankReply(pp_rank, tp_rank, payload, remote_ts - (t_send + t_recv) / 2))
    finally:
        ctx.destroy(linger=0)
    return replies


@dataclass(frozen=True)
class PeerHandshake:
    """The decoded, checked metadata of one remote worker."""

    pp_rank: int
    tp_rank: int
    metadata: wire.NixlAgentMetadata
    clock_offset_s: float


def handshake(
    host: str,
    port: int,
    targets: Sequence[tuple[int, int]],
    *,
    expected_hash: str | None,
    expected_engine_id: str | None,
    local_factors: Mapping[str, Any] | None = None,
    timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
    observe: Callable[[RankReply], None] | None = None,
) -> list[PeerHandshake]:
    """Fetch and decode (hash first, then metadata, then engine id) every target's payload; `observe` sees
    each reply before its checks, so a caller learns what a refused peer advertised."""
    out = []
    for reply in fetch_payloads(host, port, targets, timeout_s=timeout_s):
        if observe is not None:
            observe(reply)
        metadata = wire.decode_handshake_payload(
            reply.payload,
            expected_hash=expected_hash,
            local_factors=local_factors,
            expected_engine_id=expected_engine_id,
        )
        out.append(PeerHandshake(reply.pp_rank, reply.tp_rank, metadata, reply.clock_offset_s))
    return out
