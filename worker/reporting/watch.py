"""The watching sidecar (`disagg worker sidecar --mode watch`): reports on KV transfer, moves no data.

A vLLM engine runs `NixlPushConnector` in-process: it owns the NIXL agent and serves its own side channel on
the pod's IP and side-channel port, so this sidecar binds neither. Each round it

1. handshakes its own engine's side channel (`DISAGG_SIDE_CHANNEL_HOST`/`_PORT`, the pod IP by default) for
   every `(pp_rank, tp_rank)` the pod's engine serves (this stage, every TP rank) with the vLLM-compatible
   client (`side_channel.handshake`: the spec's compatibility hash first, then the connector version, then
   the engine id). An engine that does not answer or advertises something else makes the condition False
   with that reason, naming the engine;
2. checks the other role's pods of its deployment: a decode pod as `peer_check.check_peer` does; a prefill
   stage handshakes each decoder as the connector would and checks every decode rank's metadata against its
   own engine's (`check_decode_metadata`: block size, decode TP, layer alignment by name, region count,
   memory type and block length), since there is no registered `LocalKV` to plan with here;
3. writes the Pod condition and Events (`pod_report.PodReporter`, through `status_loop.PeerReporter`).

An engine (its own or a peer's) that has never answered is pending for the startup grace (`startup`): the
condition is Unknown (`AwaitingEngine`, `AwaitingPeers`) while a deployment's engines load, not False.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any

from disagg.worker.connector.side_channel import (
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    PeerHandshake,
    fetch_payloads,
    handshake,
    handshake_targets,
)
from disagg.worker.contracts.payload_facts import PayloadFacts, payload_facts, prediction_differences
from disagg.worker.contracts.peer_report import PeerReport
from disagg.worker.contracts.pod_contract import LOG_LEVEL_ENV, POD_NAME_ENV
from disagg.worker.kv import rules, wire
from disagg.worker.kv.decode_checks import LocalRegion, PrefillRank, check_decode_agent
from disagg.worker.kv.errors import CompatibilityHashMismatch, DisaggError, WorkerConfigError
from disagg.worker.kv.layout import AttentionKind
from disagg.worker.reporting.engine_lanes import EngineLanes
from disagg.worker.reporting.peer_check import (
    Advertised,
    Outcome,
    Peer,
    PeerResult,
    check_peer,
    checked,
    handshake_peer,
    hold_back,
    peer_refusal,
    peer_report,
    peers_from_pods,
    refusal_message,
    summarize,
    through_heads,
)
from disagg.worker.reporting.startup import StartupGrace
from disagg.worker.reporting.status_loop import PeerReporter, pod_api_client
from disagg.worker.sidecar.config import SidecarConfig, from_env
from disagg.worker.sidecar.logs import configure_logging

log = logging.getLogger("disagg.worker.reporting.watch")
DEFAULT_INTERVAL_S = 10.0


def own_targets(config: SidecarConfig) -> list[tuple[int, int]]:
    """The workers the pod's engine serves on its side channel: this stage, every TP rank."""
    return [(config.pp_rank, tp_rank) for tp_rank in range(config.tp_size)]


def own_engine(config: SidecarConfig, pod: str) -> Peer:
    """This pod's engine, addressed as a peer would address it."""
    return Peer(
        pod, config.role, config.pp_rank, config.engine_id, config.side_channel_host, config.side_channel_port
    )


def check_own_engine(
    config: SidecarConfig, *, timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
) -> list[PeerHandshake]:
    """Handshake this pod's engine as a peer would: the spec's hash, the connector version, its engine id."""
    return handshake(
        config.engine_host,
        config.side_channel_port,
        own_targets(config),
        expected_hash=config.compat_hash,
        expected_engine_id=config.engine_id,
        local_factors=config.compat_factors,
        timeout_s=timeout_s,
    )


