"""The prefill side of the push connector: match registrations to finished blocks and WRITE them.

Flow per request (vLLM `push_worker`): the engine reports finished blocks (`request_finished`), which are
held under a lease; the decoder's `PUSH_REG:` registration names its blocks; the producer handshakes the
decoder's side channel if needed, validates and aligns its metadata (layer-name routing under PP + HMA),
adds its NIXL agent only then, and WRITEs every layer's blocks with the completion notif
`f"{D_request_id}:{P_tp_size}"`. Heartbeats extend a lease; an expired lease frees the blocks with a warning.

A send is finished when all its WRITE handles are DONE, each released as it completes (vLLM's push worker:
the decoder sends nothing back in push mode). A push that fails is reported once and never written again;
the lease still frees its blocks. No exception from one notif or request ends `poll()`.

It runs to some 470 lines: the registration store and the bounds on what a decoder may make it allocate are
in `registrations.py`; what stays is one state machine whose steps share the held requests.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from disagg.worker.connector.push import (
    Clock,
    Failure,
    Handshake,
    LocalKV,
    PushSide,
    RemoteEngine,
    as_disagg_error,
    find_request,
)
from disagg.worker.connector.registrations import (
    MAX_REGISTRATION_BYTES,
    MAX_REGISTRATIONS,
    Registration,
    Registrations,
    check_advertised_size,
)
from disagg.worker.connector.side_channel import PeerHandshake, handshake_targets
from disagg.worker.connector.transport import LOCAL_AGENT, PreppedList, Xfer, XferState, merge_runs
from disagg.worker.kv import wire
from disagg.worker.kv.decode_checks import (
    DecodeWrite,
    LocalRegion,
    PrefillRank,
    check_same_layout,
    plan_decode_write,
)
from disagg.worker.kv.errors import (
    DisaggError,
    HandshakeError,
    InvalidRegistration,
    RegionGeometryMismatch,
    TransferFailed,
)
from disagg.worker.kv.routing import (
    BlockIds,
    IdArray,
    IdBuffer,
    StridedArray,
    TransferPlan,
    expand_logical_blocks,
    expand_strided,
    group_arrays,
)

log = logging.getLogger(__name__)


@dataclass
class _Held:
    block_ids: list[IdArray]
    deadline: float
    writing: bool = False
    failed: bool = False
    """A push of it failed and the engine was told: it is never written again, the lease frees it."""


@dataclass
class _DecodeRank:
    """One decode worker this producer writes to: its agent, the plan pairing its regions with this worker's
    and its prepared descriptors."""

    agent: str
    plan: TransferPlan
    strided: StridedArray
    """The decode rank's descriptors, one strided row per region, as prepared."""
    prepped: PreppedList
    source: tuple[StridedArray, PreppedList]
    """This worker's descriptors the WRITEs read: whole blocks, or the decode rank's head slice of each."""


@dataclass
class _DecodeEngine:
    engine_id: str
    ranks: list[_DecodeRank]
    last_active: float

    def peers(self) -> Iterator[tuple[str, PreppedList | None]]:
        return ((rank.agent, rank.prepped) for rank in self.ranks)


@dataclass
class _Sending:
    request_id: str
    registration: wire.PushRegistration
    xfers: list[Xfer]
    """The WRITEs not yet DONE: each is released as soon as it completes (as vLLM's `_pop_done_transfers`)."""
    nbytes: int
    posted_at: float


@dataclass(frozen=True)
class Sent:
    """A request whose KV this worker wrote to every decode rank, all WRITEs complete."""

    request_id: str
    """This worker's (prefill) request id."""
    decode_request_id: str
    decode_engine_id: str
    nbytes: int
    """Bytes the WRITEs moved, summed over the decode ranks written to."""
    posted_at: float
    """When the WRITEs were posted (the producer's clock): the blocks, the registration and the decoder's
    agents were all there."""
    done_at: float
    """The first poll that saw every WRITE complete."""


