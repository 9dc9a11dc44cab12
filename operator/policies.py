"""Every reason to refuse a schema-valid `DisaggDeploymentSpec`, as one ordered chain of named policies. Pure.

Modelled on cert-manager's `policies.go`: a policy is a function of one input that returns the violations it
finds (a CamelCase reason and a message that says what to change), and a chain is a tuple of policies read
top to bottom, evaluated in order, every violation kept. Reconcile, the admission webhook and `disagg check`
/ `disagg plan` all run `REFUSAL_CHAIN` (through `compat.evaluate`), so the three cannot disagree.

`COMPATIBILITY_CHAIN` is the part the spec alone decides (the CRD's CEL rules mirror it); a new rule of that
kind is a function here and one line in that tuple. The worker's own rules are not copied here: the topology
rules are `disagg.worker.kv.rules.check_topology` (the sidecar and its handshake use the same functions), and
engine arguments are judged by `builders_engine.arg_violations` beside the table of flags the builders own.
The chain ends with `objects_build`, the builders' own run, so whatever the chain accepts reconciles.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from disagg.operator.api import (
    ROLES,
    Connector,
    DisaggDeploymentSpec,
    HybridKVCacheManager,
    KVCacheDType,
    KVCacheLayout,
    ModelDType,
    Role,
    RoleSpec,
)
from disagg.operator.builders import TRANSFER_IMAGE_ENV, WORKER_IMAGE_ENV, Installation, Owner, build
from disagg.operator.builders_engine import arg_violations, is_reference_engine_image, role_image, user_args
from disagg.operator.plan import TopologyPlan, model_geometry, plan_topology
from disagg.worker.contracts import releases
from disagg.worker.kv.errors import LayoutError, Violation
from disagg.worker.kv.layout import DEFAULT_LAYER_NAME_TEMPLATE, AttentionKind, ModelGeometry, pp_partition
from disagg.worker.kv.rules import (
    RoleTopology,
    check_topology,
    decode_context_parallel,
    invalid_layer_partition,
    mamba_state_not_transferred,
    prefill_context_parallel,
)
from disagg.worker.kv.wire import differing_factors

# Kubernetes refuses a ConfigMap whose data exceeds 1 MiB; etcd's default request limit (1.5 MiB) bounds any
# other object, so 1 MiB is the size no built object may exceed.
MAX_OBJECT_BYTES: Final = 1 << 20
# Who owns the objects does not change what can be built; a name of the longest kind exercises child_name.
_CHECK_OWNER: Final = Owner(
    name="d" * 253, namespace="n" * 63, uid="00000000-0000-0000-0000-000000000000", generation=1
)

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


# ---- the policies, in chain order -------------------------------------------------------------------------


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


def handshake_factors_match(given: PolicyInput) -> Sequence[Violation]:
    mismatch = factor_mismatch(given.factors["prefill"], given.factors["decode"])
    return [] if mismatch is None else [mismatch]


def kv_pool_is_valid(given: PolicyInput) -> Sequence[Violation]:
    return kv_pool_violations(given.spec)


def engine_release_is_supported(given: PolicyInput) -> Sequence[Violation]:
    """Each role's `version` is a supported vLLM release (`releases.RELEASES`) that can run the topology."""
    return release_violations(given.spec, given.geometry)


def engine_arguments_agree(given: PolicyInput) -> Sequence[Violation]:
    return arg_violations(given.spec)


def prefill_context_is_not_split(given: PolicyInput) -> Sequence[Violation]:
    """A prefill engine started with prefill context parallelism (`--prefill-context-parallel-size`)."""
    size = flag_value(user_args(given.spec, "prefill"), PCP_FLAGS)
    # isdecimal, not isdigit: int() refuses digits such as "²" that isdigit accepts.
    violation = prefill_context_parallel(int(size)) if size is not None and size.isdecimal() else None
    return [] if violation is None else [violation]


def decode_context_is_not_split(given: PolicyInput) -> Sequence[Violation]:
    """A decode engine started with decode context parallelism (`--decode-context-parallel-size`)."""
    size = flag_value(user_args(given.spec, "decode"), DCP_FLAGS)
    violation = decode_context_parallel(int(size)) if size is not None and size.isdecimal() else None
    return [] if violation is None else [violation]


