"""The transfer sidecar process: `python -m disagg.worker.cli.transfer`, or `disagg worker`.

It wires two packages of which only one imports the other (`reporting` imports `sidecar`): the transfer
sidecar (`disagg.worker.sidecar.transfer.Sidecar`) and, in a pod, the reporter to that Pod
(`disagg.worker.reporting.status_loop.PeerReporter`), which checks the peers every `PEER_REPORT_INTERVAL_S`
once the engine has registered and writes the Pod's `disagg.io/kv-transfer-ready` condition.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Mapping

from kubernetes import client

from disagg.worker.connector.ucx_log import UcxLog, enable
from disagg.worker.kv.errors import DisaggError, KVTransportUnavailable
from disagg.worker.reporting.status_loop import PeerReporter, pod_api_client
from disagg.worker.sidecar.config import SidecarConfig, from_env
from disagg.worker.sidecar.logs import configure_logging, event
from disagg.worker.sidecar.pairs import PairLedger
from disagg.worker.sidecar.transfer import Sidecar

log = logging.getLogger(__name__)

PEER_REPORT_INTERVAL_S = 10.0


def transfer_sidecar(
    config: SidecarConfig, api: client.ApiClient | None, env: Mapping[str, str], ucx_log: UcxLog | None = None
) -> Sidecar:
    """The sidecar; in a pod (`api` from `pod_api_client(env)`), with a reporter to the Pod `env` names.

    The reporter is built now so that a pod spec without DISAGG_DEPLOYMENT fails at start, not at the engine's
    register; the sidecar starts it once the engine has registered (the prefill check plans against the
    registered layout)."""
    pairs = PairLedger()
    reporter = (
        None
        if api is None
        else PeerReporter.for_pod(
            config,
            None,
            api,
            env,
            interval_s=PEER_REPORT_INTERVAL_S,
            pairs=pairs if config.role == "prefill" else None,
        )
    )
    return Sidecar(config, reporter, ucx_log, pairs)


def run(config: SidecarConfig, env: Mapping[str, str]) -> int:
    """Run a sidecar until SIGTERM or SIGINT; returns the process exit code."""
    configure_logging(config.log_level)
    api = pod_api_client(env)
    # Before the agent exists: UCX reads where to log once, when NIXL loads it.
    log_file = enable(os.environ)
    ucx_log = UcxLog(log_file) if log_file is not None else None
    try:
        try:
            sidecar = transfer_sidecar(config, api, env, ucx_log)
        except KVTransportUnavailable as exc:
            event(log, logging.ERROR, "no KV transport", reason=exc.reason, error=exc.message)
            return 1
        signal.signal(signal.SIGTERM, sidecar.stop)
        signal.signal(signal.SIGINT, sidecar.stop)
        try:
            return sidecar.run()
        except Exception:
            log.exception("sidecar failed", extra={"fields": {"engine_id": config.engine_id}})
            return 1
    finally:
        if api is not None:
            api.close()  # type: ignore[no-untyped-call]


def main(env: Mapping[str, str] | None = None) -> int:
    """Exits 0 on SIGTERM or SIGINT, 1 when the sidecar fails, 2 on a bad configuration."""
    env = os.environ if env is None else env
    try:
        config = from_env(env)
    except DisaggError as exc:
        configure_logging("info")
        event(log, logging.ERROR, "invalid sidecar configuration", reason=exc.reason, error=exc.message)
        return 2
    return run(config, env)


if __name__ == "__main__":
    sys.exit(main())
