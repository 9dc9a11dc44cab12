"""vLLM's NIXL compatibility hash (`compute_nixl_compatibility_hash`): its factors, declared as one struct
over the connector versions like the metadata, their canonical JSON and digest, and what a mismatch says.

vLLM peers send only the digest, not their factors, so a mismatch is explained by trying the one-factor
changes that explain most real ones (connector version, transfer mode, HMA) against the local factors.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any, Final, Literal

import msgspec

from disagg.worker.kv.errors import CompatibilityHashMismatch, WireFormatError
from disagg.worker.kv.wire.versioned import VersionedStruct
from disagg.worker.kv.wire.versions import LATEST_CONNECTOR_VERSION

TransferMode = Literal["pull", "push"]


class CompatFactors(msgspec.Struct, frozen=True):
    """The keys of vLLM's hash factor dict, in vLLM's order (the same from version 9 to 15); a factor that
    joins or leaves with a connector version says so with `Since`, as the metadata's fields do."""

    vllm_version: str
    nixl_connector_version: int
    model: str
    dtype: str
    num_kv_heads: int
    head_size: int
    num_hidden_layers: int
    attn_backend_name: str
    cache_dtype: str
    is_hma_enabled: bool
    speculative_config: dict[str, Any] | None
    transfer_mode: TransferMode


FACTORS: Final = VersionedStruct(CompatFactors, what="compatibility hash factors", noun="factor set")


def compat_factor_keys(connector_version: int) -> tuple[str, ...]:
    """The factor keys vLLM hashes at that connector version, in vLLM's order."""
    return FACTORS.fields_present_at(connector_version)


COMPAT_FACTOR_KEYS: Final = compat_factor_keys(LATEST_CONNECTOR_VERSION)
"""The exact keys of vLLM's compute_nixl_compatibility_hash at the newest connector version."""

_TORCH_DTYPE_ALIASES: Final = {
    "bfloat16": "torch.bfloat16",
    "bf16": "torch.bfloat16",
    "float16": "torch.float16",
    "fp16": "torch.float16",
    "half": "torch.float16",
    "float32": "torch.float32",
    "fp32": "torch.float32",
    "float": "torch.float32",
}


def torch_dtype_name(dtype: str) -> str:
    """The `str(torch.dtype)` spelling vLLM hashes (`"torch.bfloat16"`), from either spelling."""
    if dtype.startswith("torch."):
        return dtype
    try:
        return _TORCH_DTYPE_ALIASES[dtype.lower()]
    except KeyError:
        raise ValueError(
            f"unknown model dtype {dtype!r}: use a resolved torch dtype such as 'bfloat16' or 'torch.float16'"
            " ('auto' must be resolved to the model's dtype first, as vLLM does before hashing)"
        ) from None


def compat_factors(
    *,
    vllm_version: str,
    model: str,
    dtype: str,
    num_kv_heads: int,
    head_size: int,
    num_hidden_layers: int,
    attn_backend_name: str,
    is_hma_enabled: bool,
    transfer_mode: TransferMode,
    cache_dtype: str = "auto",
    nixl_connector_version: int,
    speculative_config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The factor dict of vLLM's compute_nixl_compatibility_hash, keys in vLLM's order: those of
    `nixl_connector_version` (`compat_factor_keys`).

    `vllm_version` and `nixl_connector_version` are the release's (`releases.Release`): both are hashed, so
    no two releases ever match. `num_hidden_layers` is the model total, not a PP stage's share; for MLA
    models `num_kv_heads` is the config's `num_key_value_heads` (vLLM's `get_total_num_kv_heads`), not 1;
    `speculative_config` is None unless the engine runs EAGLE/MTP-style drafting.
    """
    if transfer_mode not in ("pull", "push"):
        raise ValueError(f"transfer_mode must be 'pull' or 'push', got {transfer_mode!r}")
    values: dict[str, Any] = {
        "vllm_version": vllm_version,
        "nixl_connector_version": nixl_connector_version,
        "model": model,
        "dtype": torch_dtype_name(dtype),
        "num_kv_heads": num_kv_heads,
        "head_size": head_size,
        "num_hidden_layers": num_hidden_layers,
        "attn_backend_name": attn_backend_name,
        "cache_dtype": cache_dtype,
        "is_hma_enabled": is_hma_enabled,
        "speculative_config": dict(speculative_config) if speculative_config is not None else None,
        "transfer_mode": transfer_mode,
    }
    return {key: values[key] for key in compat_factor_keys(nixl_connector_version)}


def canonical_factors_json(factors: Mapping[str, Any]) -> str:
    """vLLM's `hash_factors` text: Python json defaults with sorted keys (ensure_ascii, ', ' and ': ')."""
    return json.dumps(dict(factors), sort_keys=True)


