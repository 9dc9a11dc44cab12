"""charts/disagg installed, upgraded and uninstalled with the real helm against the real 1.20 API server.

There is no kubelet, so the operator pod stays Pending: these tests check what the API server and the
controller manager make of the chart, not the operator itself. The webhook is scoped to the test's namespace
(webhook.namespaceSelector) so that other sessions sharing the control plane never meet it.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from local_cluster import ControlPlane

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "disagg"
EXAMPLE = REPO / "examples" / "pp2-hma.yaml"
CRD = "disaggdeployments.disagg.io"
WEBHOOK = "validate.disaggdeployments.disagg.io"
SCOPE_LABEL = "disagg.io/helm-chart-test"

Obj = dict[str, Any]


def poll(check: Callable[[], bool], what: str, deadline_s: float = 60.0) -> None:
    """Wait for `check`; the deadline only bounds a hang, it is not what the test checks."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.3)
    pytest.fail(f"{what}: not true after {deadline_s} s")


class Release:
    def __init__(self, cp: ControlPlane, helm: Path, name: str, namespace: str) -> None:
        self.cp, self.helm, self.name, self.namespace = cp, helm, name, namespace
        self.fullname = f"{name}-disagg"

    def run_helm(self, *args: str) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.helm), *args, "--namespace", self.namespace],
            capture_output=True,
            text=True,
            env=self.cp.env(),
            check=False,
        )
        assert proc.returncode == 0, f"helm {' '.join(args)}: {proc.stdout}\n{proc.stderr}"
        return proc

    def get(self, kind: str, name: str, *, namespaced: bool = True) -> Obj | None:
        args = ["get", kind, name, "-o", "json"] + (["-n", self.namespace] if namespaced else [])
        proc = self.cp.kubectl(*args)
        if proc.returncode != 0:
            assert "NotFound" in proc.stderr, proc.stderr
            return None
        result: Obj = json.loads(proc.stdout)
        return result

    def must_get(self, kind: str, name: str, *, namespaced: bool = True) -> Obj:
        obj = self.get(kind, name, namespaced=namespaced)
        assert obj is not None, f"{kind}/{name} does not exist"
        return obj

    def dry_run_create(self, manifest: Obj) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.cp.bin_dir / "kubectl"), "create", "--dry-run=server", "-f", "-"],
            input=json.dumps(manifest),
            capture_output=True,
            text=True,
            env=self.cp.env(),
            check=False,
        )


# (kind, name suffix after the release's full name, namespaced)
TEMPLATED = [
    ("deployment", "", True),
    ("serviceaccount", "", True),
    ("service", "-webhook", True),
    ("secret", "-webhook-tls", True),
    ("clusterrole", "-cluster", False),
    ("clusterrole", "-workloads", False),
    ("clusterrolebinding", "-cluster", False),
    ("clusterrolebinding", "-workloads", False),
    ("validatingwebhookconfiguration", "", False),
]


@pytest.fixture
def release(control_plane: ControlPlane, helm: Path, namespace: str) -> Iterator[Release]:
    rel = Release(control_plane, helm, f"dg{secrets.token_hex(3)}", namespace)
    labelled = control_plane.kubectl("label", "namespace", namespace, f"{SCOPE_LABEL}={namespace}")
    assert labelled.returncode == 0, labelled.stderr
    try:
        yield rel
    finally:
        # Leave no cluster-scoped objects (or a webhook) behind when an assertion failed midway.
        subprocess.run(
            [str(helm), "uninstall", rel.name, "--namespace", namespace],
            capture_output=True,
            env=control_plane.env(),
            check=False,
        )


# What RBAC lets the operator's ServiceAccount do, as the API server's own evaluator lists it: the chart's
# rules plus what system:basic-user grants every authenticated user.
WORKLOAD_GRANTS = {
    ("disagg.io", "disaggdeployments"): {"get", "list", "watch", "patch"},
    ("disagg.io", "disaggdeployments/status"): {"get", "patch", "update"},
    ("apps", "statefulsets"): {"get", "list", "watch", "create", "patch", "delete"},
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "services"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "configmaps"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "pods"): {"get", "list", "watch"},
    ("", "events"): {"create", "patch"},
}
OUTSIDE_WATCHED_NAMESPACES = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
    ("", "namespaces"): {"list", "watch"},
    ("authorization.k8s.io", "selfsubjectaccessreviews"): {"create"},
    ("authorization.k8s.io", "selfsubjectrulesreviews"): {"create"},
}
EXPECTED_GRANTS = WORKLOAD_GRANTS | OUTSIDE_WATCHED_NAMESPACES


def granted(release: Release, namespace: str) -> dict[tuple[str, str], set[str]]:
    """`kubectl auth can-i --list` as the operator's ServiceAccount, resource rows only."""
    account = f"system:serviceaccount:{release.namespace}:{release.fullname}"
    proc = release.cp.kubectl("auth", "can-i", "--list", f"--as={account}", "-n", namespace)
    assert proc.returncode == 0, proc.stderr
    grants: dict[tuple[str, str], set[str]] = {}
    for line in proc.stdout.splitlines()[1:]:
        if not line or line[0].isspace():
            continue  # a non-resource URL (discovery, health), granted to everyone
        resource = line.split()[0]
        name, _, sub = resource.partition("/")
        plural, _, group = name.partition(".")
        key = (group, f"{plural}/{sub}" if sub else plural)
        grants.setdefault(key, set()).update(line[line.rindex("[") + 1 : line.rindex("]")].split())
    return grants


