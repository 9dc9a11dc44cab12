"""Every child of a `DisaggDeployment`, in apply order: `desired = build(...)`. Pure.

What the pods mount or run as comes first (the topology ConfigMap, the worker's ServiceAccount and
RoleBinding), then per prefill replica its headless Service and StatefulSet, then decode's Service and
Deployment, then the router's objects. Reconcile, `disagg plan` and the refusal chain's last policy
(`policies.chain.objects_build`) all call this one function.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from disagg.operator.api import DisaggDeploymentSpec, Role
from disagg.operator.builders.decode import decode_deployment
from disagg.operator.builders.prefill import prefill_statefulset
from disagg.operator.builders.router import router_objects
from disagg.operator.builders.services import headless_service
from disagg.operator.builders.topology import topology_config_map
from disagg.operator.builders.worker_access import worker_access
from disagg.operator.naming import Installation, Owner, decode_name, prefill_name, selector_labels
from disagg.operator.plan import TopologyPlan


def build(
    spec: DisaggDeploymentSpec,
    owner: Owner,
    plan: TopologyPlan,
    hashes: Mapping[Role, str],
    installation: Installation = Installation(),
    factors: Mapping[Role, Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Every object the deployment needs, in apply order (what the pods mount or run as comes first)."""
    config_map, checksum = topology_config_map(spec, owner, plan, hashes, factors)
    objects: list[dict[str, Any]] = [config_map, *worker_access(owner, installation)]
    for replica in range(spec.prefill.replicas):
        name = prefill_name(owner.name, replica)
        objects.append(
            headless_service(spec, owner, name, selector_labels(owner.name, "prefill", replica), "prefill")
        )
        objects.append(
            prefill_statefulset(spec, owner, plan, hashes["prefill"], checksum, replica, installation)
        )
    name = decode_name(owner.name)
    objects.append(headless_service(spec, owner, name, selector_labels(owner.name, "decode"), "decode"))
    objects.append(decode_deployment(spec, owner, plan, hashes["decode"], checksum, installation))
    objects += router_objects(spec, owner, installation)
    return objects
