"""What a kubelet and a scheduler would do for a deployment's pods, on a control plane that has neither.

The local control plane (`hack/control-plane.sh`) runs no kubelet, so its Pods stay Pending. `LocalKubelet`
stands in for one, for the cluster tests and the demos: it binds each pod of one DisaggDeployment (engine
pods and the router's) to a Node object (so the pod GC accepts it), gives it its own loopback IP (`127.x.y.n`,
so every server listens on the port its spec names, as in a cluster) and writes `pods/status` as a kubelet
would: phase Running, IPs, container statuses, container readiness from their HTTP readiness probes, and
`Ready` from the containers and the pod's readiness gates (only a kubelet enforces those).

What runs depends on the images. A pod whose every container is one of the project's images (the reference
engine with its transfer sidecar, the router) runs each container's own command and arguments as a local
process, with the container's environment (downward-API values filled in), its volume mounts mapped to a
folder of the pod's (ConfigMaps written there), and the cluster DNS names of stage pods resolved to their
IPs. A pod of another engine (vLLM, whose kernels need a GPU) runs only a reporting sidecar loop in place of
its sidecar (a real NIXL agent and side channel, no engine), and its engine container is reported running.
Servers bind the pod's IP (`DISAGG_HTTP_HOST`, `DISAGG_METRICS_HOST`): here the pods share one network.

A `Fault` lets a caller start one pod's sidecar with a different view of the world (another engine version,
other layer names), the way a wrong image would, to see the sidecars refuse it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from kubernetes import client

from disagg.operator.builders.engine import ENGINE_LAUNCHER_NAME, HTTP_PORT
from disagg.rig.local import free_port
from disagg.rig.vllm_node import core_for, engine_process, pinned, serves_http
from disagg.worker.connector.transport import LOOPBACK_UCX_ENV
from disagg.worker.contracts.pod_contract import (
    COMPATIBILITY_HASH_ENV,
    DEFAULT_SIDE_CHANNEL_PORT,
    DEPLOYMENT_LABEL,
    ENGINE_CONTAINER,
    ENGINE_SOCKET_ENV,
    ENGINE_WORKERS_ENV,
    HTTP_HOST_ENV,
    KV_POOL_ENV,
    METRICS_HOST_ENV,
    PIPELINE_PARALLEL_SIZE_ENV,
    POD_NAME_ENV,
    ROLE_ENV,
    ROLE_LABEL,
    SIDE_CHANNEL_PORT_ENV,
    SIDECAR_CONTAINER,
)
from disagg.worker.reporting.pod_report import rfc3339

NODE: Final = "disagg-local-node"
FIELD_MANAGER: Final = "disagg-local-kubelet"

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


def expanded_env(pod: Mapping[str, Any], container: Mapping[str, Any]) -> dict[str, str]:
    """`resolve_env`, with Kubernetes' `$(NAME)` expansion of each value from the variables before it."""
    env: dict[str, str] = {}
    for key, value in resolve_env(pod, container).items():
        env[key] = expand(value, env)
    return env


def pod_ready(pod: Mapping[str, Any], containers_ready: bool) -> bool:
    """The kubelet's rule: every container ready and every readiness gate's condition True."""
    conditions = {c.get("type"): c.get("status") for c in (pod.get("status") or {}).get("conditions") or ()}
    gates = [g["conditionType"] for g in (pod.get("spec") or {}).get("readinessGates") or ()]
    return containers_ready and all(conditions.get(gate) == "True" for gate in gates)


PROJECT_IMAGES: Final = frozenset({"disagg", "disagg-transfer"})
"""The last path component of the project's image repositories (any registry, any tag)."""
DEFAULT_ENTRYPOINT: Final = ("disagg",)
"""The project images' entry point, used when a container names no command."""
STAND_IN_LOG: Final = "sidecar.log"
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)|\$\$")
_POD_DNS = re.compile(r"\b([a-z0-9]([-a-z0-9]*[a-z0-9])?)\.[a-z0-9-]+\.[a-z0-9-]+\.svc(\.cluster\.local)?\b")


def runs_vllm(container: Mapping[str, Any]) -> bool:
    """Whether a container is a vLLM engine as the operator builds one: its command is the launcher that
    ends in `vllm serve` (named `ENGINE_LAUNCHER_NAME`), whatever its image is called."""
    command: Sequence[str] = container.get("command") or ()
    return bool(command) and command[-1] == ENGINE_LAUNCHER_NAME


