"""The local Kubernetes control plane (`hack/control-plane.sh`) as programs use it: the script, its paths,
and the protocol by which test sessions, benchmarks and demos share one running control plane.

Sharing: every user registers a file named by its PID under the state folder's `holders/`, under a lock.
The user that started the control plane stops it when it leaves last; one that found it running (started
by hand, or by another session) never stops it.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from disagg.rig.local import REPO

SCRIPT = REPO / "hack" / "control-plane.sh"
# Applied before the controller manager starts, so its garbage collector knows DisaggDeployment at once
# (a CRD created later is only discovered on a 30 s resync, and owner-reference deletion waits for it).
PRE_APPLY = REPO / "crds"


class ControlPlaneError(RuntimeError):
    """The control-plane script failed; the message carries its exit status and the end of its output."""


def call_script(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=None if env is None else dict(env),
        check=False,
    )


def script_failure(proc: subprocess.CompletedProcess[str]) -> str:
    return (
        f"{' '.join(proc.args)} exited {proc.returncode}\n"
        f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
    )


def run_script(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the script; a failure raises `ControlPlaneError` with the script's log."""
    proc = call_script(*args, env=env)
    if proc.returncode != 0:
        raise ControlPlaneError(script_failure(proc))
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
    def from_script(cls, env: Mapping[str, str] | None = None) -> Paths:
        lines = run_script("paths", env=env).stdout.splitlines()
        fields = dict(line.split("=", 1) for line in lines if "=" in line)
        return cls(Path(fields["kubeconfig"]), Path(fields["bin"]), Path(fields["state"]), fields["server"])


class Holders:
    """Users of the control plane: one file per live process, guarded by a lock file."""

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
            try:
                pid = int(entry.name)
                os.kill(pid, 0)
            except (ProcessLookupError, ValueError):
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


@contextmanager
def shared() -> Iterator[tuple[Paths, bool]]:
    """The machine's shared control plane, running while the block runs; yields its paths and whether this
    process started it. Stopped at the end only if this process started it and no other user is left."""
    paths = Paths.from_script()
    paths.state.mkdir(parents=True, exist_ok=True)
    holders = Holders(paths.state)
    try:
        with holders:
            started_here = call_script("status").returncode != 0
            if started_here:
                run_script("start", env={**os.environ, "DISAGG_PRE_APPLY": str(PRE_APPLY)})
                holders.mark_started_by_pytest()
            holders.add()
        yield paths, started_here
    finally:
        with holders:
            holders.remove()
            if not holders.live() and holders.started_by_pytest():
                run_script("stop")
                holders.owner_marker.unlink(missing_ok=True)
        holders.close()
