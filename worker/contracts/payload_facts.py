"""What a handshake payload itself shows about the engine that sent it, beyond the typed metadata. Pure.

vLLM sends only the digest of its compatibility factors, never the factors, so a hash mismatch by itself says
nothing about why. But the payload tells two of the factors outright: the connector version, by the field set
of the encoded `NixlAgentMetadata` (vLLM's encoder writes every field, defaults included, in declaration
order), and the attention backend, in `attn_backend_name`. Two payloads of the same backend and layout show
a third thing: their `block_lens` over `block_size` are the KV bytes per token of a layer, the product
num_kv_heads x head_size x the KV element's width, so a ratio between them is a dtype (or cache dtype), head
count or head size difference, never a version one. Everything else hashed (the vLLM version string, the raw
`--model` string, the layer count, HMA, speculative config, transfer mode) is invisible on the wire.

A message names a factor only where this evidence shows it; otherwise it lists the factors the payloads
cannot show. A hash that is no known release's with the spec's factors says only that something besides the
release differs, so it is never reported as a version difference.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final

import msgspec

from disagg.worker.contracts.releases import RELEASES
from disagg.worker.kv import wire
from disagg.worker.kv.errors import WireFormatError

# The bytes of one KV element by the dtype vLLM hashes (`wire.torch_dtype_name`) or the cache dtype, for
# reading a block_lens ratio as a width ratio; an fp8 cache is one byte whichever fp8 it is.
_ELEMENT_BYTES: Final = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2, "fp8": 1}
# The widths' names, widest first, for saying which dtypes a ratio fits.
_WIDTH_NAMES: Final = ((4, "float32"), (2, "bfloat16 or float16"), (1, "fp8"))


@dataclass(frozen=True)
class PayloadFacts:
    """What one payload shows: its hash, its metadata's field names, its backend and engine id, and the KV
    geometry (block_lens, block size, layout) that two payloads can be compared by."""

    compatibility_hash: str
    fields: tuple[str, ...]
    attn_backend_name: str | None
    engine_id: str | None
    ple_block_len: int | None = None
    packed_member_layouts: Mapping[str, Any] | None = None
    field_versions: tuple[int, ...] = ()
    block_lens: tuple[int, ...] = ()
    block_size: int | None = None
    kv_cache_layout: str | None = None
    # Parallel to `block_lens` where the engine names its regions (HMA, packed); pairs regions by layer
    # across a PP stage and a PP1 engine, which hold different layer sets.
    region_names: tuple[str, ...] | None = None

    @property
    def connector_versions(self) -> tuple[int, ...]:
        """The NIXL connector versions whose metadata field set this is (`wire.field_set_versions`); empty
        for a field set no release writes."""
        return self.field_versions

    @property
    def connector_version(self) -> str:
        """`13`, or `14 or 15` where the field set cannot tell them apart, or `unknown`."""
        return " or ".join(str(v) for v in self.field_versions) or "unknown"


def payload_facts(payload: bytes) -> PayloadFacts:
    """The facts of one side-channel reply (frame 0); `WireFormatError` on bytes that are not a payload."""
    envelope = wire.decode_payload_envelope(payload)
    try:
        raw = msgspec.msgpack.decode(envelope.agent_metadata_bytes)
    except msgspec.DecodeError as exc:
        raise WireFormatError(f"agent metadata is not msgpack: {exc}") from None
    if not isinstance(raw, dict):
        raise WireFormatError(f"agent metadata is a {type(raw).__name__}, not a map")
    backend, engine, ple = raw.get("attn_backend_name"), raw.get("engine_id"), raw.get("ple_block_len")
    packed, lens, names = raw.get("packed_member_layouts"), raw.get("block_lens"), raw.get("region_names")
    block_size, layout = raw.get("block_size"), raw.get("kv_cache_layout")
    return PayloadFacts(
        compatibility_hash=envelope.compatibility_hash,
        fields=tuple(str(key) for key in raw),
        attn_backend_name=backend if isinstance(backend, str) else None,
        engine_id=engine if isinstance(engine, str) else None,
        ple_block_len=ple if isinstance(ple, int) and not isinstance(ple, bool) else None,
        packed_member_layouts=packed if isinstance(packed, dict) else None,
        field_versions=wire.field_set_versions(envelope.agent_metadata_bytes),
        block_lens=tuple(lens) if isinstance(lens, list) and all(_count(n) for n in lens) else (),
        block_size=block_size if _count(block_size) else None,
        kv_cache_layout=layout if isinstance(layout, str) else None,
        region_names=(
            tuple(names) if isinstance(names, list) and all(isinstance(n, str) for n in names) else None
        ),
    )


def _count(value: object) -> bool:
    """A positive int as msgpack gives it (a bool is an int to Python, never a size)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# The releases a hash is tried against, each with the connector version it speaks: the release table's rows.
