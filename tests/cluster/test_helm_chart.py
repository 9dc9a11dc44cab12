"""charts/disagg installed, upgraded and uninstalled with the real helm against the real 1.20 API server.

There is no kubelet, so the operator pod stays Pending: these tests check what the API server and the
controller manager make of the chart, not the operator itself. The webhook is scoped to the test's namespace
(webhook.namespaceSelector) so that other sessions sharing the control plane never meet it.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import secrets
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from local_cluster import ControlPlane

from disagg.operator.permissions import grants, operator_rules
from disagg.rig.local import free_port

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "disagg"
EXAMPLE = REPO / "examples" / "pp2-hma.yaml"
BAD_EXAMPLE = REPO / "examples" / "bad-decode-pp.yaml"
DISAGG = REPO / ".venv" / "bin" / "disagg"
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


class ServiceNameHTTPS(http.client.HTTPSConnection):
    """HTTPS to 127.0.0.1 that checks the certificate against the Service name the API server would dial."""

    def __init__(self, service_host: str, port: int, context: ssl.SSLContext) -> None:
        super().__init__(service_host, port, context=context, timeout=10)
        self._tls = context

    def connect(self) -> None:
        raw = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        self.sock = self._tls.wrap_socket(raw, server_hostname=self.host)


def admission_review(manifest: Obj, uid: str) -> Obj:
    kind = {"group": "disagg.io", "version": "v1alpha1", "kind": "DisaggDeployment"}
    resource = {"group": "disagg.io", "version": "v1alpha1", "resource": "disaggdeployments"}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": kind,
            "resource": resource,
            "requestKind": kind,
            "requestResource": resource,
            "name": manifest["metadata"]["name"],
            "namespace": manifest["metadata"]["namespace"],
            "operation": "CREATE",
            "userInfo": {"username": "kubernetes-admin"},
            "object": manifest,
            "oldObject": None,
            "dryRun": False,
        },
    }


def service_account_kubeconfig(release: Release, path: Path) -> Path:
    """A kubeconfig that authenticates as the chart's ServiceAccount, by the token 1.20 keeps in a Secret."""
    token_secret: list[str] = []

    def token_created() -> bool:
        account = release.must_get("serviceaccount", release.fullname)
        token_secret[:] = [s["name"] for s in account.get("secrets", [])]
        return bool(token_secret)

    poll(token_created, "the ServiceAccount's token Secret")
    token = base64.b64decode(release.must_get("secret", token_secret[0])["data"]["token"]).decode()
    admin = yaml.safe_load(release.cp.kubeconfig.read_text())
    cluster = admin["clusters"][0]["cluster"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": cluster}],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "local", "user": "operator"}}],
        "current-context": "operator",
    }
    path.write_text(yaml.safe_dump(config))
    return path


