"""The model and the engine of a `DisaggDeployment` (`spec.model`, `spec.engine`) and their enums."""

from __future__ import annotations

import enum
import posixpath
from typing import Final, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from disagg.operator.api.fields import MAX_EXTRA_ARGS, MAX_LAYERS, ApiModel, ExtraArg
from disagg.worker.kv import layout


class AttentionKind(enum.StrEnum):
    """What a layer keeps in the KV cache; decides HMA, MLA (replicated cache) and Mamba handling."""

    FULL = "Full"
    SLIDING_WINDOW = "SlidingWindow"
    MLA = "MLA"
    MAMBA = "Mamba"

    def to_layout(self) -> layout.AttentionKind:
        return _LAYOUT_KINDS[self]


_LAYOUT_KINDS: Final = {
    AttentionKind.FULL: layout.AttentionKind.FULL,
    AttentionKind.SLIDING_WINDOW: layout.AttentionKind.SLIDING_WINDOW,
    AttentionKind.MLA: layout.AttentionKind.MLA,
    AttentionKind.MAMBA: layout.AttentionKind.MAMBA,
}


class ModelDType(enum.StrEnum):
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"

    @property
    def num_bytes(self) -> int:
        return 4 if self is ModelDType.FLOAT32 else 2


class KVCacheDType(enum.StrEnum):
    """vLLM's `--kv-cache-dtype` spellings; `auto` follows the model dtype."""

    AUTO = "auto"
    FP8 = "fp8"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"


class HybridKVCacheManager(enum.StrEnum):
    """vLLM's hybrid KV cache manager (HMA); `Disabled` is `--disable-hybrid-kv-cache-manager`. `Auto` lets
    the operator choose (`disagg.operator.hma`): Disabled where the vLLM release would load a sliding-window
    layer's KV incompletely, Enabled everywhere else."""

    AUTO = "Auto"
    ENABLED = "Enabled"
    DISABLED = "Disabled"


class KVCacheLayout(enum.StrEnum):
    """`LayerOutermost` is one region per layer (LBHNC); `BlockOutermost` packs every layer's page of a block
    together (BLHNC, vLLM #50499) and, like HMA, needs layer-name routing under PP."""

    LAYER_OUTERMOST = "LayerOutermost"
    BLOCK_OUTERMOST = "BlockOutermost"


class Connector(enum.StrEnum):
    """`Push`: prefill WRITEs KV into decode (NixlPushConnector). `Pull`: decode READs it (NixlConnector)."""

    PUSH = "Push"
    PULL = "Pull"

    @property
    def transfer_mode(self) -> Literal["push", "pull"]:
        return "push" if self is Connector.PUSH else "pull"

    @property
    def vllm_class(self) -> str:
        return "NixlPushConnector" if self is Connector.PUSH else "NixlConnector"


class NixlBackend(enum.StrEnum):
    UCX = "UCX"
    LIBFABRIC = "LIBFABRIC"
    GDS = "GDS"


class EngineKind(enum.StrEnum):
    """What the engine container runs, which decides its arguments, its user and who moves the KV.

    `VLLM`: `vllm serve` with the arguments the spec decides; it runs the NIXL connector in-process and the
    sidecar only watches. `Reference`: the project's reference engine (`disagg engine serve`), whose
    transfer sidecar moves the KV. `Custom`: any other engine; it is given the user's extra arguments and
    the pod's `DISAGG_*` environment only, and its transfer sidecar moves the KV."""

    VLLM = "VLLM"
    REFERENCE = "Reference"
    CUSTOM = "Custom"


class LayerPattern(ApiModel):
    """A periodic attention pattern (Gemma-style): layer i is Full iff (i + 1) % fullEvery == 0."""

    full_every: int = Field(
        ge=1, description="Period of full-attention layers: 6 gives the 5:1 sliding/full mix."
    )
    other_kind: AttentionKind = Field(
        default=AttentionKind.SLIDING_WINDOW,
        description="Kind of every layer that is not a full-attention layer.",
    )


