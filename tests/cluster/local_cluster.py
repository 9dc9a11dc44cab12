"""The local control plane as tests see it: its locations, a client for it, and the sessions sharing it."""

from __future__ import annotations

import fcntl
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "hack" / "control-plane.sh"
# Applied before the controller manager starts, so its garbage collector knows DisaggDeployment at once
# (a CRD created later is only discovered on a 30 s resync, and owner-reference deletion waits for it).
PRE_APPLY = REPO / "crds"


def call_script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=env,
        check=False,
    )


def script_failure(proc: subprocess.CompletedProcess[str]) -> str:
    return (
        f"{' '.join(proc.args)} exited {proc.returncode}\n"
        f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
    )


def run_script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run hack/control-plane.sh; a failure fails the test (never a skip) and shows the script's log."""
    proc = call_script(*args, env=env)
    if proc.returncode != 0:
        pytest.fail(script_failure(proc), pytrace=False)
    return proc


@dataclass(frozen=True)
class Paths:
    kubeconfig: Path
    bin_dir: Path
    state: Path
    server: str

    @property
    def installed(self) -> bool:
        return (self.bin_dir / ".installed").is_file()

    @classmethod
    def from_script(cls) -> Paths:
        fields = dict(line.split("=", 1) for line in run_script("paths").stdout.splitlines())
        return cls(Path(fields["kubeconfig"]), Path(fields["bin"]), Path(fields["state"]), fields["server"])


@dataclass(frozen=True)
class ControlPlane:
    kubeconfig: Path
    bin_dir: Path
    server: str
    api_client: client.ApiClient
    started_here: bool

    def env(self) -> dict[str, str]:
        """Environment for subprocesses (kubectl, helm, kopf) that should talk to this control plane."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    def kubectl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin_dir / "kubectl"), *args],
            capture_output=True,
            text=True,
            env=self.env(),
            check=False,
        )


class Holders:
    """Sessions using the control plane: one file per live pytest process, guarded by a lock file."""

    def __init__(self, state: Path) -> None:
        self.dir = state / "holders"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.owner_marker = state / "started-by-pytest"
        self.apiserver_pid_file = state / "kube-apiserver.pid"
        self._lock_file = (state / "holders.lock").open("w")

    def __enter__(self) -> Holders:
        fcntl.flock(self._lock_file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._lock_file, fcntl.LOCK_UN)

    def close(self) -> None:
        self._lock_file.close()

    def add(self) -> None:
        (self.dir / str(os.getpid())).touch()

    def remove(self) -> None:
        (self.dir / str(os.getpid())).unlink(missing_ok=True)

    def live(self) -> list[int]:
        alive = []
        for entry in self.dir.iterdir():
            pid = int(entry.name)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                entry.unlink(missing_ok=True)
                continue
            alive.append(pid)
        return alive

    def mark_started_by_pytest(self) -> None:
        # Keyed to the apiserver's PID, so a control plane restarted by hand later is never taken for ours.
        self.owner_marker.write_text(self.apiserver_pid_file.read_text())

    def started_by_pytest(self) -> bool:
        if not (self.owner_marker.exists() and self.apiserver_pid_file.exists()):
            return False
        return self.owner_marker.read_text() == self.apiserver_pid_file.read_text()
