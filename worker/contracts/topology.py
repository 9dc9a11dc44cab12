"""The topology document: what the operator writes into the topology ConfigMap and every sidecar reads. Pure.

It is the operator→worker contract, so it is typed once here: the operator's builders build a
`TopologyDocument` and `encode_topology` it, the data-path demo does the same, and the sidecar's
`decode_topology` turns the parsed file back into a `Topology` (the document, checked, in the terms the KV
layout uses). Keys are camelCase; keys this version does not know are ignored so the document can grow
without a new version. `version` changes only when a key changes meaning or a reader must refuse: the decoder
refuses a version it does not know, and reads a document without one (written before the key existed) as
version 1. Every problem is a `WorkerConfigError` whose message names the key.

    version: 1
    deployment: gemma-pp2                   # optional: the DisaggDeployment that wrote it
    transferMode: push                      # the sidecar runs the push connector; pull is refused
    blockSize: 16                           # logical block size, equal on both roles
    packed: false                           # block-outermost (BLHNC) pools
    prefillTensorParallelSize: 1
    decodeTensorParallelSize: 1
    hma: true                               # optional, for readers: the plan's (the layout reads model.hma)
    routingMode: layer-name                 # optional, for readers
    notificationsPerRequest: 2              # optional, for readers
    stages:                                 # one per prefill PP stage, in order; contiguous layer ranges
      - {stage: 0, startLayer: 0, endLayer: 5, routingMode: layer-name, layers: [...]}
      - {stage: 1, startLayer: 5, endLayer: 9}
    model:
      layerKinds: [sliding_window, sliding_window, full, ...]   # per layer: full|sliding_window|mla|mamba
      numKVHeads: 2
      headSize: 16
      dtypeBytes: 4
      layerNameTemplate: "model.layers.{i}.self_attn.attn"    # optional
      hma: true                             # optional, default true
      name: tiny                            # optional: with dtype, derives the compatibility hash
      dtype: float32                        # optional
      attentionBackend: FLASH_ATTN          # optional
    compatibilityHashes: {prefill: <sha256>, decode: <sha256>}  # optional
    compatibilityFactors: {prefill: {...}, decode: {...}}       # optional: what each hash is of, so a
                                            # sidecar names what a live hash differs in
    workers:                                # optional: other workers of an engine whose side-channel payload
      prefill:                              # its serving worker (pp 0, tp 0) republishes, vLLM-style
        - {ppRank: 1, tpRank: 0, host: 10.0.0.7, port: 5600}
    kvLeaseDurationSeconds: 30              # optional
    pushRegistrationTimeoutSeconds: 480     # optional
    vllmVersion: "0.33.0"                   # optional: the engines' release; hashed (default: none, "disagg")
    connectorVersion: 15                    # optional: the NIXL connector version the sidecars speak
                                            # (that release's; default the newest, 15)
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Literal

import msgspec

from disagg.worker.kv import rules, wire
from disagg.worker.kv.errors import DisaggError, WorkerConfigError
from disagg.worker.kv.layout import DEFAULT_LAYER_NAME_TEMPLATE, AttentionKind, ModelGeometry, pp_partition

TOPOLOGY_VERSION: Final = 1
Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
Positive = Annotated[int, msgspec.Meta(ge=1)]


class WorkerEndpoint(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """Another worker of the same engine, whose handshake payload the serving worker republishes."""

    pp_rank: int
    tp_rank: int = 0
    host: str
    port: int


class StageDocument(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """One prefill pipeline stage: the layers `[startLayer, endLayer)` it holds."""

    # Optional, and then the stage's position in the list; when given it must equal it.
    stage: int | None = None
    start_layer: int
    end_layer: int
    routing_mode: str | None = None
    # Optional: the stage's layer names, which must be the model's names for its range.
    layers: tuple[str, ...] | None = None


class ModelDocument(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """The model's KV cache geometry (`layout.ModelGeometry`) and what its compatibility hash needs."""

    # First: a model without it is reported as missing its layers, the key that says most.
    layer_kinds: tuple[AttentionKind, ...]
    num_kv_heads: int = msgspec.field(name="numKVHeads")
    head_size: int
    dtype_bytes: int
    layer_name_template: str = DEFAULT_LAYER_NAME_TEMPLATE
    hma: bool = True
    name: str | None = None
    dtype: str | None = None
    attention_backend: str = "FLASH_ATTN"


