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
3. writes the Pod condition and Events (`k8s_report.PodReporter`, through `status_loop.PeerReporter`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterable, Mapping, Sequence
from types import FrameType
from typing import Any

from disagg.worker import rules, wire
from disagg.worker.errors import (
    BlockSizeMismatch,
    DisaggError,
    HandshakeError,
    RegionGeometryMismatch,
    WorkerConfigError,
)
from disagg.worker.layout import AttentionKind
from disagg.worker.peer_check import (
    Outcome,
    Peer,
    PeerResult,
    check_peer,
    peers_from_pods,
    refusal_message,
    summarize,
)
from disagg.worker.push import as_disagg_error
from disagg.worker.routing import RegionGeometry, align_remote_regions, slice_pp_regions
from disagg.worker.side_channel import (
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    PeerHandshake,
    handshake,
    handshake_targets,
)
from disagg.worker.sidecar import configure_logging
from disagg.worker.sidecar_config import SidecarConfig, from_env
from disagg.worker.status_loop import PeerReporter, pod_api_client

log = logging.getLogger("disagg.worker.watch")
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
        config.side_channel_host,
        config.side_channel_port,
        own_targets(config),
        expected_hash=config.compat_hash,
        expected_engine_id=config.engine_id,
        local_factors=config.compat_factors,
        timeout_s=timeout_s,
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


def check_decode_metadata(
    config: SidecarConfig, own: wire.NixlAgentMetadata, remote: wire.NixlAgentMetadata, tp_rank: int
) -> None:
    """Would TP rank `tp_rank` of this prefill stage, advertising `own`, accept a decode rank advertising
    `remote`? The checks of `push_producer.plan_decode_rank`, with the engine's advertised metadata in place
    of a registered `LocalKV`. Pure; raises the connector's refusal."""
    topology = config.topology
    model = topology.model
    remote_tp = topology.decode_tp
    packed = own.kv_cache_layout == "BLHNC"
    layer_routing = rules.requires_layer_name_routing(
        rules.PUSH, model.hma_required, packed, model.has_mamba, config.pp_size
    )
    if layer_routing:
        violation = rules.block_size_mismatch(True, own.block_size, remote.block_size)
        if violation is not None:
            raise BlockSizeMismatch(violation.message)
        violation = rules.decode_tp_exceeds_prefill_tp(model.is_mla, config.tp_size, remote_tp, True)
        if violation is not None:
            raise HandshakeError(violation.message, reason=violation.reason)
    elif own.block_size != remote.block_size:
        raise BlockSizeMismatch(
            f"prefill block size {own.block_size} and decode block size {remote.block_size} differ; "
            "this connector moves whole blocks: use equal block sizes"
        )
    geometry = RegionGeometry.from_metadata(remote)
    if layer_routing:
        names = [name for members in own.region_members for name in members]
        local_regions = [region for region, members in enumerate(own.region_members) for _ in members]
        aligned = align_remote_regions(geometry, names)
    else:
        local_regions = list(range(len(own.kv_caches_base_addr)))
        if config.pp_size > 1:
            layers = topology.stage_layers[config.pp_rank]
            aligned = slice_pp_regions(
                geometry,
                start_layer=layers.start,
                num_local_layers=len(layers),
                num_local_regions=len(local_regions),
            )
        else:
            aligned = geometry
    if len(aligned.kv_caches_base_addr) != len(local_regions):
        raise RegionGeometryMismatch(
            f"the decoder has {len(aligned.kv_caches_base_addr)} regions for this stage's "
            f"{len(local_regions)}"
        )
    if (
        aligned.region_mem_types is not None
        and own.region_mem_types is not None
        and set(aligned.region_mem_types) != set(own.region_mem_types)
    ):
        raise RegionGeometryMismatch(
            f"decode regions are {sorted(set(aligned.region_mem_types))}, this stage's engine moves "
            f"{sorted(set(own.region_mem_types))} (mixed-memory caches are not supported by push)"
        )
    replicated = _replicated(config, own)
    local_heads = max(1, model.num_kv_heads // config.tp_size)
    remote_heads = max(1, model.num_kv_heads // remote_tp)
    names_of = own.region_names or [f"region {r}" for r in range(len(own.kv_caches_base_addr))]
    for i, r in enumerate(local_regions):
        local_len = own.block_lens[r]
        want = local_len if replicated[r] else local_len * remote_heads // local_heads
        got_len, stride = aligned.block_lens[i], aligned.block_strides[i]
        if got_len != want or stride < got_len:
            raise RegionGeometryMismatch(
                f"decode region for {names_of[r]} has block length {got_len} (stride {stride}); "
                f"TP rank {tp_rank} of this stage ({local_heads} of {model.num_kv_heads} KV heads, block "
                f"length {local_len}) needs {want} with stride >= length"
            )


def check_decode_peer(
    config: SidecarConfig,
    own: Sequence[PeerHandshake],
    peer: Peer,
    *,
    timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
) -> DisaggError | None:
    """A prefill stage's check of one decode pod: handshake the decode ranks each of its engine's TP ranks
    writes to, and check each against that rank's own metadata (`own`, from `check_own_engine`)."""
    if peer.host is None:
        raise ValueError(f"{peer.where} has no IP yet")
    decode_tp = config.topology.decode_tp
    try:
        wanted = {mine.tp_rank: handshake_targets(config.tp_size, mine.tp_rank, decode_tp, 1) for mine in own}
        targets = sorted({target for ranks in wanted.values() for target in ranks})
        ranks = handshake(
            peer.host,
            peer.port,
            targets,
            expected_hash=config.compat_hash,
            expected_engine_id=peer.engine_id,
            local_factors=config.compat_factors,
            timeout_s=timeout_s,
        )
        by_target = {(rank.pp_rank, rank.tp_rank): rank.metadata for rank in ranks}
        for mine in own:
            for target in wanted[mine.tp_rank]:
                check_decode_metadata(config, mine.metadata, by_target[target], mine.tp_rank)
    except DisaggError as exc:
        return exc
    except ValueError as exc:
        # The routing helpers raise ValueError for geometry they cannot pair (TP sizes that do not divide).
        return as_disagg_error(exc, f"handshake with {peer.where}")
    return None


def watch_round(
    config: SidecarConfig,
    pod: str,
    pods: Iterable[Mapping[str, Any]],
    *,
    timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
) -> Outcome:
    """One round of a watching sidecar in pod `pod`: its own engine first, then every peer among `pods`.

    Peers are not asked while the pod's own engine is unreachable or refused: its condition is then False
    with the engine's reason, whatever the peers say.
    """
    engine = own_engine(config, pod)
    try:
        own = check_own_engine(config, timeout_s=timeout_s)
    except DisaggError as exc:
        named = type(exc)(f"this pod's own engine {config.engine_id}: {exc.message}", reason=exc.reason)
        result = PeerResult(engine, named)
        return Outcome("False", named.reason, refusal_message(result), (result,))
    peers = peers_from_pods(pods, config)
    pending = [peer for peer in peers if peer.host is None]
    results = []
    for peer in peers:
        if peer.host is None:
            continue
        if config.role == "prefill":
            error = check_decode_peer(config, own, peer, timeout_s=timeout_s)
        else:
            error = check_peer(config, None, peer, timeout_s=timeout_s)
        results.append(PeerResult(peer, error))
    return summarize(config, results, pending)


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
    pod = env["POD_NAME"]
    with api:
        reporter = PeerReporter.for_pod(
            config,
            None,
            api,
            env,
            interval_s=interval_s,
            check=lambda pods: watch_round(config, pod, pods),
        )
        log.info(
            "%s: watching %s engine %s (pp %d) on %s:%d and its peers",
            pod,
            config.role,
            config.engine_id,
            config.pp_rank,
            config.side_channel_host,
            config.side_channel_port,
        )
        reporter.start()
        stop.wait()
        reporter.stop()
    return 0


def main(env: Mapping[str, str] | None = None, *, interval_s: float = DEFAULT_INTERVAL_S) -> int:
    """`disagg worker sidecar --mode watch`: exits 0 on SIGTERM or SIGINT, 2 on a bad configuration."""
    env = os.environ if env is None else env
    configure_logging(env.get("DISAGG_LOG_LEVEL", "info"))
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
