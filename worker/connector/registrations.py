"""What a prefill worker keeps of decoders' `PUSH_REG` registrations until they match a finished request, and
the bounds on what a decoder may make it allocate.

A registration comes from the network with no credentials, so it is checked against this worker's layout
(TP sizes that divide, its number of KV cache groups, no more blocks than a request can hold) before it is
kept, it is kept once (its block ids as arrays: a Python list of ints takes some five times the memory), and
the store is capped by count and by the bytes it holds (the notif's size plus the arrays', which are up to
8 times the notif's: msgpack writes a small id in one byte), and ages entries out. Once the registrations
dropped at their deadline, or refused, add up, the C heap's free pages go back to the system (`heap`):
without that, a flood's memory stayed resident after it expired, or after it was refused (a flood naming more
blocks than this worker has is refused before it is stored: 96 MB grew to 283-367 MB, and stayed). A refusal
is an `InvalidRegistration` naming the decoder's request, so the producer can fail the request it matches.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec

from disagg.worker.connector.heap import HeapTrimmer
from disagg.worker.connector.push import find_request
from disagg.worker.kv import wire
from disagg.worker.kv.errors import InvalidRegistration, RegionGeometryMismatch
from disagg.worker.kv.layout import StageLayout
from disagg.worker.kv.routing import IdArray, group_arrays, region_capacities

log = logging.getLogger(__name__)

MAX_REGISTRATIONS = 4096
"""Unmatched registrations held at once; more are refused until some match or age out."""
MAX_REGISTRATION_BYTES = 64 * 1024 * 1024
"""Bytes of unmatched registrations held at once: each one's notif size plus its block-id arrays."""
MIN_REMOTE_DESCS = 1 << 22
"""A decoder may advertise this many destination descriptors, or 16 times this worker's, whichever is more:
sizes beyond that are refused before the plan allocates for them."""


@dataclass
class Registration:
    """A decoder's registration as kept until it matches."""

    registration: wire.PushRegistration
    """Without its block ids (`block_ids` holds them)."""
    block_ids: list[IdArray]
    deadline: float
    nbytes: int
    """What it holds: its notif's size plus its block-id arrays'."""
    heard: float
    """When its decoder last said it still waits (the registration, then its heartbeats)."""