class TopologyDocument(
    msgspec.Struct, frozen=True, kw_only=True, rename="camel", tag_field="version", tag=TOPOLOGY_VERSION
):
    """Version 1 of the document; encoded, it always carries `version`."""

    transfer_mode: str
    block_size: Positive
    stages: tuple[StageDocument, ...]
    model: ModelDocument
    packed: bool = False
    prefill_tensor_parallel_size: Positive = 1
    decode_tensor_parallel_size: Positive = 1
    deployment: str | None = None
    hma: bool | None = None
    routing_mode: str | None = None
    notifications_per_request: int | None = None
    compatibility_hashes: dict[str, str] = {}
    compatibility_factors: dict[str, dict[str, Any]] = {}
    workers: dict[str, tuple[WorkerEndpoint, ...]] = {}
    kv_lease_duration_seconds: float = 30.0
    push_registration_timeout_seconds: float = 480.0
    # Optional, so documents written before they existed still read: the release the spec names and the
    # connector version it speaks (`releases.Release`), which the sidecars encode and hash with.
    vllm_version: str | None = None
    connector_version: int = wire.LATEST_CONNECTOR_VERSION


LEASE_WAIT_MARGIN = 0.5
"""The part of a lease added to it in `lease_wait_s`."""


def lease_wait_s(kv_lease_duration_s: float) -> float:
    """How long a decoder waits, from when it learns of a request (its decode leg arrives, its sidecar is told
    to expect it), before it takes the prefill's lease on the request's KV to have run out.

    A prefill's lease starts when its KV is complete, and only a registered decoder's heartbeats extend it.
    When the prefill finished before the decoder learnt of the request (a router that waits for the prefill's
    answer), the lease has run out at most one lease later; the margin of half a lease covers a prefill that
    finished shortly after (a router that sends both legs at once) and a producer whose poll runs late."""
    return kv_lease_duration_s * (1 + LEASE_WAIT_MARGIN)


def encode_topology(document: TopologyDocument) -> str:
    """The ConfigMap's text: JSON with sorted keys, so equal documents have equal checksums."""
    return json.dumps(msgspec.to_builtins(document), sort_keys=True, indent=2)


@dataclass(frozen=True)
class Topology:
    """A decoded, checked document in the KV layout's terms."""

    model: ModelGeometry
    transfer_mode: str
    block_size: int
    packed: bool
    prefill_tp: int
    decode_tp: int
    stage_layers: tuple[range, ...]
    model_name: str | None = None
    dtype: str | None = None
    attention_backend: str = "FLASH_ATTN"
    compatibility_hashes: Mapping[str, str] = field(default_factory=dict)
    compatibility_factors: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    workers: Mapping[str, tuple[WorkerEndpoint, ...]] = field(default_factory=dict)
    kv_lease_duration_s: float = 30.0
    push_registration_timeout_s: float = 480.0
    vllm_version: str | None = None
    connector_version: int = wire.LATEST_CONNECTOR_VERSION

    @property
    def prefill_pp(self) -> int:
        return len(self.stage_layers)

    @property
    def layer_partition(self) -> tuple[int, ...]:
        return tuple(len(layers) for layers in self.stage_layers)

    def compat_factors(self) -> dict[str, Any] | None:
        """vLLM's hash factors for this model, when the document names the model and its dtype. Without a
        `vllmVersion` (the reference engine, no vLLM) the version factor is "disagg"."""
        if self.model_name is None or self.dtype is None:
            return None
        try:
            factors: dict[str, Any] = wire.compat_factors(
                vllm_version=self.vllm_version or "disagg",
                model=self.model_name,
                dtype=self.dtype,
                num_kv_heads=self.model.num_kv_heads,
                head_size=self.model.head_size,
                num_hidden_layers=self.model.num_layers,
                attn_backend_name=self.attention_backend,
                is_hma_enabled=self.model.hma,
                transfer_mode="push",
                nixl_connector_version=self.connector_version,
            )
        except ValueError as exc:
            raise WorkerConfigError(f"topology model.dtype: {exc}") from None
        return factors


