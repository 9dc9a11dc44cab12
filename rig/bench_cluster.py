"""The cluster the operator benches run on: the machine's shared local control plane with the CRD applied,
a fresh namespace deleted afterwards, `kubectl apply`, and a real `disagg operator run` as a process.

`bench_cluster(name)` is all of it for one namespace (the rollout and autoscale benches); the operator bench
takes the parts, as it runs a floor without the operator and two namespaces beside each other.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config

from disagg.rig import control_plane
from disagg.rig.control_plane import Paths
from disagg.rig.local import REPO, free_port

CRD = REPO / "crds" / "disagg.io_disaggdeployments.yaml"


def _kubectl_env(paths: Paths) -> dict[str, str]:
    return {**os.environ, "KUBECONFIG": str(paths.kubeconfig)}


def apply_crd(paths: Paths) -> None:
    subprocess.run(
        [str(paths.bin_dir / "kubectl"), "apply", "-f", str(CRD)],
        check=True,
        capture_output=True,
        env=_kubectl_env(paths),
    )


def kubectl_apply(paths: Paths, document: dict[str, Any]) -> None:
    """`kubectl apply` of one document; a refusal raises with kubectl's own words."""
    done = subprocess.run(
        [str(paths.bin_dir / "kubectl"), "apply", "-f", "-"],
        input=yaml.safe_dump(document),
        text=True,
        check=False,
        capture_output=True,
        env=_kubectl_env(paths),
    )
    if done.returncode != 0:
        raise RuntimeError(f"kubectl apply exited with {done.returncode}: {done.stderr.strip()}")


def api_client(paths: Paths) -> client.ApiClient:
    api: client.ApiClient = config.new_client_from_config(config_file=str(paths.kubeconfig))  # type: ignore[no-untyped-call]
    return api


@contextmanager
def fresh_namespace(api: client.ApiClient, prefix: str) -> Iterator[str]:
    """A namespace named `prefix` and a random suffix, deleted when the block ends."""
    core = client.CoreV1Api(api)
    name = f"{prefix}-{secrets.token_hex(3)}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        yield name
    finally:
        core.delete_namespace(name)


class Operator:
    """`disagg operator run` watching `namespaces`, its output in `log`; returns once it is healthy."""

    def __init__(self, paths: Paths, namespaces: Sequence[str], log: Path) -> None:
        port = free_port()
        args = [
            sys.executable,
            "-m",
            "disagg.operator.cli.main",
            "operator",
            "run",
            "--health-port",
            str(port),
        ]
        for watched in namespaces:
            args += ["--namespace", watched]
        env = {**_kubectl_env(paths), "PYTHONSAFEPATH": "1"}
        self._path = log
        self._log = log.open("wb")
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd="/")
        deadline = time.monotonic() + 60
        while not _healthy(port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the operator did not become healthy; see {log}")
            time.sleep(0.1)

    def peak_rss_mib(self) -> float:
        return self._status_mib("VmHWM:")

    def rss_mib(self) -> float:
        return self._status_mib("VmRSS:")

    def _status_mib(self, field_name: str) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field_name):
                return int(line.split()[1]) / 1024
        raise RuntimeError(f"no {field_name} for the operator process")

    def errors(self) -> list[str]:
        """Lines of the operator's log that report an error (kopf logs a handler's failure so)."""
        text = self._path.read_text(errors="replace")
        return [line for line in text.splitlines() if "[ERROR" in line or line.startswith("Traceback")]

    def stop(self) -> float:
        """SIGTERM (how Kubernetes stops a pod), SIGKILL after a 30 s grace; returns the seconds it took."""
        start = time.perf_counter()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()
        return time.perf_counter() - start


# The control plane's processes, by the names of their pid files in its state folder.
CONTROL_PLANE = ("kube-apiserver", "etcd", "kube-controller-manager")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds a process has used so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    # utime and stime, the 14th and 15th fields of stat(5); the split starts at the 3rd.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds each named process spends between `start()` and `stop()`: on a machine of a few cores
    the API server, etcd, the controllers, the operator and the bench's own client share them, and a run's
    time goes where they spend it."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._start: dict[str, float] = {}
        self.spent: dict[str, float] = {}

    @classmethod
    def of(cls, paths: Paths, **more: int) -> CpuMeter:
        """The control plane's processes (their pid files), this process as `bench`, and `more`."""
        pids = {name: int((paths.state / f"{name}.pid").read_text()) for name in CONTROL_PLANE}
        return cls({**pids, "bench": os.getpid(), **more})

    def start(self) -> None:
        self._start = {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def stop(self) -> None:
        self.spent = {name: cpu_seconds(pid) - self._start[name] for name, pid in self.pids.items()}

    def describe(self) -> str:
        return ", ".join(f"{name} {seconds:.1f}" for name, seconds in self.spent.items())


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@dataclass
class BenchCluster:
    paths: Paths
    api: client.ApiClient
    namespace: str
    workdir: Path
    """Where the bench's pods keep their files (the operator's log is beside it)."""

    @property
    def kubeconfig(self) -> Path:
        return self.paths.kubeconfig

    def apply(self, document: dict[str, Any]) -> None:
        kubectl_apply(self.paths, document)


@contextmanager
def bench_cluster(name: str) -> Iterator[BenchCluster]:
    """The shared control plane with the CRD, a namespace `bench-<name>-…` and an operator watching it,
    for the block; the operator stopped and the namespace deleted after it."""
    with control_plane.shared() as (paths, _):
        apply_crd(paths)
        api = api_client(paths)
        with fresh_namespace(api, f"bench-{name}") as watched:
            workdir = Path(f"/tmp/disagg-bench-{name}-{os.getpid()}")
            operator = Operator(paths, [watched], workdir.with_suffix(".operator.log"))
            try:
                yield BenchCluster(paths, api, watched, workdir)
            finally:
                operator.stop()
