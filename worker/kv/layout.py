"""KV cache layout of a (hybrid) model, reproduced from vLLM's hybrid memory allocator (HMA).

Pure: no torch, no nixl, no I/O. Everything here follows `vllm-hma-kv-cache-layout.md` (eras B/C):

- Grouping is decided once over the whole model (§1.2): bucket layers by spec in first-appearance order,
  pick a group size (`min`, or `max` when `max < 1.5 * min`), split each bucket into strided groups.
- Each PP stage projects those global groups onto its own layers, keeping empty groups (§5.1), so a layer
  has the same group index on every stage and on the decoder; only which layers share a slot differs.
- Slot `l` of a stage is shared by the `l`-th stage layer of every group (§2.1). Each slot is one NIXL
  region; regions are ordered by the natural sort order of their first member, the order in which vLLM's
  NIXL worker iterates layers.

Byte layout of a stage (one backing allocation, registered once):

- `block_len` is the bytes of one kernel block of one layer on this TP rank. For attention,
  `2 (K‖V) * kernel_block_size * heads_per_rank * head_size * dtype_bytes`; MLA has no factor 2 and no
  head split (the latent is replicated across TP ranks). Pages of different kinds are padded to the
  largest one (era C), so every region of a stage has the same `block_len`.
- Inside a block the order is `[head][token][K‖V]` (LBHNC, historically "HND"): heads are outermost, so
  the slice of one TP rank's heads is one contiguous byte range.
- Layer-outer (`packed=False`, `LBHNC`): region `r` is bytes `[r * S, (r + 1) * S)` with
  `S = num_kernel_blocks * block_len`, and block `b` of region `r` starts at `r * S + b * block_len`.
- Block-outer (`packed=True`, `BLHNC`): block `b` holds every region's page in turn; region `r`'s page of
  block `b` starts at `b * G * block_len + r * block_len`, so `block_stride = G * block_len`.
- Total bytes: `G * block_len * num_kernel_blocks`, where `G` is the number of regions of the stage.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from disagg.worker.kv.errors import LayoutError
from disagg.worker.kv.rules import invalid_layer_partition

DEFAULT_LAYER_NAME_TEMPLATE = "model.layers.{i}.self_attn.attn"
MAX_LAYER_NAME_TEMPLATE = 256
# A `str.format` template whose only field is `{i}`: no other name, position, format spec or conversion, and
# braces otherwise only doubled. Python's format parser reads left to right, and so does this language: at a
# `{` only `{{` or `{i}` can follow, at a `}` only `}}`, so the pattern (also the CRD's) accepts exactly the
# templates `template.format(i=n)` renders without error to a name at most a few digits longer.
LAYER_NAME_TEMPLATE_PATTERN = r"^(?:[^{}]|\{\{|\}\})*\{i\}(?:[^{}]|\{\{|\}\}|\{i\})*$"
SHARED_REGION_GROUP_ID = -1
"""`region_group_ids` value of a region that layers of several KV cache groups share (vLLM's constant)."""


class AttentionKind(enum.StrEnum):
    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    MLA = "mla"
    MAMBA = "mamba"


def layer_name_template_problem(template: str) -> str | None:
    """Why `template` is not a layer-name template (`{i}` the only field, at most 256 characters), or None."""
    if len(template) > MAX_LAYER_NAME_TEMPLATE:
        return f"is {len(template)} characters long; at most {MAX_LAYER_NAME_TEMPLATE} are allowed"
    if re.fullmatch(LAYER_NAME_TEMPLATE_PATTERN, template) is None:
        return (
            f"{template[:80]!r} does not match the pattern of a layer name with {{i}} for the layer index: "
            "it must contain {i} and no other field, format spec or conversion (such as {j}, {0} or {i:>4}), "
            "and a literal brace is written {{ or }}"
        )
    return None


_NATURAL_SPLIT = re.compile(r"(\d+)")


def natural_sort_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Orders digit runs numerically, `layers.2` before `layers.10` (vLLM's `_region_sort_key`)."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in _NATURAL_SPLIT.split(name) if part
    )


def natural_sorted(names: Iterable[str]) -> list[str]:
    return sorted(names, key=natural_sort_key)


@dataclass(frozen=True)
class ModelGeometry:
    """What the KV layout of a model depends on.

    `num_kv_heads` is the model's total KV heads (per TP rank it is divided by the TP size); for MLA layers
    `head_size` is the latent width (kv_lora_rank + rope dim). `hma` is vLLM's hybrid KV cache manager switch
    (`--disable-hybrid-kv-cache-manager` sets it False and promotes sliding-window layers to full attention).
    """

    kinds: tuple[AttentionKind, ...]
    num_kv_heads: int
    head_size: int
    dtype_bytes: int
    layer_name_template: str = DEFAULT_LAYER_NAME_TEMPLATE
    hma: bool = True

    def __post_init__(self) -> None:
        if not self.kinds:
            raise LayoutError("a model needs at least one KV cache layer")
        if min(self.num_kv_heads, self.head_size, self.dtype_bytes) < 1:
            raise LayoutError(
                f"num_kv_heads, head_size and dtype_bytes must be positive, got {self.num_kv_heads}, "
                f"{self.head_size}, {self.dtype_bytes}"
            )
        problem = layer_name_template_problem(self.layer_name_template)
        if problem is not None:
            raise LayoutError(f"layer_name_template {problem}")
        if all(kind is AttentionKind.MAMBA for kind in self.kinds):
            raise LayoutError("a model made only of Mamba layers has no attention page to size its regions")

    @classmethod
    def with_full_every(
        cls,
        num_layers: int,
        period: int,
        *,
        other: AttentionKind = AttentionKind.SLIDING_WINDOW,
        num_kv_heads: int,
        head_size: int,
        dtype_bytes: int,
        layer_name_template: str = DEFAULT_LAYER_NAME_TEMPLATE,
        hma: bool = True,
    ) -> ModelGeometry:
        """Gemma-style pattern: layer `i` is full attention iff `(i + 1) % period == 0`, else `other`.

        `period=6` is the 5:1 sliding/full pattern; `period=2` with layer 0 sliding is gpt-oss; `period=1`
        makes every layer full attention.
        """
        if num_layers < 1 or period < 1:
            raise LayoutError(f"num_layers and period must be positive, got {num_layers} and {period}")
        kinds = tuple(AttentionKind.FULL if (i + 1) % period == 0 else other for i in range(num_layers))
        return cls(kinds, num_kv_heads, head_size, dtype_bytes, layer_name_template, hma)

    @property
    def num_layers(self) -> int:
        return len(self.kinds)

    def layer_name(self, index: int) -> str:
        return self.layer_name_template.format(i=index)

    @cached_property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(self.layer_name(i) for i in range(self.num_layers))

    @property
    def has_mamba(self) -> bool:
        return AttentionKind.MAMBA in self.kinds

    @property
    def is_mla(self) -> bool:
        """Every attention layer is MLA (the cache is replicated across TP ranks, never head-split)."""
        return all(kind in (AttentionKind.MLA, AttentionKind.MAMBA) for kind in self.kinds)

    @property
    def hma_required(self) -> bool:
        """vLLM's `_is_hma_required`: HMA on and some layer is not plain full attention."""
        return self.hma and any(kind is not AttentionKind.FULL for kind in self.kinds)

    def effective_kinds(self) -> tuple[AttentionKind, ...]:
        """Kinds after vLLM's promotion of sliding-window layers to full attention when HMA is off."""
        if self.hma:
            return self.kinds
        promoted = tuple(AttentionKind.FULL if k is AttentionKind.SLIDING_WINDOW else k for k in self.kinds)
        if len(set(promoted)) > 1:
            mixed = sorted({k.value for k in promoted})
            raise LayoutError(
                f"with the hybrid KV cache manager disabled every layer needs one spec, but the model mixes "
                f"{mixed}; enable HMA for this model"
            )
        return promoted

    def heads_per_rank(self, tp_size: int) -> int:
        if tp_size < 1:
            raise LayoutError(f"tp_size must be positive, got {tp_size}")
        if self.num_kv_heads % tp_size and tp_size % self.num_kv_heads:
            raise LayoutError(
                f"{self.num_kv_heads} KV heads cannot be split over TP {tp_size}: one must divide the other"
            )
        return max(1, self.num_kv_heads // tp_size)

    def page_bytes(self, kind: AttentionKind, *, block_size: int, tp_size: int) -> int:
        """Bytes of one block of one layer of `kind` on one TP rank, before padding to a common page."""
        if kind is AttentionKind.MLA:
            return block_size * self.head_size * self.dtype_bytes
        return 2 * block_size * self.heads_per_rank(tp_size) * self.head_size * self.dtype_bytes


def kv_cache_groups(geometry: ModelGeometry) -> tuple[tuple[str, ...], ...]:
    """vLLM's global `kv_cache_groups` (layer names per group, model order inside a group), §1.2."""
    kinds = geometry.effective_kinds()
    names = geometry.layer_names
    buckets: dict[AttentionKind, list[str]] = {}
    for name, kind in zip(names, kinds, strict=True):
        buckets.setdefault(kind, []).append(name)
    if len(buckets) == 1:
        return (tuple(names),)
    sizes = [len(members) for members in buckets.values()]
    group_size = max(sizes) if max(sizes) < 1.5 * min(sizes) else min(sizes)
    groups: list[tuple[str, ...]] = []
    for members in buckets.values():
        num_groups = math.ceil(len(members) / group_size)
        groups.extend(tuple(members[i::num_groups]) for i in range(num_groups))
    return tuple(groups)


def transfer_group_index_by_layer(geometry: ModelGeometry) -> dict[str, int]:
    """Layer name -> index of its KV cache group (every group of an attention/Mamba model is transferable)."""
    return {name: g for g, group in enumerate(kv_cache_groups(geometry)) for name in group}


def pp_partition(num_layers: int, pp_size: int, partition: Sequence[int] | None = None) -> list[range]:
    """Layers of each PP stage: vLLM's `get_pp_indices`, or an explicit partition (layers per stage).

    The even split gives the `num_layers % pp_size` remainder layers to the stages just before the last one.
    """
    violation = invalid_layer_partition(num_layers, pp_size, partition)
    if violation is not None:
        raise LayoutError(violation.message, reason=violation.reason)
    if partition is None:
        sizes = [num_layers // pp_size] * pp_size
        for i in range(2, num_layers % pp_size + 2):
            sizes[-i] += 1
    else:
        sizes = list(partition)
    starts = [sum(sizes[:rank]) for rank in range(pp_size)]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


@dataclass(frozen=True)
class Region:
    """One NIXL region: a physical slot that all its member layers alias (in different blocks)."""

    members: tuple[str, ...]
    """Every layer that maps to the region, in natural sort order."""
    group_id: int
    """The KV cache group of the members, or SHARED_REGION_GROUP_ID when they span several groups."""
    offset: int
    """Byte offset of the region's block 0 from the start of the stage's backing allocation."""
    block_len: int
    block_stride: int
    num_blocks: int
    """Capacity in kernel blocks."""
    replicated: bool
    """MLA region: the same bytes on every TP rank, never split by heads."""

    @property
    def name(self) -> str:
        """vLLM's `region_names` entry: the first layer that created the region."""
        return self.members[0]


@dataclass(frozen=True)
class StageLayout:
    """The KV cache of one worker (one PP stage, one TP rank): its groups, regions and byte geometry."""

    pp_rank: int
    pp_size: int
    tp_size: int
    layers: range
    """Model layer indices this stage owns."""
    groups: tuple[tuple[str, ...], ...]
    """The global groups projected onto this stage (empty groups kept, so indices equal the global ones)."""
    regions: tuple[Region, ...]
    block_size: int
    """Kernel block size in tokens (what the metadata advertises)."""
    physical_blocks_per_logical: int
    num_blocks: int
    """Kernel blocks per region."""
    kv_cache_layout: str
    total_bytes: int
    group_index_by_layer: dict[str, int] = field(repr=False)

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(name for region in self.regions for name in region.members)

    @property
    def base_offsets(self) -> list[int]:
        return [r.offset for r in self.regions]

    @property
    def block_lens(self) -> list[int]:
        return [r.block_len for r in self.regions]

    @property
    def block_strides(self) -> list[int]:
        return [r.block_stride for r in self.regions]

    @property
    def region_num_blocks(self) -> list[int]:
        return [r.num_blocks for r in self.regions]

    @property
    def region_group_ids(self) -> list[int]:
        return [r.group_id for r in self.regions]

    @property
    def region_names(self) -> list[str]:
        return [r.name for r in self.regions]

    @property
    def region_members(self) -> list[list[str]]:
        return [list(r.members) for r in self.regions]

    @property
    def region_replicated(self) -> list[bool]:
        return [r.replicated for r in self.regions]


def build_stage_layout(
    geometry: ModelGeometry,
    *,
    pp_rank: int,
    pp_size: int,
    tp_size: int,
    block_size: int,
    num_blocks: int,
    partition: Sequence[int] | None = None,
    packed: bool = False,
    kernel_block_size: int | None = None,
) -> StageLayout:
    """The era-C layout of stage `pp_rank`: global groups projected to the stage, slots pooled into regions.

    `num_blocks` is the logical capacity (vLLM's engine-wide minimum over workers); regions hold
    `num_blocks * block_size // kernel_block_size` kernel blocks.
    """
    if not 0 <= pp_rank < pp_size:
        raise LayoutError(f"pp_rank {pp_rank} is outside pipeline of size {pp_size}")
    if block_size < 1 or num_blocks < 1:
        raise LayoutError(f"block_size and num_blocks must be positive, got {block_size} and {num_blocks}")
    kernel = block_size if kernel_block_size is None else kernel_block_size
    if kernel < 1 or block_size % kernel:
        raise LayoutError(f"kernel block size {kernel} must divide the block size {block_size}")
    per_logical = block_size // kernel

    layers = pp_partition(geometry.num_layers, pp_size, partition)[pp_rank]
    owned = {geometry.layer_name(i) for i in layers}
    global_groups = kv_cache_groups(geometry)
    groups = tuple(tuple(n for n in group if n in owned) for group in global_groups)
    group_of = {name: g for g, group in enumerate(groups) for name in group}
    kinds = dict(zip(geometry.layer_names, geometry.effective_kinds(), strict=True))

    # Pages are unified over the whole model (grouping runs once on every worker's merged specs), §3.3.
    block_len = max(
        geometry.page_bytes(kind, block_size=kernel, tp_size=tp_size)
        for kind in set(kinds.values())
        if kind is not AttentionKind.MAMBA
    )
    num_slots = max(len(group) for group in groups)
    slots = [
        natural_sorted(group[slot] for group in groups if slot < len(group)) for slot in range(num_slots)
    ]
    slots.sort(key=lambda members: natural_sort_key(members[0]))

    kernel_blocks = num_blocks * per_logical
    regions = []
    for position, members in enumerate(slots):
        member_groups = {group_of[name] for name in members}
        offset = position * block_len if packed else position * kernel_blocks * block_len
        regions.append(
            Region(
                members=tuple(members),
                group_id=member_groups.pop() if len(member_groups) == 1 else SHARED_REGION_GROUP_ID,
                offset=offset,
                block_len=block_len,
                block_stride=num_slots * block_len if packed else block_len,
                num_blocks=kernel_blocks,
                replicated=all(kinds[name] is AttentionKind.MLA for name in members),
            )
        )
    return StageLayout(
        pp_rank=pp_rank,
        pp_size=pp_size,
        tp_size=tp_size,
        layers=layers,
        groups=groups,
        regions=tuple(regions),
        block_size=kernel,
        physical_blocks_per_logical=per_logical,
        num_blocks=kernel_blocks,
        kv_cache_layout="BLHNC" if packed else "LBHNC",
        total_bytes=num_slots * block_len * kernel_blocks,
        group_index_by_layer={name: group_of[name] for name in owned},
    )