# A path as a pod spec takes it: absolute, no more than Kubernetes' own bound on a volume path.
_ABSOLUTE_PATH: Final = r"^/.*$"
_MAX_PATH: Final = 4096


class HostPathModelSource(ApiModel):
    """A folder of every node the engines run on."""

    path: str = Field(
        min_length=1, max_length=_MAX_PATH, pattern=_ABSOLUTE_PATH, description="The folder on the node."
    )


class ClaimModelSource(ApiModel):
    """A PersistentVolumeClaim in the deployment's namespace, mounted read-only (ReadOnlyMany or
    ReadWriteMany when the engines are spread over nodes)."""

    claim_name: str = Field(min_length=1, max_length=253, description="The claim's name.")


class ModelVolume(ApiModel):
    """The volume that holds the model, mounted read-only in every engine container; exactly one source."""

    host_path: HostPathModelSource | None = Field(default=None, description="A folder on the node.")
    persistent_volume_claim: ClaimModelSource | None = Field(
        default=None, description="A PersistentVolumeClaim of the deployment's namespace."
    )
    mount_path: str | None = Field(
        default=None,
        min_length=1,
        max_length=_MAX_PATH,
        pattern=_ABSOLUTE_PATH,
        description="Where the engine containers see the volume; model.name must lie beneath it. Default: "
        "the folder that holds model.name (/models for /models/llama-3-8b).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelVolume:
        if (self.host_path is None) == (self.persistent_volume_claim is None):
            raise ValueError("give model.volume exactly one of hostPath and persistentVolumeClaim")
        return self

    def mount_for(self, model_name: str) -> str:
        """The mount path: the spec's, or the folder that holds the model."""
        return self.mount_path or posixpath.dirname(model_name.rstrip("/")) or "/"


class ModelSpec(ApiModel):
    """The served model's KV-cache geometry, identical on prefill and decode."""

    name: str = Field(
        min_length=1,
        max_length=512,
        description="Model name or path as the engine loads it (hashed by vLLM).",
    )
    revision: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="Model revision (commit or tag) to pin weights.",
    )
    dtype: ModelDType = Field(
        default=ModelDType.BFLOAT16, description="Resolved model dtype (vLLM hashes it)."
    )
    num_layers: int = Field(
        ge=1, le=MAX_LAYERS, description="Total hidden layers of the model (not a pipeline stage's share)."
    )
    num_kv_heads: int = Field(
        ge=1, description="Total KV heads of the model, before tensor-parallel splitting."
    )
    head_size: int = Field(ge=1, description="Size of one KV head (for MLA: the latent width).")
    kv_cache_dtype: KVCacheDType = Field(
        default=KVCacheDType.AUTO, description="KV cache dtype (--kv-cache-dtype)."
    )
    attention_kind: AttentionKind = Field(
        default=AttentionKind.FULL,
        description="Kind of every layer when neither layerPattern nor attentionKinds is given.",
    )
    layer_pattern: LayerPattern | None = Field(
        default=None, description="Periodic attention pattern; exclusive with attentionKinds."
    )
    attention_kinds: list[AttentionKind] | None = Field(
        default=None,
        max_length=MAX_LAYERS,
        description="Attention kind of each layer, one entry per layer; exclusive with layerPattern.",
    )
    sliding_window: int | None = Field(
        default=None,
        ge=1,
        le=1 << 24,
        description=(
            "The sliding window of the model's sliding-window layers, in tokens (the model config's "
            "sliding_window). With it a vLLM release whose decoders load a sliding window's KV incompletely "
            "under the hybrid KV cache manager keeps that manager on: the router serves the prompt lengths "
            "that would lose a key on the decoder alone (docs/vllm-sliding-window-load.md)."
        ),
    )
    volume: ModelVolume | None = Field(
        default=None,
        description="The volume that holds the model, mounted read-only in every engine container (at "
        "volume.mountPath, by default the folder that holds model.name, which must then be an absolute "
        "path). Unset, the engine image holds the model or fetches it itself.",
    )
    layer_name_template: str = Field(
        default=layout.DEFAULT_LAYER_NAME_TEMPLATE,
        max_length=layout.MAX_LAYER_NAME_TEMPLATE,
        json_schema_extra={"pattern": layout.LAYER_NAME_TEMPLATE_PATTERN},
        description="Engine layer name with {i} for the layer index; names route KV between PP stages. "
        "{i} is the only field (no format spec or conversion); write a literal brace as {{ or }}.",
    )

    @field_validator("layer_name_template")
    @classmethod
    def _a_template_of_i(cls, template: str) -> str:
        # The pattern is in the CRD too; here it gets a message that says what to write.
        problem = layout.layer_name_template_problem(template)
        if problem is not None:
            raise ValueError(f"layerNameTemplate {problem}")
        return template

    @model_validator(mode="after")
    def _one_layer_description(self) -> ModelSpec:
        if self.layer_pattern is not None and self.attention_kinds is not None:
            raise ValueError("give either layerPattern or attentionKinds, not both")
        if self.attention_kinds is not None and len(self.attention_kinds) != self.num_layers:
            raise ValueError(
                f"attentionKinds has {len(self.attention_kinds)} entries but numLayers is {self.num_layers}: "
                "give one kind per layer"
            )
        return self

    def layer_kinds(self) -> tuple[AttentionKind, ...]:
        if self.attention_kinds is not None:
            return tuple(self.attention_kinds)
        if self.layer_pattern is not None:
            period, other = self.layer_pattern.full_every, self.layer_pattern.other_kind
            return tuple(
                AttentionKind.FULL if (i + 1) % period == 0 else other for i in range(self.num_layers)
            )
        return (self.attention_kind,) * self.num_layers


