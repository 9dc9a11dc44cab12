"""charts/disagg installed, upgraded and uninstalled with the real helm against the real 1.20 API server.

There is no kubelet, so the operator pod stays Pending: these tests check what the API server and the
controller manager make of the chart, not the operator itself. The operator running from the chart's
Deployment, with its ServiceAccount's permissions alone and its webhook reached through its Service, is the
node suite's (`tests/node/test_node.py`), where a kubelet runs it. The webhook is scoped to the test's
namespace (webhook.namespaceSelector) so that other sessions sharing the control plane never meet it.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from local_cluster import ControlPlane

from disagg.operator.permissions import grants, operator_rules

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
        return self.kubectl_stdin(manifest, "create", "--dry-run=server", "-f", "-")

    def kubectl_stdin(self, manifest: Obj, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.cp.bin_dir / "kubectl"), *args],
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
    ("clusterrole", "-worker", False),
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


# What RBAC lets the operator's ServiceAccount do, as the API server's own evaluator lists it: the operator's
# rules (`permissions`) plus what system:basic-user grants every authenticated user.
BASIC_USER_GRANTS = {
    ("authorization.k8s.io", "selfsubjectaccessreviews"): {"create"},
    ("authorization.k8s.io", "selfsubjectrulesreviews"): {"create"},
}
OUTSIDE_WATCHED_NAMESPACES = (
    grants(rule for rule in operator_rules("") if rule.scope == "cluster") | BASIC_USER_GRANTS
)
# What a KV-worker sidecar may do in its own namespace (the chart's worker ClusterRole).
WORKER_GRANTS = {
    ("", "pods"): {"get", "list", "watch"},
    ("", "pods/status"): {"get", "patch"},
    ("", "events"): {"create", "get", "patch"},
}


def workload_grants(release: Release) -> dict[tuple[str, str], set[str]]:
    """The operator's namespaced rules (`permissions`), `bind` limited to this release's worker role."""
    rules = operator_rules(f"{release.fullname}-worker")
    return grants(rule for rule in rules if rule.scope == "namespace")


def granted(release: Release, namespace: str) -> dict[tuple[str, str], set[str]]:
    """`kubectl auth can-i --list` as the operator's ServiceAccount, resource rows only."""
    return granted_to(release.cp, f"system:serviceaccount:{release.namespace}:{release.fullname}", namespace)


def granted_to(cp: ControlPlane, user: str, namespace: str) -> dict[tuple[str, str], set[str]]:
    """Resource rows of `kubectl auth can-i --list`; a row limited to named objects is `resource[names]`."""
    proc = cp.kubectl("auth", "can-i", "--list", f"--as={user}", "-n", namespace)
    assert proc.returncode == 0, proc.stderr
    grants: dict[tuple[str, str], set[str]] = {}
    for line in proc.stdout.splitlines()[1:]:
        if not line or line[0].isspace():
            continue  # a non-resource URL (discovery, health), granted to everyone
        resource = line.split()[0]
        name, _, sub = resource.partition("/")
        plural, _, group = name.partition(".")
        _, names, verbs = re.findall(r"\[([^\]]*)\]", line)
        key = (group, (f"{plural}/{sub}" if sub else plural) + (f"[{names}]" if names else ""))
        grants.setdefault(key, set()).update(verbs.split())
    return grants


def example_in(namespace: str, path: Path = EXAMPLE) -> Obj:
    manifest: Obj = yaml.safe_load(path.read_text())
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
    assert granted(release, ns) == workload_grants(release) | OUTSIDE_WATCHED_NAMESPACES
    assert granted(release, "default") == workload_grants(release) | OUTSIDE_WATCHED_NAMESPACES
    # RBAC escalation prevention: the operator may bind the worker role, whose permissions it does not hold,
    # but not a role that would give a ServiceAccount more than it has itself.
    operator = f"system:serviceaccount:{ns}:{release.fullname}"

    def bind_as_operator(role: str) -> subprocess.CompletedProcess[str]:
        return release.cp.kubectl(
            "create",
            "rolebinding",
            "as-operator",
            "-n",
            ns,
            f"--clusterrole={role}",
            f"--serviceaccount={ns}:as-operator",
            f"--as={operator}",
            "--dry-run=server",
        )

    allowed = bind_as_operator(f"{release.fullname}-worker")
    assert allowed.returncode == 0, allowed.stderr
    # (A role whose permissions it holds, such as its own, it may bind: that grants nothing new.)
    for other in ("edit", "admin"):
        refused_bind = bind_as_operator(other)
        assert refused_bind.returncode != 0 and "forbidden" in refused_bind.stderr, refused_bind.stderr
    # The worker ClusterRole, bound in one namespace as the operator binds it, grants a sidecar exactly this.
    bound = release.cp.kubectl(
        "create",
        "rolebinding",
        "probe-kv-worker",
        "-n",
        ns,
        f"--clusterrole={release.fullname}-worker",
        f"--serviceaccount={ns}:probe-kv-worker",
    )
    assert bound.returncode == 0, bound.stderr
    sidecar = f"system:serviceaccount:{ns}:probe-kv-worker"
    assert granted_to(release.cp, sidecar, ns) == WORKER_GRANTS | BASIC_USER_GRANTS
    assert granted_to(release.cp, sidecar, "default") == BASIC_USER_GRANTS

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
    assert granted(release, ns) == workload_grants(release) | OUTSIDE_WATCHED_NAMESPACES
    assert granted(release, "default") == OUTSIDE_WATCHED_NAMESPACES
