"""Before the operator starts: does its account hold every rule of `permissions`? Ask the API server.

Each rule's verbs are asked with a SelfSubjectAccessReview (the authorizer's own answer, RoleBindings per
namespace included) in every namespace the operator will watch, or cluster-wide for `--namespace-all` and for
cluster-scoped kinds. A `--namespace` glob is resolved against the namespaces that exist now, as kopf resolves
it; a namespace created later is not asked about. `--webhook-dev` lets kopf write the webhook configuration,
which the chart's operator never may: that is not asked either (dev mode runs with an admin's kubeconfig).
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections.abc import Sequence

from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from disagg.operator.control.k8s_apply import Kube
from disagg.operator.control.kopf_tuning import API_BACKOFFS
from disagg.operator.permissions import Rule, denied_message, operator_rules

log = logging.getLogger(__name__)


class AccessDenied(Exception):
    """The account lacks rules; the message names each, where, and why it is needed."""


def watched_namespaces(patterns: Sequence[str], existing: Sequence[str]) -> list[str]:
    """The existing namespaces that any of kopf's `--namespace` patterns selects.

    kopf's syntax: comma-separated globs; a `!glob` removes what it matches, a later glob takes a namespace
    back only if the first glob had matched it; a pattern that starts with `!` starts from `*`."""

    def selects(name: str, pattern: str) -> bool:
        globs = [glob.strip() for glob in pattern.split(",")]
        if globs[0].startswith("!"):
            globs.insert(0, "*")
        first = matches = fnmatch.fnmatch(name, globs[0])
        for glob in globs[1:]:
            if glob.startswith("!"):
                matches = matches and not fnmatch.fnmatch(name, glob.lstrip("!"))
            else:
                matches = matches or (first and fnmatch.fnmatch(name, glob))
        return matches

    return [name for name in existing if any(selects(name, pattern) for pattern in patterns)]


def _is_glob(pattern: str) -> bool:
    return any(char in pattern for char in "*?!,[")


def check(kube: Kube, worker_cluster_role: str, namespaces: Sequence[str], *, clusterwide: bool) -> None:
    """Raise `AccessDenied` unless every rule holds where the operator will need it."""
    if clusterwide:
        where: list[str] = [""]
    elif any(_is_glob(pattern) for pattern in namespaces):
        where = watched_namespaces(namespaces, kube.namespace_names())
    else:
        where = list(dict.fromkeys(namespaces))
    denied: dict[Rule, list[tuple[str, str]]] = {}
    for rule in operator_rules(worker_cluster_role):
        places = [""] if rule.scope == "cluster" else where
        for namespace in places:
            for verb in rule.verbs:
                names = rule.names or ("",)
                if not all(
                    kube.allowed(verb, rule.group, rule.resource, namespace=namespace, name=name)
                    for name in names
                ):
                    denied.setdefault(rule, []).append((verb, namespace))
    if denied:
        raise AccessDenied(denied_message(denied))


def check_when_reachable(
    kube: Kube, worker_cluster_role: str, namespaces: Sequence[str], *, clusterwide: bool
) -> None:
    """`check`, retried on kopf's delays while the API server is away or answers 5xx/429: an operator
    started during an outage waits for the server, as its handlers will (`kopf_tuning.API_BACKOFFS`). A 403
    on the review itself, or a denied rule, ends it."""
    for delay in API_BACKOFFS:
        try:
            check(kube, worker_cluster_role, namespaces, clusterwide=clusterwide)
            return
        except ApiException as error:
            if error.status is None or not (error.status >= 500 or error.status == 429):
                raise
            reason = f"{error.status} {error.reason}"
        except HTTPError as error:
            reason = str(error)
        log.warning("cannot check the operator's RBAC yet (%s); again in %s s", reason, delay)
        time.sleep(delay)
