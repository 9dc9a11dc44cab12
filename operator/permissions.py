"""What the operator may do on the API server: every rule it and kopf use, and nothing more. Pure.

One table for three readers: the Helm chart's ClusterRoles must grant exactly these rules (its tests compare
the rendered chart with them), `disagg operator run` asks the API server about each before it starts
(`control.access`), and the router's and sidecars' Roles may only hold what the operator holds itself.

Why the check at start: kopf retries a request the API server refuses with 403 as if it were an outage, for
ever (`control.kopf_tuning.API_BACKOFFS`), so an installation that misses one rule (a hand-written
ClusterRole, a chart of another version) would run and log retries while nothing converges. Asked first, it
exits and names the rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Literal

Scope = Literal["namespace", "cluster"]

ALL_OBJECT_VERBS: Final = ("get", "list", "watch", "create", "patch", "delete")


@dataclass(frozen=True)
class Rule:
    """One RBAC rule: `verbs` on `resource` (`plural` or `plural/subresource`) of API group `group`.

    `scope` says where it must hold: in every watched namespace, or cluster-wide. `names` limits it to the
    named objects (RBAC's `resourceNames`)."""

    group: str
    resource: str
    verbs: tuple[str, ...]
    why: str
    scope: Scope = "namespace"
    names: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        """(group, resource) as `kubectl auth can-i --list` names a row: `plural[name ...]` when limited."""
        return self.group, self.resource + (f"[{' '.join(self.names)}]" if self.names else "")


def operator_rules(worker_cluster_role: str) -> tuple[Rule, ...]:
    """The operator's rules; `worker_cluster_role` is the ClusterRole its sidecars are bound to."""
    return (
        Rule(
            "apiextensions.k8s.io",
            "customresourcedefinitions",
            ("get", "list", "watch"),
            "kopf scans the CRDs to find the resources it serves",
            scope="cluster",
        ),
        Rule(
            "",
            "namespaces",
            ("list", "watch"),
            "kopf resolves its namespace settings (globs, --namespace-all)",
            scope="cluster",
        ),
        Rule(
            "disagg.io",
            "disaggdeployments",
            ("get", "list", "watch", "patch"),
            "the deployments it reconciles; kopf keeps its progress in their annotations",
        ),
        Rule("disagg.io", "disaggdeployments/status", ("get", "patch", "update"), "their status"),
        Rule("apps", "statefulsets", ALL_OBJECT_VERBS, "the prefill stages (server-side apply, prune)"),
        Rule("apps", "deployments", ALL_OBJECT_VERBS, "the decoders and the router"),
        Rule("", "services", ALL_OBJECT_VERBS, "the stages' and the router's Services"),
        Rule("", "configmaps", ALL_OBJECT_VERBS, "each deployment's topology document"),
        Rule(
            "",
            "pods",
            ("get", "list", "watch", "patch", "delete"),
            "the engine pods' conditions; a rollout marks old pods draining, then deletes chosen decoders",
        ),
        Rule("", "events", ("create", "patch"), "Events on the deployments it reconciles"),
        Rule("", "serviceaccounts", ALL_OBJECT_VERBS, "the sidecars' and the router's accounts"),
        Rule(
            "rbac.authorization.k8s.io",
            "rolebindings",
            ALL_OBJECT_VERBS,
            "binding the sidecars to the worker role and the router to its Role",
        ),
        Rule(
            "rbac.authorization.k8s.io",
            "roles",
            ALL_OBJECT_VERBS,
            "each router's Role (permissions the operator holds, so no escalate)",
        ),
        Rule(
            "rbac.authorization.k8s.io",
            "clusterroles",
            ("bind",),
            "binding that one ClusterRole to each deployment's sidecars",
            names=(worker_cluster_role,),
        ),
    )


def grants(rules: Iterable[Rule]) -> dict[tuple[str, str], set[str]]:
    """The verbs per `Rule.key`, merged: the shape the chart's rendered rules are compared in."""
    merged: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        merged.setdefault(rule.key, set()).update(rule.verbs)
    return merged


def denied_message(denied: Mapping[Rule, Iterable[tuple[str, str]]]) -> str:
    """What `disagg operator run` says before it exits: each rule and verb refused, where, and why it is
    needed. `denied` maps a rule to its refused (verb, namespace) pairs; namespace "" is cluster-wide."""
    lines = ["the operator's account lacks RBAC rules it needs (the chart's ClusterRoles grant them):"]
    for rule, refusals in denied.items():
        group = rule.group or '""'
        names = f" resourceNames {list(rule.names)}" if rule.names else ""
        for verb, namespace in refusals:
            where = f"in namespace {namespace}" if namespace else "cluster-wide"
            lines.append(f"  {verb} {rule.resource} (apiGroup {group}){names} {where}: {rule.why}")
    return "\n".join(lines)
