"""An engine Pod as the operator built it, read back from the API server's camelCase dict. Pure.

The sidecar's peer check (`reporting.peer_check`) and the pairing of prefill engines with decode pods
(`pairing`, used by the router and the operator's status) read pods the same way: the role from its label,
the engine id and pipeline stage by the sidecar's own defaults (`sidecar.config.from_env`), the side-channel
and HTTP ports from the containers. A Pod is input from the API server, so nothing here raises on a
field of an unexpected type: it reads as absent.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from disagg.worker.contracts.pod_contract import (
    DEFAULT_ENGINE_HTTP_PORT,
    DEFAULT_SIDE_CHANNEL_PORT,
    DEPLOYMENT_LABEL,
    DRAINING_ANNOTATION,
    ENGINE_CONTAINER,
    ENGINE_HTTP_PORT_NAME,
    ENGINE_ID_ENV,
    PIPELINE_PARALLEL_SIZE_ENV,
    POD_CONDITION,
    PP_RANK_ENV,
    ROLE_LABEL,
    SIDE_CHANNEL_PORT_ENV,
    SIDE_CHANNEL_PORT_NAME,
    SIDECAR_CONTAINER,
    TENSOR_PARALLEL_SIZE_ENV,
)
from disagg.worker.contracts.topology import Role

ORDINAL: Final = re.compile(r"^(?P<base>.+)-(?P<ordinal>\d+)$")
# What `essentials` keeps of a Pod: the env variables, named ports and conditions anything here reads.
_ENV_READ: Final = frozenset(
    {ENGINE_ID_ENV, PP_RANK_ENV, SIDE_CHANNEL_PORT_ENV, TENSOR_PARALLEL_SIZE_ENV, PIPELINE_PARALLEL_SIZE_ENV}
)
_PORTS_READ: Final = frozenset({SIDE_CHANNEL_PORT_NAME, ENGINE_HTTP_PORT_NAME})
_OWN_LABELS: Final = "disagg.io/"
_CONDITIONS_READ: Final = frozenset({"Ready", POD_CONDITION})
_CONTAINER_STATUS_FIELDS: Final = ("name", "restartCount")
_ENV_FIELDS: Final = ("name", "value")
_PORT_FIELDS: Final = ("name", "containerPort")
_CONDITION_FIELDS: Final = ("type", "status", "reason", "message")


@dataclass(frozen=True)
class EnginePod:
    """What pairing and peer checks need of one engine pod."""

    name: str
    deployment: str
    role: Role
    stage: int
    engine_id: str
    """The stable engine id (the sidecar's): a live vLLM engine adds a per-start suffix to it."""
    host: str | None
    """The pod IP; None until it has one."""
    side_channel_port: int
    http_port: int
    tp_size: int
    pp_size: int
    ready: bool
    """The pod's `Ready` condition is True (which includes its readiness gates)."""
    deleting: bool
    annotations: Mapping[str, str]
    restarts: int = 0
    """The kubelet's restarts of the pod's containers, summed: a restarted engine container keeps its pod, IP
    and (for the reference engine) its sidecar's id, so this is what tells the router its pairs are new."""

    @property
    def draining(self) -> bool:
        """The operator is draining the pod (`disagg.io/draining`): it takes no new request."""
        return DRAINING_ANNOTATION in self.annotations


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _sequence(value: object) -> Sequence[Any]:
    return value if isinstance(value, list | tuple) else ()


def _int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) < 10:
        return int(value)
    return None


def container_env(container: Mapping[str, Any], name: str) -> str | None:
    """The literal value of env variable `name` of `container` (None for one from a reference)."""
    for item in _sequence(container.get("env")):
        item = _mapping(item)
        if item.get("name") == name and isinstance(item.get("value"), str):
            value: str = item["value"]
            return value
    return None