@dataclass(frozen=True)
class OwnEngine:
    """What this pod's engine advertises on its ranks, and how that compares with the spec's prediction."""

    ranks: list[PeerHandshake]
    live: PayloadFacts
    prediction_error: DisaggError | None
    """The refusal the spec's predicted hash gives the live engine, or None when they agree."""


def read_own_engine(
    config: SidecarConfig,
    *,
    timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
    advertised: Advertised | None = None,
) -> OwnEngine:
    """Fetch this pod's engine's ranks (at its head for a PP stage) and decode them with the engine's own
    live hash, which is what its peers check; the spec's prediction is compared, not enforced. `advertised`
    notes whether (and what) the engine answered."""
    replies = fetch_payloads(
        config.engine_host, config.side_channel_port, own_targets(config), timeout_s=timeout_s
    )
    if advertised is not None:
        for reply in replies:
            advertised.note(reply)
    facts = [payload_facts(reply.payload) for reply in replies]
    hashes = sorted({fact.compatibility_hash for fact in facts})
    if len(hashes) > 1:
        raise CompatibilityHashMismatch(
            f"the engine's ranks {[(r.pp_rank, r.tp_rank) for r in replies]} advertise different "
            f"compatibility hashes {hashes}"
        )
    ranks = [
        PeerHandshake(
            reply.pp_rank,
            reply.tp_rank,
            wire.decode_handshake_payload(
                reply.payload, expected_hash=None, expected_engine_id=config.engine_id
            ),
            reply.clock_offset_s,
        )
        for reply in replies
    ]
    prediction_error = None
    if config.compat_hash is not None and hashes[0] != config.compat_hash:
        try:
            wire.decode_handshake_payload(
                replies[0].payload, expected_hash=config.compat_hash, local_factors=config.compat_factors
            )
        except DisaggError as exc:
            prediction_error = exc
    return OwnEngine(ranks, facts[0], prediction_error)


def prediction_warning(config: SidecarConfig, own: OwnEngine) -> tuple[str, str]:
    """The Warning Event for an engine whose live hash its peers accept but the spec does not predict."""
    factors = "; ".join(prediction_differences(config.compat_factors, own.live))
    return (
        "CompatibilityHashPredictionDiffers",
        f"the engines agree (the peers that accept this engine advertise its compatibility hash "
        f"{own.live.compatibility_hash}), but the spec predicts {config.compat_hash}: the prediction "
        f"differs in {factors}; fix spec.engine (version, attention backend, model string) so the operator "
        "predicts the hash the engines compute",
    )


def _replicated(config: SidecarConfig, own: wire.NixlAgentMetadata) -> list[bool]:
    """Per own region: whether every member layer is MLA (replicated across TP ranks, never head-split).
    Without advertised members, only an all-MLA model has replicated regions."""
    model = config.topology.model
    if not own.region_members:
        return [model.is_mla] * len(own.kv_caches_base_addr)
    kinds = dict(zip(model.layer_names, model.kinds, strict=True))
    return [
        bool(members) and all(kinds.get(name) is AttentionKind.MLA for name in members)
        for members in own.region_members
    ]


def _own_prefill_rank(config: SidecarConfig, own: wire.NixlAgentMetadata, tp_rank: int) -> PrefillRank:
    """TP rank `tp_rank` of this prefill stage, advertising `own`, as the decode checks read it."""
    model = config.topology.model
    layer_routing = rules.requires_layer_name_routing(
        rules.PUSH,
        model.hma_required,
        own.kv_cache_layout == "BLHNC",
        model.has_mamba,
        config.pp_size,
        connector_version=config.topology.connector_version,
    )
    routed = (
        tuple((name, region) for region, members in enumerate(own.region_members) for name in members)
        if layer_routing
        else None
    )
    names = own.region_names or [f"region {r}" for r in range(len(own.kv_caches_base_addr))]
    regions = zip(names, own.block_lens, _replicated(config, own), strict=True)
    return PrefillRank(
        block_size=own.block_size,
        routed_layers=routed,
        pp_size=config.pp_size,
        stage_layers=config.topology.stage_layers[config.pp_rank],
        regions=tuple(LocalRegion(name, block_len, replicated) for name, block_len, replicated in regions),
        mem_types=None if own.region_mem_types is None else frozenset(own.region_mem_types),
        tp_rank=tp_rank,
        tp_size=config.tp_size,
        num_kv_heads=model.num_kv_heads,
        is_mla=model.is_mla,
        kv_cache_layout=own.kv_cache_layout,
        region_group_ids=None if own.region_group_ids is None else tuple(own.region_group_ids),
        blocks_per_logical=own.physical_blocks_per_logical_kv_block,
        whole_model=layer_routing and config.pp_size == 1,
    )


