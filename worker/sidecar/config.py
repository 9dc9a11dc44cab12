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
- `DISAGG_ENGINE_SIDE_CHANNEL_HOST`: where this pod's engine's side channel is served. A PP prefill engine has
  one, on its head pod (stage 0), answering for every `(pp_rank, tp_rank)` (vLLM's EngineCore serves every
  worker's payload from node rank 0): the builders set the head pod's DNS name on every stage; default
  `DISAGG_SIDE_CHANNEL_HOST`.
- `DISAGG_ENGINE_WORKERS`: JSON list of the engine's other workers (`[{"ppRank": 1, "tpRank": 0, "host":
  ..., "port": ...}]`) whose payloads the head's transfer sidecar fetches and serves; default the topology's
  `workers` entry for the role (the builders set it per prefill StatefulSet, whose stage pods have stable
  DNS names).
- `DISAGG_ENGINE_SOCKET`: the Unix socket the engine talks to; default `/dev/shm/disagg-engine.sock`.
- `DISAGG_KV_POOL`: when set, the only KV pool path the engine may register.
- `DISAGG_METRICS_HOST`, `DISAGG_METRICS_PORT`: the health and Prometheus HTTP server; `0.0.0.0`, 9090.
- `DISAGG_COMPATIBILITY_HASH`: the NIXL compatibility hash; default the topology's `compatibilityHashes`
  entry for the role, else one derived from the topology's model (name and dtype), else the check is off.
  Its factors are the topology's `compatibilityFactors` entry or the model's, whichever hashes to it.
- `DISAGG_PIPELINE_PARALLEL_SIZE`, `DISAGG_TENSOR_PARALLEL_SIZE`, `DISAGG_BLOCK_SIZE`: optional cross-checks;
  each must equal the topology's value for this role.
- `DISAGG_LOG_LEVEL`: `debug`, `info` (default), `warning` or `error`.
- `DISAGG_PEER_PROBE_INTERVAL_S`: how often an idle connected peer engine's side channel is asked whether
  the same engine still serves it (a killed or restarted peer is then evicted); default 10, 0 turns it off.
  Not set by the builders.
- `DISAGG_PEER_STARTUP_GRACE_S`: how long a peer (or, watching, the pod's own engine) that has never answered
  a handshake is reported as pending (the Pod's KV condition Unknown) rather than failed, from when this
  sidecar first saw it; default 600, 0 reports every failure at once. Not set by the builders.

Topology file: the operator's topology document (`disagg.worker.contracts.topology`, which lists its
keys), JSON or YAML; `load_topology` reads it and `decode_topology` checks it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import yaml

from disagg.worker.connector.push import PushConfig
from disagg.worker.contracts.pod_contract import (
    BLOCK_SIZE_ENV,
    COMPATIBILITY_HASH_ENV,
    DEFAULT_SIDE_CHANNEL_PORT,
    ENGINE_ID_ENV,
    ENGINE_SIDE_CHANNEL_HOST_ENV,
    ENGINE_SOCKET_ENV,
    ENGINE_WORKERS_ENV,
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
from disagg.worker.contracts.topology import ROLES, Role, Topology, WorkerEndpoint, decode_topology
from disagg.worker.kv import wire
from disagg.worker.kv.errors import WorkerConfigError

# A tuning knob the builders do not set, so not in the pod contract.
PEER_PROBE_INTERVAL_ENV = "DISAGG_PEER_PROBE_INTERVAL_S"
DEFAULT_PEER_PROBE_INTERVAL_S = 10.0
PEER_STARTUP_GRACE_ENV = "DISAGG_PEER_STARTUP_GRACE_S"
DEFAULT_PEER_STARTUP_GRACE_S = 600.0
"""Long enough for a vLLM engine to load a large model and capture its graphs."""
DEFAULT_METRICS_PORT = 9090
DEFAULT_ENGINE_SOCKET = "/dev/shm/disagg-engine.sock"
_ORDINAL = re.compile(r"^(?P<base>.+)-(?P<ordinal>\d+)$")


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
    return decode_topology(doc)


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
    engine_side_channel_host: str = ""
    """Where this pod's engine serves its side channel (the head pod of a PP prefill); "" means
    `side_channel_host`."""
    engine_workers: tuple[WorkerEndpoint, ...] | None = None
    """The engine's workers from `DISAGG_ENGINE_WORKERS`; None means the topology's `workers`."""
    peer_probe_interval_s: float = DEFAULT_PEER_PROBE_INTERVAL_S
    peer_startup_grace_s: float = DEFAULT_PEER_STARTUP_GRACE_S
    """How long a never-answered peer is pending rather than failed (`reporting.startup`)."""

    @property
    def engine_host(self) -> str:
        return self.engine_side_channel_host or self.side_channel_host

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
        workers = self.engine_workers
        if workers is None:
            workers = self.topology.workers.get(self.role, ())
        return tuple(w for w in workers if (w.pp_rank, w.tp_rank) != (0, 0))

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
            connector_version=self.topology.connector_version,
            kv_lease_duration_s=self.topology.kv_lease_duration_s,
            push_registration_timeout_s=self.topology.push_registration_timeout_s,
            peer_probe_interval_s=self.peer_probe_interval_s,
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


def _env_seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise WorkerConfigError(f"{name}={raw!r} is not a number of seconds") from None
    if not 0 <= value < 1e6:
        raise WorkerConfigError(f"{name}={raw!r} must be between 0 and 1e6 seconds")
    return value


def _check_env_equals(env: Mapping[str, str], name: str, expected: int, what: str) -> None:
    if env.get(name):
        got = _env_int(env, name, None)
        if got != expected:
            raise WorkerConfigError(f"{name}={got} contradicts the topology file's {what} {expected}")


def _factors_of(compat_hash: str | None, *candidates: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The factors `compat_hash` is the hash of, among those known; None when none is."""
    for factors in candidates:
        if compat_hash is not None and factors is not None and wire.compat_hash(factors) == compat_hash:
            return factors
    return None


def _engine_workers(raw: str | None) -> tuple[WorkerEndpoint, ...] | None:
    if not raw:
        return None
    try:
        return msgspec.json.decode(raw, type=tuple[WorkerEndpoint, ...], strict=True)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WorkerConfigError(
            f"{ENGINE_WORKERS_ENV} must be a JSON list of {{ppRank, tpRank, host, port}}: {exc}"
        ) from None


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
        engine_side_channel_host=env.get(ENGINE_SIDE_CHANNEL_HOST_ENV) or "",
        engine_workers=_engine_workers(env.get(ENGINE_WORKERS_ENV)),
        peer_probe_interval_s=_env_seconds(env, PEER_PROBE_INTERVAL_ENV, DEFAULT_PEER_PROBE_INTERVAL_S),
        peer_startup_grace_s=_env_seconds(env, PEER_STARTUP_GRACE_ENV, DEFAULT_PEER_STARTUP_GRACE_S),
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
        compat_factors=_factors_of(compat_hash, factors, topology.compatibility_factors.get(role)),
        log_level=log_level,
        topology=topology,
    )
