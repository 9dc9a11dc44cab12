"""The vLLM releases this project supports, one row each: what the release speaks and what it can run. Pure.

`spec.engine.version` (a release version such as "0.33.0") selects the row by its minor line. A row holds the
NIXL connector version the release speaks (it is hashed, with the exact version string, so no two releases
ever pass each other's handshake), the agent metadata's field set in wire order (the `wire` struct of that
connector version), the compatibility-hash factor keys and the topologies the release can run. The facts come
from each release's wheel (`tests/golden/vllm/<release>/manifest.json` records them, and the interop tests
check every row against that release's own code). The rows are the spoken connector versions of the wire's
version table (`wire.VERSIONS`), so that a new release is one entry there.

Capabilities by the first release that has them: the push connector (`NixlPushConnector`) from 0.24, a PP
prefill pushing into a PP1 decoder from 0.26 (non-HMA), PP + attention-HMA push with layer-name routing and
packed (block-outermost) layouts with `packed_member_layouts` from 0.31. Mamba/SSM under PP push and pull-mode
PP producers are in no release; the worker's topology rules refuse those for every version.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal

from disagg.worker.kv import wire

Capability = Literal["push", "pp_push", "pp_hma_push", "packed_layouts"]

CAPABILITY_TEXT: Final[dict[Capability, str]] = {
    "push": "the push connector (NixlPushConnector)",
    "pp_push": "a pipeline-parallel prefill pushing into its decoders",
    "pp_hma_push": "pipeline-parallel push with the hybrid KV cache manager (layer-name routing)",
    "packed_layouts": "packed (block-outermost) KV cache layouts",
}

# The first vLLM minor line with each capability (release notes and wheels; see the module docstring).
FIRST_LINE_WITH: Final[dict[Capability, tuple[int, int]]] = {
    "push": (0, 24),
    "pp_push": (0, 26),
    "pp_hma_push": (0, 31),
    "packed_layouts": (0, 31),
}

Defect = Literal["sliding_window_load_edge"]

DEFECT_TEXT: Final[dict[Defect, str]] = {
    "sliding_window_load_edge": (
        "a decoder that loads a whole prompt's KV recomputes the last prompt token, whose sliding window "
        "reaches one token further back than the blocks vLLM's sliding-window manager allocated for the "
        "load: a prompt of L tokens with (L - window + 1) a multiple of the block size decodes with a wrong "
        "key and value in every sliding-window layer, and answers 200 (docs/vllm-sliding-window-load.md)"
    ),
}

# The first vLLM minor line that fixes each known engine defect; None: no release fixes it yet.
FIXED_IN_LINE: Final[dict[Defect, tuple[int, int] | None]] = {
    "sliding_window_load_edge": None,
}

_VERSION: Final = re.compile(r"^v?(?P<major>0|[1-9]\d*)\.(?P<minor>0|[1-9]\d*)\.(?P<patch>0|[1-9]\d*)$")


@dataclass(frozen=True)
class Release:
    """One supported vLLM minor line (its patch releases speak the same connector version)."""

    line: tuple[int, int]
    connector_version: int
    # The first release of the line whose wheel the golden vectors and interop tests were made from.
    tested: str

    @property
    def name(self) -> str:
        return f"{self.line[0]}.{self.line[1]}"

    @property
    def metadata_struct(self) -> wire.WireMetadata:
        return wire.metadata_struct(self.connector_version)

    @property
    def metadata_fields(self) -> tuple[str, ...]:
        return wire.metadata_fields(self.connector_version)

    @property
    def hash_factor_keys(self) -> tuple[str, ...]:
        return wire.compat_factor_keys(self.connector_version)

    def can(self, capability: Capability) -> bool:
        return self.line >= FIRST_LINE_WITH[capability]

    def has(self, defect: Defect) -> bool:
        return line_has(self.line, defect)


def loses_window_edge(prompt_tokens: int, window: int, block_size: int) -> bool:
    """Whether a decoder under HMA on a release with the sliding-window load defect loads a prompt of
    `prompt_tokens` tokens without the first key of its last token's window: the decoder's sliding-window
    manager leaves the first `(prompt_tokens - window + 1) // block_size` blocks unallocated (vLLM
    `SlidingWindowManager.get_num_skipped_tokens`), and the recomputed last prompt token reads key
    `prompt_tokens - window`, which lies in the last of them exactly when that count of skipped tokens is a
    whole number of blocks."""
    skipped = prompt_tokens - window + 1
    return skipped >= block_size and skipped % block_size == 0


def line_has(line: tuple[int, int], defect: Defect) -> bool:
    """Whether the vLLM minor line `line` has the known `defect`."""
    fixed = FIXED_IN_LINE[defect]
    return fixed is None or line < fixed


def _row(version: wire.ConnectorVersion) -> Release:
    if version.release is None:
        raise ValueError(f"connector version {version.number} names no release")  # wire.versions refuses it
    major, minor, _ = version.release.split(".")
    return Release(line=(int(major), int(minor)), connector_version=version.number, tested=version.release)


# One row per connector version the wire speaks: the wire's version table is the one list of releases.
RELEASES: Final[tuple[Release, ...]] = tuple(_row(version) for version in wire.VERSIONS if version.spoken)
"""Oldest first; the last is the newest release."""

LATEST: Final = RELEASES[-1]


def parse_version(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a release version ("0.33.0", "v0.33.0"); None for anything else (a dev or
    local build never matches its release's hash, so it is no release)."""
    match = _VERSION.match(version)
    if match is None:
        return None
    return int(match["major"]), int(match["minor"]), int(match["patch"])


def release_of(version: str) -> Release | None:
    """The supported row for a release version, or None."""
    parsed = parse_version(version)
    if parsed is None:
        return None
    return next((row for row in RELEASES if row.line == parsed[:2]), None)


def line_can(version: str, capability: Capability) -> bool | None:
    """Whether the minor line of `version` has the capability (known for unsupported lines too); None when
    `version` is no release version."""
    parsed = parse_version(version)
    return None if parsed is None else parsed[:2] >= FIRST_LINE_WITH[capability]


def supported_text() -> str:
    return ", ".join(f"{row.name}.x (connector version {row.connector_version})" for row in RELEASES)


def lines_that_can(capability: Capability) -> str:
    return ", ".join(row.name for row in RELEASES if row.can(capability))
