"""Pre-flight compatibility of a `DisaggDeploymentSpec`: every connector rule the spec can decide. Pure.

The topology rules are the worker's own (`disagg.worker.kv.rules.check_topology`), so a spec the operator
accepts is one the sidecars accept at startup. The compatibility hash is the worker's
(`disagg.worker.kv.wire`), computed per role from the spec, so a pair whose hashes would differ at handshake
is refused before any pod exists. Only rules that exist nowhere in the worker live here: KV heads that cannot
be split over a TP size, hash factors that differ between roles (including the image and model revision, which
vLLM does not hash but which change what the hashed version string and model name mean, llm-d#499 and vLLM PR
#55776), and a huge page KV pool the API server or the kubelet would refuse.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

from disagg.operator.api import (
    ROLES,
    DisaggDeploymentSpec,
    HybridKVCacheManager,
    KVCacheLayout,
    Role,
    RoleSpec,
)
from disagg.operator.plan import TopologyPlan, model_geometry, plan_topology
from disagg.worker.kv.errors import LayoutError, Violation
from disagg.worker.kv.layout import ModelGeometry
from disagg.worker.kv.rules import RoleTopology, check_topology
from disagg.worker.kv.wire import compat_factors, compat_hash, differing_factors

# Where each factor comes from in the spec, so a mismatch names the field to change.
_FACTOR_FIELDS: Final = MappingProxyType(
    {
        "vllm_version": "version",
        "attn_backend_name": "attentionBackend",
        "dtype": "dtype",
        "cache_dtype": "kvCacheDtype",
        "image": "image",
        "revision": "revision",
    }
)


@dataclass(frozen=True)
class CompatReport:
    """The verdict on a spec: every broken rule, the topology (when the layers can be split) and the
    compatibility hash each role will advertise."""

    violations: tuple[Violation, ...]
    plan: TopologyPlan | None
    factors: Mapping[Role, Mapping[str, Any]] = field(repr=False)
    hashes: Mapping[Role, str]

    @property
    def compatible(self) -> bool:
        return not self.violations

    @property
    def reasons(self) -> list[str]:
        return [violation.reason for violation in self.violations]


def role_factors(spec: DisaggDeploymentSpec, role: Role) -> dict[str, Any]:
    """vLLM's compatibility-hash factors of one role, with that role's overrides applied."""
    engine, model = spec.engine, spec.model
    factors: dict[str, Any] = compat_factors(
        vllm_version=spec.effective(role, "version", engine.version),
        model=model.name,
        dtype=spec.effective(role, "dtype", model.dtype).value,
        num_kv_heads=model.num_kv_heads,
        head_size=model.head_size,
        num_hidden_layers=model.num_layers,
        attn_backend_name=spec.effective(role, "attention_backend", engine.attention_backend),
        is_hma_enabled=engine.hybrid_kv_cache_manager is HybridKVCacheManager.ENABLED,
        transfer_mode=spec.kv_transfer.connector.transfer_mode,
        cache_dtype=spec.effective(role, "kv_cache_dtype", model.kv_cache_dtype).value,
    )
    return factors


def deployment_factors(spec: DisaggDeploymentSpec, role: Role) -> dict[str, Any]:
    """Factors vLLM does not hash but the operator still requires equal: the image and the model revision."""
    return {
        "image": spec.effective(role, "image", spec.engine.image),
        "revision": spec.effective(role, "revision", spec.model.revision),
    }


def factor_mismatch(prefill: Mapping[str, Any], decode: Mapping[str, Any]) -> Violation | None:
    """A violation naming every factor that differs between the roles, with both values."""
    differing = differing_factors(prefill, decode)
    if not differing:
        return None
    details = ", ".join(
        f"{_FACTOR_FIELDS.get(key, key)} (prefill {prefill.get(key)!r}, decode {decode.get(key)!r})"
        for key in differing
    )
    return Violation(
        "CompatibilityHashMismatch",
        f"prefill and decode would not pass the handshake compatibility check: they differ in {details}; "
        "make spec.prefill.overrides and spec.decode.overrides agree, or remove them to use the shared "
        "engine and model settings",
    )


def kv_heads_not_divisible(num_kv_heads: int, tp_size: int, role: Role, is_mla: bool) -> Violation | None:
    """Non-MLA KV heads are split over TP ranks, or replicated when TP exceeds them: one divides the other."""
    if is_mla or num_kv_heads % tp_size == 0 or tp_size % num_kv_heads == 0:
        return None
    return Violation(
        "KVHeadsNotDivisible",
        f"the model's {num_kv_heads} KV heads cannot be split over {role} tensorParallelSize {tp_size}: "
        f"choose a {role} tensorParallelSize that divides {num_kv_heads} or is a multiple of it",
    )


def kv_pool_violations(spec: DisaggDeploymentSpec) -> list[Violation]:
    """A huge page pool needs a size in whole pages, and every container that maps it (engine and sidecar)
    needs a cpu or memory request or limit beside its hugepages, which Kubernetes refuses otherwise."""
    pool = spec.kv_transfer.kv_pool
    page = None if pool is None else pool.medium.huge_page_bytes
    resource = None if pool is None else pool.medium.resource_name
    if pool is None or page is None or resource is None:
        return []
    size = pool.size_bytes()
    found: list[Violation] = []
    pages = pool.medium.value.split("-", 1)[1]
    if size is None or size <= 0 or size % page:
        given = "not set" if pool.size_limit is None else repr(pool.size_limit)
        found.append(
            Violation(
                "KVPoolSizeInvalid",
                f"spec.kvTransfer.kvPool.medium {pool.medium.value} needs sizeLimit, a positive whole number "
                f"of {pages} pages, but it is {given}: set spec.kvTransfer.kvPool.sizeLimit to the pool's "
                "size rounded up to whole pages (e.g. 16Gi)",
            )
        )
    containers = {
        "spec.prefill.resources": spec.prefill.resources,
        "spec.decode.resources": spec.decode.resources,
        "spec.worker.resources": spec.worker.resources,
    }
    for path, resources in containers.items():
        sections = [(resources or {}).get(key) or {} for key in ("requests", "limits")]
        if not any(name in section for section in sections for name in ("cpu", "memory")):
            found.append(
                Violation(
                    "KVPoolResourcesInvalid",
                    f"{path} has no cpu or memory request or limit, which Kubernetes requires of a container "
                    f"with {resource}: add requests.memory (or cpu) to {path}",
                )
            )
        other = {str(section[resource]) for section in sections if resource in section} - {pool.size_limit}
        if other:
            found.append(
                Violation(
                    "KVPoolResourcesInvalid",
                    f"{path} sets {resource} to {sorted(other)[0]!r} but spec.kvTransfer.kvPool.sizeLimit is "
                    f"{pool.size_limit!r}: remove {resource} from {path}, the operator sets it from the pool",
                )
            )
    return found


def _topology_violations(spec: DisaggDeploymentSpec, geometry: ModelGeometry) -> list[Violation]:
    def topology(role: RoleSpec) -> RoleTopology:
        partition = tuple(role.layer_partition) if role.layer_partition is not None else None
        return RoleTopology(
            role.pipeline_parallel_size, role.tensor_parallel_size, role.block_size, partition
        )

    found: list[Violation] = check_topology(
        transfer_mode=spec.kv_transfer.connector.transfer_mode,
        hma=geometry.hma_required,
        has_mamba=geometry.has_mamba,
        is_mla=geometry.is_mla,
        num_layers=geometry.num_layers,
        prefill=topology(spec.prefill),
        decode=topology(spec.decode),
        packed=spec.engine.kv_cache_layout is KVCacheLayout.BLOCK_OUTERMOST,
    )
    for role in ROLES:
        heads = kv_heads_not_divisible(
            spec.model.num_kv_heads, spec.role(role).tensor_parallel_size, role, geometry.is_mla
        )
        if heads is not None:
            found.append(heads)
    return found


def evaluate(spec: DisaggDeploymentSpec) -> CompatReport:
    """Every rule the spec breaks, the topology plan and the per-role compatibility hashes."""
    factors: dict[Role, dict[str, Any]] = {role: role_factors(spec, role) for role in ROLES}
    violations: list[Violation] = []
    plan: TopologyPlan | None = None
    try:
        geometry = model_geometry(spec)
    except LayoutError as error:
        violations.append(error.violation)
    else:
        violations.extend(_topology_violations(spec, geometry))
        try:
            plan = plan_topology(spec, geometry)
        except LayoutError:
            # The partition is invalid; check_topology already reported it as InvalidLayerPartition.
            plan = None
    mismatch = factor_mismatch(
        {**factors["prefill"], **deployment_factors(spec, "prefill")},
        {**factors["decode"], **deployment_factors(spec, "decode")},
    )
    if mismatch is not None:
        violations.append(mismatch)
    violations.extend(kv_pool_violations(spec))
    return CompatReport(
        violations=tuple(violations),
        plan=plan,
        factors=MappingProxyType({role: MappingProxyType(f) for role, f in factors.items()}),
        hashes=MappingProxyType({role: compat_hash(f) for role, f in factors.items()}),
    )
