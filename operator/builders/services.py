"""The headless Services of the engine workloads (one per prefill replica, one for decode). Pure.

A headless Service governs each prefill StatefulSet (its pods' stable DNS names are the stages' rendezvous)
and lists the decode pods; both publish not-ready addresses, because stages rendezvous and sidecars handshake
before any pod is Ready. The router's ClusterIP Service is the router module's.
"""

from __future__ import annotations

from typing import Any

from disagg.operator.api import DisaggDeploymentSpec, Role
from disagg.operator.builders.engine import HTTP_PORT
from disagg.operator.builders.objects import owned_object
from disagg.operator.naming import Owner
from disagg.worker.contracts.pod_contract import SIDE_CHANNEL_PORT_NAME


def headless_service(
    spec: DisaggDeploymentSpec, owner: Owner, name: str, selector: dict[str, str], role: Role
) -> dict[str, Any]:
    return owned_object(
        "v1",
        "Service",
        name,
        owner,
        role,
        spec={
            "clusterIP": "None",
            # Stages rendezvous and sidecars handshake before any pod is Ready (the gate waits on them).
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [
                {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                {
                    "name": SIDE_CHANNEL_PORT_NAME,
                    "port": spec.kv_transfer.side_channel_port,
                    "targetPort": SIDE_CHANNEL_PORT_NAME,
                    "protocol": "TCP",
                },
            ],
        },
    )