def check_decode_metadata(
    config: SidecarConfig, own: wire.NixlAgentMetadata, remote: wire.NixlAgentMetadata, tp_rank: int
) -> None:
    """Would TP rank `tp_rank` of this prefill stage, advertising `own`, accept a decode rank advertising
    `remote`? `producer.plan_decode_rank`'s checks (`decode_checks.check_decode_agent`), with the
    engine's advertised metadata in place of a registered `LocalKV`. Pure; raises the connector's refusal."""
    check_decode_agent(_own_prefill_rank(config, own, tp_rank), remote, config.topology.decode_tp)


def check_decode_peer(
    config: SidecarConfig,
    own: Sequence[PeerHandshake],
    peer: Peer,
    *,
    timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
    live: PayloadFacts | None = None,
    advertised: Advertised | None = None,
) -> DisaggError | None:
    """A prefill stage's check of one decode pod: handshake the decode ranks each of its engine's TP ranks
    writes to, and check each against that rank's own metadata (`own`, from `check_own_engine`)."""
    host = peer.host
    if host is None:
        raise ValueError(f"{peer.where} has no IP yet")
    decode_tp = config.topology.decode_tp

    def check() -> None:
        wanted = {mine.tp_rank: handshake_targets(config.tp_size, mine.tp_rank, decode_tp, 1) for mine in own}
        targets = sorted({target for ranks in wanted.values() for target in ranks})
        ranks = handshake_peer(
            config, peer, host, targets, timeout_s=timeout_s, live=live, advertised=advertised
        )
        by_target = {(rank.pp_rank, rank.tp_rank): rank.metadata for rank in ranks}
        for mine in own:
            for target in wanted[mine.tp_rank]:
                check_decode_metadata(config, mine.metadata, by_target[target], mine.tp_rank)

    return peer_refusal(peer, check)


