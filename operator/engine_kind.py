"""Which engine an image runs: vLLM, the project's reference engine, or another. Pure.

The builders, the HMA choice (`hma`) and the policies ask this one module.
"""

from __future__ import annotations

from typing import Final


def is_vllm_image(image: str) -> bool:
    """vLLM images are recognised by their repository name (vllm/vllm-openai, .../vllm-tpu, ...)."""
    repository = image.split("@", 1)[0]
    last = repository.rsplit("/", 1)[-1].split(":", 1)[0]
    return "vllm" in last.lower()


REFERENCE_ENGINE_REPOSITORY: Final = "disagg-transfer"


def is_reference_engine_image(image: str) -> bool:
    """The project's own engine image: its repository's last path component is `disagg-transfer` (any
    registry, any tag or digest)."""
    repository = image.split("@", 1)[0]
    last = repository.rsplit("/", 1)[-1]
    return last.split(":", 1)[0] == REFERENCE_ENGINE_REPOSITORY
