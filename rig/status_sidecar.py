"""The rig's reporting-only sidecar: it serves a handshake payload and checks its peers, moving no KV.

`python -m disagg.rig.status_sidecar` is what the local kubelet (`disagg.rig.local_kubelet`) runs in place of
the sidecar of a pod whose engine is not the project's. It reads the sidecar's configuration
(`sidecar.config.from_env`: the pod's downward-API identity and the topology file), lays out and registers a
KV pool of its own with a real NIXL agent (no engine attaches to it), serves that worker's payload on the side
channel as the connector does, and then, every `--interval` seconds, runs the product's `PeerReporter`
(`disagg.worker.reporting.status_loop`): it handshakes the other role's pods of its deployment and writes the
result to its own Pod, as a transfer sidecar would.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType

from disagg.worker.connector.push import LocalKV, agent_name
from disagg.worker.connector.side_channel import SideChannelServer
from disagg.worker.contracts.pod_contract import POD_NAME_ENV
from disagg.worker.kv.errors import DisaggError, WorkerConfigError
from disagg.worker.kv.layout import build_stage_layout
from disagg.worker.link.kv_pool import ShmPool
from disagg.worker.reporting.pod_report import kube_client
from disagg.worker.reporting.status_loop import DEFAULT_INTERVAL_S, PeerReporter
from disagg.worker.sidecar.config import SidecarConfig, from_env
from disagg.worker.sidecar.republisher import Republisher

log = logging.getLogger("disagg.rig.status_sidecar")
DEFAULT_NUM_BLOCKS = 4


@contextlib.contextmanager
def registered_kv(config: SidecarConfig, num_blocks: int, pool_path: Path) -> Iterator[LocalKV]:
    """This worker's KV layout in a fresh pool at `pool_path`, registered with a NIXL agent of its own."""
    from disagg.worker.connector.transport import NixlTransport

    topology = config.topology
    layout = build_stage_layout(
        topology.model,
        pp_rank=config.pp_rank,
        pp_size=config.pp_size,
        tp_size=config.tp_size,
        block_size=topology.block_size,
        num_blocks=num_blocks,
        partition=topology.layer_partition if config.role == "prefill" else None,
        packed=topology.packed,
    )
    pool = ShmPool.create(pool_path, layout.total_bytes)
    try:
        transport = NixlTransport(agent_name(config.engine_id, config.pp_rank, config.tp_rank))
        try:
            yield LocalKV(layout, transport, pool.addr, pool.nbytes, config.push_config())
        finally:
            transport.close()
    finally:
        pool.close()
        pool.unlink()


def run(env: Mapping[str, str], interval_s: float, num_blocks: int, stop: threading.Event) -> int:
    config = from_env(env)
    pod = env.get(POD_NAME_ENV)
    if not pod:
        raise WorkerConfigError(f"{POD_NAME_ENV} is not set (the pod spec sets it from the downward API)")
    pool_path = Path("/dev/shm") / f"disagg-status-{pod}-{os.getpid()}"
    with registered_kv(config, num_blocks, pool_path) as local, kube_client() as api:
        server = SideChannelServer(config.side_channel_host, config.side_channel_port)
        server.set_payload(config.pp_rank, config.tp_rank, local.handshake_payload())
        server.start()
        # The head of a PP engine answers for every stage, as the transfer sidecar's head does.
        republisher = Republisher(config, server).start()
        try:
            log.info(
                "%s: %s engine %s (pp %d, tp %d) serves its side channel on %s:%d",
                pod,
                config.role,
                config.engine_id,
                config.pp_rank,
                config.tp_rank,
                config.side_channel_host,
                config.side_channel_port,
            )
            reporter = PeerReporter.for_pod(config, local, api, env, interval_s=interval_s).start()
            stop.wait()
            reporter.stop()
        finally:
            republisher.stop()
            server.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disagg.rig.status_sidecar", description=__doc__)
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, help="Seconds between rounds.")
    parser.add_argument(
        "--num-blocks", type=int, default=DEFAULT_NUM_BLOCKS, help="Logical KV blocks of the registered pool."
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return run(os.environ, args.interval, args.num_blocks, stop)
    except DisaggError as exc:
        log.error("%s: %s", exc.reason, exc.message)
        return 1


if __name__ == "__main__":
    sys.exit(main())
