"""The decode side of the push connector: register blocks with every prefill worker and count completions.

Flow per request (vLLM push mode): `expect` names the decoder's blocks and the prefill engine; the consumer
handshakes the prefill side channel for every `(pp_rank, tp_rank)` the TP ratio selects (notification-only:
the decoder never writes), sends `PUSH_REG:` + msgpack(registration) to each, and finishes the request after
`pp_size * max(1, P_tp // D_tp)` completion notifs. It heartbeats the prefill workers so their leases hold,
and a watchdog fails a registration that never completes.

A request fails as soon as its KV can no longer come, not at the watchdog: one not registered within
`lease_wait_s` of `expect` (the prefill's lease on it has run out: `LeaseExpired`), and every request waiting
on a prefill engine found dead (a refused handshake, a failed registration or heartbeat send, or a probe that
finds its side channel silent or serving another agent: `PeerUnreachable`). `cancel` drops a request the
engine gave up on: a completion that still comes for it is ignored.
"""

from __future__ import annotations

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
)
from disagg.worker.connector.side_channel import PeerHandshake, handshake_targets
from disagg.worker.connector.transport import PreppedList
from disagg.worker.contracts.topology import lease_wait_s
from disagg.worker.kv import wire
from disagg.worker.kv.decode_checks import check_agent
from disagg.worker.kv.errors import (
    DisaggError,
    HandshakeError,
    InvalidRegistration,
    LeaseExpired,
    PeerUnreachable,
    RegistrationTimeout,
    UnsupportedPeerTopology,
)
from disagg.worker.kv.routing import BlockIds, group_arrays

log = logging.getLogger(__name__)


@dataclass
class _Expected:
    block_ids: list[list[int]]
    remote: RemoteEngine
    deadline: float
    lease_deadline: float
    """Unregistered by then, the prefill's lease on the request has run out (`lease_wait_s`)."""
    needed: int
    received: int = 0
    registered: bool = False
    writers: frozenset[str] = frozenset()
    """The prefill agents this decoder handshook and registered with: only their completions count."""
    completed_by: set[str] = field(default_factory=set)


@dataclass
class _PrefillEngine:
    remote: RemoteEngine
    agents: list[str]
    last_active: float

    def peers(self) -> Iterator[tuple[str, PreppedList | None]]:
        return ((agent, None) for agent in self.agents)


@dataclass
class ConsumerEvents:
    finished: list[str] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    handshakes: list[Handshake] = field(default_factory=list)
    """Prefill engines connected by this poll."""


