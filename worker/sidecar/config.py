"""The sidecar's configuration: environment variables (the pod's identity) and the topology file (the plan).

Environment (the operator's builders set these in the pod spec; names are stable):

- `DISAGG_ROLE`: `prefill` or `decode` (required).
- `DISAGG_TOPOLOGY_FILE`: path of the topology file, JSON (`.json`) or YAML (required).
- `DISAGG_ENGINE_ID`: the engine's id (vLLM `kv_transfer_config.engine_id`), shared by all its workers;
  default `POD_NAME` without its `-<ordinal>` (prefill) or `POD_NAME` (decode).
- `DISAGG_PP_RANK`: this worker's pipeline stage; default the `-<ordinal>` of `POD_NAME` (prefill) or 0.
- `DISAGG_TP_RANK`: this worker's tensor-parallel rank; default 0.
- `DISAGG_SIDE_CHANNEL_HOST`: address the side channel binds and advertises; default `POD_IP`, else 127.0.0.1.
- `DISAGG_SIDE_CHANNEL_PORT`: side channel port; default 5600.
- `DISAGG_ENGINE_SOCKET`: the Unix socket the engine talks to; default `/dev/shm/disagg-engine.sock`.
- `DISAGG_KV_POOL`: when set, the only KV pool path the engine may register.
- `DISAGG_METRICS_HOST`, `DISAGG_METRICS_PORT`: the health and Prometheus HTTP server; `0.0.0.0`, 9090.
- `DISAGG_COMPATIBILITY_HASH`: the NIXL compatibility hash; default the topology's `compatibilityHashes`
  entry for the role, else one derived from the topology's model (name and dtype), else the check is off.
- `DISAGG_PIPELINE_PARALLEL_SIZE`, `DISAGG_TENSOR_PARALLEL_SIZE`, `DISAGG_BLOCK_SIZE`: optional cross-checks;
  each must equal the topology's value for this role.
- `DISAGG_LOG_LEVEL`: `debug`, `info` (default), `warning` or `error`.

Topology file: the operator's topology plan (`disagg plan -o json`) plus what the sidecar needs to build its
KV layout. Keys (camelCase; unknown keys are ignored so the plan can grow):

    transferMode: push                      # the sidecar runs the push connector; pull is refused
    blockSize: 16                           # logical block size, equal on both roles
    packed: false                           # block-outermost (BLHNC) pools
    prefillTensorParallelSize: 1
    decodeTensorParallelSize: 1
    stages:                                 # one per prefill PP stage, in order; contiguous layer ranges
      - {stage: 0, startLayer: 0, endLayer: 5}
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
    workers:                                # optional: other workers of an engine whose side-channel payload
      prefill:                              # its serving worker (pp 0, tp 0) republishes, vLLM-style
        - {ppRank: 1, tpRank: 0, host: 10.0.0.7, port: 5600}
    kvLeaseDurationSeconds: 30              # optional
    pushRegistrationTimeoutSeconds: 480     # optional
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from disagg.worker.connector.push import PushConfig
from disagg.worker.kv import wire
from disagg.worker.kv.errors import DisaggError, WorkerConfigError
from disagg.worker.kv.layout import DEFAULT_LAYER_NAME_TEMPLATE, AttentionKind, ModelGeometry, pp_partition
from disagg.worker.kv.pod_contract import (
    BLOCK_SIZE_ENV,
    COMPATIBILITY_HASH_ENV,
    DEFAULT_SIDE_CHANNEL_PORT,
    ENGINE_ID_ENV,
    ENGINE_SOCKET_ENV,
    KV_POOL_ENV,
    LOG_LEVEL_ENV,
    METRICS_HOST_ENV,
    METRICS_PORT_ENV,
    PIPELINE_PARALLEL_SIZE_ENV,
    POD_IP_ENV,
    POD_NAME_ENV,
    PP_RANK_ENV,
    ROLE_ENV,
    SIDE_CHANNEL_HOST_ENV,
    SIDE_CHANNEL_PORT_ENV,
    TENSOR_PARALLEL_SIZE_ENV,
    TOPOLOGY_FILE_ENV,
    TP_RANK_ENV,
)

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
DEFAULT_METRICS_PORT = 9090
DEFAULT_ENGINE_SOCKET = "/dev/shm/disagg-engine.sock"
_ORDINAL = re.compile(r"^(?P<base>.+)-(?P<ordinal>\d+)$")


@dataclass(frozen=True)
class WorkerEndpoint:
    """Another worker of the same engine, whose handshake payload the serving worker republishes."""

    pp_rank: int
    tp_rank: int
    host: str
    port: int


@dataclass(frozen=True)
class Topology:
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
    workers: Mapping[str, tuple[WorkerEndpoint, ...]] = field(default_factory=dict)
    kv_lease_duration_s: float = 30.0
    push_registration_timeout_s: float = 480.0

    @property
    def prefill_pp(self) -> int:
        return len(self.stage_layers)

    @property
    def layer_partition(self) -> tuple[int, ...]:
        return tuple(len(layers) for layers in self.stage_layers)

    def compat_factors(self) -> dict[str, Any] | None:
        """vLLM's hash factors for this model, when the file names the model and its dtype."""
        if self.model_name is None or self.dtype is None:
            return None
        try:
            factors: dict[str, Any] = wire.compat_factors(
                vllm_version="disagg",
                model=self.model_name,
                dtype=self.dtype,
                num_kv_heads=self.model.num_kv_heads,
                head_size=self.model.head_size,
                num_hidden_layers=self.model.num_layers,
                attn_backend_name=self.attention_backend,
                is_hma_enabled=self.model.hma,
                transfer_mode="push",
            )
        except ValueError as exc:
            raise WorkerConfigError(f"topology model.dtype: {exc}") from None
        return factors