def containers(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [_mapping(c) for c in _sequence(_mapping(pod.get("spec")).get("containers"))]


def _named(items: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any]:
    return next((c for c in items if c.get("name") == name), {})


def _port(items: Sequence[Mapping[str, Any]], name: str) -> int | None:
    for container in items:
        for port in _sequence(container.get("ports")):
            port = _mapping(port)
            number = _int(port.get("containerPort"))
            if port.get("name") == name and number is not None:
                return number
    return None


def side_channel_port(items: Sequence[Mapping[str, Any]]) -> int:
    """The port named `side-channel` on any container (the engine's for vLLM images, else the sidecar's),
    else the sidecar's `DISAGG_SIDE_CHANNEL_PORT`, else the default."""
    port = _port(items, SIDE_CHANNEL_PORT_NAME)
    if port is not None:
        return port
    value = _int(container_env(_named(items, SIDECAR_CONTAINER), SIDE_CHANNEL_PORT_ENV))
    return DEFAULT_SIDE_CHANNEL_PORT if value is None else value


def http_port(items: Sequence[Mapping[str, Any]]) -> int:
    """The engine container's port named `http` (any container's if the engine declares none)."""
    engine = _named(items, ENGINE_CONTAINER)
    port = _port([engine], ENGINE_HTTP_PORT_NAME) if engine else None
    if port is None:
        port = _port(items, ENGINE_HTTP_PORT_NAME)
    return DEFAULT_ENGINE_HTTP_PORT if port is None else port


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """The pod's `Ready` condition is True."""
    conditions = _sequence(_mapping(pod.get("status")).get("conditions"))
    return any(_mapping(c).get("type") == "Ready" and _mapping(c).get("status") == "True" for c in conditions)


def _kept(item: Mapping[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    return {key: item[key] for key in fields if key in item}


def essentials(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a Pod that `engine_pod` and the KV status read, in the same camelCase shape: what a
    long-lived cache of pods should hold. A Pod as served is mostly managedFields, env and spec nobody here
    reads; an operator or router holding thousands of them whole holds tens of MiB for nothing. Of what is
    kept, only the fields read: an env variable's name and literal value, a port's name and number, a
    condition's type, status, reason and message (not its times, which differ from pod to pod)."""
    metadata = _mapping(pod.get("metadata"))
    status = _mapping(pod.get("status"))
    # creationTimestamp: a rollout's progress deadline counts from the making of a step's pods.
    kept_metadata = {
        key: metadata[key]
        for key in ("name", "namespace", "annotations", "creationTimestamp", "deletionTimestamp")
        if key in metadata
    }
    # Only the project's own labels (role, deployment, revision, slot) are read; the others are for people.
    labels = _mapping(metadata.get("labels"))
    kept_metadata["labels"] = {
        key: value for key, value in labels.items() if isinstance(key, str) and key.startswith(_OWN_LABELS)
    }
    kept_containers = []
    for container in containers(pod):
        env = [_mapping(item) for item in _sequence(container.get("env"))]
        ports = [_mapping(port) for port in _sequence(container.get("ports"))]
        kept_containers.append(
            {
                "name": container.get("name"),
                "env": [_kept(item, _ENV_FIELDS) for item in env if item.get("name") in _ENV_READ],
                "ports": [_kept(port, _PORT_FIELDS) for port in ports if port.get("name") in _PORTS_READ],
            }
        )
    kept_status: dict[str, Any] = {
        "conditions": [
            _kept(condition, _CONDITION_FIELDS)
            for condition in map(_mapping, _sequence(status.get("conditions")))
            if condition.get("type") in _CONDITIONS_READ
        ]
    }
    if "podIP" in status:
        kept_status["podIP"] = status["podIP"]
    statuses = [_mapping(item) for item in _sequence(status.get("containerStatuses"))]
    if statuses:
        kept_status["containerStatuses"] = [_kept(item, _CONTAINER_STATUS_FIELDS) for item in statuses]
    return {"metadata": kept_metadata, "spec": {"containers": kept_containers}, "status": kept_status}


def engine_pod(pod: Mapping[str, Any]) -> EnginePod | None:
    """A Pod (camelCase dict, as the API serves it) as an engine pod; None for a pod that is not one.

    A prefill pod is stage `<ordinal>` of engine `<StatefulSet name>`, a decode pod is an engine of its own,
    unless the sidecar container sets `DISAGG_ENGINE_ID` / `DISAGG_PP_RANK` explicitly (the sidecar's own
    defaults). TP and PP sizes are the sidecar's `DISAGG_TENSOR_PARALLEL_SIZE` / `_PIPELINE_PARALLEL_SIZE`.
    """
    metadata = _mapping(pod.get("metadata"))
    name = metadata.get("name")
    labels = _mapping(metadata.get("labels"))
    role = labels.get(ROLE_LABEL)
    if role not in ("prefill", "decode") or not isinstance(name, str) or not name:
        return None
    items = containers(pod)
    sidecar = _named(items, SIDECAR_CONTAINER)
    ordinal = ORDINAL.match(name)
    engine_id = container_env(sidecar, ENGINE_ID_ENV) or (
        ordinal.group("base") if role == "prefill" and ordinal else name
    )
    rank = _int(container_env(sidecar, PP_RANK_ENV))
    if rank is None:
        rank = int(ordinal.group("ordinal")) if role == "prefill" and ordinal else 0
    host = _mapping(pod.get("status")).get("podIP")
    deployment = labels.get(DEPLOYMENT_LABEL)
    annotations = {
        key: value
        for key, value in _mapping(metadata.get("annotations")).items()
        if isinstance(key, str) and isinstance(value, str)
    }
    return EnginePod(
        name=name,
        deployment=deployment if isinstance(deployment, str) else "",
        role="prefill" if role == "prefill" else "decode",
        stage=rank,
        engine_id=engine_id,
        host=host if isinstance(host, str) and host else None,
        side_channel_port=side_channel_port(items),
        http_port=http_port(items),
        tp_size=max(1, _int(container_env(sidecar, TENSOR_PARALLEL_SIZE_ENV)) or 1),
        pp_size=max(1, _int(container_env(sidecar, PIPELINE_PARALLEL_SIZE_ENV)) or 1),
        ready=pod_ready(pod),
        deleting=bool(metadata.get("deletionTimestamp")),
        annotations=annotations,
        restarts=restarts(pod),
    )


def restarts(pod: Mapping[str, Any]) -> int:
    """The sum of the pod's containers' `restartCount` (a value that is not a count counts 0)."""
    total = 0
    for item in _sequence(_mapping(pod.get("status")).get("containerStatuses")):
        count = _mapping(item).get("restartCount")
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            total += count
    return total
