"""The StatefulSet of one prefill replica: one pod per pipeline stage (pod ordinal = PP rank). Pure.

Every stage holds a slice of the model, so the pods start (and restart) together; a PP engine's stages find
their head (rank 0, the rendezvous and the one side channel) by the StatefulSet's stable DNS names.
"""

from __future__ import annotations

import json
from typing import Any

from disagg.operator.api import DisaggDeploymentSpec, EngineKind
from disagg.operator.builders.engine import stage_dns
from disagg.operator.builders.objects import owned_object, revision_labels
from disagg.operator.builders.pod_template import engine_pod_template
from disagg.operator.builders.topology import revision
from disagg.operator.engine_kind import engine_kind
from disagg.operator.naming import SLOTS, Installation, Owner, prefill_name, selector_labels
from disagg.operator.plan import TopologyPlan
from disagg.worker.contracts.pod_contract import ENGINE_SIDE_CHANNEL_HOST_ENV, ENGINE_WORKERS_ENV


def prefill_statefulset(
    spec: DisaggDeploymentSpec,
    owner: Owner,
    plan: TopologyPlan,
    compat_hash: str,
    checksum: str,
    replica: int,
    installation: Installation,
    slot: str = SLOTS[0],
) -> dict[str, Any]:
    name = prefill_name(owner.name, replica, slot)
    selector = selector_labels(owner.name, "prefill", replica, slot)
    master = stage_dns(name, name, owner.namespace)
    statefulset = owned_object(
        "apps/v1",
        "StatefulSet",
        name,
        owner,
        "prefill",
        spec={
            "serviceName": name,
            "replicas": spec.prefill.pipeline_parallel_size,
            # Every stage holds a slice of the model: they start (and restart) together.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector},
            "template": engine_pod_template(
                spec,
                owner,
                plan,
                "prefill",
                selector,
                compat_hash,
                checksum,
                master,
                installation,
                _engine_side_channel_env(spec, owner, name),
                slot,
            ),
        },
    )
    statefulset["metadata"]["labels"].update(revision_labels(revision(checksum), slot))
    return statefulset


def _engine_side_channel_env(spec: DisaggDeploymentSpec, owner: Owner, name: str) -> list[dict[str, Any]]:
    """Where a PP prefill engine's one side channel is: its head pod (stage 0) answers for every rank.

    A vLLM engine serves it from node rank 0 itself, so every stage's watcher reads its ranks there. The
    transfer sidecars serve the same shape: the head's fetches the other stages' payloads from their pods,
    whose DNS names the StatefulSet keeps stable across restarts (and a restarted stage's new agent is
    fetched again on the head's next refresh), so no stage needs to know whether the head is up.
    """
    pp = spec.prefill.pipeline_parallel_size
    if pp == 1:
        return []
    port = spec.kv_transfer.side_channel_port
    if engine_kind(spec, "prefill") is EngineKind.VLLM:
        return [{"name": ENGINE_SIDE_CHANNEL_HOST_ENV, "value": stage_dns(name, name, owner.namespace)}]
    # One transfer sidecar per stage pod, serving TP rank 0 (the reference engine runs TP 1 per pod).
    workers = [
        {"ppRank": stage, "tpRank": 0, "host": f"{name}-{stage}.{name}.{owner.namespace}.svc", "port": port}
        for stage in range(1, pp)
    ]
    return [{"name": ENGINE_WORKERS_ENV, "value": json.dumps(workers, separators=(",", ":"))}]