def compat_hash(factors: Mapping[str, Any]) -> str:
    """sha256 hex digest of the canonical JSON of the factors, as vLLM's `hash_factors`."""
    return hashlib.sha256(canonical_factors_json(factors).encode()).hexdigest()


def differing_factors(local: Mapping[str, Any], remote: Mapping[str, Any]) -> list[str]:
    """Sorted names of the factors whose values differ, or that only one side has.

    Values are compared by their canonical JSON, the way the hash sees them (a tuple equals a list).
    """
    differing = []
    for key in sorted(set(local) | set(remote)):
        missing = key not in local or key not in remote
        if missing or json.dumps(local[key], sort_keys=True) != json.dumps(remote[key], sort_keys=True):
            differing.append(key)
    return differing


def _single_factor_variants(local: Mapping[str, Any]) -> Iterable[tuple[str, Any]]:
    """The one-factor changes that explain most real mismatches: connector version, transfer mode, HMA."""
    for version in range(1, LATEST_CONNECTOR_VERSION + 4):
        if version != local.get("nixl_connector_version"):
            yield "nixl_connector_version", version
    for mode in ("pull", "push"):
        if mode != local.get("transfer_mode"):
            yield "transfer_mode", mode
    if isinstance(local.get("is_hma_enabled"), bool):
        yield "is_hma_enabled", not local["is_hma_enabled"]


def explain_hash_mismatch(local: Mapping[str, Any], remote_hash: str) -> tuple[str, Any] | None:
    """The single well-known factor change to the local factors that yields the remote hash, if one does.

    vLLM peers send only the digest, not their factors, so this is how a version-11 peer or a push/pull mix-up
    is told apart from an unexplained difference.
    """
    for key, value in _single_factor_variants(local):
        if compat_hash({**local, key: value}) == remote_hash:
            return key, value
    return None


def hash_mismatch_error(
    local_hash: str,
    remote_hash: str,
    local_factors: Mapping[str, Any] | None,
    remote_factors: Mapping[str, Any] | None,
) -> WireFormatError | CompatibilityHashMismatch:
    """The refusal of a peer whose hash is not ours, naming the differing factors as far as they are known
    (a connector-version difference is a `WireFormatError`, reason ConnectorVersionMismatch)."""
    head = f"NIXL compatibility hash mismatch: local {local_hash}, remote {remote_hash}"
    if local_factors is not None and remote_factors is not None:
        keys = differing_factors(local_factors, remote_factors)
        detail = ", ".join(
            f"{k} (local {local_factors.get(k)!r}, remote {remote_factors.get(k)!r})" for k in keys
        )
        return CompatibilityHashMismatch(
            f"{head}; differing factors: {detail or 'none (hash inputs differ)'}"
        )
    if local_factors is not None:
        explained = explain_hash_mismatch(local_factors, remote_hash)
        if explained is not None:
            key, value = explained
            local_value = local_factors.get(key)
            if key == "nixl_connector_version":
                return WireFormatError(
                    f"{head}: the remote runs NIXL connector version {value}, this side {local_value}; "
                    "upgrade the older engine so both speak the same connector version"
                )
            return CompatibilityHashMismatch(
                f"{head}: the remote has {key}={value!r} where this side has {local_value!r}"
            )
    return CompatibilityHashMismatch(
        f"{head}; the peer differs in at least one of {', '.join(COMPAT_FACTOR_KEYS)}"
    )