def test_operator_runs_on_the_charts_arguments_identity_and_certificate(
    release: Release, tmp_path: Path
) -> None:
    """The real `disagg operator run`, outside the cluster but with everything the chart gives its pod: the
    Deployment's command line, the ServiceAccount's token (so only the chart's RBAC applies) and the webhook
    Secret's certificate. A missing permission or an unknown flag fails here, not in a cluster."""
    ns = release.namespace
    release.run_helm(
        "install",
        release.name,
        str(CHART),
        "--set-json",
        f'watchNamespaces=["{ns}"]',
        # No kube-proxy here: the API server could not reach the in-cluster webhook, so keep it out of this
        # namespace; the test calls the operator's webhook server itself.
        "--set-json",
        f'webhook.namespaceSelector={{"matchLabels":{{"{SCOPE_LABEL}":"elsewhere"}}}}',
    )
    deployment = release.must_get("deployment", release.fullname)
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["disagg"]
    secret = release.must_get("secret", f"{release.fullname}-webhook-tls")
    cert_dir = tmp_path / "webhook"
    cert_dir.mkdir()
    for key in ("tls.crt", "tls.key", "ca.crt"):
        (cert_dir / key).write_bytes(base64.b64decode(secret["data"][key]))
    health_port, webhook_port = free_port(), free_port()
    replaced = {
        "--health-port": str(health_port),
        "--webhook-port": str(webhook_port),
        "--webhook-cert-dir": str(cert_dir),
    }
    args = [
        f"{flag}={replaced[flag]}" if flag in replaced else arg
        for arg in container["args"]
        for flag in [arg.split("=", 1)[0]]
    ]
    assert args[:3] == ["operator", "run", f"--namespace={ns}"]
    env = dict(release.cp.env())
    env["KUBECONFIG"] = str(service_account_kubeconfig(release, tmp_path / "operator.kubeconfig"))
    env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
    log = tmp_path / "operator.log"
    with log.open("wb") as out:
        operator = subprocess.Popen(
            [str(DISAGG), *args], env=env, stdout=out, stderr=subprocess.STDOUT, cwd="/"
        )
    try:

        def healthy() -> bool:
            assert operator.poll() is None, f"the operator exited {operator.returncode}:\n{log.read_text()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/healthz", timeout=2) as reply:
                    return bool(reply.status == 200)
            except OSError:
                return False

        poll(healthy, "the operator's /healthz")

        def webhook_listening() -> bool:
            # kopf starts its webhook server on its own task: /healthz can answer before the port is bound.
            try:
                socket.create_connection(("127.0.0.1", webhook_port), timeout=2).close()
            except OSError:
                return False
            return True

        poll(webhook_listening, "the operator's webhook port")

        # The webhook: the chart's CA verifies the operator's server under the Service's DNS name, and the
        # chart's path reaches the validation handler.
        tls = ssl.create_default_context(cafile=str(cert_dir / "ca.crt"))
        service_host = f"{release.fullname}-webhook.{ns}.svc"
        config = release.must_get("validatingwebhookconfiguration", release.fullname, namespaced=False)
        path = config["webhooks"][0]["clientConfig"]["service"]["path"]
        verdicts = {}
        for name, manifest in [("good", example_in(ns)), ("bad", example_in(ns, BAD_EXAMPLE))]:
            connection = ServiceNameHTTPS(service_host, webhook_port, tls)
            connection.request(
                "POST",
                path,
                json.dumps(admission_review(manifest, name)),
                {"Content-Type": "application/json"},
            )
            reply = connection.getresponse()
            assert reply.status == 200
            verdicts[name] = json.loads(reply.read())["response"]
            connection.close()
        assert verdicts["good"]["uid"] == "good" and verdicts["good"]["allowed"] is True
        assert verdicts["bad"]["allowed"] is False
        assert "pipelineParallelSize" in verdicts["bad"]["status"]["message"]

        # Reconciliation with only the chart's permissions: children applied, status and Events written.
        manifest = example_in(ns)
        created = release.kubectl_stdin(manifest, "apply", "-f", "-")
        assert created.returncode == 0, created.stderr
        name = manifest["metadata"]["name"]

        def compatible() -> bool:
            obj = release.must_get("disaggdeployment", name)
            conditions = {c["type"]: c["status"] for c in obj.get("status", {}).get("conditions", [])}
            return conditions.get("Compatible") == "True"

        poll(compatible, f"DisaggDeployment {name} Compatible=True")

        def applied_statefulsets() -> list[dict[str, Any]]:
            listed = release.cp.kubectl("get", "statefulsets", "-n", ns, "-o", "json").stdout
            items: list[dict[str, Any]] = json.loads(listed)["items"]
            return items

        # The verdict is written before the children are applied (what `kubectl apply` waits to see).
        poll(lambda: bool(applied_statefulsets()), "a StatefulSet applied")
        statefulsets = applied_statefulsets()
        assert all(s["metadata"]["ownerReferences"][0]["name"] == name for s in statefulsets)
        # The router's Role grants pods get/list/watch, which the operator may only do holding them itself;
        # its Deployment is applied last.
        poll(lambda: release.get("deployment", f"{name}-router") is not None, f"{name}-router applied")
        router_role = release.must_get("role", f"{name}-router")
        assert router_role["rules"] == [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
        ]
        [router] = release.must_get("deployment", f"{name}-router")["spec"]["template"]["spec"]["containers"]
        assert router["image"] == env["DISAGG_ROUTER_IMAGE"]

        def applied_event_posted() -> bool:  # kopf posts Events from a queue, after the handler returns
            events = json.loads(release.cp.kubectl("get", "events", "-n", ns, "-o", "json").stdout)["items"]
            return any(e["reason"] == "Applied" and e["involvedObject"]["name"] == name for e in events)

        poll(applied_event_posted, f"an Applied Event for {name}")
    finally:
        operator.send_signal(signal.SIGTERM)
        try:
            operator.wait(timeout=30)
        except subprocess.TimeoutExpired:
            operator.kill()
            operator.wait()
    text = log.read_text()
    # A 403 anywhere but in a timestamp's milliseconds (",403").
    assert "Forbidden" not in text and not re.search(r"(?<![,\d])403(?!\d)", text), text
