"""A sidecar that only reports: it serves its handshake payload and checks its peers, moving no KV.

`python -m disagg.worker.reporting.status_loop` reads the sidecar's configuration (`sidecar.config.from_env`:
the pod's downward-API identity and the topology file), lays out and registers a KV pool of its own with a
real NIXL agent (no engine attaches to it), serves that worker's payload on the side channel as the connector
does, and then, every `--interval` seconds, handshakes the other role's pods of its deployment (`peer_check`)
and writes the result to its own Pod (`pod_report`: the condition, and the peer report annotation
`disagg.io/kv-peers` the router and the operator pair pods by). The cluster tests and the control-plane demo
run one per pod, as the sidecar would run in it. A transferring sidecar in a pod (`pod_api_client`,
`disagg.worker.cli.transfer`) runs the same `PeerReporter` beside its main loop, with the `LocalKV` the
engine registered; a watching sidecar (`disagg.worker.reporting.watch`) runs it with a round that handshakes
its own engine first.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Final

import urllib3
from kubernetes import client
from kubernetes import config as kube_config

from disagg.worker.connector.kv_pool import ShmPool
from disagg.worker.connector.push import LocalKV, agent_name
from disagg.worker.connector.side_channel import DEFAULT_HANDSHAKE_TIMEOUT_S, SideChannelServer
from disagg.worker.kv.errors import DisaggError, WorkerConfigError
from disagg.worker.kv.layout import build_stage_layout
from disagg.worker.kv.pod_contract import (
    DEPLOYMENT_ENV,
    DEPLOYMENT_LABEL,
    POD_NAME_ENV,
    POD_NAMESPACE_ENV,
    ROLE_LABEL,
)
from disagg.worker.reporting.peer_check import Outcome, check_round, peer_role
from disagg.worker.reporting.pod_report import PodReporter, kube_client
from disagg.worker.sidecar.config import SidecarConfig, from_env
from disagg.worker.sidecar.republisher import Republisher

log = logging.getLogger("disagg.worker.reporting.status_loop")
DEFAULT_INTERVAL_S = 10.0
DEFAULT_NUM_BLOCKS = 4
SERVICE_ACCOUNT_TOKEN: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")

Check = Callable[[Sequence[Mapping[str, Any]]], Outcome]
"""One round's verdict from the peer pods of this pod's deployment."""


def peer_selector(deployment: str, config: SidecarConfig) -> str:
    return f"{DEPLOYMENT_LABEL}={deployment},{ROLE_LABEL}={peer_role(config.role)}"


def report_once(
    config: SidecarConfig,
    local: LocalKV | None,
    reporter: PodReporter,
    deployment: str,
    *,
    timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
    check: Check | None = None,
) -> None:
    """One round: list the peers, handshake each (`check`, by default `peer_check.check_round` with
    `local`), write this pod's condition and Events."""
    pods = reporter.list_pods(peer_selector(deployment, config))
    if check is None:
        reporter.report(check_round(config, local, pods, timeout_s=timeout_s))
    else:
        reporter.report(check(pods))


class PeerReporter:
    """`report_once` every `interval_s` on a thread of its own, until `stop()`.

    The thread makes no NIXL call (handshakes are ZMQ; planning a decode rank reads the registered layout), so
    a sidecar whose main thread owns the NIXL agent can run it beside its loop. An API server that is briefly
    unreachable or refuses a write costs one round, logged, not the sidecar. `check` replaces the round's
    peer check (a watching sidecar checks its own engine too, see `disagg.worker.reporting.watch`).
    """

    def __init__(
        self,
        config: SidecarConfig,
        local: LocalKV | None,
        reporter: PodReporter,
        deployment: str,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        check: Check | None = None,
    ) -> None:
        self.config = config
        self.local = local
        self.reporter = reporter
        self.deployment = deployment
        self.interval_s = interval_s
        self.check = check
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disagg-peer-reporter", daemon=True)

    @classmethod
    def for_pod(
        cls,
        config: SidecarConfig,
        local: LocalKV | None,
        api: client.ApiClient,
        env: Mapping[str, str],
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        check: Check | None = None,
    ) -> PeerReporter:
        """The reporter of the pod `env` names (`POD_NAMESPACE`, `POD_NAME`, `DISAGG_DEPLOYMENT`)."""
        reporter = PodReporter(api, _required(env, POD_NAMESPACE_ENV), _required(env, POD_NAME_ENV))
        deployment = _required(env, DEPLOYMENT_ENV)
        return cls(config, local, reporter, deployment, interval_s=interval_s, check=check)

    def start(self, local: LocalKV | None = None) -> PeerReporter:
        """Start the rounds; with `local`, planning against that registered KV (a transfer sidecar's)."""
        if local is not None:
            self.local = local
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 2 * DEFAULT_HANDSHAKE_TIMEOUT_S) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                report_once(self.config, self.local, self.reporter, self.deployment, check=self.check)
            except (client.ApiException, urllib3.exceptions.HTTPError) as exc:
                log.warning("%s: could not report to the API server this round: %s", self.reporter.pod, exc)
            self._stop.wait(self.interval_s)


def pod_api_client(env: Mapping[str, str]) -> client.ApiClient | None:
    """A client for the API server when `env` is a pod's (`POD_NAME` and `POD_NAMESPACE` set) and credentials
    exist: the in-cluster service account, else the `KUBECONFIG` file `env` names. None otherwise (the
    data-path demo, the sidecar tests), so a sidecar outside a pod never tries to reach an API server."""
    if not env.get(POD_NAME_ENV) or not env.get(POD_NAMESPACE_ENV):
        return None
    if env.get("KUBERNETES_SERVICE_HOST") and SERVICE_ACCOUNT_TOKEN.is_file():
        kube_config.load_incluster_config()  # type: ignore[no-untyped-call]
        return client.ApiClient()
    kubeconfig = env.get("KUBECONFIG")
    if kubeconfig and all(Path(path).is_file() for path in kubeconfig.split(os.pathsep) if path):
        api: client.ApiClient = kube_config.new_client_from_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
        return api
    return None


def _required(env: Mapping[str, str], name: str) -> str:
    value = env.get(name)
    if not value:
        raise WorkerConfigError(f"{name} is not set (the pod spec sets it from the downward API)")
    return value


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
    pod = _required(env, POD_NAME_ENV)
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
    parser = argparse.ArgumentParser(
        prog="python -m disagg.worker.reporting.status_loop", description=__doc__
    )
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
