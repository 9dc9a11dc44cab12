"""Which request holds which KV block ids, and until what: the engine's block bookkeeping. No I/O, no clock.

One scheduler per engine decides block ids for every PP stage (vLLM's single scheduler): a prefill's ids are
the same on each stage, so they return to the pool only when every stage's sidecar has reported the push
done (`KVSent`) or given up (`KVFailed`: lease expired, push failed). A decode leg's ids are held from
`ExpectRequest` until the sidecar's terminal event, or, when the client is gone, until the sidecar has
answered `CancelRequest` (it no longer expects the KV) and no prefill may still write them. Not thread-safe:
the engine calls it from its model thread only, which also runs every model step, so ids return to the pool
only after any step that used them is done.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from disagg.worker.engine.kv_cache import BlockPool, BlockTables, allocate_block_tables
from disagg.worker.kv.errors import DuplicateRequest

State = Literal["prefilling", "held_for_push", "awaiting_kv", "decoding", "running"]
STATES: tuple[State, ...] = ("prefilling", "held_for_push", "awaiting_kv", "decoding", "running")


@dataclass
class _Entry:
    tables: BlockTables
    state: State
    waiting_on: set[int] = field(default_factory=set)
    """PP stages whose terminal KV event is still to come (prefill)."""


class BlockScheduler:
    def __init__(self, pool: BlockPool, num_blocks: int, num_groups: int, block_size: int) -> None:
        self._pool = pool
        self.num_blocks = num_blocks
        self.num_groups = num_groups
        self.block_size = block_size
        self._entries: dict[str, _Entry] = {}

    @property
    def usable_blocks(self) -> int:
        """Ids the pool can hand out (the null block never is)."""
        return self.num_blocks - 1

    @property
    def free_blocks(self) -> int:
        return self._pool.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return self.num_groups * -(-num_tokens // self.block_size)

    def ever_fits(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.usable_blocks

    def holds(self, request_id: str) -> bool:
        return request_id in self._entries

    def admit(
        self, request_id: str, num_tokens: int, state: State, waiting_on: Iterable[int] = ()
    ) -> BlockTables:
        """Block tables covering `num_tokens` for a new request; `OutOfBlocks` when the pool is short now,
        `DuplicateRequest` when the id holds blocks already (its two legs would share them)."""
        if request_id in self._entries:
            raise DuplicateRequest(f"request {request_id!r} is already in flight on this engine")
        tables = allocate_block_tables(self._pool, self.num_groups, self.block_size, num_tokens)
        self._entries[request_id] = _Entry(tables, state, set(waiting_on))
        return tables

    def set_state(self, request_id: str, state: State) -> None:
        entry = self._entries.get(request_id)
        if entry is not None:
            entry.state = state

    def stage_done(self, request_id: str, stage: int) -> bool:
        """A stage's terminal KV event for a prefill; True when that returned the request's ids."""
        entry = self._entries.get(request_id)
        if entry is None:
            return False
        entry.waiting_on.discard(stage)
        if entry.waiting_on:
            return False
        self.release(request_id)
        return True

    def release(self, request_id: str) -> bool:
        """Return the request's ids to the pool (once; False when it held none)."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return False
        for ids in entry.tables.values():
            self._pool.give_back(ids)
        return True

    def counts(self) -> Counter[State]:
        # Read from the HTTP thread for metrics while the model thread mutates: copy first (atomic in C).
        return Counter(entry.state for entry in list(self._entries.values()))