def decode_topology(raw: object) -> Topology:
    """The topology from its parsed document (JSON or YAML); every problem is a `WorkerConfigError`."""
    if not isinstance(raw, Mapping):
        raise WorkerConfigError(f"topology: the document must be a mapping, got {type(raw).__name__}")
    version = raw.get("version", TOPOLOGY_VERSION)
    if version != TOPOLOGY_VERSION or isinstance(version, bool):
        raise WorkerConfigError(
            f"topology: version {version!r} is not one this worker reads (it reads version "
            f"{TOPOLOGY_VERSION}): run a worker image as new as the operator that wrote it"
        )
    try:
        document = msgspec.convert(raw, TopologyDocument, strict=True)
    except msgspec.ValidationError as exc:
        raise WorkerConfigError(f"topology: {_problem(str(exc), raw)}") from None
    return topology_of(document)


def topology_of(document: TopologyDocument) -> Topology:
    """The checks a schema cannot state: the push connector, the model's geometry and the stage ranges."""
    if document.transfer_mode != "push":
        raise WorkerConfigError(
            f"topology: transferMode is {document.transfer_mode!r}; the sidecar moves KV with the push "
            "connector only"
        )
    m = document.model
    try:
        model = ModelGeometry(
            m.layer_kinds, m.num_kv_heads, m.head_size, m.dtype_bytes, m.layer_name_template, m.hma
        )
    except DisaggError as exc:
        raise WorkerConfigError(f"topology: model: {exc.message}") from None
    mamba = rules.mamba_state_not_transferred(document.transfer_mode, model.has_mamba)
    if mamba is not None:
        raise WorkerConfigError(f"topology: {mamba.message}", reason=mamba.reason)
    if not document.stages:
        raise WorkerConfigError("topology: stages is empty; a prefill engine has at least one stage")
    for index, stage in enumerate(document.stages):
        if stage.stage is not None and stage.stage != index:
            raise WorkerConfigError(
                f"topology: stages[{index}].stage is {stage.stage}, expected {index} (in order)"
            )
    ranges = [range(stage.start_layer, stage.end_layer) for stage in document.stages]
    try:
        expected = pp_partition(model.num_layers, len(ranges), [len(r) for r in ranges])
    except DisaggError as exc:
        raise WorkerConfigError(f"topology: stages: {exc.message}") from None
    if ranges != expected:
        raise WorkerConfigError(
            f"topology: stages {[(r.start, r.stop) for r in ranges]} are not contiguous from layer 0 to "
            f"{model.num_layers}"
        )
    for index, stage in enumerate(document.stages):
        names = [model.layer_name(i) for i in ranges[index]]
        if stage.layers is not None and list(stage.layers) != names:
            raise WorkerConfigError(
                f"topology: stages[{index}].layers {list(stage.layers)} != the model's {names}"
            )
    if document.connector_version not in wire.CONNECTOR_VERSIONS:
        raise WorkerConfigError(
            f"topology: connectorVersion {document.connector_version} is not a NIXL connector version this "
            f"worker speaks ({', '.join(map(str, wire.CONNECTOR_VERSIONS))}): run a worker image as new as "
            "the operator that wrote it"
        )
    for role in document.workers:
        if role not in ROLES:
            raise WorkerConfigError(f"topology: workers.{role} must be a list under prefill or decode")
    return Topology(
        model=model,
        transfer_mode=document.transfer_mode,
        block_size=document.block_size,
        packed=document.packed,
        prefill_tp=document.prefill_tensor_parallel_size,
        decode_tp=document.decode_tensor_parallel_size,
        stage_layers=tuple(ranges),
        model_name=m.name,
        dtype=m.dtype,
        attention_backend=m.attention_backend,
        compatibility_hashes=dict(document.compatibility_hashes),
        compatibility_factors=dict(document.compatibility_factors),
        workers=dict(document.workers),
        kv_lease_duration_s=document.kv_lease_duration_seconds,
        push_registration_timeout_s=document.push_registration_timeout_seconds,
        vllm_version=document.vllm_version,
        connector_version=document.connector_version,
    )