def reference_engine_can_run(given: PolicyInput) -> Sequence[Violation]:
    """What the project's reference engine (`disagg engine serve`) cannot run, when a role's image is it."""
    return reference_engine_violations(given.spec)


def worker_image_is_named(given: PolicyInput) -> Sequence[Violation]:
    return worker_image_violations(given.spec, given.installation)


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
)
"""What the spec alone decides: `compat.evaluate(spec)` and the CRD's CEL rules."""

_BEFORE_BUILD: Final[tuple[Policy, ...]] = (
    *COMPATIBILITY_CHAIN,
    # Not mirrored in CEL: the table of releases grows with every vLLM release, the CRD should not.
    engine_release_is_supported,
    engine_arguments_agree,
    prefill_context_is_not_split,
    decode_context_is_not_split,
    reference_engine_can_run,
    worker_image_is_named,
)

REFUSAL_CHAIN: Final[tuple[Policy, ...]] = (
    *_BEFORE_BUILD,
    objects_build,
)
"""Everything the operator refuses a spec for: reconcile, the webhook, `disagg check` and `disagg plan`."""


# ---- the rules the policies apply ----------------------------------------------------------------------

PCP_FLAGS: Final = ("--prefill-context-parallel-size", "-pcp")
DCP_FLAGS: Final = ("--decode-context-parallel-size", "-dcp")


def flag_value(args: Sequence[str], spellings: Sequence[str]) -> str | None:
    """The last value an engine argument list gives one flag (`--flag value` or `--flag=value`), if any, read
    as vLLM's parser reads it: underscores for dashes, and a prefix of a spelling for it (argparse's
    abbreviations, `builders_engine`)."""
    found: str | None = None
    for index, token in enumerate(args):
        name, has_inline, inline = token.partition("=")
        flag = name.replace("_", "-") if name.startswith("--") else name
        if flag in ("-", "--") or not flag.startswith("-"):
            continue
        if not any(spelling.startswith(flag) for spelling in spellings):
            continue
        if has_inline:
            found = inline
        elif index + 1 < len(args):
            found = args[index + 1]
    return found


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


def required_capabilities(
    spec: DisaggDeploymentSpec, geometry: ModelGeometry | None
) -> list[releases.Capability]:
    """What the spec's topology needs of the engine release, in `releases.CAPABILITY_TEXT` order."""
    needed: list[releases.Capability] = []
    push = spec.kv_transfer.connector.transfer_mode == "push"
    pp = spec.prefill.pipeline_parallel_size > 1
    if push:
        needed.append("push")
    if push and pp:
        needed.append("pp_push")
    if push and pp and geometry is not None and geometry.hma_required:
        needed.append("pp_hma_push")
    if spec.engine.kv_cache_layout is KVCacheLayout.BLOCK_OUTERMOST:
        needed.append("packed_layouts")
    return needed


def release_violations(spec: DisaggDeploymentSpec, geometry: ModelGeometry | None) -> list[Violation]:
    """Each distinct version field: an unknown release, and every capability the spec needs that it lacks."""
    found: list[Violation] = []
    seen: set[tuple[str, str]] = set()
    needed = required_capabilities(spec, geometry)
    for role in ROLES:
        overrides = spec.role(role).overrides
        path = (
            f"spec.{role}.overrides.version"
            if overrides is not None and overrides.version is not None
            else "spec.engine.version"
        )
        version = spec.effective(role, "version", spec.engine.version)
        if (path, version) in seen:
            continue
        seen.add((path, version))
        unknown = unsupported_release(version, path)
        found += [] if unknown is None else [unknown]
        for capability in needed:
            lacking = release_cannot_run(version, capability, path)
            found += [] if lacking is None else [lacking]
    return found


def unsupported_release(version: str, path: str = "spec.engine.version") -> Violation | None:
    """A version no row of `releases.RELEASES` has (an older or newer line, a dev build, not a version)."""
    if releases.release_of(version) is not None:
        return None
    return Violation(
        "UnsupportedEngineVersion",
        f"{path} is {version!r}, which is not a vLLM release this operator supports: the supported releases "
        f"are {releases.supported_text()}; set {path} (and the image) to one of them, e.g. "
        f"{releases.LATEST.tested!r}",
    )


