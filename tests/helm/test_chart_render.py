"""The chart as helm renders it: lint, RBAC, security defaults, labels, the webhook's certificates, the values
schema, and the rendered manifests against the schemas of Kubernetes 1.20 through current releases."""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from disagg.operator.permissions import grants, operator_rules

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "disagg"
CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text())
RELEASE = "rel"
NAMESPACE = "disagg-system"
CERT_DIR = "/etc/disagg/webhook"

Obj = dict[str, Any]


def helm(helm_bin: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm_bin), *args], capture_output=True, text=True, check=False)


def render(
    helm_bin: Path,
    values: Mapping[str, object] | None = None,
    kube_version: str = "1.31.0",
    include_crds: bool = False,
) -> list[Obj]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", kube_version]
    if include_crds:
        args.append("--include-crds")
    for key, value in (values or {}).items():
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    proc = helm(helm_bin, *args)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def by_kind(objs: list[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def one(objs: list[Obj], kind: str) -> Obj:
    found = list(by_kind(objs, kind).values())
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def operator_container(objs: list[Obj]) -> Obj:
    containers = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["operator"]
    result: Obj = containers[0]
    return result


ALL_METRICS = {
    "podMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prometheus"}},
    "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {}},
    "dashboard": {"enabled": True, "namespace": "monitoring", "labels": {"grafana_dashboard": "1"}},
}


def openssl(*args: str, stdin: str | None = None) -> str:
    proc = subprocess.run(["openssl", *args], input=stdin, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"openssl {' '.join(args)}: {proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize(
    "values",
    [{}, {"watchNamespaces": ["team-a", "team-b"], "webhook": {"enabled": False}}, {"metrics": ALL_METRICS}],
    ids=["defaults", "namespaced-no-webhook", "metrics"],
)
def test_helm_lint_strict_passes(helm_bin: Path, values: Mapping[str, object]) -> None:
    args = ["lint", "--strict", str(CHART)]
    for key, value in values.items():
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    proc = helm(helm_bin, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout


def test_every_object_carries_the_standard_labels(helm_bin: Path) -> None:
    objs = render(helm_bin)
    assert len(objs) == 10
    for obj in objs:
        labels = obj["metadata"]["labels"]
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        assert labels["app.kubernetes.io/name"] == "disagg", where
        assert labels["app.kubernetes.io/instance"] == RELEASE, where
        assert labels["app.kubernetes.io/version"] == CHART_META["appVersion"], where
        assert labels["app.kubernetes.io/managed-by"] == "Helm", where
        assert labels["helm.sh/chart"] == f"disagg-{CHART_META['version']}", where
        assert labels["app.kubernetes.io/component"] in {"operator", "webhook", "worker"}, where
    deployment = one(objs, "Deployment")
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector == {
        "app.kubernetes.io/name": "disagg",
        "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": "operator",
    }
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert one(objs, "Service")["spec"]["selector"] == selector


# (apiGroup, resource) -> verbs: exactly what the operator and kopf use, nothing more (`permissions`).
OPERATOR_RULES = operator_rules(f"{RELEASE}-disagg-worker")
WORKLOAD_RULES = grants(rule for rule in OPERATOR_RULES if rule.scope == "namespace")
CLUSTER_RULES = grants(rule for rule in OPERATOR_RULES if rule.scope == "cluster")
# What each engine pod's KV-worker sidecar does: its own Pod condition, its peers, its Events.
WORKER_RULES = {
    ("", "pods"): {"get", "list", "watch"},
    ("", "pods/status"): {"get", "patch"},
    ("", "events"): {"create", "get", "patch"},
}


def flatten_rules(role: Obj) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "nonResourceURLs" not in rule
        for field in ("apiGroups", "resources", "verbs", "resourceNames"):
            assert "*" not in rule.get(field, ()), f"wildcard in {role['metadata']['name']}: {rule}"
        # A rule limited to named objects is keyed as `resource[name ...]`, as `kubectl auth can-i --list`.
        names = f"[{' '.join(rule['resourceNames'])}]" if "resourceNames" in rule else ""
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource + names), set()).update(rule["verbs"])
    return granted


