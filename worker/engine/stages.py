"""A PP prefill engine's stages, coordinated over one torch.distributed gloo group; the head drives.

Every stage is a process with its own layers, KV pool and sidecar; stage 0 (the head) also serves HTTP and
owns the engine's one block scheduler. All gloo traffic runs on one thread per process, in lockstep, and
only the head starts an exchange. It sends each other stage a frame (an int64 length, then msgpack bytes):

- `Prefill(request_id, token_ids, block_ids)`: every stage runs its layers, stage r's activations go to
  stage r+1, the last stage sends the first token (int64) back to the head; then every stage tells its own
  sidecar `RequestFinished` for its own layers' KV.
- `Poll`: every stage answers with a frame of the `StageReport`s gathered since the last poll (each of its
  sidecar's `KVSent`/`KVFailed`, or a refused `RequestFinished`), so the head returns a prefill's ids only
  once every stage is done with them. The head polls often while a prefill holds blocks, and every
  `IDLE_POLL_S` otherwise, which is also how a stage notices a head that is gone (its receive times out).
- `Quit`: the stage leaves the group and exits.

A broken group (a stage or the head gone) is fatal to every stage: they restart and join again together.

`prefill_step` is one stage's part of a prefill in a joined group: the one step every PP prefill runs (the
engine's stages here, the data-path demo's and `pp`'s stage processes).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import threading
from collections.abc import Callable, Sequence

import msgspec
import torch
import torch.distributed as dist

from disagg.worker.engine.kv_cache import BlockTables, PagedKVCache
from disagg.worker.engine.model import TinyModel
from disagg.worker.kv.errors import DisaggError
from disagg.worker.link.engine_link import EngineLink, Event, KVFailed, KVSent

log = logging.getLogger(__name__)

IDLE_POLL_S = 1.0
BUSY_POLL_S = 0.02
GROUP_TIMEOUT_S = 60.0
"""How long any one exchange may wait; a stage hears from its head at least every `IDLE_POLL_S`."""
_HEAD = 0


class Prefill(msgspec.Struct, frozen=True, tag="prefill"):
    request_id: str
    token_ids: list[int]
    block_ids: list[list[int]]
    """One list per KV cache group, in group order."""


class Poll(msgspec.Struct, frozen=True, tag="poll"):
    pass


class Quit(msgspec.Struct, frozen=True, tag="quit"):
    pass


class StageReport(msgspec.Struct, frozen=True):
    stage: int
    request_id: str
    ok: bool
    reason: str = ""


Command = Prefill | Poll | Quit
_COMMANDS = msgspec.msgpack.Decoder(Command)
_REPORTS = msgspec.msgpack.Decoder(list[StageReport])
_ENCODER = msgspec.msgpack.Encoder()


def join(
    master_addr: str, master_port: int, rank: int, world: int, *, timeout_s: float = GROUP_TIMEOUT_S
) -> None:
    """Join the engine's gloo group (blocks until every stage has)."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def leave() -> None:
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _send_frame(data: bytes, dst: int) -> None:
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=dst)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=dst)


def _recv_frame(src: int) -> bytes:
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src)
    if int(size) == 0:
        return b""
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(data, src=src)
    return data.numpy().tobytes()


def prompt_block_ids(tables: BlockTables, num_tokens: int, block_size: int) -> list[list[int]]:
    """The blocks holding a prompt's KV, one list per group: what `RequestFinished` and the response name."""
    blocks = math.ceil(num_tokens / block_size)
    return [tables[group][:blocks] for group in sorted(tables)]


def prefill_step(
    model: TinyModel,
    kv: PagedKVCache,
    rank: int,
    world: int,
    token_ids: Sequence[int],
    tables: BlockTables,
) -> int | None:
    """Stage `rank` of `world`'s part of one prefill, in the joined group: receive the previous stage's
    activations, run this stage's layers, pass the activations on.

    Writes only this stage's layers' KV into `kv` (a cache laid out for this stage). Returns the first
    generated token on the last stage, None on the others.
    """
    layers = model.config.stages(world)[rank]
    hidden_in = None
    if rank > 0:
        hidden_in = torch.empty(len(token_ids), model.config.hidden_size, dtype=torch.float32)
        dist.recv(hidden_in, src=rank - 1)
    out = model.prefill(token_ids, kv, tables, layers=layers, hidden_in=hidden_in)
    if rank < world - 1:
        dist.send(out.contiguous(), dst=rank + 1)
        return None
    return int(torch.argmax(out[-1]))


class PipelineHead:
    """Stage 0's side of the group; every method runs on the head's model thread."""

    def __init__(self, model: TinyModel, kv: PagedKVCache, world: int) -> None:
        self.model = model
        self.kv = kv
        self.world = world

    def prefill(self, request_id: str, token_ids: Sequence[int], tables: BlockTables) -> int:
        job = Prefill(request_id, list(token_ids), [tables[g] for g in sorted(tables)])
        frame = _ENCODER.encode(job)
        for stage in range(1, self.world):
            _send_frame(frame, stage)
        first = prefill_step(self.model, self.kv, _HEAD, self.world, job.token_ids, tables)
        if first is not None:
            return first
        token = torch.empty(1, dtype=torch.int64)
        dist.recv(token, src=self.world - 1)
        return int(token)

    def poll(self) -> list[StageReport]:
        frame = _ENCODER.encode(Poll())
        reports: list[StageReport] = []
        for stage in range(1, self.world):
            _send_frame(frame, stage)
        for stage in range(1, self.world):
            reports.extend(_REPORTS.decode(_recv_frame(stage)))
        return reports

    def quit(self) -> None:
        frame = _ENCODER.encode(Quit())
        for stage in range(1, self.world):
            with contextlib.suppress(Exception):
                _send_frame(frame, stage)


class StageReports:
    """A headless stage's sidecar outcomes, gathered by the link's event thread until the head polls."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self._lock = threading.Lock()
        self._reports: list[StageReport] = []

    def add(self, request_id: str, ok: bool, reason: str = "") -> None:
        with self._lock:
            self._reports.append(StageReport(self.stage, request_id, ok, reason))

    def on_event(self, event: Event) -> None:
        if isinstance(event, KVSent):
            self.add(event.request_id, True)
        elif isinstance(event, KVFailed):
            self.add(event.request_id, False, event.reason)

    def take(self) -> list[StageReport]:
        with self._lock:
            reports, self._reports = self._reports, []
        return reports


def run_headless(
    model: TinyModel,
    kv: PagedKVCache,
    link: EngineLink,
    rank: int,
    world: int,
    reports: StageReports,
    on_prefill: Callable[[], None] = lambda: None,
) -> None:
    """A stage other than the head: serve the head's commands until `Quit` (a broken group raises)."""
    while True:
        command = _COMMANDS.decode(_recv_frame(_HEAD))
        if isinstance(command, Quit):
            return
        if isinstance(command, Poll):
            _send_frame(_ENCODER.encode(reports.take()), _HEAD)
            continue
        tables = dict(enumerate(command.block_ids))
        first = prefill_step(model, kv, rank, world, command.token_ids, tables)
        if first is not None:  # the last stage: the head answers with its first token
            dist.send(torch.tensor([first], dtype=torch.int64), dst=_HEAD)
        on_prefill()
        blocks = prompt_block_ids(tables, len(command.token_ids), model.config.block_size)
        try:
            link.request_finished(command.request_id, blocks)
        except DisaggError as exc:
            log.warning("sidecar refused RequestFinished for %s: %s", command.request_id, exc)
            reports.add(command.request_id, False, exc.reason)