def is_project_image(image: str) -> bool:
    repository = image.split("@", 1)[0].rsplit("/", 1)[-1]
    return repository.split(":", 1)[0] in PROJECT_IMAGES


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(NAME)` expansion of command and args: unknown names stay as written, `$$` is `$`."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR.sub(one, value)


def pod_dns_to_ip(text: str, ip_of: Callable[[str], str]) -> str:
    """The cluster DNS's part: a pod's `<pod>.<service>.<namespace>.svc` name becomes `ip_of(pod)`."""
    return _POD_DNS.sub(lambda match: ip_of(match.group(1)), text)


@dataclass
class LocalPod:
    name: str
    ip: str
    workdir: Path
    processes: dict[str, subprocess.Popen[bytes]]
    """By container name; a stand-in pod has one, named after its log (`STAND_IN_LOG`)."""
    probes: dict[str, Readiness] = field(default_factory=dict)
    fault: Fault | None = None
    role: str = ""
    """Its `disagg.io/role` label, once a vLLM engine of it runs (the decoders' cores are taken in turn)."""
    sessions: set[str] = field(default_factory=set)
    """Containers started in a session of their own (vLLM engines): a stop signals the whole group."""

    def exited(self) -> list[tuple[str, int]]:
        return [
            (container, code)
            for container, process in self.processes.items()
            if (code := process.poll()) is not None and code != 0
        ]

    def running(self, container: str | None = None) -> bool:
        chosen = self.processes.values() if container is None else [self.processes[container]]
        return all(process.poll() is None for process in chosen)

    def ready(self, container: str) -> bool:
        probe = self.probes.get(container)
        return self.running(container) and (probe is None or probe.ready())


@dataclass
class Readiness:
    """A container's readiness as a kubelet keeps it: Ready after a successful probe, unready again only
    after `failure_threshold` failures in a row (the probe's `failureThreshold`), so one probe that times
    out on a loaded machine does not take the pod out of its Services."""

    probe: Callable[[], bool]
    failure_threshold: int = 3
    _ready: bool = False
    _failures: int = 0

    def ready(self) -> bool:
        if self.probe():
            self._ready, self._failures = True, 0
        else:
            self._failures += 1
            if self._failures >= self.failure_threshold:
                self._ready = False
        return self._ready


def http_probe(host: str, port: int, path: str, timeout_s: float = 1.0) -> Callable[[], bool]:
    """A kubelet's httpGet probe: any status from 200 to 399 within `timeout_s` (the probe's
    `timeoutSeconds`, 1 by default) is a success."""

    def probe() -> bool:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=timeout_s) as response:
                return 200 <= int(response.status) < 400
        except (OSError, ValueError):
            return False

    return probe


def vllm_health(ip: str, timeout_s: float = 1.0) -> Callable[[], bool]:
    """vLLM's own health endpoint on an engine pod's HTTP port, probed as a kubelet would."""
    return http_probe(ip, HTTP_PORT, "/health", timeout_s)


def readiness(host: str, port: int, spec: Mapping[str, Any]) -> Readiness:
    """The kubelet's readiness of a container with readinessProbe `spec` (its httpGet part at `port`)."""
    probe = http_probe(host, port, spec["httpGet"].get("path", "/"), float(spec.get("timeoutSeconds") or 1))
    return Readiness(probe, int(spec.get("failureThreshold") or 3))


@dataclass
class LocalKubelet:
    """Plays kubelet for every pod of one DisaggDeployment in one namespace; call `sync()` periodically."""

    api: client.ApiClient
    kubeconfig: Path
    """The processes' credentials: where a pod would mount its service account token."""
    namespace: str
    deployment: str
    workdir: Path
    command: tuple[str, ...] = (
        sys.executable,
        "-m",
        "disagg.rig.status_sidecar",
        "--interval",
        "1",
    )
    """What runs in place of the sidecar of a pod whose engine is not the project's."""
    faults: dict[str, Fault] = field(default_factory=dict)
    pods: dict[str, LocalPod] = field(default_factory=dict)
    ips: dict[str, str] = field(default_factory=dict)
    """Pod IPs by pod name: a restarted pod keeps its IP, as a restarted container does."""
    new_pod_fault: Fault | None = None
    """Applied to every pod started from now on that has no fault of its own (a new version rolling out)."""
    vllm: bool = False
    """Run vLLM engine containers as real vLLM engines (`vllm_node`, the engine venv), each beside its
    watch sidecar, instead of a stand-in for the pod."""
    _rendezvous_ports: dict[str, int] = field(default_factory=dict)
    _volumes: Path | None = None
    _subnet: str = field(default_factory=lambda: f"127.{secrets.randbelow(250) + 1}.{secrets.randbelow(250)}")
    _next_host: int = 1

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api)

    # -- the loop --------------------------------------------------------------------------------------------

    def sync(self) -> None:
        """Start new pods, stop deleted ones, keep every pod's status kubelet-like."""
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
                try:
                    local = self._start(pod)
                except client.ApiException as error:
                    # Deleted since the list (404), or being deleted (409: "cannot be assigned to a host"):
                    # a replacement a ReplicaSet made and removed at once (a rollout step deletes a chosen
                    # pod, then scales its Deployment down). The next sync sees it go, or (a 409 because
                    # it is bound already) starts it.
                    if error.status not in (404, 409):
                        raise
                    continue
            elif failed := local.exited():
                container, code = failed[0]
                raise SidecarExited(
                    f"container {container} of pod {name} exited with {code}; "
                    f"logs in {local.workdir}:\n{self.log_tail(name)}"
                )
            try:
                self._write_status(pod, local)
            except client.ApiException as error:
                # Deleted since the list (a rollout step or the planner removed it): the next sync stops it.
                if error.status != 404:
                    raise
        for name in set(self.pods) - seen:
            self._stop(name)

    def restart(self, name: str, fault: Fault | None = None) -> None:
        """Restart one pod's processes with `fault` applied (or none): the next `sync()` starts them again."""
        if fault is None:
            self.faults.pop(name, None)
        else:
            self.faults[name] = fault
        self._stop(name)

    def stop_all(self) -> None:
        # Signal every process first: one stopped alone would wait out handshakes with peers already gone.
        for local in self.pods.values():
            for process in local.processes.values():
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
        for name in list(self.pods):
            self._stop(name)
        if self._volumes is not None:
            shutil.rmtree(self._volumes, ignore_errors=True)
            self._volumes = None

    def log_tail(self, name: str, lines: int = 40) -> str:
        local = self.pods.get(name)
        folder = local.workdir if local else self.workdir / name
        tails = []
        for path in sorted(folder.glob("*.log")) if folder.is_dir() else ():
            text = "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            tails.append(text if path.name == STAND_IN_LOG else f"--- {path.stem}\n{text}")
        return "\n".join(tails)

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
        """A vLLM engine's head serves every stage's payload itself (EngineCore collects them); a stand-in
        pod is a disagg worker in place of its engine, so its head is told the stage pods to republish."""
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

    def _resolve_dns(self, text: str) -> str:
        """The cluster DNS's part: a stage pod's `<pod>.<service>.<namespace>.svc` name is its loopback IP."""
        return pod_dns_to_ip(text, self._ip)

    def _config_maps(self, pod: Mapping[str, Any]) -> dict[str, dict[str, str]]:
        """The data of every ConfigMap volume of the pod, by volume name."""
        found: dict[str, dict[str, str]] = {}
        for volume in (pod.get("spec") or {}).get("volumes") or ():
            source = (volume.get("configMap") or {}).get("name")
            if source:
                data = _json(
                    self.core.read_namespaced_config_map(source, self.namespace, _preload_content=False)
                )
                found[volume["name"]] = dict(data.get("data") or {})
        return found

    def _start(self, pod: dict[str, Any]) -> LocalPod:
        name = pod["metadata"]["name"]
        if not (pod.get("spec") or {}).get("nodeName"):
            self._bind(pod)
            pod = {**pod, "spec": {**pod["spec"], "nodeName": NODE}}
        ip = self._ip(name)
        pod = {**pod, "status": {**(pod.get("status") or {}), "podIP": ip}}
        workdir = self.workdir / name
        workdir.mkdir(parents=True, exist_ok=True)
        fault = (
            self.faults.setdefault(name, self.new_pod_fault) if self.new_pod_fault else self.faults.get(name)
        )
        # Every volume is a folder of the pod's; a ConfigMap's keys are files in it (faults edit the copy).
        volumes: dict[str, Path] = {}
        # Under a short root: the engine socket lives in a volume, and a Unix socket path has 107 bytes.
        root = self._volumes_root() / ip
        shutil.rmtree(root, ignore_errors=True)  # a new pod's emptyDirs are empty
        for volume in (pod.get("spec") or {}).get("volumes") or ():
            volumes[volume["name"]] = root / volume["name"]
            volumes[volume["name"]].mkdir(parents=True, exist_ok=True)
        containers = pod["spec"]["containers"]
        sidecar = next((c for c in containers if c["name"] == SIDECAR_CONTAINER), None)
        # A fault edits the sidecar's environment (it may read the pod's role there); what it changes, every
        # container of the pod gets.
        sidecar_env = resolve_env(pod, sidecar) if sidecar is not None else {}
        faulted = dict(sidecar_env)
        for volume, documents in self._config_maps(pod).items():
            for key, text in documents.items():
                if fault is not None:
                    document = json.loads(text)
                    fault(document, faulted)
                    text = json.dumps(document, indent=2)
                (volumes[volume] / key).write_text(text)
        fault_env = {key: value for key, value in faulted.items() if sidecar_env.get(key) != value}
        local = LocalPod(name, ip, workdir, {}, fault=fault)
        if all(is_project_image(c.get("image", "")) for c in containers):
            for container in containers:
                self._run_container(pod, container, local, volumes, fault_env)
        elif self.vllm and all(is_project_image(c.get("image", "")) or runs_vllm(c) for c in containers):
            for container in containers:
                if is_project_image(container.get("image", "")):
                    self._run_container(pod, container, local, volumes, fault_env)
                else:
                    self._run_vllm(pod, container, local, fault_env)
        else:
            if sidecar is None:
                raise ValueError(f"pod {name} has no {SIDECAR_CONTAINER} container to stand in for")
            env, _ = self._pod_env(pod, sidecar, local, volumes)
            env = self._engine_workers(env)
            env = {**env, **fault_env}
            local.processes[STAND_IN_LOG] = self._spawn(
                list(self.command), env, workdir / STAND_IN_LOG, workdir
            )
        self.pods[name] = local
        return local

    def _volumes_root(self) -> Path:
        if self._volumes is None:
            shm = Path("/dev/shm")
            self._volumes = Path(tempfile.mkdtemp(prefix="disagg-pods-", dir=shm if shm.is_dir() else None))
        return self._volumes

    def _pod_env(
        self,
        pod: Mapping[str, Any],
        container: Mapping[str, Any],
        local: LocalPod,
        volumes: Mapping[str, Path],
    ) -> tuple[dict[str, str], dict[str, Path]]:
        """The container's environment here, and its mounts (mount path to the pod's folder)."""
        env = resolve_env(pod, container)
        mounts = {
            m["mountPath"].rstrip("/"): volumes[m["name"]]
            for m in container.get("volumeMounts") or ()
            if m.get("name") in volumes
        }

        def local_path(value: str) -> str:
            for mount, folder in sorted(mounts.items(), key=lambda item: -len(item[0])):
                if value == mount or value.startswith(mount + "/"):
                    return str(folder) + value[len(mount) :]
            return value

        env = {key: local_path(self._resolve_dns(value)) for key, value in env.items()}
        # The engine and its sidecar meet at one socket in the pod's shared memory, as in the pod.
        shm = mounts.get("/dev/shm", local.workdir)
        env[ENGINE_SOCKET_ENV] = (
            local_path(env[ENGINE_SOCKET_ENV])
            if ENGINE_SOCKET_ENV in env
            else str(shm / "disagg-engine.sock")
        )
        # So does the KV pool the engine creates: its default file in /dev/shm would be every local pod's.
        env.setdefault(KV_POOL_ENV, str(shm / "disagg-kv.pool"))
        env[METRICS_HOST_ENV] = local.ip
        env[HTTP_HOST_ENV] = local.ip
        return env, mounts

    def _run_container(
        self,
        pod: Mapping[str, Any],
        container: Mapping[str, Any],
        local: LocalPod,
        volumes: Mapping[str, Path],
        fault_env: Mapping[str, str],
    ) -> None:
        env, mounts = self._pod_env(pod, container, local, volumes)
        # A fault stands for another image: every container of the pod sees what it changed.
        env = {**env, **fault_env}
        argv = [
            expand(part, env)
            for part in [*(container.get("command") or DEFAULT_ENTRYPOINT), *(container.get("args") or ())]
        ]

        def local_arg(value: str) -> str:
            value = self._resolve_dns(value)
            for mount, folder in sorted(mounts.items(), key=lambda item: -len(item[0])):
                if value.startswith(mount + "/"):
                    return str(folder) + value[len(mount) :]
            return value

        argv = self._rendezvous(argv)
        argv = [local_arg(part) for part in argv]
        if argv[0] == "disagg":
            argv[0] = str(Path(sys.executable).with_name("disagg"))
        log = local.workdir / f"{container['name']}.log"
        local.processes[container["name"]] = self._spawn(argv, env, log, local.workdir)
        probe = container.get("readinessProbe") or {}
        if probe.get("httpGet"):
            port = _port_of(container, probe["httpGet"]["port"])
            local.probes[container["name"]] = readiness(local.ip, port, probe)

    def _run_vllm(
        self,
        pod: Mapping[str, Any],
        container: Mapping[str, Any],
        local: LocalPod,
        fault_env: Mapping[str, str],
    ) -> None:
        """A vLLM engine container as the node runs it (`vllm_node.engine_process`), on its pod's core."""
        env = expanded_env(pod, container)
        argv = [
            self._resolve_dns(expand(part, env))
            for part in [*(container.get("command") or ()), *(container.get("args") or ())]
        ]
        argv = self._rendezvous(argv)
        # A fault stands for an engine started otherwise than the spec says (another dtype, another build):
        # vLLM reads the last of a repeated flag.
        argv += fault_env.get(ENGINE_ARGS_FAULT_ENV, "").split()
        role = (pod["metadata"].get("labels") or {}).get(ROLE_LABEL, "")
        decoders = sum(1 for p in self.pods.values() if p.role == "decode")
        core = core_for(role, decoders, sorted(os.sched_getaffinity(0)))
        argv, env = engine_process(argv, env, local.ip, core)
        local.role = role
        log = local.workdir / f"{container['name']}.log"
        local.processes[container["name"]] = self._spawn(argv, env, log, local.workdir, preexec=pinned(core))
        local.sessions.add(container["name"])
        probe = container.get("readinessProbe") or {}
        if probe.get("httpGet"):
            port = _port_of(container, probe["httpGet"]["port"])
            local.probes[container["name"]] = readiness(local.ip, port, probe)
        elif serves_http(role, pod["metadata"]["name"]):
            local.probes[container["name"]] = Readiness(vllm_health(local.ip))

    def _rendezvous(self, argv: list[str]) -> list[str]:
        """torch's rendezvous store on a PP head listens on every address: in pods each engine has its own
        network, here they share one, so each engine (its head's address) gets a port of its own."""
        if "--master-port" not in argv or "--master-addr" not in argv:
            return argv
        head = argv[argv.index("--master-addr") + 1]
        at = argv.index("--master-port") + 1
        port = self._rendezvous_ports.setdefault(head, free_port())
        return [*argv[:at], str(port), *argv[at + 1 :]]

    def _spawn(
        self,
        argv: list[str],
        env: Mapping[str, str],
        log: Path,
        cwd: Path,
        preexec: Callable[[], None] | None = None,
    ) -> subprocess.Popen[bytes]:
        process_env = {
            **{k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")},
            **env,
            # Every local pod shares this host's loopback; UCX would otherwise stripe over every interface.
            **LOOPBACK_UCX_ENV,
            "KUBECONFIG": str(self.kubeconfig),
            "PYTHONSAFEPATH": "1",
        }
        with log.open("ab") as out:
            return subprocess.Popen(
                argv,
                env=process_env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=preexec,
                # vLLM's engine starts processes of its own: a stop must reach them too.
                start_new_session=preexec is not None,
            )

    def _stop(self, name: str) -> None:
        """The engine first, then the other containers: the sidecar must outlive the requests the engine
        drains at SIGTERM (as Kubernetes' native sidecar containers, which stop after the main ones)."""
        local = self.pods.pop(name, None)
        if local is None:
            return
        engine = [(c, p) for c, p in local.processes.items() if c == ENGINE_CONTAINER]
        others = [(c, p) for c, p in local.processes.items() if c != ENGINE_CONTAINER]
        for group in (engine, others):
            for container, process in group:
                if process.poll() is None:
                    _signal(process, signal.SIGTERM, container in local.sessions)
            for container, process in group:
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    _signal(process, signal.SIGKILL, container in local.sessions)
                    process.wait(timeout=20)
                if container in local.sessions:
                    # A vLLM engine's own processes (EngineCore, workers) must not outlive it.
                    _signal(process, signal.SIGKILL, True)

    def _force_delete(self, name: str) -> None:
        try:
            self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)
        except client.ApiException as exc:
            if exc.status != 404:
                raise

    def _write_status(self, pod: Mapping[str, Any], local: LocalPod) -> None:
        status = pod.get("status") or {}
        now = rfc3339(datetime.now(UTC))
        names = [c["name"] for c in pod["spec"]["containers"]]
        stand_in = STAND_IN_LOG in local.processes
        running = {n: local.running(None if stand_in else n) for n in names}
        ready = {n: running[n] if stand_in else local.ready(n) for n in names}
        pod_is_ready = pod_ready(pod, all(ready.values()))
        current = {c.get("type"): c for c in status.get("conditions") or ()}

        def condition(type_: str, value: bool) -> dict[str, Any]:
            text = "True" if value else "False"
            previous = current.get(type_) or {}
            since = previous.get("lastTransitionTime") if previous.get("status") == text else now
            return {"type": type_, "status": text, "lastTransitionTime": since or now}

        wanted_conditions = [
            condition("PodScheduled", True),
            condition("Initialized", True),
            condition("ContainersReady", all(ready.values())),
            condition("Ready", pod_is_ready),
        ]
        started = status.get("startTime") or now
        containers = [
            {
                "name": c["name"],
                "image": c["image"],
                "imageID": "",
                "ready": ready[c["name"]],
                "started": running[c["name"]],
                "restartCount": 0,
                "state": {"running": {"startedAt": started}}
                if running[c["name"]]
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
            and [s.get("ready") for s in status.get("containerStatuses") or ()] == [ready[n] for n in names]
        )
        if unchanged:
            return
        self.core.patch_namespaced_pod_status(
            pod["metadata"]["name"], self.namespace, {"status": patch}, field_manager=FIELD_MANAGER
        )


@dataclass
class KubeletLoop:
    """Runs `sync()` of a kubelet (and anything else, e.g. a `ServiceProxy`) every `interval_s` in a thread,
    so a caller can block (a curl, a load run) while the pods keep their status. The first error stops the
    loop; `check()` and `stop()` raise it."""

    steps: Sequence[Callable[[], None]]
    interval_s: float = 0.5
    _stop: threading.Event = field(default_factory=threading.Event)
    _error: BaseException | None = None
    _thread: threading.Thread | None = None

    def start(self) -> KubeletLoop:
        self._thread = threading.Thread(target=self._run, name="local-kubelet", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for step in self.steps:
                    step()
            except BaseException as exc:  # handed to the caller by check() and stop()
                self._error = exc
                return
            self._stop.wait(self.interval_s)

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.check()


def with_engine_hash(role: str, compat_hash: str) -> Fault:
    """A sidecar whose engine advertises another compatibility hash (e.g. another engine version)."""

    def fault(document: dict[str, Any], env: dict[str, str]) -> None:
        document.setdefault("compatibilityHashes", {})[role] = compat_hash
        env[COMPATIBILITY_HASH_ENV] = compat_hash

    return fault


def _port_of(container: Mapping[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(int(p["containerPort"]) for p in container.get("ports") or () if p.get("name") == port)


def _signal(process: subprocess.Popen[bytes], sig: signal.Signals, group: bool) -> None:
    """To the process, or to its whole group (`group`: a vLLM engine started in a session of its own)."""
    try:
        if group:
            os.killpg(process.pid, sig)
        elif process.poll() is None:
            process.send_signal(sig)
    except ProcessLookupError:
        pass


ENGINE_ARGS_FAULT_ENV: Final = "DISAGG_RIG_ENGINE_ARGS"


def with_engine_args(*args: str) -> Fault:
    """A vLLM engine started with `args` after the operator's (e.g. `--dtype bfloat16`: a decoder whose image
    or wrapper runs another dtype than the spec says, which only the live handshake can tell)."""

    def fault(document: dict[str, Any], env: dict[str, str]) -> None:
        env[ENGINE_ARGS_FAULT_ENV] = " ".join(args)

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
