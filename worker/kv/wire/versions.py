"""The NIXL connector versions this wire knows, as data: one row per version, and the field annotation that
says in which version a struct field appeared (or left).

A row names the first vLLM release that spoke the version (None for one only ever on vLLM's main branch) and
whether this worker speaks it. Versions it knows but does not speak still count for telling a peer's field
set apart (`metadata.field_set_versions`). Every struct of `disagg.worker.kv.wire` whose field set changes
with the connector version declares that change on the field (`Annotated[..., Since(14)]`) and derives its
encoders, decoders and checks from this table (`versioned.VersionedStruct`);
`disagg.worker.contracts.releases` derives its release rows from it. Adding a release is one row here (plus,
when its metadata gains a field, that field with its `Since`). Pure data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True)
class Since:
    """A struct field's lifetime on the wire: present from connector version `version` and, when `until` is
    set, gone from that version on. `needed_by` names what needs the field, for the refusal to write it at an
    older version ("a PLE model needs vLLM 0.32 (connector version 14) or later")."""

    version: int
    until: int | None = None
    needed_by: str = "this value"

    def __post_init__(self) -> None:
        if self.until is not None and self.until <= self.version:
            raise ValueError(f"a field cannot leave the wire (version {self.until}) before it joins it")

    def present_at(self, connector_version: int) -> bool:
        return self.version <= connector_version and (self.until is None or connector_version < self.until)


@dataclass(frozen=True)
class ConnectorVersion:
    """One NIXL connector version: the first vLLM release (`"0.32.0"`) whose wheel speaks it, None when only
    vLLM's main branch ever did, and whether this worker speaks it (encodes and hashes with it)."""

    number: int
    release: str | None
    spoken: bool = True
    layer_pairing: bool = False
    """Every worker of this version advertises the layers of all its regions (`region_members`, and
    `layer_group_ids` where the struct has it), push or pull, any layout, and regions pair by layer name with
    every peer, PP1 included (vLLM 0.34's `_pair_regions`). Before it, only push workers with an HMA or
    packed cache advertised their layers, and only a PP prefill paired by them."""

    @property
    def release_line(self) -> str | None:
        """The release's minor line ("0.32"), the name its refusals give."""
        return None if self.release is None else ".".join(self.release.split(".")[:2])


VERSIONS: Final[tuple[ConnectorVersion, ...]] = (
    # 0.30: the metadata before region_members; known so that such a peer is named, not spoken.
    ConnectorVersion(11, "0.30.0", spoken=False),
    # region_members without packed_member_layouts, only ever on vLLM's main branch.
    ConnectorVersion(12, None, spoken=False),
    ConnectorVersion(13, "0.31.0"),
    ConnectorVersion(14, "0.32.0"),
    ConnectorVersion(15, "0.33.0"),
    # layer_group_ids; layer-name pairing for every peer.
    ConnectorVersion(16, "0.34.0", layer_pairing=True),
)
"""Oldest first; the spoken ones are the releases this project supports (`contracts.releases`)."""


def spoken_numbers(table: Sequence[ConnectorVersion]) -> tuple[int, ...]:
    return tuple(row.number for row in table if row.spoken)


CONNECTOR_VERSIONS: Final = spoken_numbers(VERSIONS)
"""The NIXL connector versions this worker speaks, oldest first."""
LATEST_CONNECTOR_VERSION: Final = CONNECTOR_VERSIONS[-1]


def pairs_by_layer_name(connector_version: int, table: Sequence[ConnectorVersion] = VERSIONS) -> bool:
    """Whether workers of that connector version always advertise their layers and pair regions by them
    (`ConnectorVersion.layer_pairing`); False for a version the table does not have."""
    return any(row.number == connector_version and row.layer_pairing for row in table)


def check_table(table: Sequence[ConnectorVersion]) -> None:
    """A table is usable when its versions strictly increase and it speaks at least one of them."""
    numbers = [row.number for row in table]
    if numbers != sorted(set(numbers)):
        raise ValueError(f"connector versions must strictly increase, got {numbers}")
    if not spoken_numbers(table):
        raise ValueError("a connector version table must speak at least one version")
    unreleased = [row.number for row in table if row.spoken and row.release is None]
    if unreleased:
        raise ValueError(f"a spoken connector version names the release that speaks it: {unreleased} do not")


check_table(VERSIONS)