def release_cannot_run(
    version: str, capability: releases.Capability, path: str = "spec.engine.version"
) -> Violation | None:
    """A release line older than the first one with a capability the spec needs."""
    if releases.line_can(version, capability) is not False:
        return None
    first = ".".join(map(str, releases.FIRST_LINE_WITH[capability]))
    return Violation(
        "EngineVersionCannotRunTopology",
        f"{path} is {version!r}, but vLLM before {first} has no {releases.CAPABILITY_TEXT[capability]}, "
        f"which this spec asks for: set {path} to a release that can, {releases.lines_that_can(capability)}",
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
        declared = resources.sections() if resources is not None else {}
        sections = [declared.get(key) or {} for key in ("requests", "limits")]
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


def worker_image_violations(spec: DisaggDeploymentSpec, installation: Installation) -> list[Violation]:
    """A sidecar image neither the spec nor the installation names."""
    if installation.sidecar_image(spec) is not None:
        return []
    return [
        Violation(
            "WorkerImageMissing",
            f"spec.worker.image is not set and the operator has no default sidecar image "
            f"({WORKER_IMAGE_ENV} and {TRANSFER_IMAGE_ENV} are unset): set spec.worker.image, or install the "
            "operator with the Helm chart, which sets them from worker.image and worker.transferImage",
        )
    ]


# ---- the reference engine ----------------------------------------------------------------------------------
#
# `disagg engine serve` runs the reference model (`disagg.worker.engine.config.TinyConfig`): float32, one TP
# rank per pod, 4 query heads, full attention every third layer with a fixed 32-token sliding window between,
# layers split evenly over the stages. From the topology it takes the number of layers, the KV heads, the head
# size, the block size, the pipeline size and the model name it serves (`disagg.worker.engine.serve`'s
# `model_config` checks the rest); everything else that would change what it computes or how its KV is laid
# out is refused here, before any pod exists.

# TinyConfig.num_heads: grouped-query attention needs the KV heads to divide them.
REFERENCE_QUERY_HEADS: Final = 4
# TinyConfig.full_every: the reference engine builds its layer pattern, not the topology's.
REFERENCE_FULL_EVERY: Final = 3
REFERENCE_ENGINE_FLAGS: Final = ("--num-blocks",)
# `disagg engine serve --num-blocks`: a pool of at least two blocks, at most 2**20.
REFERENCE_NUM_BLOCKS: Final = range(2, (1 << 20) + 1)


def _reference_refusal(problem: str) -> Violation:
    return Violation(
        "ReferenceEngineUnsupported",
        f"the image is the project's reference engine (disagg-transfer), which {problem}",
    )


def reference_tensor_parallel(role: str, tensor_parallel_size: int) -> Violation | None:
    """The reference engine runs one tensor-parallel rank per pod."""
    if tensor_parallel_size == 1:
        return None
    return _reference_refusal(
        f"runs one tensor-parallel rank per pod, but spec.{role}.tensorParallelSize is "
        f"{tensor_parallel_size}: set it to 1, or serve the model with vLLM"
    )


def reference_extra_args(args: Sequence[str]) -> Violation | None:
    """The only engine argument a spec may give the reference engine is `--num-blocks N` (its KV capacity)."""
    index = 0
    while index < len(args):
        name, has_inline, value = args[index].partition("=")
        index += 1
        if name not in REFERENCE_ENGINE_FLAGS:
            return _reference_refusal(
                f"takes no argument {args[index - 1][:100]!r}: the extra arguments may only give "
                f"{' or '.join(REFERENCE_ENGINE_FLAGS)} N"
            )
        if not has_inline:
            value = args[index] if index < len(args) else ""
            index += 1
        if not (value.isdecimal() and int(value) in REFERENCE_NUM_BLOCKS):
            return _reference_refusal(
                f"needs a whole number from {REFERENCE_NUM_BLOCKS.start} to {REFERENCE_NUM_BLOCKS.stop - 1} "
                f"after {name}, not {value[:100]!r}"
            )
    return None


def reference_engine_violations(spec: DisaggDeploymentSpec) -> list[Violation]:
    """Every spec field the reference engine cannot honour, when some role's image is it."""
    roles = [role for role in ROLES if is_reference_engine_image(role_image(spec, role))]
    if not roles:
        return []
    found: list[Violation | None] = []
    for role in roles:
        found.append(reference_tensor_parallel(role, spec.role(role).tensor_parallel_size))
        dtype = spec.effective(role, "dtype", spec.model.dtype)
        if dtype is not ModelDType.FLOAT32:
            found.append(
                _reference_refusal(
                    f"computes in float32 only, not {dtype.value}: set spec.model.dtype to float32"
                )
            )
        cache_dtype = spec.effective(role, "kv_cache_dtype", spec.model.kv_cache_dtype)
        if cache_dtype is not KVCacheDType.AUTO:
            found.append(
                _reference_refusal(
                    f"keeps its KV cache in the model dtype, not {cache_dtype.value}: set "
                    "spec.model.kvCacheDtype to auto"
                )
            )
        found.append(reference_extra_args(user_args(spec, role)))
    model = spec.model
    kinds = tuple(kind.to_layout() for kind in model.layer_kinds())
    pattern = tuple(
        AttentionKind.FULL if (i + 1) % REFERENCE_FULL_EVERY == 0 else AttentionKind.SLIDING_WINDOW
        for i in range(model.num_layers)
    )
    if kinds != pattern:
        found.append(
            _reference_refusal(
                f"has full attention every {REFERENCE_FULL_EVERY}rd layer and sliding-window layers between "
                f"(layer i is full iff (i + 1) % {REFERENCE_FULL_EVERY} == 0): set spec.model.layerPattern "
                f"to {{fullEvery: {REFERENCE_FULL_EVERY}}}"
            )
        )
    if spec.engine.hybrid_kv_cache_manager is HybridKVCacheManager.DISABLED:
        found.append(
            _reference_refusal(
                "pools its sliding-window and full-attention layers as the hybrid KV cache manager does: set "
                "spec.engine.hybridKvCacheManager to Enabled"
            )
        )
    partition = spec.prefill.layer_partition
    # Only a pipeline size the layers can fill has an even split; any other is `worker_topology_rules`'
    # InvalidLayerPartition (pp_partition raises on it), so there is no even split to compare against.
    pp_size = spec.prefill.pipeline_parallel_size
    fillable = invalid_layer_partition(model.num_layers, pp_size, None) is None
    even = [len(stage) for stage in pp_partition(model.num_layers, pp_size)] if fillable else None
    if partition is not None and even is not None and list(partition) != even:
        found.append(
            _reference_refusal(
                f"splits its layers over the pipeline stages evenly ({even}): remove "
                "spec.prefill.layerPartition"
            )
        )
    if REFERENCE_QUERY_HEADS % model.num_kv_heads:
        found.append(
            _reference_refusal(
                f"has {REFERENCE_QUERY_HEADS} query heads, which spec.model.numKvHeads {model.num_kv_heads} "
                "does not divide: set it to 1, 2 or 4"
            )
        )
    if model.head_size % 2:
        found.append(
            _reference_refusal(
                f"applies rotary embeddings, which need an even head size: spec.model.headSize is "
                f"{model.head_size}"
            )
        )
    if model.layer_name_template != DEFAULT_LAYER_NAME_TEMPLATE:
        found.append(
            _reference_refusal(
                f"names its layers {DEFAULT_LAYER_NAME_TEMPLATE!r}: remove spec.model.layerNameTemplate"
            )
        )
    if spec.engine.kv_cache_layout is not KVCacheLayout.LAYER_OUTERMOST:
        found.append(
            _reference_refusal(
                "lays its KV cache out layer-outermost: set spec.engine.kvCacheLayout to LayerOutermost"
            )
        )
    if spec.kv_transfer.connector is not Connector.PUSH:
        found.append(
            _reference_refusal(
                "is served by the push transfer sidecar: set spec.kvTransfer.connector to Push"
            )
        )
    return [violation for violation in found if violation is not None]
