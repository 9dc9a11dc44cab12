"""Every reason to refuse a schema-valid `DisaggDeploymentSpec`, as one ordered chain of named policies. Pure.

Reconcile, the admission webhook and `disagg check` / `disagg plan` all run `REFUSAL_CHAIN` (through
`compat.evaluate`), so the three cannot disagree. `COMPATIBILITY_CHAIN` is the part the spec alone decides
(the CRD's CEL rules mirror it); a new rule of that kind is a function in the module of what it checks and
one line in that tuple. The worker's own rules are not copied: the topology rules are
`disagg.worker.kv.rules.check_topology` (the sidecar and its handshake use the same functions), and engine
arguments are judged by `builders.engine.arg_violations` beside the table of flags the builders own. The
chain ends with `objects_build`, the builders' own run, so whatever the chain accepts reconciles; it lives
here because it runs the chain before it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Final

from disagg.operator.builders.children import build
from disagg.operator.naming import Owner
from disagg.operator.policies.engine_args import (
    decode_context_is_not_split,
    engine_arguments_agree,
    engine_arguments_parse,
    prefill_context_is_not_split,
)
from disagg.operator.policies.engine_release import engine_release_is_supported, sliding_window_kv_loads_whole
from disagg.operator.policies.handshake import handshake_factors_match
from disagg.operator.policies.pods import (
    kv_pool_is_valid,
    model_volume_is_valid,
    transport_has_devices,
    worker_image_is_named,
)
from disagg.operator.policies.policy import Policy, PolicyInput, evaluate_chain
from disagg.operator.policies.reference_engine import reference_engine_can_run
from disagg.operator.policies.topology import (
    kernel_blocks_match,
    kv_heads_divide_over_tp,
    model_geometry_is_valid,
    transfer_sidecar_moves_the_model,
    worker_topology_rules,
)
from disagg.worker.kv.errors import Violation

# Kubernetes refuses a ConfigMap whose data exceeds 1 MiB; etcd's default request limit (1.5 MiB) bounds any
# other object, so 1 MiB is the size no built object may exceed.
MAX_OBJECT_BYTES: Final = 1 << 20


# Who owns the objects does not change what can be built; a name of the longest kind exercises child_name.
_CHECK_OWNER: Final = Owner(
    name="d" * 253, namespace="n" * 63, uid="00000000-0000-0000-0000-000000000000", generation=1
)


def objects_build(given: PolicyInput) -> Sequence[Violation]:
    """The builders' own run on the spec, so that what the chain accepts always reconciles. Judged only when
    every earlier policy passes: what they refuse is what the builders cannot build, said better."""
    if given.plan is None or evaluate_chain(_BEFORE_BUILD, given):
        return []
    try:
        objects = build(given.spec, _CHECK_OWNER, given.plan, given.hashes, given.installation)
    except Exception as error:  # every failure of the builders is a reason to refuse, not a crash
        return [
            Violation(
                "BuildFailed",
                f"the operator cannot build this spec's objects ({type(error).__name__}: "
                f"{str(error)[:500]}); this is a gap in the operator's validation: report it with the spec",
            )
        ]
    found = []
    for obj in objects:
        size = len(json.dumps(obj, separators=(",", ":")))
        if size > MAX_OBJECT_BYTES:
            found.append(
                Violation(
                    "ManifestTooLarge",
                    f"the {obj['kind']} {obj['metadata']['name']} the operator builds for this spec is "
                    f"{size} bytes, over the {MAX_OBJECT_BYTES} Kubernetes stores: shorten "
                    "spec.model.layerNameTemplate or spec.*.extraArgs, or serve fewer layers",
                )
            )
    return found


COMPATIBILITY_CHAIN: Final[tuple[Policy, ...]] = (
    model_geometry_is_valid,
    worker_topology_rules,
    transfer_sidecar_moves_the_model,
    kv_heads_divide_over_tp,
    handshake_factors_match,
    kv_pool_is_valid,
    model_volume_is_valid,
)
"""What the spec alone decides: `compat.evaluate(spec)` and the CRD's CEL rules."""


_BEFORE_BUILD: Final[tuple[Policy, ...]] = (
    *COMPATIBILITY_CHAIN,
    # Not mirrored in CEL: the table of releases grows with every vLLM release, the CRD should not.
    engine_release_is_supported,
    sliding_window_kv_loads_whole,
    # Not in CEL either: the table of backends' kernel block sizes is vLLM's and grows with it.
    kernel_blocks_match,
    engine_arguments_agree,
    engine_arguments_parse,
    prefill_context_is_not_split,
    decode_context_is_not_split,
    reference_engine_can_run,
    worker_image_is_named,
    transport_has_devices,
)


REFUSAL_CHAIN: Final[tuple[Policy, ...]] = (
    *_BEFORE_BUILD,
    objects_build,
)
"""Everything the operator refuses a spec for: reconcile, the webhook, `disagg check` and `disagg plan`."""
