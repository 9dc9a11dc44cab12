"""The operator as a ServiceAccount holding exactly `permissions.operator_rules`, on the real 1.20 API server.

With one verb missing, `disagg operator run` exits at once and names it (kopf would retry the 403 for ever);
with the whole table, the same account reconciles a deployment to Compatible: the table is enough."""

from __future__ import annotations

import base64
import dataclasses
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from local_cluster import ControlPlane
from operator_harness import DISAGG, Cluster, OperatorProcess, example, satisfied, wait_for

from disagg.operator.naming import DEFAULT_WORKER_CLUSTER_ROLE
from disagg.operator.permissions import Rule, operator_rules

RULES = operator_rules(DEFAULT_WORKER_CLUSTER_ROLE)
ACCOUNT = "operator"


def _rbac_rules(rules: list[Rule], leave_out: tuple[str, str] | None = None) -> list[dict[str, Any]]:
    """RBAC rules for `rules`, without the verb `leave_out` = (resource, verb)."""
    out = []
    for rule in rules:
        verbs = [verb for verb in rule.verbs if (rule.resource, verb) != leave_out]
        body: dict[str, Any] = {"apiGroups": [rule.group], "resources": [rule.resource], "verbs": verbs}
        if rule.names:
            body["resourceNames"] = list(rule.names)
        out.append(body)
    return out


@dataclasses.dataclass
class Account:
    """The test's ServiceAccount, its kubeconfig, and the roles bound to it."""

    cluster: Cluster
    namespace: str
    kubeconfig: Path
    cluster_role: str

    def grant(self, leave_out: tuple[str, str] | None = None) -> None:
        namespaced = [rule for rule in RULES if rule.scope == "namespace"]
        role = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": ACCOUNT, "namespace": self.namespace},
            "rules": _rbac_rules(namespaced, leave_out),
        }
        applied = self.cluster.kubectl_apply(role)
        assert applied.returncode == 0, applied.stderr

    def control_plane(self) -> ControlPlane:
        return dataclasses.replace(self.cluster.cp, kubeconfig=self.kubeconfig)


@pytest.fixture
def account(cluster: Cluster, namespace: str, tmp_path: Path) -> Iterator[Account]:
    core = cluster.core
    core.create_namespaced_service_account(namespace, client.V1ServiceAccount(metadata={"name": ACCOUNT}))
    subject = [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": namespace}]
    cluster_role = f"{namespace}-{secrets.token_hex(2)}"
    cluster_wide = [rule for rule in RULES if rule.scope == "cluster"]
    documents = [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": cluster_role},
            "rules": _rbac_rules(cluster_wide),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": cluster_role},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
            "subjects": subject,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": ACCOUNT, "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ACCOUNT},
            "subjects": subject,
        },
    ]
    for document in documents:
        applied = cluster.kubectl_apply(document)
        assert applied.returncode == 0, applied.stderr

    def token() -> str | None:
        found = core.read_namespaced_service_account(ACCOUNT, namespace).secrets
        if not found:
            return None
        secret = core.read_namespaced_secret(found[0].name, namespace)
        return base64.b64decode(secret.data["token"]).decode()

    admin = yaml.safe_load(cluster.cp.kubeconfig.read_text())
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": admin["clusters"],
                "users": [{"name": ACCOUNT, "user": {"token": wait_for("the account's token", token)}}],
                "contexts": [
                    {"name": ACCOUNT, "context": {"cluster": admin["clusters"][0]["name"], "user": ACCOUNT}}
                ],
                "current-context": ACCOUNT,
            }
        )
    )
    try:
        yield Account(cluster, namespace, kubeconfig, cluster_role)
    finally:
        for kind in ("clusterrolebinding", "clusterrole"):
            cluster.cp.kubectl("delete", kind, cluster_role, "--ignore-not-found")


def test_a_missing_rule_stops_the_operator_before_it_starts_and_names_the_rule(account: Account) -> None:
    account.grant(leave_out=("pods", "patch"))
    run = subprocess.run(
        [str(DISAGG), "operator", "run", "--namespace", account.namespace],
        env=account.control_plane().env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd="/",
    )
    assert run.returncode == 1, run.stderr
    assert "lacks RBAC rules" in run.stderr, run.stderr
    (line,) = [line for line in run.stderr.splitlines() if line.startswith("  ")]
    assert line.startswith(f'  patch pods (apiGroup "") in namespace {account.namespace}: '), run.stderr


def test_the_table_is_enough_to_reconcile_a_deployment(account: Account, tmp_path: Path) -> None:
    account.grant()
    operator = OperatorProcess(account.control_plane(), [account.namespace], tmp_path / "operator.log")
    operator.start()
    try:
        applied = account.cluster.kubectl_apply(example("pp2-hma.yaml", account.namespace, "gemma"))
        assert applied.returncode == 0, applied.stderr
        account.cluster.wait_condition(account.namespace, "gemma", "Compatible", "True")
        # The verdict is written before the children are applied: wait for them.
        wait_for(
            "the StatefulSets and Deployments",
            lambda: satisfied(
                account.cluster.names(account.namespace, "gemma"),
                lambda names: bool(names["StatefulSet"] and names["Deployment"]),
            ),
        )
    finally:
        operator.stop()
    assert "Forbidden" not in operator.tail(400), operator.tail()
