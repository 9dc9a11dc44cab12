"""The verdict on a `DisaggDeploymentSpec`: a policy chain's violations, the topology plan, the hashes. Pure.

The compatibility hash is the worker's (`disagg.worker.kv.wire`), computed per role from the spec, so a pair
whose hashes would differ at handshake is refused before any pod exists; the image and model revision are
compared too, which vLLM does not hash but which change what the hashed version string and model name mean
(llm-d#499 and vLLM PR #55776). The rules themselves, in order, are `disagg.operator.policies.chain`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from disagg.operator.api import ROLES, DisaggDeploymentSpec, Role
from disagg.operator.hma import hma_enabled
from disagg.operator.naming import Installation
from disagg.operator.plan import TopologyPlan, role_release
from disagg.operator.policies.chain import COMPATIBILITY_CHAIN
from disagg.operator.policies.policy import Policy, PolicyInput, evaluate_chain
from disagg.operator.policies.resources import resources_note
from disagg.operator.policies.topology import kernel_blocks_note
from disagg.worker.kv.errors import Violation
from disagg.worker.kv.wire import compat_factors, compat_hash


@dataclass(frozen=True)
class CompatReport:
    """The verdict on a spec: every broken rule, the topology (when the layers can be split) and the
    compatibility hash each role will advertise."""

    violations: tuple[Violation, ...]
    plan: TopologyPlan | None
    factors: Mapping[Role, Mapping[str, Any]] = field(repr=False)
    hashes: Mapping[Role, str]
    notes: tuple[str, ...] = ()
    """What the verdict cannot decide and leaves to the live handshake (the kernel block sizes of a push
    pair whose attention backend picks them by the GPU), and what the operator generates that the spec did
    not say (engine containers without cpu or memory requests)."""

    @property
    def compatible(self) -> bool:
        return not self.violations

    @property
    def reasons(self) -> list[str]:
        return [violation.reason for violation in self.violations]


def role_factors(spec: DisaggDeploymentSpec, role: Role) -> dict[str, Any]:
    """vLLM's compatibility-hash factors of one role, with that role's overrides applied: the connector
    version is the one the role's release speaks."""
    engine, model = spec.engine, spec.model
    factors: dict[str, Any] = compat_factors(
        vllm_version=spec.effective(role, "version", engine.version),
        model=model.name,
        dtype=spec.effective(role, "dtype", model.dtype).value,
        num_kv_heads=model.num_kv_heads,
        head_size=model.head_size,
        num_hidden_layers=model.num_layers,
        attn_backend_name=spec.effective(role, "attention_backend", engine.attention_backend),
        is_hma_enabled=hma_enabled(spec),
        transfer_mode=spec.kv_transfer.connector.transfer_mode,
        cache_dtype=spec.effective(role, "kv_cache_dtype", model.kv_cache_dtype).value,
        nixl_connector_version=role_release(spec, role).connector_version,
    )
    return factors


def deployment_factors(spec: DisaggDeploymentSpec, role: Role) -> dict[str, Any]:
    """Factors vLLM does not hash but the operator still requires equal: the image and the model revision."""
    return {
        "image": spec.effective(role, "image", spec.engine.image),
        "revision": spec.effective(role, "revision", spec.model.revision),
    }


def evaluate(
    spec: DisaggDeploymentSpec,
    chain: Sequence[Policy] = COMPATIBILITY_CHAIN,
    installation: Installation | None = None,
) -> CompatReport:
    """The violations of `chain` (by default the rules the spec alone decides; the operator runs
    `policies.REFUSAL_CHAIN`), the topology plan and the per-role compatibility hashes. `installation`
    (default: one that sets no defaults) matters only to the policies that read it."""
    factors: dict[Role, dict[str, Any]] = {role: role_factors(spec, role) for role in ROLES}
    compared = {role: {**factors[role], **deployment_factors(spec, role)} for role in ROLES}
    hashes = MappingProxyType({role: compat_hash(f) for role, f in factors.items()})
    given = PolicyInput.of(spec, compared, installation or Installation(), hashes)
    return CompatReport(
        violations=evaluate_chain(chain, given),
        plan=given.plan,
        factors=MappingProxyType({role: MappingProxyType(f) for role, f in factors.items()}),
        hashes=hashes,
        notes=tuple(note for note in (kernel_blocks_note(given), resources_note(spec)) if note is not None),
    )