def watch_round(
    config: SidecarConfig,
    pod: str,
    pods: Iterable[Mapping[str, Any]],
    *,
    timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
    grace: StartupGrace | None = None,
) -> Outcome:
    """One round of a watching sidecar in pod `pod`: its own engine first, then every peer among `pods`.

    Peers are not asked while the pod's own engine is unreachable or refused: its condition is then False
    with the engine's reason, whatever the peers say. With `grace` (kept from round to round), an engine
    that has never answered, this pod's or a peer's, is pending until its startup grace has passed.
    """
    engine = own_engine(config, pod)
    peers = through_heads(peers_from_pods(pods, config))
    if grace is not None:
        grace.keep_only([engine.key, *(peer.key for peer in peers if peer.host is not None)])

    def refused(exc: DisaggError, report: PeerReport) -> Outcome:
        named = type(exc)(f"this pod's own engine {config.engine_id}: {exc.message}", reason=exc.reason)
        result = PeerResult(engine, named)
        return Outcome("False", named.reason, refusal_message(result), (result,), report=report)

    own_seen = Advertised()
    try:
        own = read_own_engine(config, timeout_s=timeout_s, advertised=own_seen)
    except DisaggError as exc:
        # Nothing is vouched for while the pod's own engine does not answer as expected.
        left = None if grace is None else grace.left(engine.key, own_seen.answered)
        if left is not None:
            return Outcome(
                "Unknown",
                "AwaitingEngine",
                f"waiting for this pod's own engine {config.engine_id} at {engine.address} to answer its "
                f"first handshake ({exc.reason}: {exc.message}; {left:.0f} s of its startup grace left)",
                report=peer_report(config.engine_id, "", []),
            )
        return refused(exc, peer_report(config.engine_id, "", []))
    if grace is not None:
        grace.answered(engine.key)
    pending = [peer for peer in peers if peer.host is None]
    results = []
    for peer in peers:
        if peer.host is None:
            continue
        seen = Advertised()
        if config.role == "prefill":
            error = check_decode_peer(
                config, own.ranks, peer, timeout_s=timeout_s, live=own.live, advertised=seen
            )
        else:
            error = check_peer(config, None, peer, timeout_s=timeout_s, live=own.live, advertised=seen)
        results.append(checked(peer, error, seen))
    results, starting = hold_back(results, grace)
    report = peer_report(own.live.engine_id or config.engine_id, own.live.compatibility_hash, results)
    if own.prediction_error is None:
        return replace(summarize(config, results, pending, starting), report=report)
    if not results and starting:
        # The peers that would settle it are still starting: until one answers, the prediction is a note.
        outcome = replace(summarize(config, results, pending, starting), report=report)
        factors = "; ".join(prediction_differences(config.compat_factors, own.live))
        note = (
            f"; this engine advertises compatibility hash {own.live.compatibility_hash}, the spec predicts "
            f"{config.compat_hash} (it differs in {factors}): the peers settle whether that matters"
        )
        return replace(outcome, message=outcome.message + note)
    if not results:
        # No live peer to compare with yet: until one answers, the prediction is all there is.
        factors = "; ".join(prediction_differences(config.compat_factors, own.live))
        error = own.prediction_error
        message = f"{error.message}; the engine differs in {factors}"
        return refused(type(error)(message, reason=error.reason), report)
    outcome = replace(summarize(config, results, pending, starting), report=report)
    warning = prediction_warning(config, own)
    if outcome.status != "True":
        return outcome
    return replace(
        outcome, reason=warning[0], message=f"{outcome.message}; {warning[1]}", warnings=(warning,)
    )


def run(env: Mapping[str, str], stop: threading.Event, *, interval_s: float = DEFAULT_INTERVAL_S) -> int:
    """Watch until `stop` is set: in a pod, report each round to the Pod; elsewhere there is nothing to
    report to, which is a configuration error."""
    config = from_env(env)
    api = pod_api_client(env)
    if api is None:
        raise WorkerConfigError(
            "watch mode reports to its Pod: POD_NAME and POD_NAMESPACE must be set and a Kubernetes client "
            "configured (in-cluster service account or KUBECONFIG)"
        )
    pod = env[POD_NAME_ENV]
    grace = StartupGrace(config.peer_startup_grace_s)
    with api:
        reporter = PeerReporter.for_pod(
            config,
            None,
            api,
            env,
            interval_s=interval_s,
            check=lambda pods: watch_round(config, pod, pods, grace=grace),
            # A prefill engine's agent writes the KV: its UCX log names the transport of its pairs.
            pairs=EngineLanes() if config.role == "prefill" else None,
        )
        log.info(
            "%s: watching %s engine %s (pp %d) on %s:%d and its peers",
            pod,
            config.role,
            config.engine_id,
            config.pp_rank,
            config.engine_host,
            config.side_channel_port,
        )
        reporter.start()
        stop.wait()
        reporter.stop()
    return 0


def main(env: Mapping[str, str] | None = None, *, interval_s: float = DEFAULT_INTERVAL_S) -> int:
    """`disagg worker sidecar --mode watch`: exits 0 on SIGTERM or SIGINT, 2 on a bad configuration."""
    env = os.environ if env is None else env
    configure_logging(env.get(LOG_LEVEL_ENV, "info"))
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return run(env, stop, interval_s=interval_s)
    except DisaggError as exc:
        log.error("invalid watch configuration: %s: %s", exc.reason, exc.message)
        return 2