KNOWN_RELEASES: Final = tuple((release.tested, release.connector_version) for release in RELEASES)


def identify_release(
    predicted: Mapping[str, Any] | None,
    live_hash: str,
    releases: Sequence[tuple[str, int]] = KNOWN_RELEASES,
) -> str | None:
    """The release whose version string and connector version, put into the predicted factors, give
    `live_hash`: how a hash names the vLLM an engine runs when everything else was predicted right."""
    if predicted is None:
        return None
    for version, connector in releases:
        variant = {**predicted, "vllm_version": version, "nixl_connector_version": connector}
        if wire.compat_hash(variant) == live_hash:
            return version
    return None


def _same(a: object, b: object) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def unseen_factors(
    local: PayloadFacts, remote: PayloadFacts | None = None, *, kv_bytes_agree: bool = False
) -> list[str]:
    """The hashed factors, in vLLM's order, that the payload(s) cannot show, each with what limits it:
    what a message lists when nothing shown explains a mismatch. `kv_bytes_agree` says two payloads showed
    the same KV bytes per token, which leaves the KV-shape factors only in combinations that keep it."""
    versions = set(local.connector_versions)
    if remote is not None:
        versions &= set(remote.connector_versions)
    told = {
        "vllm_version": "vllm_version (the exact release string)",
        "model": "model (the raw --model string: a repo id and a local path differ)",
        "num_hidden_layers": "num_hidden_layers",
        "is_hma_enabled": "is_hma_enabled",
        "speculative_config": "speculative_config",
        "transfer_mode": "transfer_mode",
    }
    if len(versions) != 1:
        # 14 and 15 write the same fields, so only the hash tells those two apart.
        told["nixl_connector_version"] = (
            "nixl_connector_version (14 and 15 write the same fields)"
            if versions
            else "nixl_connector_version"
        )
    if local.attn_backend_name is None or (remote is not None and remote.attn_backend_name is None):
        told["attn_backend_name"] = "attn_backend_name"
    if kv_bytes_agree:
        told["dtype"] = "dtype or cache_dtype only as bfloat16 against float16, or under one cache_dtype"
        told["num_kv_heads"] = "num_kv_heads and head_size only with the same product"
    else:
        told.update(
            dtype="dtype", cache_dtype="cache_dtype", num_kv_heads="num_kv_heads", head_size="head_size"
        )
    return [told[key] for key in wire.COMPAT_FACTOR_KEYS if key in told]


def _not_shown(
    local: PayloadFacts, remote: PayloadFacts | None = None, *, kv_bytes_agree: bool = False
) -> str:
    return f"a factor the payload{'s do' if remote is not None else ' does'} not show: one of " + ", ".join(
        unseen_factors(local, remote, kv_bytes_agree=kv_bytes_agree)
    )


