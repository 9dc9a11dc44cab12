"""What a policy is: a function of one `PolicyInput` that returns the violations it finds. Pure.

Modelled on cert-manager's `policies.go`: a policy returns the violations it finds (a CamelCase reason and a
message that says what to change), and a chain is a tuple of policies read top to bottom, evaluated in order
(`evaluate_chain`), every violation kept. `PolicyInput` derives what every policy needs from the spec once:
the model's geometry and the topology plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from disagg.operator.api import DisaggDeploymentSpec, Role
from disagg.operator.naming import Installation
from disagg.operator.plan import TopologyPlan, model_geometry, plan_topology
from disagg.worker.kv.errors import LayoutError, Violation
from disagg.worker.kv.layout import ModelGeometry


@dataclass(frozen=True)
class PolicyInput:
    """What the policies judge: the spec, and what is derived from it once for all of them."""

    spec: DisaggDeploymentSpec
    # None when the model's geometry cannot be built; `model_geometry_is_valid` reports why.
    geometry: ModelGeometry | None
    geometry_error: Violation | None
    # Per role: the factors the handshake compares (`compat.role_factors`) and those the operator also
    # requires equal (`compat.deployment_factors`).
    factors: Mapping[Role, Mapping[str, Any]]
    installation: Installation
    # The compatibility hash each role advertises, and the topology (None when the layers cannot be split).
    hashes: Mapping[Role, str]
    plan: TopologyPlan | None

    @classmethod
    def of(
        cls,
        spec: DisaggDeploymentSpec,
        factors: Mapping[Role, Mapping[str, Any]],
        installation: Installation,
        hashes: Mapping[Role, str],
    ) -> PolicyInput:
        try:
            geometry = model_geometry(spec)
        except LayoutError as error:
            return cls(spec, None, error.violation, factors, installation, hashes, None)
        try:
            plan: TopologyPlan | None = plan_topology(spec, geometry)
        except LayoutError:
            # The partition is invalid; the worker's topology rules report it as InvalidLayerPartition.
            plan = None
        return cls(spec, geometry, None, factors, installation, hashes, plan)


Policy = Callable[[PolicyInput], Sequence[Violation]]


def evaluate_chain(chain: Sequence[Policy], given: PolicyInput) -> tuple[Violation, ...]:
    """Every violation of every policy of `chain`, in chain order.

    A policy that raises is a refusal named for it (`PolicyFailed`), never an exception: `disagg check` would
    print a traceback and the webhook could only say `VerdictFailed`, neither naming what is wrong. The spec
    fuzz asserts no spec reaches it, so each one found is a gap to close in the policy itself."""
    found: list[Violation] = []
    for policy in chain:
        try:
            found += policy(given)
        except Exception as error:  # see the docstring: a crash in one policy refuses, it does not escape
            found.append(
                Violation(
                    "PolicyFailed",
                    f"the operator's rule {policy.__name__} failed on this spec ({type(error).__name__}: "
                    f"{str(error)[:500]}); this is a gap in the operator's validation: report it with the "
                    "spec",
                )
            )
    return tuple(found)