def _get(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in doc:
        raise WorkerConfigError(f"topology: {where}{key} is missing")
    value = doc[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise WorkerConfigError(f"topology: {where}{key} must be {_kind_name(kind)}, got {value!r}")
    return value


def _opt(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any, where: str) -> Any:
    return default if doc.get(key) is None else _get(doc, key, kind, where)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _positive(value: int, what: str) -> int:
    if value < 1:
        raise WorkerConfigError(f"topology: {what} must be positive, got {value}")
    return value


def parse_topology(doc: Any) -> Topology:
    """The topology from its parsed document; every problem is a `WorkerConfigError` naming the key."""
    if not isinstance(doc, Mapping):
        raise WorkerConfigError(f"topology: the document must be a mapping, got {type(doc).__name__}")
    transfer_mode = _get(doc, "transferMode", str, "")
    if transfer_mode != "push":
        raise WorkerConfigError(
            f"topology: transferMode is {transfer_mode!r}; the sidecar moves KV with the push connector only"
        )
    m = _get(doc, "model", Mapping, "")
    kinds_raw = _get(m, "layerKinds", list, "model.")
    try:
        kinds = tuple(AttentionKind(kind) for kind in kinds_raw)
    except ValueError as exc:
        raise WorkerConfigError(f"topology: model.layerKinds: {exc}") from None
    try:
        model = ModelGeometry(
            kinds,
            _get(m, "numKVHeads", int, "model."),
            _get(m, "headSize", int, "model."),
            _get(m, "dtypeBytes", int, "model."),
            _opt(m, "layerNameTemplate", str, DEFAULT_LAYER_NAME_TEMPLATE, "model."),
            _opt(m, "hma", bool, True, "model."),
        )
    except DisaggError as exc:
        raise WorkerConfigError(f"topology: model: {exc.message}") from None
    stages = _get(doc, "stages", list, "")
    if not stages:
        raise WorkerConfigError("topology: stages is empty; a prefill engine has at least one stage")
    ranges = []
    for index, stage in enumerate(stages):
        where = f"stages[{index}]."
        if not isinstance(stage, Mapping):
            raise WorkerConfigError(f"topology: stages[{index}] must be a mapping")
        if _opt(stage, "stage", int, index, where) != index:
            raise WorkerConfigError(
                f"topology: {where}stage is {stage['stage']}, expected {index} (in order)"
            )
        ranges.append(range(_get(stage, "startLayer", int, where), _get(stage, "endLayer", int, where)))
    sizes = [len(r) for r in ranges]
    try:
        expected = pp_partition(model.num_layers, len(ranges), sizes)
    except DisaggError as exc:
        raise WorkerConfigError(f"topology: stages: {exc.message}") from None
    if ranges != expected:
        raise WorkerConfigError(
            f"topology: stages {[(r.start, r.stop) for r in ranges]} are not contiguous from layer 0 to "
            f"{model.num_layers}"
        )
    for index, stage in enumerate(stages):
        listed = stage.get("layers")
        names = [model.layer_name(i) for i in ranges[index]]
        if listed is not None and list(listed) != names:
            raise WorkerConfigError(f"topology: stages[{index}].layers {listed} != the model's {names}")
    hashes = _opt(doc, "compatibilityHashes", Mapping, {}, "")
    workers: dict[str, tuple[WorkerEndpoint, ...]] = {}
    for role, listed in _opt(doc, "workers", Mapping, {}, "").items():
        if role not in ROLES or not isinstance(listed, list):
            raise WorkerConfigError(f"topology: workers.{role} must be a list under prefill or decode")
        workers[role] = tuple(
            WorkerEndpoint(
                _get(w, "ppRank", int, f"workers.{role}[{i}]."),
                _opt(w, "tpRank", int, 0, f"workers.{role}[{i}]."),
                _get(w, "host", str, f"workers.{role}[{i}]."),
                _get(w, "port", int, f"workers.{role}[{i}]."),
            )
            for i, w in enumerate(listed)
        )
    return Topology(
        model=model,
        transfer_mode=transfer_mode,
        block_size=_positive(_get(doc, "blockSize", int, ""), "blockSize"),
        packed=_opt(doc, "packed", bool, False, ""),
        prefill_tp=_positive(_opt(doc, "prefillTensorParallelSize", int, 1, ""), "prefillTensorParallelSize"),
        decode_tp=_positive(_opt(doc, "decodeTensorParallelSize", int, 1, ""), "decodeTensorParallelSize"),
        stage_layers=tuple(ranges),
        model_name=_opt(m, "name", str, None, "model."),
        dtype=_opt(m, "dtype", str, None, "model."),
        attention_backend=_opt(m, "attentionBackend", str, "FLASH_ATTN", "model."),
        compatibility_hashes={str(k): str(v) for k, v in hashes.items()},
        workers=workers,
        kv_lease_duration_s=float(_opt(doc, "kvLeaseDurationSeconds", (int, float), 30.0, "")),
        push_registration_timeout_s=float(
            _opt(doc, "pushRegistrationTimeoutSeconds", (int, float), 480.0, "")
        ),
    )


def load_topology(path: str | Path) -> Topology:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise WorkerConfigError(f"cannot read the topology file {path}: {exc.strerror}") from None
    try:
        doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise WorkerConfigError(f"topology file {path} is not valid {path.suffix or 'YAML'}: {exc}") from None
    return parse_topology(doc)


@dataclass(frozen=True)
class SidecarConfig:
    role: Role
    engine_id: str
    pp_rank: int
    tp_rank: int
    side_channel_host: str
    side_channel_port: int
    engine_socket: str
    metrics_host: str
    metrics_port: int
    kv_pool: str | None
    compat_hash: str | None
    """None: no hash known, the check is off (logged)."""
    compat_factors: Mapping[str, Any] | None
    log_level: str
    topology: Topology

    @property
    def pp_size(self) -> int:
        return self.topology.prefill_pp if self.role == "prefill" else 1

    @property
    def tp_size(self) -> int:
        return self.topology.prefill_tp if self.role == "prefill" else self.topology.decode_tp

    @property
    def serves_engine(self) -> bool:
        """The (pp 0, tp 0) worker hosts the engine's side channel for all its workers (vLLM's scheduler)."""
        return self.pp_rank == 0 and self.tp_rank == 0

    @property
    def republished_workers(self) -> tuple[WorkerEndpoint, ...]:
        if not self.serves_engine:
            return ()
        return tuple(w for w in self.topology.workers.get(self.role, ()) if (w.pp_rank, w.tp_rank) != (0, 0))

    def push_config(self) -> PushConfig:
        return PushConfig(
            engine_id=self.engine_id,
            model=self.topology.model,
            side_channel_host=self.side_channel_host,
            side_channel_port=self.side_channel_port,
            compat_hash=self.compat_hash,
            compat_factors=self.compat_factors,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            attn_backend_name=self.topology.attention_backend,
            kv_lease_duration_s=self.topology.kv_lease_duration_s,
            push_registration_timeout_s=self.topology.push_registration_timeout_s,
        )


def _env_int(env: Mapping[str, str], name: str, default: int | None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise WorkerConfigError(f"{name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise WorkerConfigError(f"{name}={raw!r} is not an integer") from None


def _check_env_equals(env: Mapping[str, str], name: str, expected: int, what: str) -> None:
    if env.get(name):
        got = _env_int(env, name, None)
        if got != expected:
            raise WorkerConfigError(f"{name}={got} contradicts the topology file's {what} {expected}")


def from_env(env: Mapping[str, str]) -> SidecarConfig:
    """The configuration from `env` (usually `os.environ`) and the topology file it names."""
    role = env.get(ROLE_ENV, "")
    if role not in ROLES:
        raise WorkerConfigError(f"{ROLE_ENV} must be one of {list(ROLES)}, got {role!r}")
    topology_file = env.get(TOPOLOGY_FILE_ENV)
    if not topology_file:
        raise WorkerConfigError(f"{TOPOLOGY_FILE_ENV} is not set")
    topology = load_topology(topology_file)
    pod = env.get(POD_NAME_ENV, "")
    ordinal = _ORDINAL.match(pod)
    engine_id = env.get(ENGINE_ID_ENV) or (ordinal.group("base") if role == "prefill" and ordinal else pod)
    if not engine_id:
        raise WorkerConfigError(
            f"{ENGINE_ID_ENV} is not set and there is no {POD_NAME_ENV} to derive it from"
        )
    default_rank = int(ordinal.group("ordinal")) if role == "prefill" and ordinal else 0
    if role == "prefill" and not env.get(PP_RANK_ENV) and not ordinal:
        raise WorkerConfigError(
            f"{PP_RANK_ENV} is not set and {POD_NAME_ENV} has no -<ordinal> to derive it from"
        )
    pp_rank = _env_int(env, PP_RANK_ENV, default_rank)
    tp_rank = _env_int(env, TP_RANK_ENV, 0)
    pp_size = topology.prefill_pp if role == "prefill" else 1
    tp_size = topology.prefill_tp if role == "prefill" else topology.decode_tp
    if not 0 <= pp_rank < pp_size:
        raise WorkerConfigError(f"{PP_RANK_ENV}={pp_rank} is outside the {role} pipeline of size {pp_size}")
    if not 0 <= tp_rank < tp_size:
        raise WorkerConfigError(f"{TP_RANK_ENV}={tp_rank} is outside the {role} TP size {tp_size}")
    _check_env_equals(env, PIPELINE_PARALLEL_SIZE_ENV, pp_size, f"{role} pipeline size")
    _check_env_equals(env, TENSOR_PARALLEL_SIZE_ENV, tp_size, f"{role} tensor-parallel size")
    _check_env_equals(env, BLOCK_SIZE_ENV, topology.block_size, "blockSize")

    factors = topology.compat_factors()
    computed = None if factors is None else wire.compat_hash(factors)
    listed = topology.compatibility_hashes.get(role)
    from_env_hash = env.get(COMPATIBILITY_HASH_ENV) or None
    if from_env_hash and listed and from_env_hash != listed:
        raise WorkerConfigError(
            f"{COMPATIBILITY_HASH_ENV} {from_env_hash} contradicts the topology's {role} hash {listed}"
        )
    compat_hash = from_env_hash or listed or computed
    log_level = env.get(LOG_LEVEL_ENV, "info").lower()
    if log_level not in ("debug", "info", "warning", "error"):
        raise WorkerConfigError(f"{LOG_LEVEL_ENV}={log_level!r} is not debug, info, warning or error")
    return SidecarConfig(
        role=role,
        engine_id=engine_id,
        pp_rank=pp_rank,
        tp_rank=tp_rank,
        side_channel_host=env.get(SIDE_CHANNEL_HOST_ENV) or env.get(POD_IP_ENV) or "127.0.0.1",
        side_channel_port=_env_int(env, SIDE_CHANNEL_PORT_ENV, DEFAULT_SIDE_CHANNEL_PORT),
        engine_socket=env.get(ENGINE_SOCKET_ENV) or DEFAULT_ENGINE_SOCKET,
        metrics_host=env.get(METRICS_HOST_ENV) or "0.0.0.0",
        metrics_port=_env_int(env, METRICS_PORT_ENV, DEFAULT_METRICS_PORT),
        kv_pool=env.get(KV_POOL_ENV) or None,
        compat_hash=compat_hash,
        compat_factors=factors if compat_hash is not None and compat_hash == computed else None,
        log_level=log_level,
        topology=topology,
    )