def prediction_differences(predicted: Mapping[str, Any] | None, live: PayloadFacts) -> list[str]:
    """The factors where the spec's prediction and what the live payload shows differ, each with both values;
    the unseen factors when the payload shows no difference. Pure."""
    told = []
    release = identify_release(predicted, live.compatibility_hash)
    if predicted is not None and release is not None and release != predicted.get("vllm_version"):
        told.append(
            f"vllm_version (the engine's hash is the prediction's with vLLM {release}; the prediction has "
            f"{predicted.get('vllm_version')!r})"
        )
    if predicted is not None:
        version = predicted.get("nixl_connector_version")
        if live.connector_versions and version not in live.connector_versions:
            told.append(
                f"nixl_connector_version (the engine speaks {live.connector_version}, by its metadata's "
                f"fields; the prediction has {version!r})"
            )
        backend = predicted.get("attn_backend_name")
        if live.attn_backend_name is not None and not _same(backend, live.attn_backend_name):
            told.append(
                f"attn_backend_name (the engine runs {live.attn_backend_name!r}, "
                f"the prediction has {backend!r})"
            )
    return told or [_not_shown(live)]


def _kv_bytes_per_token(local: PayloadFacts, remote: PayloadFacts) -> list[tuple[Fraction, Fraction]] | None:
    """(here, there) KV bytes per token of the layers both payloads show, or None where their block_lens are
    not comparable: another backend or layout lays the same bytes out in other regions (a K/V split halves a
    block_len), and two PP stages hold different layers."""
    if not (local.block_lens and remote.block_lens and local.block_size and remote.block_size):
        return None
    if local.attn_backend_name != remote.attn_backend_name or local.kv_cache_layout != remote.kv_cache_layout:
        return None
    named = [
        dict(zip(facts.region_names, facts.block_lens, strict=True))
        for facts in (local, remote)
        if facts.region_names is not None and len(facts.region_names) == len(facts.block_lens)
    ]
    if len(named) == 2:
        pairs = [(length, named[1][name]) for name, length in named[0].items() if name in named[1]]
    else:
        # No layer names on one side (a non-HMA engine): one block_len per distinct layer kind, smallest to
        # largest on both sides.
        here, there = sorted(set(local.block_lens)), sorted(set(remote.block_lens))
        pairs = list(zip(here, there, strict=True)) if len(here) == len(there) else []
    if not pairs:
        return None
    return [(Fraction(a, local.block_size), Fraction(b, remote.block_size)) for a, b in pairs]