class PushConsumer(PushSide[_PrefillEngine]):
    def __init__(self, local: LocalKV, *, clock: Clock = time.monotonic) -> None:
        if local.layout.pp_size != 1:
            raise HandshakeError(
                "the push consumer counts completions per decode rank and needs decode PP 1",
                reason="DecodePipelineParallel",
            )
        super().__init__(local, clock)
        self._expected: dict[str, _Expected] = {}
        self._next_heartbeat = clock() + self.config.heartbeat_interval_s

    def expect(self, request_id: str, local_block_ids_per_group: BlockIds, remote: RemoteEngine) -> None:
        """KV for `request_id` will be pushed into these logical blocks by `remote` (one list per group);
        the registration watchdog starts now."""
        local_tp = self.config.tp_size
        for name, size in (("TP", remote.tp_size), ("PP", remote.pp_size)):
            if not 0 < size <= wire.MAX_PARALLEL_SIZE:
                raise UnsupportedPeerTopology(
                    f"request {wire.quote(request_id)}: prefill engine {wire.quote(remote.engine_id)} has "
                    f"{name} size {wire.quote(size)}, outside 1..{wire.MAX_PARALLEL_SIZE}"
                )
        if max(local_tp, remote.tp_size) % min(local_tp, remote.tp_size):
            raise UnsupportedPeerTopology(
                f"request {wire.quote(request_id)}: prefill TP {remote.tp_size} and this decoder's TP "
                f"{local_tp} do not divide one another"
            )
        blocks = [ids.tolist() for ids in group_arrays(local_block_ids_per_group)]
        needed = remote.pp_size * max(1, remote.tp_size // local_tp)
        now = self._clock()
        deadline = now + self.config.push_registration_timeout_s
        lease_deadline = now + lease_wait_s(self.config.kv_lease_duration_s)
        self._expected[request_id] = _Expected(blocks, remote, deadline, lease_deadline, needed)

    def cancel(self, request_id: str) -> bool | None:
        """The engine gave the request up: forget it (no heartbeat keeps its lease, a completion that still
        comes is ignored as one for an unknown request). Whether its registration was sent (its prefill may
        then still write the blocks until its lease ends); None when it waits for nothing here."""
        expected = self._expected.pop(request_id, None)
        return None if expected is None else expected.registered

    @property
    def expected_requests(self) -> frozenset[str]:
        return frozenset(self._expected)

    def poll(self) -> ConsumerEvents:
        events = ConsumerEvents()
        now = self._clock()
        self._apply_handshakes(now, events)
        self._register(now, events)
        self._read_notifs(now, events)
        self._heartbeat(now, events)
        self._watchdog(now, events)
        # A busy prefill engine is probed too: one found gone fails its requests at once. Evicting it then
        # frees no descriptor NIXL uses: the decoder posts no transfer, it only sends notifs.
        self._evict_idle(
            now,
            {e.remote.engine_id for e in self._expected.values()},
            lambda engine_id, why: self._fail_engine(engine_id, _gone(engine_id, why), events),
        )
        return events

    def _fail_engine(self, engine_id: str, error: DisaggError, events: ConsumerEvents) -> None:
        """Every request waiting on `engine_id` fails with `error`: its KV will not come."""
        for request_id, expected in list(self._expected.items()):
            if expected.remote.engine_id == engine_id:
                del self._expected[request_id]
                events.failed.append(Failure.of(request_id, error))

    # -- steps -----------------------------------------------------------------------------------------------

    def _register(self, now: float, events: ConsumerEvents) -> None:
        for request_id, expected in list(self._expected.items()):
            if expected.registered:
                continue
            try:
                self._register_one(request_id, expected, now, events)
            except Exception as exc:
                # One request's failure (a bug, a value out of range) must not end the loop.
                self._expected.pop(request_id, None)
                events.failed.append(
                    Failure.of(request_id, as_disagg_error(exc, "registering", reason="InternalError"))
                )

    def _register_one(self, request_id: str, expected: _Expected, now: float, events: ConsumerEvents) -> None:
        engine = self._engines.get(expected.remote.engine_id)
        if engine is None:
            targets = handshake_targets(
                self.config.tp_size, self.config.tp_rank, expected.remote.tp_size, expected.remote.pp_size
            )
            self._start_handshake(expected.remote, targets)
            return
        registration = wire.PushRegistration(
            request_id=request_id,
            decode_engine_id=self.config.engine_id,
            decode_host=self.config.side_channel_host,
            decode_port=self.config.side_channel_port,
            decode_tp_size=self.config.tp_size,
            local_block_ids=expected.block_ids,
            remote_engine_id=expected.remote.engine_id,
            remote_host=expected.remote.host,
            remote_port=expected.remote.port,
            remote_tp_size=expected.remote.tp_size,
            remote_pp_size=expected.remote.pp_size,
        )
        message = wire.encode_push_reg_notif(registration)
        try:
            for agent in engine.agents:
                self.transport.send_notif(agent, message)
        except DisaggError as exc:
            log.warning("registration with prefill engine %r failed: %s", engine.remote.engine_id, exc)
            self._evict(engine.remote.engine_id)
            self._fail_engine(engine.remote.engine_id, _gone(engine.remote.engine_id, exc.message), events)
            return
        expected.registered = True
        expected.writers = frozenset(engine.agents)
        engine.last_active = now

    def _apply_handshakes(self, now: float, events: ConsumerEvents) -> None:
        for engine_id, started_at, result in self._handshakes.collect():
            try:
                if isinstance(result, BaseException):
                    raise as_disagg_error(result, f"handshake with prefill engine {engine_id!r}")
                remote = next(e.remote for e in self._expected.values() if e.remote.engine_id == engine_id)
                agents = self._connect(remote, result, now)
                events.handshakes.append(Handshake(engine_id, tuple(agents), started_at, now))
            except Exception as exc:
                error = (
                    HandshakeError("no request waits for it")
                    if isinstance(exc, StopIteration)
                    else as_disagg_error(exc, f"connecting prefill engine {wire.quote(engine_id)}")
                )
                log.warning("prefill engine %s refused: %s", wire.quote(engine_id), error)
                self._fail_engine(engine_id, error, events)

    def _connect(self, remote: RemoteEngine, peers: Sequence[PeerHandshake], now: float) -> list[str]:
        """Notification-only peers: the decoder only sends PUSH_REG and heartbeats to prefill workers; what
        the prefill metadata says it cannot receive (another KV layout, Mamba state, PCP) is refused first."""
        for peer in peers:
            check_agent(self.local.layout.kv_cache_layout, self.config.model.is_mla, peer.metadata)
        agents: list[str] = []
        try:
            for peer in peers:
                agents.append(self._add_agent(remote.engine_id, peer, "prefill"))
        except DisaggError:
            for agent in agents:
                self.transport.remove_peer(agent)
            raise
        self._engines[remote.engine_id] = _PrefillEngine(remote, agents, now)
        return agents

    def _read_notifs(self, now: float, events: ConsumerEvents) -> None:
        for sender, _, notif in self._notifs():
            try:
                self._completion(sender, notif, now, events)
            except Exception as exc:
                self.ignored_notifs += 1
                log.warning("notif from %s refused: %s", wire.quote(sender), as_disagg_error(exc, "notif"))

    def _completion(
        self, sender: str, notif: wire.Notif | InvalidRegistration, now: float, events: ConsumerEvents
    ) -> None:
        if not isinstance(notif, wire.CompletionNotif):
            self.ignored_notifs += 1
            log.warning("unexpected %s from %s on a consumer", type(notif).__name__, wire.quote(sender))
            return
        expected = self._expected.get(notif.req_id)
        if expected is None:
            self.ignored_notifs += 1
            log.warning("Potentially invalid KV blocks for unrecognized request %s", wire.quote(notif.req_id))
            return
        if sender not in expected.writers or sender in expected.completed_by:
            # Only an agent this decoder handshook and registered the request with has written its
            # blocks, and each writes once: anything else would report KV that never arrived.
            self.ignored_notifs += 1
            log.warning(
                "ignoring a completion of request %s from %s: not a prefill agent it registered with, or "
                "one that completed it already",
                wire.quote(notif.req_id),
                wire.quote(sender),
            )
            return
        expected.completed_by.add(sender)
        expected.received += 1
        engine = self._engines.get(expected.remote.engine_id)
        if engine is not None:
            engine.last_active = now
        if expected.received >= expected.needed:
            del self._expected[notif.req_id]
            events.finished.append(notif.req_id)

    def _heartbeat(self, now: float, events: ConsumerEvents) -> None:
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.config.heartbeat_interval_s
        by_engine: dict[str, list[str]] = {}
        for request_id, expected in self._expected.items():
            if expected.registered:
                by_engine.setdefault(expected.remote.engine_id, []).append(request_id)
        for engine_id, request_ids in by_engine.items():
            engine = self._engines.get(engine_id)
            if engine is None:
                continue
            message = wire.encode_heartbeat_notif(request_ids)
            try:
                for agent in engine.agents:
                    self.transport.send_notif(agent, message)
            except DisaggError as exc:
                log.warning("heartbeat to prefill engine %r failed: %s", engine_id, exc)
                self._evict(engine_id)
                self._fail_engine(engine_id, _gone(engine_id, exc.message), events)

    def _watchdog(self, now: float, events: ConsumerEvents) -> None:
        for request_id, expected in list(self._expected.items()):
            if not expected.registered and now >= expected.lease_deadline:
                del self._expected[request_id]
                lease = self.config.kv_lease_duration_s
                error: DisaggError = LeaseExpired(
                    f"request {request_id}: not registered with prefill engine {expected.remote.engine_id!r} "
                    f"within {lease_wait_s(lease):g} s of being expected, so its lease of {lease:g} s there "
                    "has run out and its KV will not come"
                )
                log.warning("%s", error)
                events.failed.append(Failure.of(request_id, error))
            elif now >= expected.deadline:
                del self._expected[request_id]
                error = RegistrationTimeout(
                    f"request {request_id}: {expected.received} of {expected.needed} completion notifs from "
                    f"prefill engine {expected.remote.engine_id!r} within "
                    f"{self.config.push_registration_timeout_s} s; its blocks hold no valid KV"
                )
                log.warning("%s", error)
                events.failed.append(Failure.of(request_id, error))


def _gone(engine_id: str, why: str) -> PeerUnreachable:
    """What fails every request waiting on a prefill engine found dead: its KV will not come."""
    return PeerUnreachable(f"prefill engine {wire.quote(engine_id)} is gone: {why}")
