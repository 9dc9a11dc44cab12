"""A pod's peer reporter: every few seconds, handshake the other role's pods and write what was found.

`PeerReporter` runs `report_once` on a thread of its own: list the other role's pods of this pod's deployment,
handshake each (`peer_check`) and write the result to this pod (`pod_report`: the condition, and the peer
report annotation `disagg.io/kv-peers` the router and the operator pair pods by). A transferring sidecar in a
pod (`pod_api_client`, `disagg.worker.cli.transfer`) runs it beside its main loop, with the `LocalKV` the
engine registered; a watching sidecar (`disagg.worker.reporting.watch`) runs it with a round that handshakes
its own engine first. (The rig's local kubelet runs a reporting-only stand-in, `disagg.rig.status_sidecar`.)
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

import urllib3
from kubernetes import client
from kubernetes import config as kube_config

from disagg.worker.connector.push import LocalKV
from disagg.worker.connector.side_channel import DEFAULT_HANDSHAKE_TIMEOUT_S
from disagg.worker.contracts.pod_contract import (
    DEPLOYMENT_ENV,
    DEPLOYMENT_LABEL,
    POD_NAME_ENV,
    POD_NAMESPACE_ENV,
    ROLE_LABEL,
)
from disagg.worker.kv.errors import WorkerConfigError
from disagg.worker.reporting.in_flight import engine_in_flight, metrics_url
from disagg.worker.reporting.peer_check import Outcome, check_round, peer_role
from disagg.worker.reporting.pod_report import PodReporter
from disagg.worker.reporting.startup import StartupGrace
from disagg.worker.reporting.transport_report import TRANSPORT_ENV, with_transports
from disagg.worker.sidecar.config import SidecarConfig
from disagg.worker.sidecar.pairs import PairStats

log = logging.getLogger("disagg.worker.reporting.status_loop")


class PairSource(Protocol):
    """Each pair's transport and bandwidth, by decode engine id: a transfer sidecar's ledger
    (`sidecar.pairs.PairLedger`), or a vLLM engine's lanes (`engine_lanes.EngineLanes`)."""

    def snapshot(self) -> Mapping[str, PairStats]: ...


DEFAULT_INTERVAL_S = 10.0
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
    grace: StartupGrace | None = None,
    pairs: PairSource | None = None,
    transport: str = "any",
) -> None:
    """One round: list the peers, handshake each (`check`, by default `peer_check.check_round` with
    `local` and the startup `grace`), write this pod's condition and Events; with a prefill worker's `pairs`,
    each pair's transport and bandwidth too, warning where it is not the `transport` the spec demands."""
    pods = reporter.list_pods(peer_selector(deployment, config))
    if check is None:
        outcome = check_round(config, local, pods, timeout_s=timeout_s, grace=grace)
    else:
        outcome = check(pods)
    if pairs is not None:
        outcome = with_transports(outcome, pairs.snapshot(), transport)
    reporter.report(outcome)


class PeerReporter:
    """`report_once` every `interval_s` on a thread of its own, until `stop()`.

    The thread makes no NIXL call (handshakes are ZMQ; planning a decode rank reads the registered layout), so
    a sidecar whose main thread owns the NIXL agent can run it beside its loop. An API server that is briefly
    unreachable or refuses a write costs one round, logged, not the sidecar. `check` replaces the round's
    peer check (a watching sidecar checks its own engine too, see `disagg.worker.reporting.watch`, and keeps
    its own startup grace); the default check keeps `grace`, one for the reporter's life.
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
        pairs: PairSource | None = None,
        transport: str = "any",
    ) -> None:
        self.pairs = pairs
        self.transport = transport
        self.config = config
        self.local = local
        self.reporter = reporter
        self.deployment = deployment
        self.interval_s = interval_s
        self.check = check
        self.grace = StartupGrace(config.peer_startup_grace_s)
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
        pairs: PairSource | None = None,
    ) -> PeerReporter:
        """The reporter of the pod `env` names (`POD_NAMESPACE`, `POD_NAME`, `DISAGG_DEPLOYMENT`, and the
        demanded `DISAGG_KV_TRANSPORT`)."""
        # While the pod drains, its reports say what its engine still has in flight.
        url = metrics_url(config)
        reporter = PodReporter(
            api,
            _required(env, POD_NAMESPACE_ENV),
            _required(env, POD_NAME_ENV),
            in_flight=lambda: engine_in_flight(url),
        )
        deployment = _required(env, DEPLOYMENT_ENV)
        return cls(
            config,
            local,
            reporter,
            deployment,
            interval_s=interval_s,
            check=check,
            pairs=pairs,
            transport=env.get(TRANSPORT_ENV) or "any",
        )

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
                report_once(
                    self.config,
                    self.local,
                    self.reporter,
                    self.deployment,
                    check=self.check,
                    grace=self.grace,
                    pairs=self.pairs,
                    transport=self.transport,
                )
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
