"""The sidecar's periodic handshake of its peers, and what it makes of the results.

A prefill stage handshakes every decode pod's side channel; a decode pod handshakes every prefill stage's.
Each check is the connector's own: `side_channel.handshake` (hash first, connector version, engine id), and on
the prefill side `producer.plan_decode_rank` (block sizes, layer alignment by name, region geometry), so
a peer this module accepts is one the connector would accept, and a refusal carries the connector's reason.

Peers are found from their Pods (labels, IP, side-channel port) and reported as one outcome for this pod's
condition. A pod stays usable while at least one peer engine works with it (for a decoder: every stage of a
prefill engine): one bad decoder must not make every prefill stage unready. So this pod's condition turns
False only when peers refuse it and no peer engine is usable; a refusal by some peers is still named in the
message and posted as an Event here. The pod at fault (a decoder on another engine version, a stage with
other layers) is refused by every peer, so its own condition is False, naming them, and the operator's
`KVTransferReady` turns False with its reason. A peer that has never answered is pending, not refused, for a
bounded startup grace (`startup`): a deployment whose engines are still loading is Unknown, not False.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, Literal

import msgspec

from disagg.worker.connector.producer import plan_decode_rank
from disagg.worker.connector.push import LocalKV, as_disagg_error
from disagg.worker.connector.side_channel import (
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    PeerHandshake,
    RankReply,
    fetch_payloads,
    handshake,
    handshake_target_tp_ranks,
    handshake_targets,
)
from disagg.worker.contracts.engine_pods import engine_pod
from disagg.worker.contracts.payload_facts import PayloadFacts, live_differences, payload_facts
from disagg.worker.contracts.peer_report import (
    MAX_DIFFERS_CHARS,
    MAX_ENGINE_ID_CHARS,
    MAX_HASH_CHARS,
    MAX_PEER_REPORT_BYTES,
    MAX_PEERS,
    MAX_REASON_CHARS,
    OK_REASON,
    PEER_REPORT_VERSION,
    REASON_PATTERN,
    PeerReport,
    PeerVerdict,
)
from disagg.worker.contracts.topology import Role
from disagg.worker.kv import wire
from disagg.worker.kv.errors import CompatibilityHashMismatch, DisaggError, HandshakeError
from disagg.worker.reporting.startup import PeerKey, StartupGrace
from disagg.worker.sidecar.config import SidecarConfig

MAX_MESSAGE_CHARS: Final = 4000

Status = Literal["True", "False", "Unknown"]


def peer_role(role: Role) -> Role:
    return "decode" if role == "prefill" else "prefill"


@dataclass(frozen=True)
class Peer:
    """A peer engine pod as its Pod object shows it; `host` is None until it has an IP."""

    pod: str
    role: Role
    stage: int
    engine_id: str
    host: str | None
    port: int
    head: str | None = None
    """The head pod whose side channel answers for this stage (a PP prefill's stages ≥ 1); None: its own."""

    @property
    def where(self) -> str:
        if self.role == "prefill":
            return f"prefill stage {self.stage} (pod {self.pod})"
        return f"decode pod {self.pod}"

    @property
    def address(self) -> str:
        through = f" (the side channel of its head pod {self.head})" if self.head else ""
        return f"{self.host}:{self.port}{through}"

    @property
    def key(self) -> PeerKey:
        """The peer as the startup grace knows it: a pod recreated at another address is another peer."""
        return self.pod, f"{self.host}:{self.port}"


@dataclass
class Advertised:
    """What a peer's side channel advertised during one check (its first reply's hash and engine id), noted
    before the checks run so that a refusal still says what the peer offered."""

    engine_id: str = ""
    kv_hash: str = ""
    answered: bool = False
    """Whether any rank's reply carried a payload (a refusal after that is the peer's answer)."""

    def note(self, reply: RankReply) -> None:
        self.answered = True
        if self.kv_hash or self.engine_id:
            return
        try:
            facts = payload_facts(reply.payload)
        except DisaggError:
            return
        self.kv_hash = facts.compatibility_hash
        self.engine_id = facts.engine_id or ""


def peer_from_pod(pod: Mapping[str, Any]) -> Peer | None:
    """A Pod (camelCase dict, as the API serves it) as a peer; None for a pod that is not an engine pod.

    Engine ids and stages follow the sidecar's own defaults (`engine_pods.engine_pod`): a prefill pod is
    stage `<ordinal>` of engine `<StatefulSet name>`, a decode pod is an engine of its own, unless the sidecar
    container sets `DISAGG_ENGINE_ID` / `DISAGG_PP_RANK` explicitly.
    """
    found = engine_pod(pod)
    if found is None:
        return None
    return Peer(found.name, found.role, found.stage, found.engine_id, found.host, found.side_channel_port)


def through_heads(peers: Sequence[Peer]) -> list[Peer]:
    """Each prefill stage addressed where its engine serves it: the side channel of the engine's head pod
    (stage 0), which answers for every `(pp_rank, tp_rank)` of the engine, as vLLM's EngineCore does on node
    rank 0 (headless stage pods serve none) and the head's transfer sidecar does by republishing. A stage
    whose head is missing or has no IP yet has no address (`host` None) until it has."""
    heads = {peer.engine_id: peer for peer in peers if peer.role == "prefill" and peer.stage == 0}
    out = []
    for peer in peers:
        if peer.role != "prefill" or peer.stage == 0:
            out.append(peer)
            continue
        head = heads.get(peer.engine_id)
        host, port = (head.host, head.port) if head is not None else (None, peer.port)
        out.append(replace(peer, host=host, port=port, head=head.pod if head is not None else None))
    return out


def peers_from_pods(pods: Iterable[Mapping[str, Any]], config: SidecarConfig) -> list[Peer]:
    """The other role's live engine pods (pods being deleted are no longer peers), in a stable order, each
    at its own Pod's address (`through_heads` gives where a stage is asked for)."""
    wanted = peer_role(config.role)
    peers = [
        peer
        for pod in pods
        if not (pod.get("metadata") or {}).get("deletionTimestamp")
        and (peer := peer_from_pod(pod)) is not None
        and peer.role == wanted
    ]
    return sorted(peers, key=lambda peer: (peer.stage, peer.pod))


def handshake_peer(
    config: SidecarConfig,
    peer: Peer,
    host: str,
    targets: Sequence[tuple[int, int]],
    *,
    timeout_s: float,
    live: PayloadFacts | None = None,
    advertised: Advertised | None = None,
) -> list[PeerHandshake]:
    """Handshake `targets` of `peer` at `host` expecting this sidecar's compatibility hash and the peer's
    engine id, as the connector would; with `live` (what this pod's own engine advertises), expecting the
    engine's live hash instead, which is what vLLM itself checks. `peer.engine_id` is the stable prefix the
    operator's engine launcher extends with a per-start suffix; `wire.engine_id_matches` accepts the prefix
    plus one such suffix. `advertised` notes what the peer offered."""
    observe = advertised.note if advertised is not None else None
    if live is not None:
        return live_handshake(config, live, peer, host, targets, timeout_s=timeout_s, observe=observe)
    return handshake(
        host,
        peer.port,
        targets,
        expected_hash=config.compat_hash,
        expected_engine_id=peer.engine_id,
        local_factors=config.compat_factors,
        timeout_s=timeout_s,
        observe=observe,
    )


def live_handshake(
    config: SidecarConfig,
    live: PayloadFacts,
    peer: Peer,
    host: str,
    targets: Sequence[tuple[int, int]],
    *,
    timeout_s: float,
    observe: Callable[[RankReply], None] | None = None,
) -> list[PeerHandshake]:
    """vLLM's check between two live engines: every rank's advertised hash against this engine's, then the
    peer's engine id. A mismatch names both engines and what the payloads show of the difference."""
    out = []
    for reply in fetch_payloads(host, peer.port, targets, timeout_s=timeout_s):
        if observe is not None:
            observe(reply)
        facts = payload_facts(reply.payload)
        if facts.compatibility_hash != live.compatibility_hash:
            differences = tuple(live_differences(live, facts, config.compat_factors))
            raise CompatibilityHashMismatch(
                f"this pod's own engine {live.engine_id or config.engine_id} advertises compatibility hash "
                f"{live.compatibility_hash}, {peer.where} engine {facts.engine_id} rank (pp {reply.pp_rank}, "
                f"tp {reply.tp_rank}) advertises {facts.compatibility_hash}, so vLLM refuses the handshake; "
                f"the engines differ in {'; '.join(differences)}",
                differences=differences,
            )
        metadata = wire.decode_handshake_payload(
            reply.payload, expected_hash=None, expected_engine_id=peer.engine_id
        )
        out.append(PeerHandshake(reply.pp_rank, reply.tp_rank, metadata, reply.clock_offset_s))
    return out


def peer_refusal(peer: Peer, check: Callable[[], object]) -> DisaggError | None:
    """Run one check of `peer`; the connector's refusal it raised, or None when the peer would be accepted."""
    try:
        check()
    except DisaggError as exc:
        return exc
    except ValueError as exc:
        # The routing helpers raise ValueError for geometry they cannot pair (TP sizes that do not divide).
        return as_disagg_error(exc, f"handshake with {peer.where}")
    return None


def check_peer(
    config: SidecarConfig,
    local: LocalKV | None,
    peer: Peer,
    *,
    timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
    live: PayloadFacts | None = None,
    advertised: Advertised | None = None,
) -> DisaggError | None:
    """Handshake one peer as the connector would; the refusal, or None when it would be accepted.

    A prefill stage (which needs its registered `local` KV) asks the decode pod for the decode ranks its TP
    rank writes to and plans each one; a decode pod asks the prefill stage for the ranks its TP rank registers
    with. Nothing here adds a NIXL agent.
    """
    host = peer.host
    if host is None:
        raise ValueError(f"{peer.where} has no IP yet")
    if config.role == "prefill" and local is None:
        raise ValueError("a prefill stage checks its decode peers against its registered KV")
    topology = config.topology

    def check() -> None:
        if local is not None and config.role == "prefill":
            targets = handshake_targets(config.tp_size, config.tp_rank, topology.decode_tp, 1)
            ranks = handshake_peer(config, peer, host, targets, timeout_s=timeout_s, advertised=advertised)
            for rank in ranks:
                plan_decode_rank(local, rank.metadata, topology.decode_tp, rank.tp_rank)
        else:
            tp_ranks = handshake_target_tp_ranks(config.tp_size, config.tp_rank, topology.prefill_tp)
            targets = [(peer.stage, tp) for tp in tp_ranks]
            handshake_peer(config, peer, host, targets, timeout_s=timeout_s, live=live, advertised=advertised)

    return peer_refusal(peer, check)


@dataclass(frozen=True)
class PeerResult:
    peer: Peer
    error: DisaggError | None
    engine_id: str = ""
    """The live engine id the peer's side channel answered with ("" if it did not answer)."""
    kv_hash: str = ""
    """The compatibility hash the peer advertised ("" if it did not answer)."""
    answered: bool = True
    """Whether the peer's side channel answered with a payload this round; False for one that is not up
    yet (unreachable, or serving no payload), which the startup grace may hold back (`hold_back`)."""


@dataclass(frozen=True)
class Starting:
    """A peer that has never answered and whose failure the startup grace holds back this round."""

    result: PeerResult
    grace_left_s: float


def checked(peer: Peer, error: DisaggError | None, seen: Advertised) -> PeerResult:
    """One peer's result from its check and what its side channel advertised during it."""
    return PeerResult(peer, error, seen.engine_id, seen.kv_hash, answered=error is None or seen.answered)


def hold_back(
    results: Sequence[PeerResult], grace: StartupGrace | None
) -> tuple[list[PeerResult], list[Starting]]:
    """The results to report this round, and those of peers still starting (never answered, within their
    grace); without a grace, every result is reported."""
    if grace is None:
        return list(results), []
    reported, starting = [], []
    for result in results:
        if result.error is None:
            grace.answered(result.peer.key)
            reported.append(result)
        elif (left := grace.left(result.peer.key, result.answered)) is not None:
            starting.append(Starting(result, left))
        else:
            reported.append(result)
    return reported, starting


@dataclass(frozen=True)
class Outcome:
    """What this pod's `disagg.io/kv-transfer-ready` condition says, and the refusals to post as Events."""

    status: Status
    reason: str
    message: str
    refusals: tuple[PeerResult, ...] = ()
    warnings: tuple[tuple[str, str], ...] = ()
    """(reason, message) pairs posted as Warning Events without failing the condition."""
    report: PeerReport | None = None
    """The round's peer report for the Pod's annotation; None leaves the annotation as it is."""


def _clip(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


def refusal_message(result: PeerResult) -> str:
    """One refusal, naming the peer and its address: `decode pod x at 10.0.0.3:5600: <why>`."""
    error = result.error
    assert error is not None, "only a refusal has a refusal message"
    return f"{result.peer.where} at {result.peer.address}: {error.message}"


def _refusals(refused: Sequence[PeerResult]) -> str:
    """`prefill stage 1 (pod p-1) at 10.0.0.2:5600 with MissingLayers: <why>; ...`"""
    parts = []
    for result in refused:
        assert result.error is not None
        peer, error = result.peer, result.error
        parts.append(f"{peer.where} at {peer.address} with {error.reason}: {error.message}")
    return "; ".join(parts)


def _awaited(peer: Peer) -> str:
    if peer.role == "prefill" and peer.stage > 0:
        head = f"head pod {peer.head}" if peer.head else "head pod (stage 0)"
        return f"{peer.where}'s {head}, which serves its side channel,"
    return peer.where


def _first_answer(starting: Starting) -> str:
    """`decode pod d-1 at 10.0.0.3:5600 to answer (PeerUnreachable: ...; 540 s of its startup grace left)`"""
    result = starting.result
    assert result.error is not None
    return (
        f"{result.peer.where} at {result.peer.address} to answer ({result.error.reason}: "
        f"{result.error.message}; {starting.grace_left_s:.0f} s of its startup grace left)"
    )


def summarize(
    config: SidecarConfig,
    results: Sequence[PeerResult],
    pending: Sequence[Peer],
    starting: Sequence[Starting] = (),
) -> Outcome:
    """This pod's verdict from one round of checks (`pending`: peers without an IP, not checked; `starting`:
    peers that have never answered, held back by the startup grace). Pure.

    True while at least one peer engine accepts this pod on every one of its pods (all stages of a prefill
    engine); False when some peer refuses and no engine is usable; Unknown before any peer could be asked or
    while the only peers are still starting.
    """
    refused = tuple(result for result in results if result.error is not None)
    waiting_engines = {peer.engine_id for peer in pending} | {s.result.peer.engine_id for s in starting}
    broken_engines = {result.peer.engine_id for result in refused} | waiting_engines
    usable = [r.peer for r in results if r.error is None and r.peer.engine_id not in broken_engines]
    waiting = f"; waiting for {', '.join(_awaited(peer) for peer in pending)} to get an IP" if pending else ""
    if starting:
        waiting += f"; waiting for {', '.join(_first_answer(s) for s in starting)}"
    if usable:
        names = ", ".join(peer.where for peer in usable)
        if refused:
            message = f"handshakes succeeded with {names}; refused by {_refusals(refused)}{waiting}"
            return Outcome("True", "SomePeersRefused", _clip(message), refused)
        return Outcome("True", "HandshakesSucceeded", _clip(f"handshakes succeeded with {names}{waiting}"))
    if refused:
        first = refused[0].error
        assert first is not None
        return Outcome("False", first.reason, _clip(f"refused by {_refusals(refused)}{waiting}"), refused)
    others = "decode pods" if config.role == "prefill" else "prefill stages"
    if pending or starting:
        return Outcome("Unknown", "AwaitingPeers", _clip(f"no usable {others} yet{waiting}"))
    return Outcome("Unknown", "NoPeers", f"no {others} of this deployment exist yet")


def check_round(
    config: SidecarConfig,
    local: LocalKV | None,
    pods: Iterable[Mapping[str, Any]],
    *,
    timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
    grace: StartupGrace | None = None,
) -> Outcome:
    """Handshake every peer among `pods` once and summarize; with `grace` (kept from round to round), a
    peer that has never answered is pending until its startup grace has passed."""
    peers = through_heads(peers_from_pods(pods, config))
    pending = [peer for peer in peers if peer.host is None]
    results = []
    for peer in peers:
        if peer.host is not None:
            seen = Advertised()
            results.append(
                checked(peer, check_peer(config, local, peer, timeout_s=timeout_s, advertised=seen), seen)
            )
    if grace is not None:
        grace.keep_only(peer.key for peer in peers if peer.host is not None)
    reported, starting = hold_back(results, grace)
    engine_id, kv_hash = own_identity(config, local)
    outcome = summarize(config, reported, pending, starting)
    # A peer still starting is not yet checked, as one without an IP: the report vouches for it or not later.
    return replace(outcome, report=peer_report(engine_id, kv_hash, reported))


def own_identity(config: SidecarConfig, local: LocalKV | None) -> tuple[str, str]:
    """(live engine id, compatibility hash) this pod's worker advertises: what its registered KV's payload
    says, as a peer reads it; the configuration's before the engine registered."""
    if local is None:
        return config.engine_id, config.compat_hash or ""
    facts = payload_facts(local.handshake_payload())
    return facts.engine_id or config.engine_id, facts.compatibility_hash


def _bounded(text: str, limit: int) -> str:
    # A peer's answer is untrusted: a value too long for the report is unknown, not an unreadable report.
    return text if len(text) <= limit else ""


def peer_report(engine_id: str, kv_hash: str, results: Sequence[PeerResult]) -> PeerReport:
    """The annotation's report of one round: a verdict per peer handshaken (not those still without an IP),
    at most `MAX_PEERS`. Pure."""
    verdicts = []
    for result in results[:MAX_PEERS]:
        reason = OK_REASON if result.error is None else result.error.reason
        if len(reason) > MAX_REASON_CHARS or not re.fullmatch(REASON_PATTERN, reason):
            reason = HandshakeError.reason
        differences = result.error.differences if isinstance(result.error, CompatibilityHashMismatch) else ()
        verdicts.append(
            PeerVerdict(
                pod=result.peer.pod,
                engine_id=_bounded(result.engine_id, MAX_ENGINE_ID_CHARS),
                ok=result.error is None,
                reason=reason,
                kv_hash=_bounded(result.kv_hash, MAX_HASH_CHARS),
                differs=_clipped(differences[0] if differences else "", MAX_DIFFERS_CHARS),
            )
        )
    report = PeerReport(
        version=PEER_REPORT_VERSION,
        engine_id=engine_id[:MAX_ENGINE_ID_CHARS],
        kv_hash=_bounded(kv_hash, MAX_HASH_CHARS),
        peers=tuple(verdicts),
    )
    if len(msgspec.json.encode(report)) > MAX_PEER_REPORT_BYTES:
        # The differences are a courtesy: a report with every peer refused must still fit.
        report = msgspec.structs.replace(
            report, peers=tuple(msgspec.structs.replace(v, differs="") for v in report.peers)
        )
    return report


def _clipped(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