@dataclass
class ProducerEvents:
    """What one `poll()` observed. `sent` and `expired` requests' blocks may be freed by the caller."""

    sent: list[Sent] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)
    registered: list[str] = field(default_factory=list)
    """Registrations received (decoder request ids), for observability."""
    handshakes: list[Handshake] = field(default_factory=list)
    """Decode engines connected by this poll."""


class PushProducer(PushSide[_DecodeEngine]):
    def __init__(
        self,
        local: LocalKV,
        *,
        clock: Clock = time.monotonic,
        max_registrations: int = MAX_REGISTRATIONS,
        max_registration_bytes: int = MAX_REGISTRATION_BYTES,
    ) -> None:
        super().__init__(local, clock)
        self._held: dict[str, _Held] = {}
        # Unmatched registrations, each dropped at its deadline: by then the decoder's own watchdog (the same
        # push_registration_timeout_s) has failed the request, and keeping it would pin the decoder. Capped
        # by count and bytes, so a flood of them cannot grow the process.
        self.registrations = Registrations(
            local.layout, self.config.tp_size, max_count=max_registrations, max_bytes=max_registration_bytes
        )
        self._waiting: dict[str, list[tuple[str, Registration]]] = {}
        self._sending: list[_Sending] = []
        # Head slices of the local blocks (vLLM's local split handles), prepared once per slice and kept for
        # the worker's life like the whole-block list: every decode engine of one TP size reuses them.
        self._head_slices: dict[tuple[int, int], tuple[StridedArray, PreppedList]] = {}
        # One decode rank's descriptor ids at a time, in memory kept from request to request (see IdBuffer).
        self._ids = IdBuffer()

    def request_finished(self, request_id: str, block_ids_per_group: BlockIds) -> None:
        """The request's KV is complete in these logical blocks (one list per KV cache group); its lease
        starts now."""
        deadline = self._clock() + self.config.kv_lease_duration_s
        self._held[request_id] = _Held(group_arrays(block_ids_per_group), deadline)

    def poll(self) -> ProducerEvents:
        events = ProducerEvents()
        now = self._clock()
        self._read_notifs(now, events)
        self._apply_handshakes(now, events)
        self._match(now, events)
        self._poll_transfers(now, events)
        self._expire(now, events)
        # A decoder whose registration waits for this worker's KV is not idle: it is about to be written to.
        busy = {s.registration.decode_engine_id for s in self._sending}
        busy.update(r.registration.decode_engine_id for r in self.registrations)
        self._evict_idle(now, busy)
        return events

    @property
    def held_requests(self) -> frozenset[str]:
        return frozenset(self._held)

    # -- steps -----------------------------------------------------------------------------------------------

    def _read_notifs(self, now: float, events: ProducerEvents) -> None:
        for sender, message, notif in self._notifs():
            try:
                if isinstance(notif, wire.PushRegistration):
                    self._registered(notif, len(message), now, events)
                elif isinstance(notif, InvalidRegistration):
                    self.registrations.refuse(len(message))
                    self._refuse_registration(notif, events)
                elif isinstance(notif, wire.HeartbeatNotif):
                    for request_id in notif.req_ids:
                        held = self._find_held(request_id)
                        if held is not None:
                            held.deadline = max(held.deadline, now + self.config.heartbeat_extension_s)
                        self.registrations.hear(request_id, now)
                else:
                    self.ignored_notifs += 1
                    log.warning(
                        "unexpected completion notif %s from %s on a producer",
                        wire.quote(message),
                        wire.quote(sender),
                    )
            except Exception as exc:
                # One message must never take the loop down; what it names fails, nothing else.
                self.ignored_notifs += 1
                log.warning("notif from %s refused: %s", wire.quote(sender), as_disagg_error(exc, "notif"))

    def _registered(
        self, registration: wire.PushRegistration, nbytes: int, now: float, events: ProducerEvents
    ) -> None:
        try:
            self.registrations.add(registration, nbytes, now + self.config.push_registration_timeout_s, now)
        except InvalidRegistration as exc:
            self._refuse_registration(exc, events)
            return
        events.registered.append(registration.request_id)

    def _refuse_registration(self, error: InvalidRegistration, events: ProducerEvents) -> None:
        held_id = None if error.request_id is None else find_request(error.request_id, self._held)
        if held_id is not None and not self._held[held_id].writing and not self._held[held_id].failed:
            self._fail(held_id, error.request_id or "", error, events)
        else:
            log.warning("refused a registration: %s", error)

    def _find_held(self, request_id: str) -> _Held | None:
        held_id = find_request(request_id, self._held)
        return None if held_id is None else self._held[held_id]

    def _match(self, now: float, events: ProducerEvents) -> None:
        for kept in self.registrations:
            decode_request_id = kept.registration.request_id
            held_id = find_request(decode_request_id, self._held)
            if held_id is None or self._held[held_id].writing or self._held[held_id].failed:
                continue
            self.registrations.pop(decode_request_id)
            self._held[held_id].writing = True
            registration = kept.registration
            engine_id = registration.decode_engine_id
            try:
                if engine_id in self._engines:
                    self._write(held_id, kept, now, events)
                    continue
                remote = RemoteEngine(
                    engine_id, registration.decode_host, registration.decode_port, registration.decode_tp_size
                )
                targets = handshake_targets(self.config.tp_size, self.config.tp_rank, remote.tp_size, 1)
                self._waiting.setdefault(engine_id, []).append((held_id, kept))
                self._start_handshake(remote, targets)
            except Exception as exc:
                self._fail(
                    held_id, decode_request_id, as_disagg_error(exc, "push", reason="InternalError"), events
                )

    def _apply_handshakes(self, now: float, events: ProducerEvents) -> None:
        for engine_id, started_at, result in self._handshakes.collect():
            waiting = self._waiting.pop(engine_id, [])
            try:
                if isinstance(result, BaseException):
                    raise as_disagg_error(result, f"handshake with decode engine {engine_id!r}")
                decode_tp = waiting[0][1].registration.decode_tp_size if waiting else 1
                agents = self._connect(engine_id, result, decode_tp, now)
            except Exception as exc:
                error = as_disagg_error(exc, f"connecting decode engine {wire.quote(engine_id)}")
                log.warning("decode engine %s refused: %s", wire.quote(engine_id), error)
                for held_id, kept in waiting:
                    self._fail(held_id, kept.registration.request_id, error, events)
                continue
            events.handshakes.append(Handshake(engine_id, tuple(agents), started_at, now))
            for held_id, kept in waiting:
                self._write(held_id, kept, now, events)

    def _connect(
        self, engine_id: str, peers: Sequence[PeerHandshake], decode_tp: int, now: float
    ) -> list[str]:
        """Validate and align every decode rank; only when all pass are their NIXL agents added."""
        planned = [(p, plan_decode_rank(self.local, p.metadata, decode_tp, p.tp_rank)) for p in peers]
        check_same_layout(engine_id, [write for _, write in planned])
        ranks = []
        try:
            for peer, write in planned:
                name = self._add_agent(engine_id, peer, "decode")
                # Strided: one row per region reaches NIXL, never a row per block (see DecodeWrite).
                prepped = self.transport.prep(name, write.remote_strided, self.config.mem_type)
                ranks.append(
                    _DecodeRank(name, write.plan, write.remote_strided, prepped, self._source(write))
                )
        except DisaggError:
            for rank in ranks:
                self.transport.release_prepped(rank.prepped)
                self.transport.remove_peer(rank.agent)
            raise
        self._engines[engine_id] = _DecodeEngine(engine_id, ranks, now)
        return [rank.agent for rank in ranks]

    def _source(self, write: DecodeWrite) -> tuple[StridedArray, PreppedList]:
        if write.head_slice not in self._head_slices:
            strided = write.source_strided()
            prepped = (
                self.local.prepped
                if write.head_slice == (0, 1)
                else self.transport.prep(LOCAL_AGENT, strided, self.config.mem_type)
            )
            self._head_slices[write.head_slice] = (strided, prepped)
        return self._head_slices[write.head_slice]

    def _write(self, held_id: str, kept: Registration, now: float, events: ProducerEvents) -> None:
        registration = kept.registration
        engine = self._engines.get(registration.decode_engine_id)
        if engine is None:
            self._fail(
                held_id, registration.request_id, HandshakeError("decode engine is not connected"), events
            )
            return
        engine.last_active = now
        held = self._held.get(held_id)
        if held is None:
            # Its lease ended while the decoder's handshake ran: the engine was told it expired.
            return
        notif = wire.encode_completion_notif(registration.request_id, self.config.tp_size)
        xfers: list[Xfer] = []
        nbytes = 0
        try:
            local_blocks, decode_blocks = self._trimmed(held.block_ids, kept.block_ids)
            local_kernel = expand_logical_blocks(
                local_blocks, self.local.geometry.physical_blocks_per_logical_kv_block
            )
            for rank in engine.ranks:
                remote_kernel = expand_logical_blocks(
                    decode_blocks, rank.plan.remote.physical_blocks_per_logical_kv_block
                )
                xfer, moved = self._post(rank, local_kernel, remote_kernel, notif)
                xfers.append(xfer)
                nbytes += moved
        except Exception as exc:
            self._release_all(xfers)
            error = as_disagg_error(exc, "preparing the WRITE", reason="InternalError")
            if isinstance(error, TransferFailed):
                self._evict(engine.engine_id)
            self._fail(held_id, registration.request_id, error, events)
            return
        self._sending.append(_Sending(held_id, registration, xfers, nbytes, now))

    def _post(
        self, rank: _DecodeRank, local_blocks: list[IdArray], remote_blocks: list[IdArray], notif: bytes
    ) -> tuple[Xfer, int]:
        """One WRITE and the bytes it moves: runs contiguous on both sides as single descriptors when there
        are any, else by index into the prepared lists."""
        source, source_prepped = rank.source
        runs = rank.plan.runs(local_blocks, remote_blocks, source, rank.strided)
        if runs is not None and runs.count < runs.num_descs:
            local_rows, remote_rows = runs.descriptors()
            xfer = self.transport.write_descs(
                local_rows, rank.agent, remote_rows, notif, self.config.mem_type
            )
            return xfer, runs.nbytes
        # Views into self._ids: NIXL copies them before the next rank's ids overwrite them.
        local_ids, remote_ids = rank.plan.desc_ids(local_blocks, remote_blocks, self._ids)
        if len(remote_ids) != len(local_ids):
            raise RegionGeometryMismatch(
                f"{len(local_ids)} local blocks against {len(remote_ids)} decode blocks"
            )
        if runs is None:
            local_descs = expand_strided(source)[local_ids]
            # The sides' id rows do not pair row for row: merge the gathered rows.
            local_rows, remote_rows = merge_runs(local_descs, expand_strided(rank.strided)[remote_ids])
            if len(local_rows) < len(local_ids):
                xfer = self.transport.write_descs(
                    local_rows, rank.agent, remote_rows, notif, self.config.mem_type
                )
                return xfer, int(local_rows[:, 1].sum())
            nbytes = int(local_descs[:, 1].sum())
        else:
            nbytes = runs.nbytes
        return self.transport.write(source_prepped, local_ids, rank.prepped, remote_ids, notif), nbytes

    def _trimmed(self, held: list[IdArray], decode: list[IdArray]) -> tuple[list[IdArray], list[IdArray]]:
        """This request's blocks and the decoder's, per group, paired block by block."""
        if len(decode) != len(held):
            raise RegionGeometryMismatch(
                f"the decoder named blocks for {len(decode)} KV cache groups, this worker has {len(held)}"
            )
        trimmed = []
        for g, (mine, theirs) in enumerate(zip(held, decode, strict=True)):
            if len(theirs) > len(mine):
                raise RegionGeometryMismatch(
                    f"group {g}: the decoder asks for {len(theirs)} blocks, the request has {len(mine)}"
                )
            # A prefix-cache hit on the decoder leaves it needing only the trailing blocks.
            trimmed.append(mine[len(mine) - len(theirs) :])
        return trimmed, decode

    def _poll_transfers(self, now: float, events: ProducerEvents) -> None:
        still = []
        for sending in self._sending:
            try:
                pending = []
                for xfer in sending.xfers:
                    if self.transport.state(xfer) is XferState.DONE:
                        self.transport.release(xfer)
                    else:
                        pending.append(xfer)
                sending.xfers = pending
            except Exception as exc:
                self._release_all(sending.xfers)
                self._evict(sending.registration.decode_engine_id)
                # The blocks stay held until the lease ends, but are never written again: the engine is told
                # the push failed, once.
                held = self._held[sending.request_id]
                held.writing, held.failed = False, True
                events.failed.append(
                    Failure.of(sending.request_id, as_disagg_error(exc, "WRITE", reason="TransferFailed"))
                )
                continue
            if not sending.xfers:
                del self._held[sending.request_id]
                registration = sending.registration
                events.sent.append(
                    Sent(
                        sending.request_id,
                        registration.request_id,
                        registration.decode_engine_id,
                        sending.nbytes,
                        sending.posted_at,
                        now,
                    )
                )
                engine = self._engines.get(registration.decode_engine_id)
                if engine is not None:
                    engine.last_active = now
            else:
                still.append(sending)
        self._sending = still

    def _release_all(self, xfers: Sequence[Xfer]) -> None:
        for xfer in xfers:
            # A handle NIXL cannot release (one still in flight to a dead peer) must not end the loop.
            with contextlib.suppress(DisaggError):
                self.transport.release(xfer)

    def _fail(self, held_id: str, decode_request_id: str, error: DisaggError, events: ProducerEvents) -> None:
        log.warning(
            "push of %s to decode request %s failed: %s", held_id, wire.quote(decode_request_id), error
        )
        held = self._held.get(held_id)
        if held is not None:
            # Reported once: a later registration naming it is not written (the engine may reuse the blocks).
            held.writing, held.failed = False, True
        events.failed.append(Failure.of(held_id, error))

    def _expire(self, now: float, events: ProducerEvents) -> None:
        self.registrations.expire(now, self.config.registration_silence_s)
        sending = {s.request_id for s in self._sending}
        for request_id, held in list(self._held.items()):
            if held.deadline <= now and request_id not in sending:
                log.warning(
                    "Releasing expired KV blocks for request %s: no decoder retrieved them before the lease "
                    "expired",
                    request_id,
                )
                del self._held[request_id]
                events.expired.append(request_id)


