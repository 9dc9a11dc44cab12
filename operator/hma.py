"""Whether the engines run vLLM's hybrid KV cache manager (HMA), as the spec asks or the operator chooses.

Pure. `spec.engine.hybridKvCacheManager: Auto` (the default) is Disabled where a vLLM release loads a
sliding-window layer's KV incompletely (`releases.DEFECT_TEXT`, docs/vllm-sliding-window-load.md): under
HMA a decoder allocates no block for the first key of the window of the last prompt token, which it
recomputes, so one prompt length in every block size decodes wrong with a 200. Without HMA every layer keeps
every block, which costs KV memory and transfer bytes in the sliding-window layers (the doc sizes it), and no
prompt loses a key. Where the spec gives the model's sliding window and the deployment has its router, HMA
stays on instead and the router is told which prompt lengths lose a key (`window_edges`): it serves those on
the decoder alone. Auto is Enabled everywhere else: the reference engine, models without sliding-window
layers, a release that fixes the defect, and models that cannot run without HMA (sliding-window layers beside
Mamba or MLA ones). `policies.engine_release.sliding_window_kv_loads_whole` refuses HMA on where the defect
applies and no router guards it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from disagg.operator.api import ROLES, AttentionKind, DisaggDeploymentSpec, EngineKind, HybridKVCacheManager
from disagg.operator.engine_kind import engine_kind
from disagg.worker.contracts.releases import line_has, parse_version

# Without HMA vLLM promotes sliding-window layers to full attention and needs one spec for every layer.
_PROMOTABLE: Final = frozenset({AttentionKind.FULL, AttentionKind.SLIDING_WINDOW})


@dataclass(frozen=True)
class HmaChoice:
    enabled: bool
    chosen_by: Literal["spec", "operator"]
    why: str


def window_edge_defect(spec: DisaggDeploymentSpec) -> bool:
    """Whether, under HMA, this deployment's decoders would load a sliding-window layer's KV without the first
    key of the last prompt token's window: a model with sliding-window layers, and a role whose engine is
    vLLM on a release with the defect (an unparsable version counts; pre-flight refuses it anyway)."""
    if AttentionKind.SLIDING_WINDOW not in spec.model.layer_kinds():
        return False
    for role in ROLES:
        if engine_kind(spec, role) is not EngineKind.VLLM:
            continue
        parsed = parse_version(spec.effective(role, "version", spec.engine.version))
        if parsed is None or line_has(parsed[:2], "sliding_window_load_edge"):
            return True
    return False


def router_guards_window_edges(spec: DisaggDeploymentSpec) -> bool:
    """Whether the deployment's router can serve the prompt lengths that lose a key on the decoder alone: it
    has a router, and the spec gives the window those lengths follow from."""
    return spec.router.enabled and spec.model.sliding_window is not None


def hma_choice(spec: DisaggDeploymentSpec) -> HmaChoice:
    asked = spec.engine.hybrid_kv_cache_manager
    if asked is not HybridKVCacheManager.AUTO:
        return HmaChoice(asked is HybridKVCacheManager.ENABLED, "spec", f"hybridKvCacheManager is {asked}")
    defect = window_edge_defect(spec)
    if defect and router_guards_window_edges(spec):
        return HmaChoice(
            True,
            "operator",
            "Auto: under HMA this vLLM release's decoders load a sliding window's KV without its first key "
            "for some prompt lengths (docs/vllm-sliding-window-load.md); the router serves those on the "
            "decoder alone (spec.model.slidingWindow)",
        )
    if defect and set(spec.model.layer_kinds()) <= _PROMOTABLE:
        return HmaChoice(
            False,
            "operator",
            "Auto: the model has sliding-window layers, and under HMA this vLLM release's decoders load "
            "their KV without the first key of the last prompt token's window "
            "(docs/vllm-sliding-window-load.md), so every layer keeps every block",
        )
    return HmaChoice(True, "operator", "Auto")


def hma_enabled(spec: DisaggDeploymentSpec) -> bool:
    return hma_choice(spec).enabled


def window_edges(spec: DisaggDeploymentSpec) -> tuple[tuple[int, int], ...]:
    """The (sliding window, block size) whose prompt lengths the router must serve on the decoder alone
    (`--recompute-window-edge`): the decoder's block size, since its allocation is what skips the block."""
    window = spec.model.sliding_window
    if window is None or not hma_enabled(spec) or not window_edge_defect(spec):
        return ()
    return ((window, spec.decode.block_size),)
