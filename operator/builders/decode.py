"""The decode Deployment: `spec.decode.replicas` engine pods, each an engine of its own. Pure.

Under `spec.decode.autoscaling.mode: external` its replicas are left out: a server-side apply that never
names the field never takes it back from the HorizontalPodAutoscaler (or KEDA) that writes it."""

from __future__ import annotations

from typing import Any

from disagg.operator.api import DisaggDeploymentSpec
from disagg.operator.builders.objects import owned_object, revision_labels
from disagg.operator.builders.pod_template import engine_pod_template
from disagg.operator.builders.topology import revision
from disagg.operator.naming import SLOTS, Installation, Owner, decode_name, selector_labels
from disagg.operator.plan import TopologyPlan


def decode_deployment(
    spec: DisaggDeploymentSpec,
    owner: Owner,
    plan: TopologyPlan,
    compat_hash: str,
    checksum: str,
    installation: Installation,
    slot: str = SLOTS[0],
) -> dict[str, Any]:
    selector = selector_labels(owner.name, "decode", slot=slot)
    deployment = owned_object(
        "apps/v1",
        "Deployment",
        decode_name(owner.name, slot),
        owner,
        "decode",
        spec={
            "replicas": spec.decode.replicas,
            "selector": {"matchLabels": selector},
            "template": engine_pod_template(
                spec, owner, plan, "decode", selector, compat_hash, checksum, None, installation, slot=slot
            ),
        },
    )
    if spec.external("decode"):
        del deployment["spec"]["replicas"]
    deployment["metadata"]["labels"].update(revision_labels(revision(checksum), slot))
    return deployment
