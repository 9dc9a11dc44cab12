"""The local socket between an engine and its sidecar: msgspec messages, framing, and the engine's client.

Transport: a Unix domain stream socket (the sidecar listens at `DISAGG_ENGINE_SOCKET`, a path on the
pod's shared `/dev/shm` volume). Each frame is a 4-byte big-endian length followed by one msgpack-encoded
message; messages are a tagged union (`msgspec.Struct`, `tag_field="type"`), so either side can name what it
got without guessing.

Engine -> sidecar (every one gets exactly one reply, in order):
- `RegisterLayout`: the engine's KV pool (a shared-memory file; `pool` is a tagged union so a CUDA IPC
  handle can take its place on GPU nodes) and the layout it laid out in it. The sidecar checks it against its
  own configuration, maps the pool and registers it with NIXL. Reply `Ack` or `Error`.
- `RequestFinished` (prefill): a request's KV is complete in these logical blocks, one list per KV cache
  group. Reply `Ack`; later a `KVSent` or `KVFailed` event on the same connection.
- `ExpectRequest` (decode): KV for this request will be pushed into these blocks by that prefill engine.
  Reply `Ack`; later a `KVReady` or `KVFailed` event on the same connection.
- `QueryRequest`: the state of a request this sidecar was told about. Reply `RequestStatus` or `Error`.
- `CancelRequest` (decode): the engine gave up an expected request (its client went away). The sidecar stops
  waiting for its KV (a completion that still comes is ignored) and replies `RequestStatus`: `cancelled`
  when it was still pending, and then no event follows, else the terminal state whose event was already
  sent. `registered` says whether the prefill was told the blocks: then it may still write them until its
  lease ends, and the engine frees them only then; else at once. A request it was never told about gets
  `Error(UnknownRequest)`.

Sidecar -> engine: replies `Ack`, `Error(reason, message)`, `RequestStatus`; events `KVReady`, `KVSent`,
`KVFailed(reason, message)`, pushed whenever they happen (the client sorts events from replies). An
acknowledged request gets exactly one of them; a frame that is no message gets an `Error` in its turn.

Both ends of the protocol (messages, framing, the engine's client) stay in this one module of some 450 lines,
so that they change together; an engine needs this module (and the KV pool) and nothing of the sidecar
package, which serves the protocol (`disagg.worker.sidecar.engine_socket`).
"""

from __future__ import annotations

import contextlib
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Literal

import msgspec

from disagg.worker.kv import errors
from disagg.worker.kv.errors import DisaggError, EngineProtocolError
from disagg.worker.kv.layout import AttentionKind, ModelGeometry, StageLayout
from disagg.worker.kv.wire import clip

MAX_FRAME_BYTES = 16 * 1024 * 1024
FRAME_TIMEOUT_S = 30.0
"""How long the rest of a frame may take once its header arrived: a half-sent frame is not held forever."""
MAX_ID_CHARS = 1024
"""Request and engine ids longer than this are refused (they travel in notifs, logs and metrics)."""
_HEADER = struct.Struct(">I")
RequestState = Literal["pending", "sent", "ready", "failed", "cancelled"]


class _Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type"):
    pass


class ModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The model geometry the KV layout depends on (`disagg.worker.kv.layout.ModelGeometry`)."""

    layer_kinds: list[str]
    num_kv_heads: int
    head_size: int
    dtype_bytes: int
    layer_name_template: str
    hma: bool

    @classmethod
    def of(cls, geometry: ModelGeometry) -> ModelSpec:
        return cls(
            [kind.value for kind in geometry.kinds],
            geometry.num_kv_heads,
            geometry.head_size,
            geometry.dtype_bytes,
            geometry.layer_name_template,
            geometry.hma,
        )

    def geometry(self) -> ModelGeometry:
        try:
            kinds = tuple(AttentionKind(kind) for kind in self.layer_kinds)
        except ValueError as exc:
            raise EngineProtocolError(f"model: {exc}") from None
        return ModelGeometry(
            kinds, self.num_kv_heads, self.head_size, self.dtype_bytes, self.layer_name_template, self.hma
        )


class RegionSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One region of the engine's pool as the engine laid it out (byte offsets from the pool's start)."""

    members: list[str]
    offset: int
    block_len: int
    block_stride: int
    num_blocks: int


class ShmPoolRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="shm", tag_field="kind"):
    """A KV pool in a shared-memory file that engine and sidecar both map."""

    path: str
    nbytes: int


PoolRef = ShmPoolRef
"""Where the pool lives; a `CudaIpcPoolRef` (IPC handle, device) joins this union on GPU nodes."""


class PrefillEngine(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The prefill engine that will push a request's KV: its side channel and parallel layout."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    pp_size: int = 1


class RegisterLayout(_Message, frozen=True, tag="register_layout"):
    engine_id: str
    role: str
    model: ModelSpec
    pp_rank: int
    pp_size: int
    tp_rank: int
    tp_size: int
    block_size: int
    """Logical block size in tokens."""
    kernel_block_size: int
    num_blocks: int
    """Logical blocks per region."""
    packed: bool
    layer_start: int
    layer_stop: int
    regions: list[RegionSpec]
    pool: PoolRef


class RequestFinished(_Message, frozen=True, tag="request_finished"):
    request_id: str
    block_ids: list[list[int]]


class ExpectRequest(_Message, frozen=True, tag="expect_request"):
    request_id: str
    block_ids: list[list[int]]
    prefill: PrefillEngine


class QueryRequest(_Message, frozen=True, tag="query_request"):
    request_id: str


class CancelRequest(_Message, frozen=True, tag="cancel_request"):
    request_id: str


class Ack(_Message, frozen=True, tag="ack"):
    pass


class Error(_Message, frozen=True, tag="error"):
    reason: str
    message: str


class RequestStatus(_Message, frozen=True, tag="request_status"):
    request_id: str
    state: RequestState
    reason: str = ""
    message: str = ""
    registered: bool = False
    """A `cancelled` request's registration had reached its prefill, which may still write the blocks until
    its lease on the KV ends: the engine keeps them until then."""


class KVReady(_Message, frozen=True, tag="kv_ready"):
    """Every prefill worker's KV for the request has arrived in the decoder's blocks."""

    request_id: str
    seconds: float
    """From the sidecar accepting `ExpectRequest` to the last completion notification."""


class KVSent(_Message, frozen=True, tag="kv_sent"):
    """This worker's KV for the request is in the decoder's blocks; the engine may free the blocks."""

    request_id: str
    bytes: int
    seconds: float
    """From the first WRITE posted for the request to the last one done."""


class KVFailed(_Message, frozen=True, tag="kv_failed"):
    request_id: str
    reason: str
    message: str


EngineMessage = RegisterLayout | RequestFinished | ExpectRequest | QueryRequest | CancelRequest
Reply = Ack | Error | RequestStatus
Event = KVReady | KVSent | KVFailed
SidecarMessage = Ack | Error | RequestStatus | KVReady | KVSent | KVFailed

_ENCODER = msgspec.msgpack.Encoder()
_ENGINE_DECODER = msgspec.msgpack.Decoder(EngineMessage)
_SIDECAR_DECODER = msgspec.msgpack.Decoder(SidecarMessage)


def encode_frame(message: EngineMessage | SidecarMessage) -> bytes:
    body = _ENCODER.encode(message)
    return _HEADER.pack(len(body)) + body


def decode_engine_message(body: bytes) -> EngineMessage:
    try:
        message: EngineMessage = _ENGINE_DECODER.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise EngineProtocolError(f"not an engine message: {clip(str(exc))}") from None
    return message


def decode_sidecar_message(body: bytes) -> SidecarMessage:
    try:
        message: SidecarMessage = _SIDECAR_DECODER.decode(body)
    except msgspec.DecodeError as exc:
        raise EngineProtocolError(f"not a sidecar message: {exc}") from None
    return message


def _readable(sock: socket.socket, timeout_s: float) -> bool:
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(max(1, int(timeout_s * 1000))))