class EngineSpec(ApiModel):
    """The inference engine both roles run."""

    image: str = Field(min_length=1, max_length=512, description="Engine container image.")
    kind: EngineKind | None = Field(
        default=None,
        description="What the image runs: VLLM, Reference (the project's reference engine) or Custom (any "
        "other: it gets only extraArgs and the DISAGG_* environment). Unset, the image's name decides: "
        "VLLM when the last path component of its repository contains vllm, Reference when it is "
        "disagg-transfer, Custom otherwise; set it for a mirrored or renamed image. status.<role>.engineKind "
        "shows the kind used.",
    )
    version: str = Field(
        min_length=1, max_length=64, description="Engine (vLLM) version in the image; part of the hash."
    )
    attention_backend: str = Field(
        default="FLASH_ATTN",
        min_length=1,
        max_length=64,
        description="Attention backend name the engine resolves (hashed by vLLM).",
    )
    hybrid_kv_cache_manager: HybridKVCacheManager = Field(
        default=HybridKVCacheManager.AUTO,
        description=(
            "Hybrid KV cache manager (HMA) switch; part of the hash. Auto: Disabled for a vLLM model with "
            "sliding-window layers on a release whose decoders load their KV incompletely "
            "(docs/vllm-sliding-window-load.md), Enabled otherwise; the status says which."
        ),
    )
    kv_cache_layout: KVCacheLayout = Field(
        default=KVCacheLayout.LAYER_OUTERMOST, description="Physical KV cache layout."
    )
    extra_args: list[ExtraArg] = Field(
        default_factory=list, max_length=MAX_EXTRA_ARGS, description="Extra engine arguments for both roles."
    )
    run_as_user: int | None = Field(
        default=None,
        ge=1,
        le=2**31 - 1,
        description=(
            "Run the engine container as this non-root user and group (runAsNonRoot). The reference engine "
            "always runs as its image's user, 65532. A vLLM image runs as its image's user (often root) "
            "unless this is set; non-root, the engine keeps IPC_LOCK but Linux does not apply it, so RDMA "
            "registration then needs an unlimited RLIMIT_MEMLOCK from the container runtime, and the image's "
            "caches (HF_HOME, the compile caches) must be writable by that user."
        ),
    )
