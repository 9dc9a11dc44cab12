"""The engine pods' identity: a ServiceAccount per deployment and the RoleBinding that grants it the
installation's worker ClusterRole (the sidecar patches its Pod's condition, reads its peers and posts Events).
Pure.
"""

from __future__ import annotations

from typing import Any

from disagg.operator.builders.objects import owned_object
from disagg.operator.naming import Installation, Owner, worker_account_name


def worker_access(owner: Owner, installation: Installation) -> list[dict[str, Any]]:
    """The sidecars' identity: a ServiceAccount per deployment, bound in its namespace only.

    A RoleBinding to the shared ClusterRole (rather than a Role per deployment) keeps the permission set in
    one place, the chart, and lets the operator grant it with `bind` alone instead of holding it.
    """
    name = worker_account_name(owner.name)
    return [
        owned_object("v1", "ServiceAccount", name, owner, "kv-worker"),
        owned_object(
            "rbac.authorization.k8s.io/v1",
            "RoleBinding",
            name,
            owner,
            "kv-worker",
            roleRef={
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": installation.worker_cluster_role,
            },
            subjects=[{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
        ),
    ]
