"""The local control plane as tests see it: a client for it and the tools on its PATH.

The script, its paths and the sharing protocol are the rig's (`disagg.rig.control_plane`)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client

from disagg.rig import local

REPO = local.REPO


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
