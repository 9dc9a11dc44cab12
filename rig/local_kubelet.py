"""What a kubelet and a scheduler would do for a deployment's pods, on a control plane that has neither.

The local control plane (`hack/control-plane.sh`) runs no kubelet, so its Pods stay Pending. `LocalKubelet`
stands in for one, for the cluster tests and the control-plane demo: it binds each engine pod to a Node
object (so the pod GC and Endpoints accept it), gives it its own loopback IP (`127.x.y.n`, so every pod's
side channel listens on the port its spec names, as in a cluster), starts the pod's KV sidecar as a local
process with the pod's downward-API environment and its topology ConfigMap written where the pod would
mount it, and writes `pods/status` as a kubelet would: phase Running, IPs, container statuses, and `Ready`
computed from the containers and the pod's readiness gates (only a kubelet enforces those).
No engine runs: the engine container is reported running, so the sidecar's condition decides readiness.

A `Fault` lets a caller start one pod's sidecar with a different view of the world (another engine version,
other layer names), the way a wrong image would, to see the sidecars refuse it.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from kubernetes import client

from disagg.worker.connector.transport import LOOPBACK_UCX_ENV
from disagg.worker.kv.pod_contract import (
    COMPATIBILITY_HASH_ENV,
    DEFAULT_SIDE_CHANNEL_PORT,
    DEPLOYMENT_LABEL,
    ENGINE_SIDE_CHANNEL_HOST_ENV,
    ENGINE_SOCKET_ENV,
    ENGINE_WORKERS_ENV,
    METRICS_HOST_ENV,
    PIPELINE_PARALLEL_SIZE_ENV,
    POD_NAME_ENV,
    ROLE_ENV,
    SIDE_CHANNEL_PORT_ENV,
    SIDECAR_CONTAINER,
    TOPOLOGY_FILE_ENV,
)
from disagg.worker.reporting.pod_report import rfc3339

NODE: Final = "disagg-local-node"
FIELD_MANAGER: Final = "disagg-local-kubelet"
TOPOLOGY_VOLUME: Final = "topology"

Fault = Callable[[dict[str, Any], dict[str, str]], None]
"""Edits a copy of the pod's topology document and sidecar environment before its sidecar starts."""


class SidecarExited(RuntimeError):
    """A pod's sidecar process failed (its log tail is in the message); a kubelet would restart it."""


def _json(response: Any) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(response.data)
    return body


