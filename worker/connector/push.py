"""What the push connector's producer and consumer share: configuration, identity, the local KV registration
and the bookkeeping of connected peer engines (`PushSide`).

The connector has two single-threaded state machines, `PushProducer` (prefill, `producer.py`) and
`PushConsumer` (decode, `consumer.py`), each called by one thread, which owns the NIXL agent (NIXL is not
thread-safe): the methods that take work (`request_finished`, `expect`) only record it, and every NIXL call
happens inside `poll()`. Side-channel handshakes (ZMQ and decoding, no NIXL) run on one background thread,
and their results are applied by `poll()`. What `poll()` reports carries what the connector knew when it
acted: the bytes it posted, when, and to which peer (`producer.Sent`, `Handshake`), read from the clock it
was given.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from disagg.worker.connector.side_channel import DEFAULT_HANDSHAKE_TIMEOUT_S, PeerHandshake, handshake
from disagg.worker.connector.transport import LOCAL_AGENT, NixlTransport, PreppedList
from disagg.worker.kv import rules, wire
from disagg.worker.kv.errors import DisaggError, HandshakeError, InvalidRegistration, PeerUnreachable
from disagg.worker.kv.layout import ModelGeometry, StageLayout
from disagg.worker.kv.routing import RegionGeometry, TransferLayers, local_descs

log = logging.getLogger(__name__)

PROBE_THREADS = 4
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def base_request_id(request_id: str) -> str:
    """vLLM's `get_base_request_id`: the id without the random `-<8 hex>` suffix an engine appends."""
    return _RANDOM_SUFFIX.sub("", request_id)


def find_request(request_id: str, ids: Collection[str]) -> str | None:
    """`request_id` if `ids` holds it, else the first id equal to it up to an engine's random suffix."""
    if request_id in ids:
        return request_id
    base = base_request_id(request_id)
    return next((other for other in ids if base_request_id(other) == base), None)


def agent_name(engine_id: str, pp_rank: int, tp_rank: int) -> str:
    """A NIXL agent name unique per (engine, PP rank, TP rank); a restarted worker reuses its name."""
    return f"{engine_id}/pp{pp_rank}/tp{tp_rank}"


@dataclass(frozen=True)
class PushConfig:
    """One worker's connector settings (vLLM `kv_connector_extra_config` names where one exists)."""

    engine_id: str
    model: ModelGeometry
    side_channel_host: str
    side_channel_port: int
    compat_hash: str | None
    """None disables the hash check (vLLM `enforce_handshake_compat=false`)."""
    compat_factors: Mapping[str, Any] | None = None
    """When given, a hash mismatch names the differing factor."""
    tp_rank: int = 0
    tp_size: int = 1
    attn_backend_name: str = "FLASH_ATTN"
    connector_version: int = wire.LATEST_CONNECTOR_VERSION
    """The NIXL connector version whose metadata field set this worker writes (the release's)."""
    mem_type: str = "DRAM"
    device_id: int = 0
    kv_lease_duration_s: float = 30.0
    push_registration_timeout_s: float = 480.0
    engine_ttl_s: float = 3600.0
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    peer_probe_interval_s: float = 10.0
    """How often an idle connected peer's side channel is asked whether the same engine still serves it. A
    killed or restarted peer (a new engine id) is evicted, so its NIXL agents and descriptors do not stay
    for `engine_ttl_s`; 0 turns the probe off."""
    peer_probe_failures: int = 2
    """Unanswered probes in a row that evict a peer (one answer from another engine evicts at once)."""

    @property
    def heartbeat_interval_s(self) -> float:
        return self.kv_lease_duration_s / 6

    @property
    def heartbeat_extension_s(self) -> float:
        return self.kv_lease_duration_s * 2 / 3

    @property
    def registration_silence_s(self) -> float:
        """How long an unmatched registration is kept without a heartbeat from its decoder (which sends one
        every `heartbeat_interval_s`): a decoder silent for a lease gave the request up, or died, and its
        blocks may be another request's by now. A decoder that cancels holds the blocks for longer
        (`contracts.topology.lease_wait_s`), so no WRITE lands after it freed them."""
        return self.kv_lease_duration_s


