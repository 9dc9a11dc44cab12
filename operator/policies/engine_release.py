"""The policy that each role's vLLM release is one this operator supports and can run the topology. Pure.

The table of releases and what each can do is the worker's (`disagg.worker.contracts.releases`).
"""

from __future__ import annotations

from collections.abc import Sequence

from disagg.operator.api import ROLES, DisaggDeploymentSpec, KVCacheLayout
from disagg.operator.hma import hma_enabled, router_guards_window_edges, window_edge_defect
from disagg.operator.policies.policy import PolicyInput
from disagg.worker.contracts import releases
from disagg.worker.kv.errors import Violation
from disagg.worker.kv.layout import ModelGeometry


def engine_release_is_supported(given: PolicyInput) -> Sequence[Violation]:
    """Each role's `version` is a supported vLLM release (`releases.RELEASES`) that can run the topology."""
    return release_violations(given.spec, given.geometry)


def sliding_window_kv_loads_whole(given: PolicyInput) -> Sequence[Violation]:
    """HMA on where the release's decoders would load a sliding-window layer's KV incompletely
    (`disagg.operator.hma`), asked for or needed by the model's other layers: refused, since one prompt
    length in every block size would decode wrong."""
    spec = given.spec
    if not hma_enabled(spec) or not window_edge_defect(spec) or router_guards_window_edges(spec):
        return []
    return [
        Violation(
            "SlidingWindowLoadDefect",
            f"vLLM {spec.engine.version} with the hybrid KV cache manager: "
            f"{releases.DEFECT_TEXT['sliding_window_load_edge']}. Set spec.engine.hybridKvCacheManager to "
            "Auto or Disabled, or give spec.model.slidingWindow and keep spec.router enabled: the router "
            "then serves the prompt lengths that lose a key on the decoder alone",
        )
    ]


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