def _recv_exact(sock: socket.socket, size: int, deadline: float | None = None) -> bytes | None:
    chunks, got = [], 0
    while got < size:
        if deadline is not None:
            # poll, not a socket timeout: the socket stays blocking for the thread that writes to it.
            left = deadline - time.monotonic()
            if left <= 0 or not _readable(sock, left):
                raise EngineProtocolError(f"a frame stalled after {got} of {size} bytes")
        chunk = sock.recv(min(size - got, 1 << 20))
        if not chunk:
            if got:
                raise EngineProtocolError(f"connection closed inside a frame ({got} of {size} bytes)")
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket, frame_timeout_s: float | None = None) -> bytes | None:
    """The next frame's body, or None at a clean end of stream; an oversized frame is refused unread, and
    with `frame_timeout_s` so is one whose rest does not arrive within that time of its first byte."""
    header = _recv_exact(sock, 1)
    if header is None:
        return None
    deadline = None if frame_timeout_s is None else time.monotonic() + frame_timeout_s
    header += _recv_exact(sock, _HEADER.size - 1, deadline) or b""
    if len(header) < _HEADER.size:
        raise EngineProtocolError("connection closed inside a frame header")
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise EngineProtocolError(f"frame of {size} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    body = _recv_exact(sock, size, deadline)
    if body is None:
        raise EngineProtocolError(f"connection closed before a {size}-byte frame")
    return body


def register_layout_message(
    *,
    engine_id: str,
    role: str,
    geometry: ModelGeometry,
    stage: StageLayout,
    tp_rank: int,
    num_blocks: int,
    pool_path: str,
    pool_bytes: int,
    packed: bool = False,
) -> RegisterLayout:
    """What an engine sends for the stage layout it built its cache from (logical `num_blocks`)."""
    return RegisterLayout(
        engine_id=engine_id,
        role=role,
        model=ModelSpec.of(geometry),
        pp_rank=stage.pp_rank,
        pp_size=stage.pp_size,
        tp_rank=tp_rank,
        tp_size=stage.tp_size,
        block_size=stage.block_size * stage.physical_blocks_per_logical,
        kernel_block_size=stage.block_size,
        num_blocks=num_blocks,
        packed=packed,
        layer_start=stage.layers.start,
        layer_stop=stage.layers.stop,
        regions=[
            RegionSpec(list(r.members), r.offset, r.block_len, r.block_stride, r.num_blocks)
            for r in stage.regions
        ],
        pool=ShmPoolRef(pool_path, pool_bytes),
    )


def _error_types() -> dict[str, type[DisaggError]]:
    found: dict[str, type[DisaggError]] = {}
    for value in vars(errors).values():
        if isinstance(value, type) and issubclass(value, DisaggError) and value is not DisaggError:
            error_type: type[DisaggError] = value
            found[error_type.reason] = error_type
    return found


_ERROR_TYPES = _error_types()


def error_of(reason: str, message: str) -> DisaggError:
    """The typed error for a reason the sidecar sent (the shared errors module's class where one exists)."""
    cls = _ERROR_TYPES.get(reason)
    if cls is None:
        return DisaggError(message, reason=reason)
    return cls(message, reason=reason)


def _status(reply: Reply) -> RequestStatus:
    if not isinstance(reply, RequestStatus):
        raise EngineProtocolError(f"expected a request status, got {type(reply).__name__}")
    return reply


class EngineLink:
    """The engine's end of the socket: one call at a time (thread-safe), events queued as they arrive."""

    def __init__(self, path: str, *, connect_timeout_s: float = 30.0, reply_timeout_s: float = 60.0) -> None:
        self.path = path
        self.reply_timeout_s = reply_timeout_s
        deadline = time.monotonic() + connect_timeout_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                sock.close()
                if time.monotonic() > deadline:
                    raise errors.PeerUnreachable(
                        f"no sidecar listens on {path} after {connect_timeout_s} s: {exc}"
                    ) from None
                time.sleep(0.05)
        self._sock = sock
        self._call_lock = threading.Lock()
        self._replies: queue.Queue[Reply | None] = queue.Queue()
        self._events: queue.Queue[Event | None] = queue.Queue()
        self._pending: dict[str, Event] = {}
        self._closed = False
        self._lost: str = "closed the connection"
        self._reader = threading.Thread(target=self._read, name="engine-link-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while True:
                body = read_frame(self._sock)
                if body is None:
                    break
                message = decode_sidecar_message(body)
                if isinstance(message, KVReady | KVSent | KVFailed):
                    self._events.put(message)
                else:
                    self._replies.put(message)
        except (OSError, DisaggError) as exc:
            # Kept for the caller: the reader thread has no one else to tell why the link is gone.
            if not self._closed:
                self._lost = f"broke the connection: {type(exc).__name__}: {exc}"
        finally:
            self._replies.put(None)
            self._events.put(None)

    def call(self, message: EngineMessage) -> Reply:
        """Send one message and return its reply; an `Error` reply raises its typed error."""
        with self._call_lock:
            if self._closed:
                raise EngineProtocolError("the link to the sidecar is closed")
            try:
                self._sock.sendall(encode_frame(message))
            except OSError as exc:
                raise errors.PeerUnreachable(f"could not send to the sidecar on {self.path}: {exc}") from exc
            try:
                reply = self._replies.get(timeout=self.reply_timeout_s)
            except queue.Empty:
                raise errors.PeerUnreachable(
                    f"the sidecar on {self.path} did not answer within {self.reply_timeout_s} s"
                ) from None
        if reply is None:
            self._replies.put(None)
            raise errors.PeerUnreachable(f"the sidecar on {self.path} {self._lost}")
        if isinstance(reply, Error):
            raise error_of(reply.reason, reply.message)
        return reply

    def register_layout(self, message: RegisterLayout) -> None:
        self.call(message)

    def request_finished(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> None:
        self.call(RequestFinished(request_id, [list(ids) for ids in block_ids]))

    def expect_request(
        self, request_id: str, block_ids: Sequence[Sequence[int]], prefill: PrefillEngine
    ) -> None:
        self.call(ExpectRequest(request_id, [list(ids) for ids in block_ids], prefill))

    def query(self, request_id: str) -> RequestStatus:
        return _status(self.call(QueryRequest(request_id)))

    def cancel_request(self, request_id: str) -> RequestStatus:
        """Stop the sidecar waiting for an expected request's KV; the status says whether an event still
        comes (`cancelled`: none will)."""
        return _status(self.call(CancelRequest(request_id)))

    def next_event(self, timeout_s: float) -> Event | None:
        """The next event, or None if none comes within the timeout."""
        try:
            event = self._events.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if event is None:
            self._events.put(None)
            raise errors.PeerUnreachable(f"the sidecar on {self.path} {self._lost}")
        return event

    def wait(self, request_id: str, timeout_s: float) -> KVReady | KVSent:
        """Block until the request's KV is ready (decode) or sent (prefill); `KVFailed` raises its error."""
        deadline = time.monotonic() + timeout_s
        while request_id not in self._pending:
            left = deadline - time.monotonic()
            event = self.next_event(max(0.0, left)) if left > 0 else None
            if event is None:
                raise errors.TransferFailed(f"no KV event for request {request_id} within {timeout_s} s")
            self._pending[event.request_id] = event
        event = self._pending.pop(request_id)
        if isinstance(event, KVFailed):
            raise error_of(event.reason, f"request {request_id}: {event.message}")
        return event

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._reader.join(timeout=5)

    def __enter__(self) -> EngineLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