@dataclass(frozen=True)
class RemoteEngine:
    """How to reach a peer engine's side channel, and its parallel layout."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    pp_size: int = 1


@dataclass(frozen=True)
class Failure:
    """A request the connector gave up on, with a CamelCase reason (the errors module's) and a message."""

    request_id: str
    reason: str
    message: str

    @classmethod
    def of(cls, request_id: str, error: DisaggError) -> Failure:
        return cls(request_id, error.reason, error.message)


class LocalKV:
    """This worker's KV pool: registered once with NIXL, described to peers, prepared for transfers."""

    def __init__(
        self,
        layout: StageLayout,
        transport: NixlTransport,
        base_addr: int,
        nbytes: int,
        config: PushConfig,
        *,
        layer_routing: bool | None = None,
    ) -> None:
        """`layer_routing=None` applies vLLM's rule (push, HMA or packed, no Mamba, PP > 1); True forces
        routing by layer name on any stage that tracks region layers."""
        if nbytes < layout.total_bytes:
            raise ValueError(f"the pool has {nbytes} bytes, the layout needs {layout.total_bytes}")
        self.layout = layout
        self.config = config
        self.transport = transport
        self.packed = layout.kv_cache_layout == "BLHNC"
        model = config.model
        # vLLM `_tracks_region_layers` and `_requires_layer_name_routing` (push connector) before connector
        # version 16; from it, every worker advertises its layers and pairs by them.
        self.tracks_region_layers = rules.tracks_region_layers(
            rules.PUSH,
            model.hma_required,
            self.packed,
            model.has_mamba,
            connector_version=config.connector_version,
        )
        self.layer_routing = rules.requires_layer_name_routing(
            rules.PUSH,
            model.hma_required,
            self.packed,
            model.has_mamba,
            layout.pp_size,
            connector_version=config.connector_version,
        )
        if layer_routing is not None:
            if layer_routing and not self.tracks_region_layers:
                raise ValueError(
                    "layer-name routing needs a layout that tracks region layers (HMA or packed)"
                )
            self.layer_routing = layer_routing
        transport.register(base_addr, nbytes, config.mem_type, config.device_id)
        self.geometry = RegionGeometry.from_layout(
            layout,
            base_addr=base_addr,
            device_id=config.device_id,
            mem_type=config.mem_type,
            advertise_members=self.tracks_region_layers,
        )
        self.transfer_layers = TransferLayers.from_layout(layout) if self.layer_routing else None
        order = None if self.transfer_layers is None else list(self.transfer_layers.region_indices)
        self.descs = local_descs(self.geometry, regions=order)
        """Nx3 source descriptors: one per kernel block of each region (of each transfer layer if routing)."""
        self._prepped: PreppedList | None = None

    @property
    def agent(self) -> str:
        name: str = self.transport.name
        return name

    @property
    def prepped(self) -> PreppedList:
        """Local source descriptors, prepared on first use (by the thread that owns the agent)."""
        if self._prepped is None:
            self._prepped = self.transport.prep(LOCAL_AGENT, self.descs, self.config.mem_type)
        return self._prepped

    def metadata(self) -> wire.NixlAgentMetadata:
        return advertised_metadata(self.layout, self.geometry, self.config, self.transport.metadata())

    def handshake_payload(self) -> bytes:
        """Reply frame 0 for this worker's `(pp_rank, tp_rank)` on the engine's side channel."""
        payload: bytes = wire.encode_handshake_payload(
            self.metadata(), self.config.compat_hash or "", self.config.connector_version
        )
        return payload


def advertised_metadata(
    layout: StageLayout, geometry: RegionGeometry, config: PushConfig, agent_blob: bytes
) -> wire.NixlAgentMetadata:
    """What a worker with `layout`, registered as `geometry`, advertises at handshake. Where the connector
    version has `layer_group_ids` (16, vLLM 0.34) it carries the transfer group of every advertised layer:
    a 0.34 peer pairs a layer only within its group. Pure."""
    groups = (
        {name: layout.group_index_by_layer[name] for members in geometry.region_members for name in members}
        if "layer_group_ids" in wire.metadata_fields(config.connector_version)
        else {}
    )
    return wire.NixlAgentMetadata(
        engine_id=config.engine_id,
        agent_metadata=agent_blob,
        kv_caches_base_addr=geometry.kv_caches_base_addr,
        device_id=geometry.device_id,
        num_blocks=geometry.num_blocks,
        block_lens=geometry.block_lens,
        block_strides=geometry.block_strides,
        kv_cache_layout=layout.kv_cache_layout,
        block_size=geometry.block_size,
        ssm_sizes=(0, 0),
        attn_backend_name=config.attn_backend_name,
        physical_blocks_per_logical_kv_block=geometry.physical_blocks_per_logical_kv_block,
        region_num_blocks=geometry.region_num_blocks,
        region_group_ids=geometry.region_group_ids,
        region_names=geometry.region_names,
        region_mem_types=geometry.region_mem_types,
        region_members=geometry.region_members,
        layer_group_ids=groups,
    )


Clock = Callable[[], float]


@dataclass(frozen=True)
class Handshake:
    """A peer engine connected: its side channel answered, its metadata passed the checks and its NIXL
    agents are loaded."""

    engine_id: str
    agents: tuple[str, ...]
    started_at: float
    """When the handshake was started (the connector's clock)."""
    done_at: float
    """The poll that loaded the peer's agents."""


@dataclass
class HandshakeJobs:
    """Side-channel handshakes on one background thread; `poll()` collects finished ones."""

    config: PushConfig
    clock: Clock
    _pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="disagg-handshake")
    )
    _running: dict[str, tuple[float, Future[list[PeerHandshake]]]] = field(default_factory=dict)

    def start(self, remote: RemoteEngine, targets: Sequence[tuple[int, int]]) -> None:
        if remote.engine_id in self._running:
            return
        self._running[remote.engine_id] = (
            self.clock(),
            self._pool.submit(
                handshake,
                remote.host,
                remote.port,
                targets,
                expected_hash=self.config.compat_hash,
                expected_engine_id=remote.engine_id,
                local_factors=self.config.compat_factors,
                timeout_s=self.config.handshake_timeout_s,
            ),
        )

    def collect(self) -> list[tuple[str, float, list[PeerHandshake] | BaseException]]:
        """Each finished handshake: the engine, when it was started, and its result."""
        done = []
        for engine_id, (started_at, future) in list(self._running.items()):
            if future.done():
                del self._running[engine_id]
                exc = future.exception()
                done.append((engine_id, started_at, exc if exc is not None else future.result()))
        return done

    @property
    def running(self) -> frozenset[str]:
        return frozenset(self._running)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class PeerProbes:
    """Side-channel probes of connected peers (idle ones; on a decoder, busy ones too), on a thread of their
    own (a dead peer's probe waits out the handshake timeout, which must not delay a real handshake).

    UCX notices a dead peer only when something is sent to it, and nothing is sent to an idle peer, so
    without these a killed decoder's agents and descriptors (megabytes for a large KV) stay until
    `engine_ttl_s`. A probe is the handshake itself, checked against the engine id that connected: a
    restarted peer answers with a new engine id (or another hash) and is gone at once; an unanswered probe
    counts, and `peer_probe_failures` of them in a row are gone."""

    def __init__(self, config: PushConfig, clock: Clock) -> None:
        self.config = config
        # Several threads: each dead peer's probe waits out the handshake timeout.
        self._jobs = HandshakeJobs(
            config,
            clock,
            ThreadPoolExecutor(max_workers=PROBE_THREADS, thread_name_prefix="disagg-peer-probe"),
        )
        self._known: dict[str, tuple[RemoteEngine, tuple[tuple[int, int], ...]]] = {}
        self._agents: dict[str, dict[tuple[int, int], bytes]] = {}
        self._last: dict[str, float] = {}
        self._misses: dict[str, int] = {}

    def know(self, remote: RemoteEngine, targets: Sequence[tuple[int, int]]) -> None:
        self._known[remote.engine_id] = (remote, tuple(targets))

    def connected(self, engine_id: str, peer: PeerHandshake) -> None:
        """The agent loaded for one rank: a probe that finds another one there found a restarted peer."""
        self._agents.setdefault(engine_id, {})[(peer.pp_rank, peer.tp_rank)] = peer.metadata.agent_metadata

    def keep_only(self, engine_ids: Collection[str]) -> None:
        """Drop what is known of peers neither connected nor connecting (a refused handshake's)."""
        for engine_id in [e for e in self._known if e not in engine_ids]:
            self.forget(engine_id)

    def forget(self, engine_id: str) -> None:
        self._known.pop(engine_id, None)
        self._agents.pop(engine_id, None)
        self._last.pop(engine_id, None)
        self._misses.pop(engine_id, None)

    def maybe_start(self, engine_id: str, last_active: float, now: float) -> None:
        interval = self.config.peer_probe_interval_s
        known = self._known.get(engine_id)
        if interval <= 0 or known is None:
            return
        if now - max(last_active, self._last.get(engine_id, last_active)) < interval:
            return
        self._last[engine_id] = now
        self._jobs.start(*known)

    def gone(self) -> list[tuple[str, str, str]]:
        """Peers whose probes say another engine, or nobody, serves their side channel now: (id, reason,
        why), the reason `PeerRestarted` or `PeerUnreachable`."""
        out = []
        for engine_id, _, result in self._jobs.collect():
            if engine_id not in self._known:
                continue
            if not isinstance(result, BaseException):
                self._misses.pop(engine_id, None)
                loaded = self._agents.get(engine_id, {})
                if any(loaded.get((p.pp_rank, p.tp_rank)) != p.metadata.agent_metadata for p in result):
                    out.append((engine_id, "PeerRestarted", "its side channel names another NIXL agent"))
            elif isinstance(result, PeerUnreachable):
                misses = self._misses[engine_id] = self._misses.get(engine_id, 0) + 1
                if misses >= self.config.peer_probe_failures:
                    why = f"{misses} probes of its side channel unanswered: {result}"
                    out.append((engine_id, "PeerUnreachable", why))
            else:
                out.append((engine_id, "PeerRestarted", f"its side channel answers otherwise: {result}"))
        return out

    def close(self) -> None:
        self._jobs.close()


