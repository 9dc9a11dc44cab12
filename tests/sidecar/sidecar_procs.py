"""Helpers for the sidecar tests: real sidecar processes configured like pods, and their HTTP endpoints.

A module of its own (not conftest.py): several test folders have a conftest.py, and `from conftest import`
would pick whichever was imported first.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg.rig.local import LOOPBACK_UCX_ENV as UCX_ENV
from disagg.rig.local import free_port
from disagg.worker.kv.layout import ModelGeometry, StageLayout, build_stage_layout
from disagg.worker.link.engine_link import RegisterLayout, register_layout_message
from disagg.worker.link.kv_pool import ShmPool

HOST = "127.0.0.1"


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=5) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return 0, ""


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of the Prometheus text exposition, or None when absent."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        sample, _, label_text = key.partition("{")
        if sample == name and ",".join(sorted(label_text.rstrip("}").split(","))) == want:
            return float(value)
    return None


class SidecarProcess:
    """One sidecar process, configured like a pod: environment plus a topology file."""

    def __init__(self, tmp: Path, name: str, topology: dict[str, Any], **env: str) -> None:
        self.tmp = tmp
        self.socket_path = str(tmp / f"{name}.sock")
        self.metrics_port = free_port()
        self.side_channel_port = free_port()
        topology_file = tmp / f"{name}-topology.json"
        topology_file.write_text(json.dumps(topology))
        full_env = {
            **os.environ,
            **UCX_ENV,
            "PYTHONSAFEPATH": "1",
            "DISAGG_TOPOLOGY_FILE": str(topology_file),
            "DISAGG_ENGINE_SOCKET": self.socket_path,
            "DISAGG_SIDE_CHANNEL_HOST": HOST,
            "DISAGG_SIDE_CHANNEL_PORT": str(self.side_channel_port),
            "DISAGG_METRICS_HOST": HOST,
            "DISAGG_METRICS_PORT": str(self.metrics_port),
            **env,
        }
        self.log_path = tmp / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "disagg.worker.cli.transfer"],
                env=full_env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_listening(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while http_get(self.metrics_port, "/healthz")[0] != 200 or not os.path.exists(self.socket_path):
            assert self.proc.poll() is None, f"sidecar exited with {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"sidecar not up after {timeout} s:\n{self.log()}"
            time.sleep(0.05)

    def get(self, path: str) -> tuple[int, str]:
        return http_get(self.metrics_port, path)

    def terminate(self, timeout: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@dataclass(frozen=True)
class KVShape:
    """One stage's KV as a sidecar test configures it: the topology document a sidecar reads, the layout, and
    the engine's registration of a pool of that layout."""

    geometry: ModelGeometry
    block_size: int
    num_blocks: int

    def topology(self, **extra: Any) -> dict[str, Any]:
        """A single-stage push topology; `extra` adds keys (`kvLeaseDurationSeconds`, ...)."""
        g = self.geometry
        return {
            "transferMode": "push",
            "blockSize": self.block_size,
            "stages": [{"stage": 0, "startLayer": 0, "endLayer": g.num_layers}],
            "model": {
                "layerKinds": [kind.value for kind in g.kinds],
                "numKVHeads": g.num_kv_heads,
                "headSize": g.head_size,
                "dtypeBytes": g.dtype_bytes,
            },
            **extra,
        }

    def stage_layout(self) -> StageLayout:
        return build_stage_layout(
            self.geometry,
            pp_rank=0,
            pp_size=1,
            tp_size=1,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
        )

    def registration(self, pool: ShmPool, engine_id: str, role: str) -> RegisterLayout:
        return register_layout_message(
            engine_id=engine_id,
            role=role,
            geometry=self.geometry,
            stage=self.stage_layout(),
            tp_rank=0,
            num_blocks=self.num_blocks,
            pool_path=str(pool.path),
            pool_bytes=pool.nbytes,
        )