def example_in(namespace: str) -> Obj:
    manifest: Obj = yaml.safe_load(EXAMPLE.read_text())
    manifest["metadata"]["namespace"] = namespace
    return manifest


def test_install_upgrade_uninstall_on_the_1_20_api_server(release: Release) -> None:
    ns = release.namespace
    installed = release.run_helm(
        "install",
        release.name,
        str(CHART),
        "--set",
        "webhook.timeoutSeconds=3",
        "--set-json",
        f'webhook.namespaceSelector={{"matchLabels":{{"{SCOPE_LABEL}":"{ns}"}}}}',
    )
    assert f"kubectl -n {ns} rollout status deployment/{release.fullname}" in installed.stdout  # NOTES.txt
    listed = json.loads(release.run_helm("list", "--output", "json").stdout)
    assert [(r["name"], r["status"]) for r in listed] == [(release.name, "deployed")]

    for kind, suffix, namespaced in TEMPLATED:
        release.must_get(kind, release.fullname + suffix, namespaced=namespaced)

    def crd_established() -> bool:
        crd = release.must_get("customresourcedefinition", CRD, namespaced=False)
        conditions = {c["type"]: c["status"] for c in crd.get("status", {}).get("conditions", [])}
        return conditions.get("Established") == "True"

    poll(crd_established, f"CRD {CRD} Established")

    # The controller manager made the operator pod from the Deployment; with no kubelet it stays Pending.
    pods: list[Obj] = []

    def pod_created() -> bool:
        proc = release.cp.kubectl(
            "get", "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={release.name}", "-o", "json"
        )
        assert proc.returncode == 0, proc.stderr
        pods[:] = json.loads(proc.stdout)["items"]
        return bool(pods)

    poll(pod_created, "operator pod created")
    [pod] = pods
    assert pod["status"]["phase"] == "Pending"
    assert pod["spec"]["serviceAccountName"] == release.fullname
    assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True

    # RBAC as the API server evaluates it: exactly the operator's needs, here and in any other namespace.
    assert granted(release, ns) == EXPECTED_GRANTS
    assert granted(release, "default") == EXPECTED_GRANTS

    secret = release.must_get("secret", f"{release.fullname}-webhook-tls")
    config = release.must_get("validatingwebhookconfiguration", release.fullname, namespaced=False)
    [webhook] = config["webhooks"]
    assert webhook["name"] == WEBHOOK
    assert webhook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"] != ""

    # The webhook is live: with no ready operator behind it and failurePolicy Fail, a create is refused.
    refused = release.dry_run_create(example_in(ns))
    assert refused.returncode != 0
    assert f'failed calling webhook "{WEBHOOK}"' in refused.stderr
    assert f"{release.fullname}-webhook.{ns}.svc" in refused.stderr

    # An upgrade keeps the certificate and the caBundle (looked up, not regenerated) and applies new values.
    release.run_helm(
        "upgrade", release.name, str(CHART), "--reuse-values", "--set", "webhook.failurePolicy=Ignore"
    )
    upgraded_secret = release.must_get("secret", f"{release.fullname}-webhook-tls")
    assert upgraded_secret["data"] == secret["data"]
    upgraded = release.must_get("validatingwebhookconfiguration", release.fullname, namespaced=False)
    assert upgraded["webhooks"][0]["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    assert upgraded["webhooks"][0]["failurePolicy"] == "Ignore"
    accepted = release.dry_run_create(example_in(ns))
    assert accepted.returncode == 0, accepted.stderr
    assert "created (server dry run)" in accepted.stdout

    release.run_helm("uninstall", release.name)
    # helm deletes with background propagation, so every templated object is gone when uninstall returns.
    remaining = [
        f"{kind}/{release.fullname}{suffix}"
        for kind, suffix, namespaced in TEMPLATED
        if release.get(kind, release.fullname + suffix, namespaced=namespaced) is not None
    ]
    assert remaining == []
    # Helm never deletes what a chart's crds/ installed, so users' DisaggDeployments survive an uninstall.
    assert release.get("customresourcedefinition", CRD, namespaced=False) is not None


def test_watch_namespaces_grant_the_workload_permissions_only_there(release: Release) -> None:
    ns = release.namespace
    release.run_helm(
        "install",
        release.name,
        str(CHART),
        "--set",
        "webhook.enabled=false",
        "--set-json",
        f'watchNamespaces=["{ns}"]',
    )
    assert release.get("clusterrolebinding", f"{release.fullname}-workloads", namespaced=False) is None
    release.must_get("rolebinding", f"{release.fullname}-workloads")
    assert granted(release, ns) == EXPECTED_GRANTS
    assert granted(release, "default") == OUTSIDE_WATCHED_NAMESPACES