def resolve_env(pod: Mapping[str, Any], container: Mapping[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet gives it: literal values and downward-API field refs."""
    fields = {
        "metadata.name": pod["metadata"]["name"],
        "metadata.namespace": pod["metadata"]["namespace"],
        "metadata.uid": pod["metadata"].get("uid", ""),
        "status.podIP": (pod.get("status") or {}).get("podIP", ""),
        "spec.nodeName": (pod.get("spec") or {}).get("nodeName", ""),
    }
    env: dict[str, str] = {}
    for item in container.get("env") or ():
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        ref = ((item.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        if ref not in fields:
            raise ValueError(f"env {item['name']} of {pod['metadata']['name']}: unsupported source {item}")
        env[item["name"]] = str(fields[ref])
    return env


def pod_ready(pod: Mapping[str, Any], containers_ready: bool) -> bool:
    """The kubelet's rule: every container ready and every readiness gate's condition True."""
    conditions = {c.get("type"): c.get("status") for c in (pod.get("status") or {}).get("conditions") or ()}
    gates = [g["conditionType"] for g in (pod.get("spec") or {}).get("readinessGates") or ()]
    return containers_ready and all(conditions.get(gate) == "True" for gate in gates)


@dataclass
class LocalPod:
    name: str
    ip: str
    workdir: Path
    process: subprocess.Popen[bytes]
    fault: Fault | None = None


@dataclass
class LocalKubelet:
    """Plays kubelet for every pod of one DisaggDeployment in one namespace; call `sync()` periodically."""

    api: client.ApiClient
    kubeconfig: Path
    """The sidecars' credentials: where a pod would mount its service account token."""
    namespace: str
    deployment: str
    workdir: Path
    command: tuple[str, ...] = (
        sys.executable,
        "-m",
        "disagg.worker.reporting.status_loop",
        "--interval",
        "1",
    )
    faults: dict[str, Fault] = field(default_factory=dict)
    pods: dict[str, LocalPod] = field(default_factory=dict)
    ips: dict[str, str] = field(default_factory=dict)
    """Pod IPs by pod name: a restarted sidecar keeps its pod's IP, as a restarted container does."""
    _subnet: str = field(default_factory=lambda: f"127.{secrets.randbelow(250) + 1}.{secrets.randbelow(250)}")
    _next_host: int = 1

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api)

    # -- the loop --------------------------------------------------------------------------------------------

    def sync(self) -> None:
        """Start sidecars for new pods, stop them for deleted ones, keep every pod's status kubelet-like."""
        listed = _json(
            self.core.list_namespaced_pod(
                self.namespace, label_selector=f"{DEPLOYMENT_LABEL}={self.deployment}", _preload_content=False
            )
        )["items"]
        seen = set()
        for pod in listed:
            name = pod["metadata"]["name"]
            seen.add(name)
            if pod["metadata"].get("deletionTimestamp"):
                self._stop(name)
                # A kubelet confirms a graceful delete once the containers are gone; nothing else would.
                self._force_delete(name)
                continue
            local = self.pods.get(name)
            if local is None:
                local = self._start(pod)
            elif local.process.poll() is not None and local.process.returncode != 0:
                raise SidecarExited(
                    f"the sidecar of pod {name} exited with {local.process.returncode}; "
                    f"log: {local.workdir / 'sidecar.log'}:\n{self.log_tail(name)}"
                )
            self._write_status(pod, local)
        for name in set(self.pods) - seen:
            self._stop(name)

    def restart(self, name: str, fault: Fault | None = None) -> None:
        """Restart one pod's sidecar, with `fault` applied (or none): the next `sync()` starts it again."""
        if fault is None:
            self.faults.pop(name, None)
        else:
            self.faults[name] = fault
        self._stop(name)

    def stop_all(self) -> None:
        # Signal every sidecar first: one stopped alone would wait out handshakes with peers already gone.
        for local in self.pods.values():
            if local.process.poll() is None:
                local.process.send_signal(signal.SIGTERM)
        for name in list(self.pods):
            self._stop(name)

    def log_tail(self, name: str, lines: int = 40) -> str:
        local = self.pods.get(name)
        path = (local.workdir if local else self.workdir / name) / "sidecar.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # -- steps -----------------------------------------------------------------------------------------------

    def _ensure_node(self) -> None:
        try:
            self.core.read_node(NODE)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            try:
                self.core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=NODE)))
            except client.ApiException as create_exc:
                if create_exc.status != 409:
                    raise

    def _bind(self, pod: Mapping[str, Any]) -> None:
        self._ensure_node()
        binding = client.V1Binding(
            metadata=client.V1ObjectMeta(name=pod["metadata"]["name"]),
            target=client.V1ObjectReference(api_version="v1", kind="Node", name=NODE),
        )
        # The client parses the Status the server answers as a V1Binding and fails, so skip the parse.
        self.core.create_namespaced_pod_binding(
            pod["metadata"]["name"], self.namespace, binding, _preload_content=False
        )

    def _ip(self, name: str) -> str:
        if name not in self.ips:
            self.ips[name] = f"{self._subnet}.{self._next_host}"
            self._next_host += 1
        return self.ips[name]

    def _engine_workers(self, env: dict[str, str]) -> dict[str, str]:
        """A vLLM engine's head serves every stage's payload itself (EngineCore collects them); each local
        pod is a disagg worker standing in for its engine, so its head is told the stage pods to republish."""
        pp = int(env.get(PIPELINE_PARALLEL_SIZE_ENV) or 1)
        name = env.get(POD_NAME_ENV, "")
        base, _, ordinal = name.rpartition("-")
        if env.get(ROLE_ENV) != "prefill" or pp == 1 or ordinal != "0" or env.get(ENGINE_WORKERS_ENV):
            return env
        port = int(env.get(SIDE_CHANNEL_PORT_ENV) or DEFAULT_SIDE_CHANNEL_PORT)
        workers = [
            {"ppRank": k, "tpRank": 0, "host": self._ip(f"{base}-{k}"), "port": port} for k in range(1, pp)
        ]
        return {**env, ENGINE_WORKERS_ENV: json.dumps(workers)}

    def _resolve_dns(self, env: dict[str, str]) -> dict[str, str]:
        """The cluster DNS's part: a stage pod's `<pod>.<service>.<namespace>.svc` name is its loopback IP."""

        def ip_of(host: str) -> str:
            return self._ip(host.split(".", 1)[0]) if host.endswith(".svc") else host

        if env.get(ENGINE_SIDE_CHANNEL_HOST_ENV):
            env[ENGINE_SIDE_CHANNEL_HOST_ENV] = ip_of(env[ENGINE_SIDE_CHANNEL_HOST_ENV])
        if env.get(ENGINE_WORKERS_ENV):
            workers = json.loads(env[ENGINE_WORKERS_ENV])
            env[ENGINE_WORKERS_ENV] = json.dumps([{**w, "host": ip_of(w["host"])} for w in workers])
        return env

    def _topology(self, pod: Mapping[str, Any]) -> dict[str, Any]:
        volumes = (pod.get("spec") or {}).get("volumes") or ()
        source = next(v["configMap"]["name"] for v in volumes if v.get("name") == TOPOLOGY_VOLUME)
        data = _json(self.core.read_namespaced_config_map(source, self.namespace, _preload_content=False))
        documents: dict[str, Any] = data.get("data") or {}
        return documents

    def _start(self, pod: dict[str, Any]) -> LocalPod:
        name = pod["metadata"]["name"]
        if not (pod.get("spec") or {}).get("nodeName"):
            self._bind(pod)
            pod = {**pod, "spec": {**pod["spec"], "nodeName": NODE}}
        ip = self._ip(name)
        pod = {**pod, "status": {**(pod.get("status") or {}), "podIP": ip}}
        container = next(c for c in pod["spec"]["containers"] if c["name"] == SIDECAR_CONTAINER)
        env = self._resolve_dns(self._engine_workers(resolve_env(pod, container)))
        workdir = self.workdir / name
        workdir.mkdir(parents=True, exist_ok=True)
        documents = self._topology(pod)
        fault = self.faults.get(name)
        for key, text in documents.items():
            document = json.loads(text)
            if fault is not None:
                fault(document, env)
            (workdir / key).write_text(json.dumps(document, indent=2))
        # The pod mounts the ConfigMap at the folder the env names; here that folder is the pod's workdir.
        env[TOPOLOGY_FILE_ENV] = str(workdir / Path(env[TOPOLOGY_FILE_ENV]).name)
        env[ENGINE_SOCKET_ENV] = str(workdir / "engine.sock")
        env[METRICS_HOST_ENV] = ip
        process_env = {
            **{k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")},
            **env,
            # Every local pod shares this host's loopback; UCX would otherwise stripe over every interface.
            **LOOPBACK_UCX_ENV,
            "KUBECONFIG": str(self.kubeconfig),
            "PYTHONSAFEPATH": "1",
        }
        with (workdir / "sidecar.log").open("ab") as log:
            process = subprocess.Popen(
                list(self.command),
                env=process_env,
                cwd=workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        local = LocalPod(name, ip, workdir, process, fault)
        self.pods[name] = local
        return local

    def _stop(self, name: str) -> None:
        local = self.pods.pop(name, None)
        if local is None or local.process.poll() is not None:
            return
        local.process.send_signal(signal.SIGTERM)
        try:
            local.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            local.process.kill()
            local.process.wait(timeout=20)

    def _force_delete(self, name: str) -> None:
        try:
            self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)
        except client.ApiException as exc:
            if exc.status != 404:
                raise

    def _write_status(self, pod: Mapping[str, Any], local: LocalPod) -> None:
        status = pod.get("status") or {}
        now = rfc3339(datetime.now(UTC))
        running = local.process.poll() is None
        ready = pod_ready(pod, running)
        current = {c.get("type"): c for c in status.get("conditions") or ()}

        def condition(type_: str, value: bool) -> dict[str, Any]:
            text = "True" if value else "False"
            previous = current.get(type_) or {}
            since = previous.get("lastTransitionTime") if previous.get("status") == text else now
            return {"type": type_, "status": text, "lastTransitionTime": since or now}

        wanted_conditions = [
            condition("PodScheduled", True),
            condition("Initialized", True),
            condition("ContainersReady", running),
            condition("Ready", ready),
        ]
        started = status.get("startTime") or now
        containers = [
            {
                "name": c["name"],
                "image": c["image"],
                "imageID": "",
                "ready": running,
                "started": running,
                "restartCount": 0,
                "state": {"running": {"startedAt": started}}
                if running
                else {"waiting": {"reason": "Starting"}},
            }
            for c in pod["spec"]["containers"]
        ]
        patch = {
            "phase": "Running",
            "hostIP": "127.0.0.1",
            "podIP": local.ip,
            "podIPs": [{"ip": local.ip}],
            "startTime": started,
            "conditions": wanted_conditions,
            "containerStatuses": containers,
        }
        unchanged = (
            status.get("phase") == "Running"
            and status.get("podIP") == local.ip
            and all((current.get(c["type"]) or {}).get("status") == c["status"] for c in wanted_conditions)
            and [s.get("ready") for s in status.get("containerStatuses") or ()] == [running] * len(containers)
        )
        if unchanged:
            return
        self.core.patch_namespaced_pod_status(
            pod["metadata"]["name"], self.namespace, {"status": patch}, field_manager=FIELD_MANAGER
        )


def with_engine_hash(role: str, compat_hash: str) -> Fault:
    """A sidecar whose engine advertises another compatibility hash (e.g. another engine version)."""

    def fault(document: dict[str, Any], env: dict[str, str]) -> None:
        document.setdefault("compatibilityHashes", {})[role] = compat_hash
        env[COMPATIBILITY_HASH_ENV] = compat_hash

    return fault


def with_layer_names(template: str) -> Fault:
    """A sidecar whose engine names its layers by another template (another model build)."""

    def fault(document: dict[str, Any], env: dict[str, str]) -> None:
        document["model"]["layerNameTemplate"] = template
        for stage in document.get("stages") or ():
            if "layers" in stage:
                stage["layers"] = [
                    template.format(i=i) for i in range(stage["startLayer"], stage["endLayer"])
                ]

    return fault
