"""The decode Deployment: `spec.decode.replicas` engine pods, each an engine of its own. Pure."""

from __future__ import annotations

from typing import Any

from disagg.operator.api import DisaggDeploymentSpec
from disagg.operator.builders.objects import owned_object
from disagg.operator.builders.pod_template import engine_pod_template
from disagg.operator.naming import Installation, Owner, decode_name, selector_labels
from disagg.operator.plan import TopologyPlan


def decode_deployment(
    spec: DisaggDeploymentSpec,
    owner: Owner,
    plan: TopologyPlan,
    compat_hash: str,
    checksum: str,
    installation: Installation,
) -> dict[str, Any]:
    selector = selector_labels(owner.name, "decode")
    return owned_object(
        "apps/v1",
        "Deployment",
        decode_name(owner.name),
        owner,
        "decode",
        spec={
            "replicas": spec.decode.replicas,
            "selector": {"matchLabels": selector},
            "template": engine_pod_template(
                spec, owner, plan, "decode", selector, compat_hash, checksum, None, installation
            ),
        },
    )
