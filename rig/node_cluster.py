"""The real one-node cluster (`hack/node.sh`) as programs use it, and the user's path onto it.

`NodeCluster` runs kubectl, helm, skopeo and containerd's `ctr` against the node; `push_images` and
`helm_install` do what the README tells a platform engineer to do: push both images (`skopeo copy`) to the
node's registry and `helm install` the chart with those repositories (then `kubectl apply` a sample).
Nothing here plays a part of the cluster: the kubelet runs the pods, kube-proxy serves the Services, the
registry serves the images.
"""

from __future__ import annotations

import fcntl
import json
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from disagg.rig.demo_serving import ROUTABLE, curl_command, sse_text
from disagg.rig.local import REPO

SCRIPT = REPO / "hack" / "node.sh"
IMAGES = REPO / "build" / "images"
CHART = REPO / "charts" / "disagg"
RELEASE = "disagg"
OPERATOR_NAMESPACE = "disagg-system"
# The node is one per machine (fixed ports, one bridge): whoever brings it up, uses it or takes it down holds
# this lock (`flock` takes the same one from a shell), so a demo and a test run never share it by accident.
LOCK = Path("/tmp/disagg-node.lock")


class NodeError(RuntimeError):
    """A command against the node failed; the message carries its output."""


@contextmanager
def exclusive() -> Iterator[None]:
    """The node to this process alone until the block ends (waits for another holder to finish)."""
    with LOCK.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def call_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False
    )


def failure(proc: subprocess.CompletedProcess[str]) -> str:
    command = proc.args if isinstance(proc.args, str) else " ".join(map(str, proc.args))
    out, err = proc.stdout[-4000:], proc.stderr[-6000:]
    return f"{command} exited {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"


def script_paths() -> dict[str, str]:
    """What `hack/node.sh paths` prints: the kubeconfig, binaries, state, registry and node(s)."""
    proc = call_script("paths")
    if proc.returncode != 0:
        raise NodeError(failure(proc))
    return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)


@contextmanager
def held(*up_args: str, running: Callable[[], bool] = lambda: True) -> Iterator[NodeCluster]:
    """The node to this process alone, brought up (`hack/node.sh up *up_args`) unless it already runs as
    `running` wants it, and taken down at the end only when it was brought up here. A failed `up` or `down`
    raises NodeError with the script's output."""
    with exclusive():
        started_here = call_script("status").returncode != 0 or not running()
        if started_here:
            up = call_script("up", *up_args)
            if up.returncode != 0:
                raise NodeError(failure(up))
            print(up.stderr.strip().splitlines()[-1] if up.stderr.strip() else up.stdout.strip())
        try:
            yield NodeCluster.from_script()
        finally:
            if started_here:
                down = call_script("down")
                if down.returncode != 0:
                    raise NodeError(failure(down))


