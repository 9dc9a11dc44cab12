"""The policy that prefill and decode would pass each other's handshake compatibility check. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final

from disagg.operator.policies.policy import PolicyInput
from disagg.worker.kv.errors import Violation
from disagg.worker.kv.wire import differing_factors

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


def handshake_factors_match(given: PolicyInput) -> Sequence[Violation]:
    mismatch = factor_mismatch(given.factors["prefill"], given.factors["decode"])
    return [] if mismatch is None else [mismatch]


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
