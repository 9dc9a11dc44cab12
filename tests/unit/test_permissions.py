"""The operator's RBAC table and the start-up check's reading of it (`permissions`, `control.access`)."""

from __future__ import annotations

import pytest
from kopf._cogs.structs.references import match_namespace  # kopf's own matcher, the oracle here

from disagg.operator.control.access import watched_namespaces
from disagg.operator.permissions import denied_message, grants, operator_rules

EXISTING = ["default", "myapp-live", "myapp-pr-123", "myapp-pr-456", "otherapp-live", "otherapp-pr-123", "a"]
PATTERNS = [
    "default",
    "myapp-*",
    "!*-pr-*",
    "myapp-*,!*-pr-*,*-pr-123",
    "!*-pr-*, *pr-123",
    "?",
    "nothing-*",
    "*",
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_glob_namespaces_resolve_as_kopf_resolves_them(pattern: str) -> None:
    assert watched_namespaces([pattern], EXISTING) == [n for n in EXISTING if match_namespace(n, pattern)]


def test_several_patterns_select_the_union() -> None:
    assert watched_namespaces(["myapp-*", "default"], EXISTING) == [
        "default",
        "myapp-live",
        "myapp-pr-123",
        "myapp-pr-456",
    ]


def test_the_bind_rule_is_limited_to_the_worker_role() -> None:
    table = grants(operator_rules("rel-disagg-worker"))
    assert table[("rbac.authorization.k8s.io", "clusterroles[rel-disagg-worker]")] == {"bind"}
    assert ("rbac.authorization.k8s.io", "clusterroles") not in table
    assert all("*" not in verb for verbs in table.values() for verb in verbs)


def test_the_refusal_names_each_verb_where_and_why() -> None:
    rules = {rule.resource: rule for rule in operator_rules("w")}
    message = denied_message(
        {
            rules["pods"]: [("patch", "team-a")],
            rules["namespaces"]: [("watch", "")],
            rules["clusterroles"]: [("bind", "team-a")],
        }
    )
    lines = message.splitlines()
    assert lines[1].startswith('  patch pods (apiGroup "") in namespace team-a: ')
    assert "draining" in lines[1]
    assert lines[2].startswith('  watch namespaces (apiGroup "") cluster-wide: ')
    assert lines[3].startswith(
        "  bind clusterroles (apiGroup rbac.authorization.k8s.io) resourceNames ['w'] in namespace team-a: "
    )