def _number(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{float(value):g}"


def _spec_kv_bytes(predicted: Mapping[str, Any] | None) -> tuple[str, int] | None:
    """The KV element the spec predicts (cache_dtype where set, else the model dtype) and its bytes."""
    if predicted is None:
        return None
    cache, dtype = predicted.get("cache_dtype"), predicted.get("dtype")
    name = cache if isinstance(cache, str) and cache != "auto" else dtype
    if not isinstance(name, str):
        return None
    width = _ELEMENT_BYTES.get("fp8" if name.startswith("fp8") else name)
    return (name, width) if width is not None else None


def _kv_dtype_difference(
    local: PayloadFacts,
    remote: PayloadFacts,
    per_token: list[tuple[Fraction, Fraction]],
    spec_kv: tuple[str, str, int] | None,
) -> str:
    """What differing KV bytes per token say: the numbers, and the dtype widths whose ratio they are;
    `spec_kv` is the side ("here" or "there") whose hash is the spec's, with the spec's KV element."""
    here = "/".join(str(n) for n in sorted(set(local.block_lens)))
    there = "/".join(str(n) for n in sorted(set(remote.block_lens)))
    sizes = (
        f"block size {local.block_size}"
        if local.block_size == remote.block_size
        else f"block size {local.block_size} here, {remote.block_size} there"
    )
    shown = (
        f"block_lens {here} here, {there} there at {sizes}, backend {local.attn_backend_name!r} and "
        f"layout {local.kv_cache_layout!r} on both"
    )
    ratios = {b / a for a, b in per_token}
    if len(ratios) != 1:
        return (
            f"the KV dtype, num_kv_heads or head_size, by block_lens: the KV bytes per token of the same "
            f"layers differ by layer ({shown})"
        )
    (ratio,) = ratios
    a, b = per_token[0]
    numbers = f"{_number(a)} KV bytes per token here, {_number(b)} there ({shown})"
    fits = [
        (f"{mine} here", theirs)
        for width_a, mine in _WIDTH_NAMES
        for width_b, theirs in _WIDTH_NAMES
        if Fraction(width_b, width_a) == ratio
    ]
    if spec_kv is not None:
        # That side's hash is the spec's, so its KV element is the spec's: only the other one is inferred.
        side, name, width = spec_kv
        fits = [
            (f"{name} (the spec's) here", other)
            if side == "here"
            else (f"{other} here", f"{name} (the spec's)")
            for other_width, other in _WIDTH_NAMES
            if (Fraction(other_width, width) if side == "here" else Fraction(width, other_width)) == ratio
        ]
    larger = "here" if ratio < 1 else "there"
    times = f"{_number(max(ratio, 1 / ratio))} times as large {larger}"
    if not fits:
        return (
            f"num_kv_heads x head_size, by block_lens: {numbers}, {times}, which no dtype change gives alone"
        )
    dtypes = "; or ".join(f"{mine} against {theirs} there" for mine, theirs in fits)
    return (
        f"the KV dtype (dtype, or cache_dtype where set), likely, by block_lens: {numbers}, what {dtypes} "
        f"gives; otherwise num_kv_heads x head_size is {times}"
    )


def live_differences(
    local: PayloadFacts, remote: PayloadFacts, predicted: Mapping[str, Any] | None = None
) -> list[str]:
    """What two live payloads with different hashes show of why: connector version, backend, the KV bytes
    per token, and with the spec's `predicted` factors, the release each hash is of. A factor is named only
    where that evidence shows it; otherwise the factors the payloads do not show are listed. Pure."""
    told = []
    here, there = (
        identify_release(predicted, local.compatibility_hash),
        identify_release(predicted, remote.compatibility_hash),
    )
    if here is not None and there is not None and here != there:
        # Each hash is the spec's factors with that release's version string: the version is what differs.
        told.append(f"vLLM version: this engine runs vLLM {here}, the peer vLLM {there} (by their hashes)")
    versions = (local.connector_versions, remote.connector_versions)
    if all(versions) and not set(versions[0]) & set(versions[1]):
        told.append(
            f"NIXL connector version {local.connector_version} here, {remote.connector_version} there "
            "(by the metadata's fields): the engines run different vLLM releases"
        )
    if (
        local.attn_backend_name is not None
        and remote.attn_backend_name is not None
        and local.attn_backend_name != remote.attn_backend_name
    ):
        told.append(f"attention backend {local.attn_backend_name!r} here, {remote.attn_backend_name!r} there")
    per_token = _kv_bytes_per_token(local, remote)
    kv_bytes_agree = per_token is not None and all(a == b for a, b in per_token)
    if per_token is not None and not kv_bytes_agree:
        # A side's KV element is known only where its hash is the spec's prediction (with some release).
        spec = _spec_kv_bytes(predicted)
        side = "here" if here is not None else "there" if there is not None else None
        spec_kv = (side, *spec) if spec is not None and side is not None else None
        told.append(_kv_dtype_difference(local, remote, per_token, spec_kv))
    if not told:
        told.append(_not_shown(local, remote, kv_bytes_agree=kv_bytes_agree))
    if here is not None and there is None:
        # The peer's hash is not the spec's with any known release, so something besides the release differs
        # there: that says which side departs from the spec, not that the version does.
        told.append(
            f"this engine's hash is the spec's prediction with vLLM {here}; the peer's is the prediction "
            "with no known release, so the peer departs from the spec in more than the release"
        )
    elif there is not None and here is None:
        told.append(
            f"the peer's hash is the spec's prediction with vLLM {there}; this engine's is the prediction "
            "with no known release, so this engine departs from the spec in more than the release"
        )
    return told