def image_version() -> str:
    """The images' tag: pyproject.toml's version (= the chart's appVersion)."""
    proc = subprocess.run(
        [str(REPO / ".venv" / "bin" / "python"), str(REPO / "hack" / "image" / "image.py"), "version"],
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout.strip()


@dataclass(frozen=True)
class NodeCluster:
    kubeconfig: Path
    bin_dir: Path
    state: Path
    registry: str
    node: str
    node_ip: str
    containerd: str
    ctr_bin: Path

    @classmethod
    def from_script(cls) -> NodeCluster:
        f = script_paths()
        return cls(
            Path(f["kubeconfig"]),
            Path(f["bin"]),
            Path(f["state"]),
            f["registry"],
            f["node"],
            f["node_ip"],
            f["containerd"],
            Path(f["ctr"]),
        )

    def env(self) -> dict[str, str]:
        import os

        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{self.bin_dir}:{os.environ['PATH']}",
        }

    def run(
        self, *command: str, check: bool = True, timeout: float = 300, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        try:
            proc = subprocess.run(
                list(command),
                capture_output=True,
                text=True,
                env=self.env(),
                timeout=timeout,
                input=input,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise NodeError(f"{' '.join(command)}: no answer in {timeout:.0f} s") from exc
        if check and proc.returncode != 0:
            raise NodeError(failure(proc))
        return proc

    def kubectl(
        self, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self.run(str(self.bin_dir / "kubectl"), *args, check=check, timeout=timeout)

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(str(self.ctr_bin), "--address", self.containerd, "-n", "k8s.io", *args, check=check)

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.json("-n", namespace, "get", "pods", "-l", selector)["items"]
        return items

    def image_ref(self, image: str, version: str) -> str:
        return f"{self.registry}/disagg/{image}:{version}"


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, interval_s: float = 1.0) -> Any:
    """Poll until `check` returns something truthy; a timeout names what was awaited and the last value."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise NodeError(f"timed out after {timeout_s:.0f}s waiting for {what}; last seen: {last!r}")
        time.sleep(interval_s)


def pod_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def push_images(
    node: NodeCluster, version: str, images: Sequence[str] = ("disagg", "disagg-transfer")
) -> list[str]:
    """`skopeo copy` of the OCI layouts that `make image` (and `make image-vllm`) wrote to the node's loopback
    registry."""
    refs = []
    for image in images:
        layout = IMAGES / image
        if not (layout / "index.json").is_file():
            target = "image-vllm" if image == "disagg-vllm" else "image"
            raise NodeError(f"{layout} is missing: run `make {target}` first")
        ref = node.image_ref(image, version)
        node.run(
            "skopeo",
            "copy",
            "--quiet",
            "--dest-tls-verify=false",
            f"oci:{layout}:{version}",
            f"docker://{ref}",
            # The vLLM image is about 1 GiB compressed.
            timeout=900,
        )
        refs.append(ref)
    return refs


def helm_install(node: NodeCluster, extra: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """The README's `helm install`, with the node registry's repositories; waits for the operator's pod."""
    base = f"{node.registry}/disagg"
    return node.run(
        str(node.bin_dir / "helm"),
        "upgrade",
        "--install",
        RELEASE,
        str(CHART),
        "-n",
        OPERATOR_NAMESPACE,
        "--create-namespace",
        "--set",
        f"image.repository={base}/disagg",
        "--set",
        f"worker.image.repository={base}/disagg",
        "--set",
        f"worker.transferImage.repository={base}/disagg-transfer",
        *extra,
        "--wait",
        "--timeout",
        "5m",
        timeout=360,
    )


def wait_operator(node: NodeCluster) -> dict[str, Any]:
    """The operator's pod once Ready (the chart installed)."""
    pods = wait_for(
        "the operator's pod Ready",
        lambda: [
            p for p in node.pods(OPERATOR_NAMESPACE, "app.kubernetes.io/component=operator") if pod_ready(p)
        ],
        timeout_s=180,
    )
    pod: dict[str, Any] = pods[0]
    return pod


def serving(node: NodeCluster, name: str, pods: int) -> bool:
    """The DisaggDeployment Routable and Available, and its `pods` pods (the router's too) Ready. A node under
    pressure or an evicted pod raises at once: the kubelet would go on evicting what it starts."""
    # Routable (the READY column) holds with one pair; Available once every engine pod is ready.
    status = node.json("get", "disagg", name).get("status") or {}
    true = {c.get("type") for c in status.get("conditions") or [] if c.get("status") == "True"}
    found = node.pods("default", f"disagg.io/deployment={name}")
    trouble = pressure(node) + [
        f"pod {p['metadata']['name']} evicted: {p['status'].get('message', '')}"
        for p in found
        if (p.get("status") or {}).get("reason") == "Evicted"
    ]
    if trouble:
        raise NodeError("; ".join(trouble))
    return {ROUTABLE, "Available"} <= true and len(found) == pods and all(pod_ready(p) for p in found)


def pressure(node: NodeCluster) -> list[str]:
    """The pressure conditions that hold on any node of the cluster (DiskPressure, MemoryPressure,
    PIDPressure), with the kubelet's message."""
    return [
        f"node {n['metadata']['name']} {c['type']}: {c.get('message', '')}"
        for n in node.json("get", "nodes")["items"]
        for c in n["status"].get("conditions") or []
        if c.get("type", "").endswith("Pressure") and c.get("status") == "True"
    ]


def apply_sample(node: NodeCluster, sample: Path, pods: int, timeout_s: float = 420) -> str:
    """`kubectl apply -f sample`, then Routable, Available and its `pods` pods (the router's too) Ready;
    returns its name. A sample that does not get there fails with `diagnosis`."""
    node.kubectl("apply", "-f", str(sample))
    name: str = yaml.safe_load(sample.read_text())["metadata"]["name"]
    try:
        wait_for(
            f"DisaggDeployment {name} Routable and Available, its {pods} pods Ready",
            lambda: serving(node, name, pods),
            timeout_s=timeout_s,
            interval_s=2,
        )
    except NodeError as exc:
        raise NodeError(f"{exc}\n{diagnosis(node, name)}") from exc
    return name


def diagnosis(node: NodeCluster, name: str) -> str:
    """What a failure's message needs: the pods, the deployment's status, the nodes' conditions and free disk,
    the tail of every container's log, and the latest events."""
    parts = [node.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout]
    parts.append(node.kubectl("get", "disagg", name, "-o", "yaml", check=False).stdout[-3000:])
    conditions = (
        "{range .items[*]}{.metadata.name}{'\\n'}"
        "{range .status.conditions[*]}  {.type}={.status} {.message}{'\\n'}{end}{end}"
    )
    parts.append(node.kubectl("get", "nodes", "-o", f"jsonpath={conditions}", check=False).stdout)
    parts.append(node.run("df", "-h", str(node.state), check=False).stdout)
    for pod in node.pods("default", f"disagg.io/deployment={name}"):
        pod_name = pod["metadata"]["name"]
        for container in pod["spec"]["containers"]:
            log = node.kubectl("logs", pod_name, "-c", container["name"], "--tail", "40", check=False)
            parts.append(f"--- {pod_name}/{container['name']}\n{log.stdout[-3000:]}{log.stderr[-500:]}")
    parts.append(node.kubectl("get", "events", "-A", "--sort-by=.lastTimestamp", check=False).stdout[-4000:])
    return "\n".join(parts)


def router_url(node: NodeCluster, name: str) -> str:
    """The completions URL at the router Service's ClusterIP: kube-proxy's rules take it to the pod."""
    svc = node.json("get", "service", f"{name}-router")
    return f"http://{svc['spec']['clusterIP']}:{svc['spec']['ports'][0]['port']}/v1/completions"


def curl_text(node: NodeCluster, name: str, model: str, prompt: str, max_tokens: int) -> str:
    """A streamed completion through the router's Service, sent with curl as a person would; its text."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    proc = subprocess.run(
        curl_command(router_url(node, name), body), capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise NodeError(failure(proc))
    return sse_text(proc.stdout)