def test_rbac_grants_exactly_the_operators_needs_without_wildcards(helm_bin: Path) -> None:
    objs = render(helm_bin)
    roles = by_kind(objs, "ClusterRole")
    assert set(roles) == {
        f"{RELEASE}-disagg-cluster",
        f"{RELEASE}-disagg-workloads",
        f"{RELEASE}-disagg-worker",
    }
    assert flatten_rules(roles[f"{RELEASE}-disagg-cluster"]) == CLUSTER_RULES
    assert flatten_rules(roles[f"{RELEASE}-disagg-workloads"]) == WORKLOAD_RULES
    assert flatten_rules(roles[f"{RELEASE}-disagg-worker"]) == WORKER_RULES
    assert by_kind(objs, "Role") == {}
    assert by_kind(objs, "RoleBinding") == {}
    # The chart owns the webhook configuration, so the operator may not touch admission configuration at all.
    all_groups = {g for role in roles.values() for rule in role["rules"] for g in rule["apiGroups"]}
    assert "admissionregistration.k8s.io" not in all_groups

    account = one(objs, "ServiceAccount")["metadata"]["name"]
    bindings = by_kind(objs, "ClusterRoleBinding")
    # The worker role is bound by the operator, per DisaggDeployment and namespace: never cluster-wide.
    assert {b["roleRef"]["name"] for b in bindings.values()} == set(roles) - {f"{RELEASE}-disagg-worker"}
    for binding in bindings.values():
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    assert one(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == account


def test_the_operator_holds_every_permission_it_grants_a_router(helm_bin: Path) -> None:
    """The API server lets the operator create the router's Role only with permissions it holds itself."""
    from disagg.operator.builders.router import ROUTER_RULES

    granted = flatten_rules(by_kind(render(helm_bin), "ClusterRole")[f"{RELEASE}-disagg-workloads"])
    router = flatten_rules({"metadata": {"name": "router"}, "rules": list(ROUTER_RULES)})
    assert router == {("", "pods"): {"get", "list", "watch"}}
    for resource, verbs in router.items():
        assert verbs <= granted[resource], resource


def test_watch_namespaces_bind_the_workload_role_only_in_those_namespaces(helm_bin: Path) -> None:
    objs = render(helm_bin, {"watchNamespaces": ["team-a", "team-b"]})
    bindings = [o for o in objs if o["kind"] == "RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for binding in bindings:
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": f"{RELEASE}-disagg-workloads",
        }
        assert binding["subjects"][0]["namespace"] == NAMESPACE
    # Cluster-wide, only kopf's CRD and namespace scanning stays bound.
    assert [b["roleRef"]["name"] for b in by_kind(objs, "ClusterRoleBinding").values()] == [
        f"{RELEASE}-disagg-cluster"
    ]
    args = operator_container(objs)["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    assert "--namespace-all" not in args


def test_existing_service_account_and_externally_managed_rbac(helm_bin: Path) -> None:
    objs = render(
        helm_bin,
        {"serviceAccount": {"create": False, "name": "platform-operator"}, "rbac": {"create": False}},
    )
    kinds = {o["kind"] for o in objs}
    assert kinds.isdisjoint({"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"})
    assert one(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "platform-operator"


def test_pod_and_container_security_defaults(helm_bin: Path) -> None:
    objs = render(helm_bin)
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    context = operator_container(objs)["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "privileged" not in context and "add" not in context["capabilities"]


def test_operator_command_probes_and_mounts_match_the_operator_cli(helm_bin: Path) -> None:
    container = operator_container(render(helm_bin))
    # The chart's defaults are the images `make image` builds, tagged with the chart's appVersion.
    assert container["image"] == f"ghcr.io/disagg/disagg:{CHART_META['appVersion']}"
    assert container["command"] == ["disagg"]
    assert container["args"] == [
        "operator",
        "run",
        "--namespace-all",
        "--webhook-port=9443",
        f"--webhook-cert-dir={CERT_DIR}",
        "--health-port=8080",
    ]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"health": 8080, "webhook": 9443}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["readinessProbe"]["tcpSocket"] == {"port": "webhook"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DISAGG_LOG_LEVEL"] == "info"
    assert env["DISAGG_WORKER_IMAGE"] == f"ghcr.io/disagg/disagg:{CHART_META['appVersion']}"
    assert env["DISAGG_TRANSFER_IMAGE"] == f"ghcr.io/disagg/disagg-transfer:{CHART_META['appVersion']}"
    assert env["DISAGG_ROUTER_IMAGE"] == f"ghcr.io/disagg/disagg:{CHART_META['appVersion']}"
    # The same name the workload role may bind and the worker ClusterRole carries.
    assert env["DISAGG_WORKER_CLUSTERROLE"] == f"{RELEASE}-disagg-worker"
    # The router runs from the operator's own (light) image.
    assert env["DISAGG_ROUTER_IMAGE"] == container["image"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts[CERT_DIR]["readOnly"] is True
    assert "/tmp" in mounts  # the only writable path under a read-only root filesystem


def test_values_reach_the_deployment(helm_bin: Path) -> None:
    objs = render(
        helm_bin,
        {
            "image": {"repository": "registry.example/op", "tag": "1.2.3", "pullPolicy": "Always"},
            "worker": {
                "image": {"repository": "registry.example/worker", "tag": "9.9"},
                "transferImage": {"repository": "registry.example/transfer", "tag": "9.8"},
            },
            "logLevel": "debug",
            "replicas": 0,
            "healthPort": 18080,
            "webhook": {"port": 10443},
            "nodeSelector": {"pool": "system"},
            "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
            "resources": {"requests": {"cpu": "1"}, "limits": {"memory": "1Gi"}},
        },
    )
    deployment = one(objs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = operator_container(objs)
    assert deployment["spec"]["replicas"] == 0
    assert container["image"] == "registry.example/op:1.2.3"
    assert container["imagePullPolicy"] == "Always"
    assert "--webhook-port=10443" in container["args"] and "--health-port=18080" in container["args"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"health": 18080, "webhook": 10443}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DISAGG_LOG_LEVEL"] == "debug"
    assert env["DISAGG_WORKER_IMAGE"] == "registry.example/worker:9.9"
    assert env["DISAGG_ROUTER_IMAGE"] == "registry.example/op:1.2.3"
    assert env["DISAGG_TRANSFER_IMAGE"] == "registry.example/transfer:9.8"
    assert pod["nodeSelector"] == {"pool": "system"}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]
    assert container["resources"]["requests"]["cpu"] == "1"
    assert container["resources"]["limits"]["memory"] == "1Gi"


def test_webhook_ca_bundle_signs_the_serving_certificate_for_the_service(
    helm_bin: Path, tmp_path: Path
) -> None:
    objs = render(helm_bin)
    config = one(objs, "ValidatingWebhookConfiguration")
    [webhook] = config["webhooks"]
    service = one(objs, "Service")
    secret = one(objs, "Secret")
    assert webhook["clientConfig"]["service"] == {
        "namespace": NAMESPACE,
        "name": service["metadata"]["name"],
        "path": "/validate-disaggdeployment",
        "port": 443,
    }
    assert service["spec"]["ports"] == [
        {"name": "https", "port": 443, "targetPort": "webhook", "protocol": "TCP"}
    ]
    assert webhook["failurePolicy"] == "Fail"
    assert webhook["sideEffects"] == "None"
    assert webhook["rules"] == [
        {
            "apiGroups": ["disagg.io"],
            "apiVersions": ["v1alpha1"],
            "operations": ["CREATE", "UPDATE"],
            "resources": ["disaggdeployments"],
            "scope": "Namespaced",
        }
    ]

    ca_bundle = webhook["clientConfig"]["caBundle"]
    assert ca_bundle, "caBundle is empty"
    assert secret["type"] == "kubernetes.io/tls"
    assert secret["data"]["ca.crt"] == ca_bundle
    ca_pem = base64.b64decode(ca_bundle).decode()
    crt_pem = base64.b64decode(secret["data"]["tls.crt"]).decode()
    key_pem = base64.b64decode(secret["data"]["tls.key"]).decode()
    (tmp_path / "ca.crt").write_text(ca_pem)
    (tmp_path / "tls.crt").write_text(crt_pem)
    verified = openssl(
        "verify", "-purpose", "sslserver", "-CAfile", str(tmp_path / "ca.crt"), str(tmp_path / "tls.crt")
    )
    assert verified.strip().endswith(": OK")
    # The key in the Secret is the certificate's key.
    assert openssl("x509", "-noout", "-pubkey", stdin=crt_pem) == openssl("pkey", "-pubout", stdin=key_pem)
    # Go checks the SAN (never the CN) against the name the API server dials: <service>.<namespace>.svc.
    san = openssl("x509", "-noout", "-ext", "subjectAltName", stdin=crt_pem)
    assert f"DNS:{service['metadata']['name']}.{NAMESPACE}.svc" in san

    # The operator mounts that Secret where --webhook-cert-dir points.
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mount = next(m for m in operator_container(objs)["volumeMounts"] if m["mountPath"] == CERT_DIR)
    assert volumes[mount["name"]]["secret"]["secretName"] == secret["metadata"]["name"]
    assert {i["path"] for i in volumes[mount["name"]]["secret"]["items"]} == {"tls.crt", "tls.key"}


def test_webhook_disabled_renders_no_webhook_objects_or_flags(helm_bin: Path) -> None:
    objs = render(helm_bin, {"webhook": {"enabled": False}})
    kinds = {o["kind"] for o in objs}
    assert kinds.isdisjoint({"ValidatingWebhookConfiguration", "Secret", "Service"})
    container = operator_container(objs)
    assert not any(a.startswith("--webhook") for a in container["args"])
    assert [p["name"] for p in container["ports"]] == ["health"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert all(m["mountPath"] != CERT_DIR for m in container["volumeMounts"])


@pytest.mark.parametrize(
    ("values", "field"),
    [({"replicas": -1}, "replicas"), ({"replicass": 1}, "replicass"), ({"webhook": {"prt": 1}}, "prt")],
    ids=["negative-replicas", "unknown-top-level-key", "unknown-nested-key"],
)
def test_helm_refuses_values_the_schema_rejects(
    helm_bin: Path, values: Mapping[str, object], field: str
) -> None:
    args = ["template", RELEASE, str(CHART)]
    for key, value in values.items():
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    proc = helm(helm_bin, *args)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert field in proc.stderr


# What the 1.20 test cluster serves, and what every release since serves as well.
PORTABLE_API_VERSIONS = {
    "v1",
    "apps/v1",
    "rbac.authorization.k8s.io/v1",
    "admissionregistration.k8s.io/v1",
    "apiextensions.k8s.io/v1",
}


def test_renders_for_kubernetes_1_20_with_apis_it_serves(helm_bin: Path) -> None:
    objs = render(helm_bin, kube_version="1.20.2", include_crds=True)
    assert {o["apiVersion"] for o in objs} <= PORTABLE_API_VERSIONS
    assert "CustomResourceDefinition" in {o["kind"] for o in objs}


def test_kube_version_below_the_charts_floor_is_refused(helm_bin: Path) -> None:
    proc = helm(helm_bin, "template", RELEASE, str(CHART), "--kube-version", "1.19.0")
    assert proc.returncode != 0
    assert "incompatible with Kubernetes v1.19.0" in proc.stderr


@pytest.mark.parametrize("kube_version", ["1.25.0", "1.31.0", "1.37.0"])
def test_manifests_pass_strict_schema_validation_of_current_kubernetes(
    helm_bin: Path, kube_version: str
) -> None:
    objs = render(helm_bin, kube_version=kube_version, include_crds=True)
    for obj in objs:
        kubernetes_validate.validate(obj, kube_version, strict=True)

    # The validator is not vacuous: a misspelt pod field (silently dropped by a real API server) is caught.
    deployment = json.loads(json.dumps(one(objs, "Deployment")))
    deployment["spec"]["template"]["spec"]["readinessGate"] = []
    with pytest.raises(kubernetes_validate.ValidationError, match="readinessGate"):
        kubernetes_validate.validate(deployment, kube_version, strict=True)


# --- metrics: the monitors and the dashboard -------------------------------------------------------------


def matches(selector: Obj, labels: Mapping[str, str]) -> bool:
    """A LabelSelector's verdict (matchLabels and the In operator, which the chart uses)."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def test_the_monitors_and_the_dashboard_are_off_by_default(helm_bin: Path) -> None:
    kinds = {o["kind"] for o in render(helm_bin)}
    assert not kinds & {"PodMonitor", "ServiceMonitor"}
    assert not [o for o in render(helm_bin) if o["metadata"]["name"].endswith("-dashboard")]


def test_the_monitors_select_every_workload_pod_and_service_the_operator_builds(helm_bin: Path) -> None:
    from disagg.operator.naming import COMPONENT_LABEL, PART_OF_LABEL, owner_labels, selector_labels
    from disagg.worker.contracts.pod_contract import ROUTER_COMPONENT

    objs = render(helm_bin, {"metrics": ALL_METRICS, "watchNamespaces": ["team-a"]})
    pods = one(objs, "PodMonitor")
    services = one(objs, "ServiceMonitor")
    assert pods["metadata"]["labels"]["release"] == "prometheus"
    # What the operator's builders put on the pods and Services of a DisaggDeployment.
    engine = {**owner_labels("llm"), **selector_labels("llm", "decode")}
    prefill = {**owner_labels("llm"), **selector_labels("llm", "prefill", 0)}
    router = {**owner_labels("llm"), COMPONENT_LABEL: ROUTER_COMPONENT, PART_OF_LABEL: "disagg"}
    chart_operator = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    for monitor in (pods, services):
        spec = monitor["spec"]
        assert spec["namespaceSelector"] == {"matchNames": ["team-a"]}
        assert all(matches(spec["selector"], labels) for labels in (engine, prefill, router))
        assert not matches(spec["selector"], chart_operator)
    endpoints = pods["spec"]["podMetricsEndpoints"]
    assert [(e["port"], e["path"], e["interval"]) for e in endpoints] == [
        ("http", "/metrics", "15s"),
        ("metrics", "/metrics", "15s"),
    ]
    assert [(e["port"], e["path"]) for e in services["spec"]["endpoints"]] == [("http", "/metrics")]
    for endpoint in [*endpoints, *services["spec"]["endpoints"]]:
        assert {r["targetLabel"] for r in endpoint["relabelings"]} == {"component", "deployment"}
    everywhere = render(helm_bin, {"metrics": ALL_METRICS})
    assert one(everywhere, "PodMonitor")["spec"]["namespaceSelector"] == {"any": True}


def test_the_dashboard_configmap_holds_the_charts_dashboard(helm_bin: Path) -> None:
    objs = render(helm_bin, {"metrics": ALL_METRICS})
    [configmap] = [
        o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard")
    ]
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "dashboards" / "disagg.json").read_text())
    assert json.loads(configmap["data"]["disagg.json"]) == shipped
    kubernetes_validate.validate(configmap, "1.31.0", strict=True)
