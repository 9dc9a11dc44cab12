"""DisaggDeployment test documents: the committed examples, and variations of the PP2+HMA one."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from disagg.operator.api import DisaggDeployment, DisaggDeploymentSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
VALID_EXAMPLE = EXAMPLES / "pp2-hma.yaml"
DELETE = object()
"""Marks a key to remove in `patched`."""
HMA_ENABLED: dict[str, Any] = {"engine": {"hybridKvCacheManager": "Enabled"}}
"""A patch that asks for the hybrid KV cache manager explicitly: what the connector's own rules (the
compatibility chain) judge for a hybrid model with HMA on. The full refusal chain refuses it for the example's
sliding-window model on every supported release (SlidingWindowLoadDefect)."""
HMA_ON: dict[str, Any] = {"model": {"layerPattern": DELETE}}
"""A patch that leaves the example's vLLM engines with the hybrid KV cache manager on: its model without
sliding-window layers (with them, `Auto` turns it off on every supported release, `disagg.operator.hma`)."""


def load(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    return document


def patched(document: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of `document` with `patch` merged in (nested dicts merge, `DELETE` removes a key)."""
    result = copy.deepcopy(document)
    for key, value in patch.items():
        if value is DELETE:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = patched(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def valid_document(spec_patch: dict[str, Any] | None = None) -> dict[str, Any]:
    document = load(VALID_EXAMPLE)
    return patched(document, {"spec": spec_patch}) if spec_patch else document


def spec(spec_patch: dict[str, Any] | None = None) -> DisaggDeploymentSpec:
    return DisaggDeployment.model_validate(valid_document(spec_patch)).spec


def spec_dict(model: DisaggDeploymentSpec) -> dict[str, Any]:
    """The spec as the API server stores it after defaulting: camelCase, defaults filled, omitted = absent."""
    dumped: dict[str, Any] = model.model_dump(mode="json", by_alias=True, exclude_none=True)
    return dumped