def _prefill_rank(local: LocalKV) -> PrefillRank:
    """`local`, as the decode checks read it."""
    config = local.config
    layout = local.layout
    layers = local.transfer_layers
    routed = None if layers is None else tuple(zip(layers.names, layers.region_indices, strict=True))
    return PrefillRank(
        block_size=layout.block_size,
        routed_layers=routed,
        pp_size=layout.pp_size,
        stage_layers=layout.layers,
        regions=tuple(LocalRegion(r.name, r.block_len, r.replicated) for r in layout.regions),
        mem_types=frozenset({config.mem_type}),
        tp_rank=config.tp_rank,
        tp_size=config.tp_size,
        num_kv_heads=config.model.num_kv_heads,
        is_mla=config.model.is_mla,
        kv_cache_layout=layout.kv_cache_layout,
        region_group_ids=tuple(layout.region_group_ids),
        blocks_per_logical=layout.physical_blocks_per_logical,
        whole_model=layers is not None and layout.pp_size == 1,
    )


def plan_decode_rank(
    local: LocalKV, meta: wire.NixlAgentMetadata, remote_tp: int, remote_tp_rank: int
) -> DecodeWrite:
    """`decode_checks.plan_decode_write` for this worker's registered KV: every check that can refuse decode
    rank `remote_tp_rank`, and what to write to it; no NIXL call."""
    check_advertised_size(len(local.descs), meta)
    return plan_decode_write(
        _prefill_rank(local), local.geometry, local.transfer_layers, meta, remote_tp, remote_tp_rank
    )
