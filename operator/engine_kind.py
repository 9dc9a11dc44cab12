"""What a role's engine container runs: `spec.engine.kind`, or what its image's name suggests. Pure.

The builders, the policies, the status and the HMA choice (`hma`) read `engine_kind`; `kind_of_image` is the
only code that reads an image's name.
"""

from __future__ import annotations

from typing import Final

from disagg.operator.api import DisaggDeploymentSpec, EngineKind, Role

REFERENCE_ENGINE_REPOSITORY: Final = "disagg-transfer"


def role_image(spec: DisaggDeploymentSpec, role: Role) -> str:
    return spec.effective(role, "image", spec.engine.image)


def kind_of_image(image: str) -> EngineKind:
    """The engine kind an image's name suggests, the default when `spec.engine.kind` is unset: `VLLM` when
    the last path component of its repository contains "vllm" (vllm/vllm-openai, .../vllm-tpu),
    `Reference` when it is `disagg-transfer` (the project's own engine image, any registry, tag or digest),
    `Custom` otherwise. A mirrored image (`registry.corp/ml/inference:0.33`) says nothing, so the spec
    names its kind."""
    repository = image.split("@", 1)[0]
    last = repository.rsplit("/", 1)[-1].split(":", 1)[0]
    if last == REFERENCE_ENGINE_REPOSITORY:
        return EngineKind.REFERENCE
    return EngineKind.VLLM if "vllm" in last.lower() else EngineKind.CUSTOM


def engine_kind(spec: DisaggDeploymentSpec, role: Role) -> EngineKind:
    """The one answer to what a role's engine container runs: `spec.engine.kind`, or what the role's image's
    name suggests when it is unset. Every builder, policy and the status read this."""
    return spec.engine.kind if spec.engine.kind is not None else kind_of_image(role_image(spec, role))
