"""Whether a transfer sidecar reports to its Pod: only in a pod, with credentials for the API server.

The sidecars here are real (`Sidecar` as the process entry point wires it, with its NIXL agent, side
channel, engine socket and HTTP server) and the Kubernetes clients are the real client loaded from a real
kubeconfig file; nothing here reaches an API server, because the reporter only starts once an engine
registers its layout.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sidecar_procs import HOST
from test_sidecar_config import env_for, topology

from disagg.rig.local import free_port
from disagg.worker.cli.transfer import transfer_sidecar
from disagg.worker.kv.errors import WorkerConfigError
from disagg.worker.reporting.status_loop import pod_api_client
from disagg.worker.sidecar.config import from_env
from disagg.worker.sidecar.transfer import Sidecar

API_SERVER = "https://127.0.0.1:6443"


def kubeconfig(tmp_path: Path) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "c", "cluster": {"server": API_SERVER, "insecure-skip-tls-verify": True}}
                ],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


def sidecar_env(tmp_path: Path, **env: str) -> dict[str, str]:
    built: dict[str, str] = env_for(
        tmp_path,
        topology(),
        DISAGG_ROLE="decode",
        POD_NAME="llm-decode-7c9-x",
        DISAGG_SIDE_CHANNEL_HOST=HOST,
        DISAGG_SIDE_CHANNEL_PORT=str(free_port()),
        DISAGG_METRICS_HOST=HOST,
        DISAGG_METRICS_PORT="0",
        DISAGG_ENGINE_SOCKET=str(tmp_path / "engine.sock"),
        **env,
    )
    return built


@pytest.fixture
def started() -> Iterator[list[Sidecar]]:
    sidecars: list[Sidecar] = []
    yield sidecars
    for sidecar in sidecars:
        sidecar.close()


def test_a_pod_with_a_kubeconfig_gets_a_client_for_its_api_server(tmp_path: Path) -> None:
    env = {"POD_NAME": "p-0", "POD_NAMESPACE": "ns", "KUBECONFIG": str(kubeconfig(tmp_path))}
    api = pod_api_client(env)
    assert api is not None
    assert api.configuration.host == API_SERVER


@pytest.mark.parametrize(
    "missing",
    [
        {"POD_NAMESPACE": ""},
        {"POD_NAME": ""},
        {"KUBECONFIG": ""},
        {"KUBECONFIG": "/nonexistent/kubeconfig"},
    ],
)
def test_without_a_pod_identity_or_credentials_there_is_no_client(
    tmp_path: Path, missing: dict[str, str]
) -> None:
    env = {"POD_NAME": "p-0", "POD_NAMESPACE": "ns", "KUBECONFIG": str(kubeconfig(tmp_path)), **missing}
    assert pod_api_client(env) is None


def test_a_sidecar_in_a_pod_reports_to_that_pod(tmp_path: Path, started: list[Sidecar]) -> None:
    env = sidecar_env(
        tmp_path, POD_NAMESPACE="team-a", DISAGG_DEPLOYMENT="llm", KUBECONFIG=str(kubeconfig(tmp_path))
    )
    sidecar = transfer_sidecar(from_env(env), pod_api_client(env), env)
    started.append(sidecar)
    assert sidecar.peer_reporter is not None
    reporter = sidecar.peer_reporter
    assert (reporter.reporter.namespace, reporter.reporter.pod, reporter.deployment) == (
        "team-a",
        "llm-decode-7c9-x",
        "llm",
    )
    assert reporter.local is None, "the reporter waits for the engine's registration"


def test_a_sidecar_outside_a_pod_does_not_report(tmp_path: Path, started: list[Sidecar]) -> None:
    env = sidecar_env(tmp_path, DISAGG_DEPLOYMENT="llm", KUBECONFIG=str(kubeconfig(tmp_path)))
    sidecar = transfer_sidecar(from_env(env), pod_api_client(env), env)
    started.append(sidecar)
    assert sidecar.peer_reporter is None


def test_a_pod_spec_without_its_deployment_fails_at_start(tmp_path: Path) -> None:
    env = sidecar_env(tmp_path, POD_NAMESPACE="team-a", KUBECONFIG=str(kubeconfig(tmp_path)))
    with pytest.raises(WorkerConfigError, match="DISAGG_DEPLOYMENT is not set"):
        transfer_sidecar(from_env(env), pod_api_client(env), env)