def as_disagg_error(exc: BaseException, what: str, reason: str = "HandshakeFailed") -> DisaggError:
    """Typed errors pass through; anything else (a bug or an OS error) is wrapped with its type named and
    its text cut short (a peer's value may be in it)."""
    if isinstance(exc, DisaggError):
        return exc
    text = wire.clip(str(exc))
    return DisaggError(f"{what}: {type(exc).__name__}: {text}", reason=reason)


class PeerEngine(Protocol):
    """A connected peer engine as `PushSide` keeps it."""

    last_active: float

    def peers(self) -> Iterable[tuple[str, PreppedList | None]]:
        """Each NIXL agent added for the engine, with the descriptors prepared for it, if any."""
        ...


E = TypeVar("E", bound=PeerEngine)


class PushSide(Generic[E]):
    """What the producer and the consumer keep alike: the handshake thread, the connected peer engines
    (added and evicted the same way) and the notif stream."""

    def __init__(self, local: LocalKV, clock: Clock) -> None:
        self.local = local
        self.config = local.config
        self.transport = local.transport
        self._clock = clock
        self._engines: dict[str, E] = {}
        self._handshakes = HandshakeJobs(self.config, clock)
        self._probes = PeerProbes(self.config, clock)
        self._evicted: list[tuple[str, str]] = []
        self.ignored_notifs = 0
        """Notifs dropped unread or unmatched: garbage, or from an agent that may not complete the request."""

    def close(self) -> None:
        self._handshakes.close()
        self._probes.close()
        for engine_id in list(self._engines):
            self._evict(engine_id, "Closed")

    @property
    def connected_engines(self) -> frozenset[str]:
        """The peer engines whose NIXL agents are loaded."""
        return frozenset(self._engines)

    def take_evictions(self) -> list[tuple[str, str]]:
        """The peer engines evicted since the last call, each with its CamelCase reason."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def _notifs(self) -> Iterator[tuple[str, bytes, wire.Notif | InvalidRegistration]]:
        """Every notif received since the last call. A registration whose sizes are out of bounds comes as
        its refusal (the producer fails the request it names); any other unreadable one is logged, counted
        in `ignored_notifs` and skipped."""
        for sender, messages in self.transport.notifs().items():
            for message in messages:
                try:
                    notif: wire.Notif | InvalidRegistration = wire.parse_notif(message)
                except InvalidRegistration as exc:
                    notif = exc
                except Exception as exc:
                    self.ignored_notifs += 1
                    log.warning(
                        "ignoring an unreadable notif from %s: %s",
                        wire.quote(sender),
                        as_disagg_error(exc, "notif"),
                    )
                    continue
                yield sender, message, notif

    def _add_agent(self, engine_id: str, peer: PeerHandshake, role: str) -> str:
        """Add the NIXL agent of one rank of `engine_id`; refuse one not named for that rank."""
        name = agent_name(engine_id, peer.pp_rank, peer.tp_rank)
        # A restarted peer keeps its agent name; its old connection info must go first.
        self.transport.remove_peer(name)
        loaded = self.transport.add_peer(peer.metadata.agent_metadata)
        if loaded != name:
            self.transport.remove_peer(loaded)
            raise HandshakeError(
                f"{role} rank (pp {peer.pp_rank}, tp {peer.tp_rank}) of {engine_id!r} runs NIXL "
                f"agent {loaded!r}, expected {name!r}"
            )
        self._probes.connected(engine_id, peer)
        return name

    def _start_handshake(self, remote: RemoteEngine, targets: Sequence[tuple[int, int]]) -> None:
        """Handshake `remote` in the background; once connected, the same targets are what probes ask."""
        self._probes.know(remote, targets)
        self._handshakes.start(remote, targets)

    def _evict_idle(
        self, now: float, busy: set[str], fail_busy: Callable[[str, str], None] | None = None
    ) -> None:
        """Evict peers idle past their TTL and peers a probe found gone; start the probes that are due.
        A busy peer (a transfer or registration names it) is never evicted for idling. Without `fail_busy`
        it is neither probed nor evicted here (its own path fails it: a NIXL transfer to it may still use
        its descriptors); with it, it is probed too, and one found gone is handed to `fail_busy` (engine
        id, why) to fail what waits on it, then evicted."""
        for engine_id, engine in list(self._engines.items()):
            if engine_id not in busy and now - engine.last_active > self.config.engine_ttl_s:
                log.info("evicting engine %r after %.0f s idle", engine_id, now - engine.last_active)
                self._evict(engine_id, "Idle")
        for engine_id, reason, why in self._probes.gone():
            if engine_id not in self._engines or (engine_id in busy and fail_busy is None):
                continue
            log.info("evicting engine %s: %s", wire.quote(engine_id), why)
            if engine_id in busy and fail_busy is not None:
                fail_busy(engine_id, why)
            self._evict(engine_id, reason)
        self._probes.keep_only(self._engines.keys() | self._handshakes.running)
        for engine_id, engine in self._engines.items():
            if engine_id not in busy or fail_busy is not None:
                self._probes.maybe_start(engine_id, engine.last_active, now)

    def _evict(self, engine_id: str, reason: str = "PeerFailed") -> None:
        """Release a peer's descriptors and agents; `reason` is what `take_evictions` reports."""
        self._probes.forget(engine_id)
        engine = self._engines.pop(engine_id, None)
        if engine is None:
            return
        self._evicted.append((engine_id, reason))
        for agent, prepped in engine.peers():
            try:
                if prepped is not None:
                    self.transport.release_prepped(prepped)
                self.transport.remove_peer(agent)
            except DisaggError as exc:
                log.warning("while evicting %s: %s", agent, exc)
