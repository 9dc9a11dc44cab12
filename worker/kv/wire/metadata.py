"""vLLM's `NixlAgentMetadata`, what one worker advertises at handshake, as one struct over every connector
version: each field that is not on the wire at every version says when it joined (`Since`), and the
encoder, decoder, version check and field-set lookup derive from it and the version table (`versions`).

The releases differ in the field set: 0.31 (v13) has 20 fields, 0.32 (v14) and 0.33 (v15) insert
`ple_block_len` between `pcp_size` and `region_members`, and 0.34 (v16) `layer_group_ids` between
`region_members` and `packed_member_layouts` (22 fields). Version 12 (`region_members` without
`packed_member_layouts`) was only ever on vLLM's main branch: it still decodes, because the decoder fills the
missing field for free, but nothing here writes it. The golden vectors in `tests/golden/vllm/<release>/`,
written by each release's own classes, pin the encoding.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from disagg.worker.kv.wire.versioned import VersionedStruct
from disagg.worker.kv.wire.versions import LATEST_CONNECTOR_VERSION, Since


class NixlAgentMetadata(msgspec.Struct, frozen=True):
    """What one worker advertises at handshake (vLLM `nixl/metadata.py`): the field set of every connector
    version this worker knows, each in the version it joined. Field order is wire order."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    region_num_blocks: Annotated[list[int] | None, Since(11)] = None
    region_group_ids: Annotated[list[int] | None, Since(11)] = None
    region_names: Annotated[list[str] | None, Since(11)] = None
    region_mem_types: Annotated[list[str] | None, Since(11)] = None
    dcp_size: int = 1
    pcp_size: int = 1
    # The page length of a per-layer-embedding (PLE) state region, when the model has one.
    ple_block_len: Annotated[int | None, Since(14, needed_by="a PLE model")] = None
    # Before v16 empty unless the peer tracks region layers (push + HMA or packed, no Mamba); from v16 every
    # worker fills it. Routing decides whether an empty list is acceptable.
    region_members: Annotated[list[list[str]], Since(12)] = msgspec.field(default_factory=list)
    # The KV cache (transfer) group of each layer in region_members: from v16 every worker sends both, and
    # a peer's layer pairs only within the same group.
    layer_group_ids: Annotated[dict[str, int], Since(16, needed_by="a layer's cache group")] = msgspec.field(
        default_factory=dict
    )
    # Per member layer of a packed (block-outermost) region, its (offset, length) inside the block.
    packed_member_layouts: Annotated[dict[str, tuple[int, int]], Since(13, needed_by="a packed layout")] = (
        msgspec.field(default_factory=dict)
    )


METADATA: Final = VersionedStruct(NixlAgentMetadata, what="agent metadata", noun="metadata")
"""The agent metadata at every connector version of `versions.VERSIONS`."""

WireMetadata = type[msgspec.Struct]
"""A struct whose fields are the agent metadata of one connector version (`metadata_struct`)."""


def metadata_struct(connector_version: int) -> WireMetadata:
    """The struct whose fields, in order, are the agent metadata of that connector version."""
    return METADATA.struct_at(connector_version)


def metadata_fields(connector_version: int) -> tuple[str, ...]:
    """The agent metadata's field names in wire order at that connector version."""
    return METADATA.fields_at(connector_version)


def encode_agent_metadata(
    metadata: NixlAgentMetadata, connector_version: int = LATEST_CONNECTOR_VERSION
) -> bytes:
    """The metadata as that connector version's vLLM encodes it: its field set, in its order."""
    return METADATA.encode(metadata, connector_version)


def decode_agent_metadata(data: bytes) -> NixlAgentMetadata:
    return METADATA.decode(data)


def field_set_versions(data: bytes) -> tuple[int, ...]:
    """The connector versions whose metadata field set, in order, is exactly the keys of the encoded map
    (empty when it is no known field set, e.g. a metadata re-encoded by another release's class). Versions
    14 and 15 write the same fields: only the hash tells them apart."""
    return METADATA.field_set_versions(data)