class Registrations:
    """Unmatched registrations by decoder request id, checked, capped by count and bytes, aged out."""

    def __init__(
        self,
        layout: StageLayout,
        tp_size: int,
        *,
        max_count: int = MAX_REGISTRATIONS,
        max_bytes: int = MAX_REGISTRATION_BYTES,
        trimmer: HeapTrimmer | None = None,
    ) -> None:
        self._layout = layout
        self._tp_size = tp_size
        self._max_count = max_count
        self._max_bytes = max_bytes
        self._kept: dict[str, Registration] = {}
        self.nbytes = 0
        self.refused = 0
        """Registrations refused since the start (out of bounds, or over the caps)."""
        self.trimmer = HeapTrimmer() if trimmer is None else trimmer

    def __iter__(self) -> Iterator[Registration]:
        return iter(list(self._kept.values()))

    def add(self, registration: wire.PushRegistration, notif_bytes: int, deadline: float, now: float) -> None:
        """Keep `registration`, which came in a notif of `notif_bytes` at `now` (replacing one for the same
        request); raises InvalidRegistration."""
        try:
            block_ids = self._checked_block_ids(registration)
            nbytes = notif_bytes + sum(ids.nbytes for ids in block_ids)
            old = self._kept.get(registration.request_id)
            held_bytes = self.nbytes - (old.nbytes if old else 0)
            count = len(self._kept) - (1 if old else 0)
            if count >= self._max_count or held_bytes + nbytes > self._max_bytes:
                raise InvalidRegistration(
                    f"{count} registrations of {held_bytes} bytes are held unmatched already (caps "
                    f"{self._max_count} and {self._max_bytes} bytes)",
                    request_id=registration.request_id,
                )
        except InvalidRegistration:
            # What its decoding allocated (its block-id lists, about an array's worth) is freed with it.
            self.refuse(notif_bytes + 8 * sum(len(ids) for ids in registration.local_block_ids))
            raise
        if old is not None:
            self.pop(registration.request_id)
        kept = msgspec.structs.replace(registration, local_block_ids=[])
        self._kept[registration.request_id] = Registration(kept, block_ids, deadline, nbytes, now)
        self.nbytes += nbytes

    def refuse(self, nbytes: int) -> None:
        """A registration of about `nbytes` decoded was refused: a flood of refusals leaves its memory in
        the heap as one of expiries does, so it counts towards the next trim too."""
        self.refused += 1
        self.trimmer.freed(nbytes)

    def pop(self, request_id: str) -> Registration:
        kept = self._kept.pop(request_id)
        self.nbytes -= kept.nbytes
        return kept

    def hear(self, request_id: str, now: float) -> None:
        """The decoder's heartbeat names `request_id` (up to an engine's random suffix): it still waits."""
        kept_id = find_request(request_id, self._kept)
        if kept_id is not None:
            self._kept[kept_id].heard = now

    def expire(self, now: float, silence_s: float) -> None:
        """Drop the registrations whose deadline has passed, and those whose decoder said nothing for
        `silence_s` (it gave the request up or died: writing its blocks later could land in blocks it gave to
        another request); trim the heap once enough were dropped."""
        for kept in list(self._kept.values()):
            why = (
                "this worker never finished a matching request within push_registration_timeout_s"
                if kept.deadline <= now
                else f"its decoder sent no heartbeat for it in {silence_s:g} s"
                if now - kept.heard > silence_s
                else None
            )
            if why is not None:
                log.warning(
                    "Dropping the registration of decode request %s from engine %s: %s",
                    wire.quote(kept.registration.request_id),
                    wire.quote(kept.registration.decode_engine_id),
                    why,
                )
                self.trimmer.freed(self.pop(kept.registration.request_id).nbytes)
        self.trimmer.maybe_trim(now)

    def _checked_block_ids(self, registration: wire.PushRegistration) -> list[IdArray]:
        """The registration's block ids, once its TP and block lists are known to fit this worker's layout."""

        def refuse(what: str) -> InvalidRegistration:
            return InvalidRegistration(
                f"decode request {wire.quote(registration.request_id)}: {what}",
                request_id=registration.request_id,
            )

        local_tp, decode_tp = self._tp_size, registration.decode_tp_size
        if max(local_tp, decode_tp) % min(local_tp, decode_tp):
            raise refuse(f"decode TP {decode_tp} and this worker's TP {local_tp} do not divide one another")
        layout = self._layout
        if len(registration.local_block_ids) != len(layout.groups):
            raise refuse(
                f"names blocks for {len(registration.local_block_ids)} KV cache groups, this worker has "
                f"{len(layout.groups)}"
            )
        capacity = layout.num_blocks // layout.physical_blocks_per_logical
        for g, ids in enumerate(registration.local_block_ids):
            if len(ids) > capacity:
                raise refuse(f"group {g}: names {len(ids)} blocks, a request here has at most {capacity}")
        return group_arrays(registration.local_block_ids)


def check_advertised_size(local_descs: int, meta: wire.NixlAgentMetadata) -> None:
    """A decoder's advertised block counts, bounded before a plan allocates a descriptor per block
    (`local_descs`: this worker's own source descriptors)."""
    counts = [meta.num_blocks, meta.physical_blocks_per_logical_kv_block, *(meta.region_num_blocks or [])]
    if min(counts) < 0 or max(counts) > wire.MAX_BLOCK_ID:
        raise RegionGeometryMismatch(
            f"decode engine {wire.quote(meta.engine_id)} advertises block counts {wire.quote(counts)} "
            f"outside 0..{wire.MAX_BLOCK_ID}"
        )
    limit = max(MIN_REMOTE_DESCS, 16 * local_descs)
    total = sum(region_capacities(meta))
    if total > limit:
        raise RegionGeometryMismatch(
            f"decode engine {wire.quote(meta.engine_id)} advertises {total} destination descriptors, over "
            f"the {limit} this worker accepts (16 times its own {local_descs}, at least {MIN_REMOTE_DESCS})"
        )
