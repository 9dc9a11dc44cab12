"""The policies on the model and its split over the engines: geometry, the worker's topology rules, the
transfer sidecar's reach, the KV heads over TP and the kernel block sizes of a push pair. Pure.

The topology rules themselves are the worker's (`disagg.worker.kv.rules.check_topology`): the sidecar and its
handshake use the same functions, so the operator never copies them.
"""

from __future__ import annotations

from collections.abc import Sequence

from disagg.operator.api import ROLES, KVCacheLayout, Role, RoleSpec
from disagg.operator.policies.policy import PolicyInput
from disagg.worker.contracts.attention_backends import KERNEL_BLOCK_SIZES, kernel_blocks
from disagg.worker.kv.errors import Violation
from disagg.worker.kv.rules import (
    PUSH,
    RoleTopology,
    check_topology,
    kernel_block_mismatch,
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


def _role_backend(given: PolicyInput, role: Role) -> str:
    spec = given.spec
    return str(spec.effective(role, "attention_backend", spec.engine.attention_backend))


def kernel_blocks_match(given: PolicyInput) -> Sequence[Violation]:
    """A push pair whose `(kernel block size, kernel blocks per logical block)` the spec decides on both roles
    (each pins an attention backend whose kernel block sizes are constants, `contracts.attention_backends`)
    must have them equal (`rules.kernel_block_mismatch`); where the spec cannot decide, `kernel_blocks_note`
    says so and the live handshake decides."""
    spec = given.spec
    if spec.kv_transfer.connector.transfer_mode != PUSH:
        return []
    decided = [kernel_blocks(_role_backend(given, role), spec.role(role).block_size) for role in ROLES]
    prefill, decode = decided
    if prefill is None or decode is None:
        return []
    violation = kernel_block_mismatch(prefill, decode)
    return [] if violation is None else [violation]


def kernel_blocks_note(given: PolicyInput) -> str | None:
    """What the verdict says when a push pair's kernel block sizes are not the spec's to decide: the backend
    whose kernel block size the engine picks at start (by its GPU and KV spec), left to the handshake."""
    spec = given.spec
    if spec.kv_transfer.connector.transfer_mode != PUSH:
        return None
    undecided = []
    for role in ROLES:
        backend, block_size = _role_backend(given, role), spec.role(role).block_size
        if kernel_blocks(backend, block_size) is not None:
            continue
        why = (
            f"no kernel block size of {backend} divides blockSize {block_size}"
            if backend in KERNEL_BLOCK_SIZES
            else f"{backend} picks its kernel block size by the GPU and KV cache spec"
        )
        undecided.append(f"{role}: {why}")
    if not undecided:
        return None
    return (
        "kernel block sizes undecided before pods exist (" + "; ".join(undecided) + "): push needs equal "
        "(kernel block size, kernel blocks per logical block) on both roles, so the handshake decides "
        "(KernelBlockSizeMismatch names both); pin a backend whose kernel block sizes are fixed (such as "
        "TRITON_ATTN) to decide it here"
    )


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