# msgspec reports `<detail> - at `$.model.layerKinds[0]`` (or `- at `key` in `$.workers``); the messages
# below restate it in the document's own key names, with the value found there.
_AT = re.compile(r"^(?P<detail>.*?)(?: - at `(?P<path>[^`]*)`(?: in `(?P<parent>[^`]*)`)?)?$", re.DOTALL)
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]+)`")
_EXPECTED = re.compile(r"Expected `(?P<type>[^`]+)`(?:, got `[^`]+`| (?P<bound>.+))")
_ENUM = re.compile(r"Invalid enum value (?P<value>.+)")
_ABSENT: Final = object()
_JSON_TYPES: Final = {"object": "a mapping", "array": "a list"}


def _problem(error: str, raw: object) -> str:
    match = _AT.match(error)
    assert match is not None  # the pattern matches any text
    detail, path, parent = match["detail"], match["path"] or "$", match["parent"]
    if path == "key" and parent is not None:
        return f"a key of {_dotted(_steps(parent)) or 'the document'}: {detail}"
    steps = _steps(path)
    where = _dotted(steps)
    value = _value_at(raw, steps)
    got = "" if value is _ABSENT else f", got {value!r}"
    if missing := _MISSING.fullmatch(detail):
        return f"{where + '.' if where else ''}{missing['field']} is missing"
    if expected := _EXPECTED.fullmatch(detail):
        kind = " or ".join(_JSON_TYPES.get(t, t) for t in expected["type"].split(" | "))
        return f"{where} must be {kind}{' ' + expected['bound'] if expected['bound'] else ''}{got}"
    if _ENUM.fullmatch(detail) and value is not _ABSENT:
        enum = _type_at(steps)
        name = enum.cls.__name__ if isinstance(enum, msgspec.inspect.EnumType) else "value"
        return f"{where}: {value!r} is not a valid {name}"
    return f"{where or 'the document'}: {detail}"


def _steps(path: str) -> list[str | int]:
    # A mapping's values are `[...]` in msgspec's paths (it does not name the key).
    return [key or (int(index) if index.isdigit() else "<key>") for key, index in _STEP.findall(path)]


def _dotted(steps: list[str | int]) -> str:
    text = ""
    for step in steps:
        text += f"[{step}]" if isinstance(step, int) else (f".{step}" if text else step)
    return text


def _value_at(raw: object, steps: list[str | int]) -> object:
    value = raw
    for step in steps:
        if isinstance(step, int) and isinstance(value, list) and step < len(value):
            value = value[step]
            continue
        if isinstance(step, str) and isinstance(value, Mapping) and step in value:
            value = value[step]
            continue
        return _ABSENT
    return value


def _type_at(steps: list[str | int]) -> msgspec.inspect.Type | None:
    kind: msgspec.inspect.Type | None = msgspec.inspect.type_info(TopologyDocument)
    for step in steps:
        if isinstance(kind, msgspec.inspect.UnionType):
            kind = next((t for t in kind.types if not isinstance(t, msgspec.inspect.NoneType)), None)
        if isinstance(kind, msgspec.inspect.StructType):
            kind = next((f.type for f in kind.fields if f.encode_name == step), None)
        elif isinstance(kind, msgspec.inspect.VarTupleType | msgspec.inspect.ListType):
            kind = kind.item_type
        elif isinstance(kind, msgspec.inspect.DictType):
            kind = kind.value_type
        else:
            return None
    return kind
