"""The topology ConfigMap: the plan plus what a sidecar needs to build its KV layout. Pure.

Every sidecar (and the reference engine) reads `topology.json` from it at startup (`TOPOLOGY_DIR`); the pod
templates carry its checksum, so a changed plan rolls the pods.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Final

from disagg.operator.api import DisaggDeploymentSpec, Role
from disagg.operator.builders.objects import owned_object, revision_labels
from disagg.operator.naming import SLOTS, Owner, topology_name
from disagg.operator.plan import TopologyPlan, role_release
from disagg.worker.contracts.topology import ModelDocument, TopologyDocument, encode_topology

TOPOLOGY_KEY: Final = "topology.json"
TOPOLOGY_DIR: Final = "/etc/disagg/topology"
REVISION_CHARS: Final = 10


def revision(checksum: str) -> str:
    """The revision of a deployment's engines: what their pairs depend on is the topology document (the plan,
    the model's KV geometry, the engine release, the predicted compatibility hashes and their factors), so
    it is its checksum's prefix. Replicas, resources, images and the router are not in it: changing them
    needs no new pairs."""
    return checksum[:REVISION_CHARS]


def topology_document(
    spec: DisaggDeploymentSpec,
    owner: Owner,
    plan: TopologyPlan,
    hashes: Mapping[Role, str],
    factors: Mapping[Role, Mapping[str, Any]] | None = None,
) -> TopologyDocument:
    """The plan plus what a sidecar needs to build its KV layout (the sidecar decodes it at startup)."""
    model = spec.model
    return TopologyDocument(
        deployment=owner.name,
        transfer_mode=plan.transfer_mode,
        hma=plan.hma,
        packed=plan.packed,
        routing_mode=plan.routing_mode.value,
        prefill_tensor_parallel_size=plan.prefill_tp,
        decode_tensor_parallel_size=plan.decode_tp,
        notifications_per_request=plan.notifications_per_request,
        stages=plan.stage_documents(),
        block_size=spec.prefill.block_size,
        kv_lease_duration_seconds=spec.kv_transfer.lease_seconds,
        model=ModelDocument(
            name=model.name,
            dtype=model.dtype.value,
            dtype_bytes=model.dtype.num_bytes,
            num_kv_heads=model.num_kv_heads,
            head_size=model.head_size,
            layer_kinds=tuple(kind.to_layout() for kind in model.layer_kinds()),
            layer_name_template=model.layer_name_template,
            hma=plan.hma,
            attention_backend=spec.engine.attention_backend,
        ),
        compatibility_hashes={role: value for role, value in hashes.items()},
        # What each predicted hash is of: a sidecar names the factor a live engine's hash differs in.
        compatibility_factors={role: dict(value) for role, value in (factors or {}).items()},
        # Pre-flight refuses a pair whose releases differ, so prefill's release is the deployment's.
        vllm_version=spec.effective("prefill", "version", spec.engine.version),
        connector_version=role_release(spec, "prefill").connector_version,
    )


def topology_config_map(
    spec: DisaggDeploymentSpec,
    owner: Owner,
    plan: TopologyPlan,
    hashes: Mapping[Role, str],
    factors: Mapping[Role, Mapping[str, Any]] | None = None,
    slot: str = SLOTS[0],
) -> tuple[dict[str, Any], str]:
    """The ConfigMap of `slot`'s pods, and the checksum of its document the pod templates carry."""
    topology = encode_topology(topology_document(spec, owner, plan, hashes, factors))
    checksum = hashlib.sha256(topology.encode()).hexdigest()[:16]
    config_map = owned_object(
        "v1", "ConfigMap", topology_name(owner.name, slot), owner, "topology", data={TOPOLOGY_KEY: topology}
    )
    config_map["metadata"]["labels"].update(revision_labels(revision(checksum), slot))
    return config_map, checksum
