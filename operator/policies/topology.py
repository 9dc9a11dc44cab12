"""The policies on the model and its split over the engines: geometry, the worker's topology rules, the
transfer sidecar's reach and the KV heads over TP. Pure.

The topology rules themselves are the worker's (`disagg.worker.kv.rules.check_topology`): the sidecar and its
handshake use the same functions, so the operator never copies them.
"""

from __future__ import annotations

from collections.abc import Sequence

from disagg.operator.api import ROLES, KVCacheLayout, Role, RoleSpec
from disagg.operator.policies.policy import PolicyInput
from disagg.worker.kv.errors import Violation
from disagg.worker.kv.rules import (
    RoleTopology,
    check_topology,
    mamba_state_not_transferred,
)


def model_geometry_is_valid(given: PolicyInput) -> Sequence[Violation]:
    return [] if given.geometry_error is None else [given.geometry_error]


def worker_topology_rules(given: PolicyInput) -> Sequence[Violation]:
    """The connector's PP/TP/block-size/partition rules: the worker's own functions."""
    spec, geometry = given.spec, given.geometry
    if geometry is None:
        return []

    def topology(role: RoleSpec) -> RoleTopology:
        partition = tuple(role.layer_partition) if role.layer_partition is not None else None
        return RoleTopology(
            role.pipeline_parallel_size, role.tensor_parallel_size, role.block_size, partition
        )

    return check_topology(
        transfer_mode=spec.kv_transfer.connector.transfer_mode,
        hma=geometry.hma_required,
        has_mamba=geometry.has_mamba,
        is_mla=geometry.is_mla,
        num_layers=geometry.num_layers,
        prefill=topology(spec.prefill),
        decode=topology(spec.decode),
        packed=spec.engine.kv_cache_layout is KVCacheLayout.BLOCK_OUTERMOST,
    )


def transfer_sidecar_moves_the_model(given: PolicyInput) -> Sequence[Violation]:
    """The push transfer sidecar moves attention KV pages only: a Mamba hybrid is refused before any pod."""
    geometry = given.geometry
    if geometry is None:
        return []
    violation = mamba_state_not_transferred(
        given.spec.kv_transfer.connector.transfer_mode, geometry.has_mamba
    )
    return [] if violation is None else [violation]


def kv_heads_divide_over_tp(given: PolicyInput) -> Sequence[Violation]:
    geometry = given.geometry
    if geometry is None:
        return []
    found = (
        kv_heads_not_divisible(
            given.spec.model.num_kv_heads, given.spec.role(role).tensor_parallel_size, role, geometry.is_mla
        )
        for role in ROLES
    )
    return [violation for violation in found if violation is not None]


def kv_heads_not_divisible(num_kv_heads: int, tp_size: int, role: Role, is_mla: bool) -> Violation | None:
    """Non-MLA KV heads are split over TP ranks, or replicated when TP exceeds them: one divides the other."""
    if is_mla or num_kv_heads % tp_size == 0 or tp_size % num_kv_heads == 0:
        return None
    return Violation(
        "KVHeadsNotDivisible",
        f"the model's {num_kv_heads} KV heads cannot be split over {role} tensorParallelSize {tp_size}: "
        f"choose a {role} tensorParallelSize that divides {num_kv_heads} or is a multiple of it",
    )
