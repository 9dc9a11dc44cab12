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
from disagg.operator.builders.objects import revision_labels
from disagg.operator.builders.prefill import prefill_statefulset
from disagg.operator.builders.router import router_objects
from disagg.operator.builders.services import headless_service
from disagg.operator.builders.topology import revision, topology_config_map
from disagg.operator.builders.worker_access import worker_access
from disagg.operator.naming import (
    SLOTS,
    Installation,
    Owner,
    decode_name,
    prefill_name,
    selector_labels,
)
from disagg.operator.plan import TopologyPlan


def build(
    spec: DisaggDeploymentSpec,
    owner: Owner,
    plan: TopologyPlan,
    hashes: Mapping[Role, str],
    installation: Installation = Installation(),
    factors: Mapping[Role, Mapping[str, Any]] | None = None,
    slot: str = SLOTS[0],
) -> list[dict[str, Any]]:
    """Every object the deployment needs, in apply order (what the pods mount or run as comes first); the
    engines' own (topology, Services, workloads) in `slot`, the rest shared by both slots."""
    config_map, checksum = topology_config_map(spec, owner, plan, hashes, factors, slot)
    objects: list[dict[str, Any]] = [config_map, *worker_access(owner, installation)]
    for replica in range(spec.prefill.replicas):
        name = prefill_name(owner.name, replica, slot)
        selector = selector_labels(owner.name, "prefill", replica, slot)
        objects.append(_labelled(headless_service(spec, owner, name, selector, "prefill"), checksum, slot))
        objects.append(
            prefill_statefulset(spec, owner, plan, hashes["prefill"], checksum, replica, installation, slot)
        )
    name = decode_name(owner.name, slot)
    selector = selector_labels(owner.name, "decode", slot=slot)
    objects.append(_labelled(headless_service(spec, owner, name, selector, "decode"), checksum, slot))
    objects.append(decode_deployment(spec, owner, plan, hashes["decode"], checksum, installation, slot))
    objects += router_objects(spec, owner, installation)
    return objects


def revision_of(
    spec: DisaggDeploymentSpec,
    owner: Owner,
    plan: TopologyPlan,
    hashes: Mapping[Role, str],
    factors: Mapping[Role, Mapping[str, Any]] | None = None,
) -> str:
    """The revision `build` labels the engines with (`topology.revision`), without building them."""
    return revision(topology_config_map(spec, owner, plan, hashes, factors)[1])


def _labelled(obj: dict[str, Any], checksum: str, slot: str) -> dict[str, Any]:
    obj["metadata"]["labels"].update(revision_labels(revision(checksum), slot))
    return obj
